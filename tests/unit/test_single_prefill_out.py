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

    class Run:
        def run(self, q, k, v, tmp, o, lse, mask_mode, layout, window_left, *args):
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


@pytest.mark.parametrize("kind", ["strided", "none"])
def test_any_other_out_gets_a_copy_of_the_kernels_output(module, kind):
    q, k, v, want = _inputs()
    out = {"strided": torch.empty(5, 8, 64, dtype=q.dtype)[:, ::2], "none": None}[kind]
    got = fivar.load("softcap").prefill(q, k, v, backend="fa2", out=out)
    assert module[-1] is not out and torch.equal(module[-1], want)
    assert torch.equal(got.to(q.dtype), want) and (out is None or got is out)
