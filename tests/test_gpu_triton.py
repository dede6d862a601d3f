"""The Triton twin of every bundled variant on the GPU, at real shapes (bf16, hd128, 32/8 heads): against
the torch reference and against fivar's FlashInfer kernels of the same variant (marked `gpu`)."""
import pytest
import torch

import fivar
from fivar.testing import _ragged_reference, _to_paged, compare, example_params

BUNDLED = ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask", "relative_bias",
           "softcap_sliding_window"]
HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16
pytestmark = pytest.mark.gpu


def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def _agree(name, case, triton_out, ref, flashinfer_fn):
    r = compare(name, f"triton vs reference, {case}", triton_out, ref, DTYPE)
    assert r.passed, r
    if flashinfer_fn is not None and _flashinfer_available():
        r = compare(name, f"triton vs flashinfer, {case}", triton_out, flashinfer_fn(), DTYPE)
        assert r.passed, r


def _qkv(lq, lk):
    return (torch.randn(lq, HQ, D, dtype=DTYPE, device="cuda"), torch.randn(lk, HKV, D, dtype=DTYPE, device="cuda"),
            torch.randn(lk, HKV, D, dtype=DTYPE, device="cuda"))


def _params(v, batch, max_len):
    return example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=batch, max_len=max_len, device="cuda")


@pytest.mark.parametrize("lq,lk,causal", [(1, 1, False), (37, 129, False), (37, 129, True), (300, 300, True),
                                           (257, 1000, False), (1000, 257, True)])
@pytest.mark.parametrize("name", BUNDLED)
def test_single_prefill(name, lq, lk, causal):
    v = fivar.load(name)
    q, k, vv = _qkv(lq, lk)
    params = _params(v, 1, lk)
    out = v.prefill(q, k, vv, causal=causal, backend="triton", **params)
    # FlashInfer's kernels refuse causal with qo_len > kv_len (fivar says so before launch): reference only
    fi = None if (causal and lq > lk) else (lambda: v.prefill(q, k, vv, causal=causal, backend="fa2", **params))
    _agree(name, f"qo{lq} kv{lk} causal={causal}", out, v.reference(q, k, vv, causal=causal, **params), fi)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", BUNDLED)
def test_batch_prefill_ragged(name, causal):
    v = fivar.load(name)
    qo_lens, kv_lens = [17, 1, 40, 300], [17, 70, 300, 300]
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens))
    params = _params(v, len(qo_lens), max(kv_lens))
    cum = lambda xs: torch.tensor([0] + xs, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)  # noqa: E731
    qo_indptr, kv_indptr = cum(qo_lens), cum(kv_lens)
    out = v.batch_prefill_ragged(q, k, vv, qo_indptr, kv_indptr, causal=causal, backend="triton", **params)
    _agree(name, f"ragged causal={causal}", out, _ragged_reference(v, q, k, vv, qo_lens, kv_lens, causal, params),
           lambda: v.batch_prefill_ragged(q, k, vv, qo_indptr, kv_indptr, causal=causal, backend="fa2", **params))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", BUNDLED)
def test_decode(name, page_size):
    v = fivar.load(name)
    kv_lens = [1, 33, 517, 4000]
    q = torch.randn(len(kv_lens), HQ, D, dtype=DTYPE, device="cuda")
    _, k, vv = _qkv(1, sum(kv_lens))
    params = _params(v, len(kv_lens), max(kv_lens))
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size)
    out = v.decode(q, cache, indptr, indices, last, backend="triton", **params)
    _agree(name, f"decode page {page_size}", out,
           _ragged_reference(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params),
           lambda: v.decode(q, cache, indptr, indices, last, backend="fa2", **params))


# Values that are one per program (a per-head table read, a truncated float param) combined with per-element
# ones: the twin emits a select for such an `or`/`and` and tl.cast for int()/float() (the interpreter needs
# both); compiled, against the reference and FA2.
def _per_head_or_key(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx <= q_idx - 3 or params.open[qo_head] > 0.0


def _truncated_param(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + float(int(params.f)) * 0.25


PER_PROGRAM = [fivar.AttentionVariant(name="gpu_per_head_or_key", mask=_per_head_or_key,
                                      params={"open": fivar.Tensor("float32", ("qo_head",))}),
               fivar.AttentionVariant(name="gpu_truncated_param", logits=_truncated_param,
                                      params={"f": fivar.Scalar(float, default=-2.5)})]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("v", PER_PROGRAM, ids=lambda v: v.name)
def test_values_per_program_mixed_with_values_per_element(v, causal):
    q, k, vv = _qkv(300, 700)
    params = {"open": torch.randn(HQ, device="cuda")} if "open" in v.params else {"f": -2.5}
    out = v.prefill(q, k, vv, causal=causal, backend="triton", **params)
    _agree(v.name, f"causal={causal}", out, v.reference(q, k, vv, causal=causal, **params),
           lambda: v.prefill(q, k, vv, causal=causal, backend="fa2", **params))
