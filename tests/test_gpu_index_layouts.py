"""Index tensors as callers pass them (fivar.testing.INDEX_LAYOUTS: strided views of larger tensors, transposed then
sliced, int64, int64 on the host while the data is on the GPU, broadcast) on every GPU backend (marked `gpu`): ragged
prefill on FA2, FA3 and Triton, paged prefill on FA2 and FA3, decode on FA2's tensor-core and CUDA-core kernels and
Triton, one-shot and planned, for a logits variant (softcap) and a mask variant (document_mask, sliding_window). Each
gives the contiguous int32 call's output bit for bit, and the float64 reference's. The CPU twin of this file:
tests/unit/test_index_layouts.py."""
import pytest
import torch

import fivar
from fivar.testing import INDEX_LAYOUTS, _ragged_reference, _to_paged, compare

from test_gpu_index_tensors import _indptr, _params as _params_at

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16
HQ, HKV, D = 16, 4, 128
QO, KV = [37, 1, 130], [200, 64, 130]


def _randn(*shape):
    return torch.randn(*shape, dtype=DTYPE, device="cuda")


def _check(name, case, got, want, ref):
    assert torch.equal(got, want), f"{name} {case}: differs from the contiguous int32 call"
    r = compare(name, case, got, ref, DTYPE)
    assert r.passed, r


@pytest.mark.parametrize("backend", ["fa2", "fa3", "triton"])
@pytest.mark.parametrize("name", ["softcap", "document_mask"])
def test_ragged_index_layouts(name, backend):
    v = fivar.load(name)
    q, k, vv = _randn(sum(QO), HQ, D), _randn(sum(KV), HKV, D), _randn(sum(KV), HKV, D)
    params = _params_at(v, len(QO), max(KV), HQ, HKV)
    qo, kv = _indptr(QO), _indptr(KV)
    want = v.batch_prefill_ragged(q, k, vv, qo, kv, causal=True, backend=backend, **params)
    ref = _ragged_reference(v, q, k, vv, QO, KV, True, params, float_dtype=torch.float64)
    for form, f in INDEX_LAYOUTS.items():
        got = v.batch_prefill_ragged(q, k, vv, f(qo), f(kv), causal=True, backend=backend, **params)
        _check(name, f"ragged {backend} {form}", got, want, ref)
        if backend != "triton":  # the twin has no plan step
            plan = v.plan_ragged(f(qo), f(kv), num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=DTYPE,
                                 causal=True, backend=backend, **params)
            _check(name, f"plan_ragged {backend} {form}", plan.run(q, k, vv), want, ref)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("name", ["softcap", "document_mask"])
def test_paged_index_layouts(name, backend):
    v = fivar.load(name)
    q, k, vv = _randn(sum(QO), HQ, D), _randn(sum(KV), HKV, D), _randn(sum(KV), HKV, D)
    params = _params_at(v, len(QO), max(KV), HQ, HKV)
    cache, indptr, indices, last = _to_paged(k, vv, KV, page_size=16)
    qo = _indptr(QO)
    want = v.batch_prefill_paged(q, cache, qo, indptr, indices, last, causal=True, backend=backend, **params)
    ref = _ragged_reference(v, q, k, vv, QO, KV, True, params, float_dtype=torch.float64)
    for form, f in INDEX_LAYOUTS.items():
        got = v.batch_prefill_paged(q, cache, f(qo), f(indptr), f(indices), f(last), causal=True, backend=backend,
                                    **params)
        _check(name, f"paged {backend} {form}", got, want, ref)
        plan = v.plan_paged(f(qo), f(indptr), f(indices), f(last), num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                            page_size=16, dtype=DTYPE, causal=True, backend=backend, **params)
        _check(name, f"plan_paged {backend} {form}", plan.run(q, cache), want, ref)


@pytest.mark.parametrize("heads", [(16, 4), (4, 4)], ids=["tensor-core", "cuda-core"])
@pytest.mark.parametrize("name", ["softcap", "sliding_window"])
def test_decode_index_layouts(name, heads):
    """FA2 (one-shot and planned) and Triton. Every last page holds the same count: the broadcast form passes
    kv_last_page_len with stride 0."""
    v = fivar.load(name)
    hq, hkv = heads
    kv_lens = [16 * n + 5 for n in (0, 4, 12)]
    q, k, vv = _randn(len(kv_lens), hq, D), _randn(sum(kv_lens), hkv, D), _randn(sum(kv_lens), hkv, D)
    params = _params_at(v, len(kv_lens), max(kv_lens), hq, hkv)
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=16)
    ref = _ragged_reference(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params, float_dtype=torch.float64)
    for backend in ("fa2", "triton"):
        want = v.decode(q, cache, indptr, indices, last, backend=backend, **params)
        for form, f in INDEX_LAYOUTS.items():
            got = v.decode(q, cache, f(indptr), f(indices), f(last), backend=backend, **params)
            _check(name, f"decode {backend} {heads} {form}", got, want, ref)
            if backend == "fa2":
                plan = v.plan_decode(f(indptr), f(indices), f(last), num_qo_heads=hq, num_kv_heads=hkv, head_dim=D,
                                     page_size=16, dtype=DTYPE, **params)
                _check(name, f"plan_decode {heads} {form}", plan.run(q, cache), want, ref)
    assert INDEX_LAYOUTS["broadcast"](last).stride() == (0,)


def test_cuda_graph_decode_plan_names_a_kv_indices_that_is_no_tensor():
    v = fivar.load("softcap")
    with pytest.raises(fivar.FivarError, match=r"^variant 'softcap': kv_indices must be a 1-D int32 tensor, got list$"):
        v.plan_decode(_indptr([2]), [0, 1], _indptr([5])[1:], cuda_graph=True, num_qo_heads=4, num_kv_heads=4,
                      head_dim=D, page_size=16, dtype=DTYPE)
