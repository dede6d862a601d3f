"""Single prefill's `out`: the module's run writes straight into a contiguous output of the right dtype (no copy of
the output afterwards, as context parallelism's pairs pass their rows of one output), and into a fresh tensor copied
into a strided `out`. A stand-in module's run (the arguments FlashInfer's single_prefill_with_kv_cache_with_jit_module
passes) records where it wrote."""
import types

import pytest
import torch

import fivar
from fivar.runtime import attention


@pytest.fixture
def module(monkeypatch):
    written = []

    from flashinfer.utils import SINGLE_KERNEL_TMP_SIZE, TensorLayout

    class Run:
        def run(self, q, k, v, tmp, o, lse, mask_mode, layout, window_left, *args):
            assert tmp.numel() == SINGLE_KERNEL_TMP_SIZE and layout == TensorLayout.NHD.value and window_left == -1
            written.append(o)
            o.copy_(q * 2 + v[: q.shape[0], :1].repeat_interleave(q.shape[1], 1))
            if lse is not None:
                lse.copy_(q.float().sum(-1))

    monkeypatch.setattr(attention, "_module", lambda *a, **kw: types.SimpleNamespace(load=Run, options={}))
    monkeypatch.setattr(attention, "_check_qkv", lambda *a, **kw: None)
    monkeypatch.setattr(attention, "_check_backend", lambda *a, **kw: "fa2")
    return written


def _inputs():
    q = torch.randn(5, 4, 64, dtype=torch.float16)
    k, v = torch.randn(7, 2, 64, dtype=torch.float16), torch.randn(7, 2, 64, dtype=torch.float16)
    return q, k, v, (q * 2 + v[:5, :1].repeat_interleave(4, 1))


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_contiguous_out_is_written_by_the_kernel_itself(module, return_lse):
    q, k, v, want = _inputs()
    out = torch.empty_like(q)
    got = fivar.load("softcap").prefill(q, k, v, backend="fa2", out=out, return_lse=return_lse)
    o = got[0] if return_lse else got
    assert module[-1] is out and o is out and torch.equal(out, want)
    if return_lse:
        assert torch.equal(got[1], q.float().sum(-1))


@pytest.mark.parametrize("kind", ["strided", "q itself", "rows of k's buffer", "none"])
def test_any_other_out_gets_a_copy_of_the_kernels_output(module, kind):
    """A strided out, or one sharing memory with q, k or v (the kernel reads them while it writes): a fresh output,
    copied once the kernel is done."""
    q, k, v, want = _inputs()
    k_big = torch.randn(5, 4, 64, dtype=q.dtype)
    out = {"strided": torch.empty(5, 8, 64, dtype=q.dtype)[:, ::2], "q itself": q, "rows of k's buffer": k_big,
           "none": None}[kind]
    kk = k_big[:, :2] if kind == "rows of k's buffer" else k
    want = want.clone()
    got = fivar.load("softcap").prefill(q, kk, v, backend="fa2", out=out)
    assert module[-1] is not out and torch.equal(module[-1], want)
    assert torch.equal(got, want) and (out is None or got is out)


def test_where_flashinfer_changed_the_run_it_goes_through_flashinfers_helper(module, monkeypatch):
    """The coupling check failing: FlashInfer's single_prefill_with_kv_cache_with_jit_module, then a copy."""
    import fivar.flashinfer_compat as compat
    monkeypatch.setattr(compat, "active", lambda name: name != "single_prefill_run")
    q, k, v, want = _inputs()
    out = torch.empty_like(q)
    got = fivar.load("softcap").prefill(q, k, v, backend="fa2", out=out)
    assert module[-1] is not out and got is out and torch.equal(out, want)
