"""Index tensors as callers pass them (fivar.testing.INDEX_LAYOUTS: strided views of larger tensors, transposed then
sliced, int64, broadcast) through the Triton twin under the interpreter: the result of contiguous int32 ones, bit for
bit, and the float64 reference's; and what cannot be an index tensor is one line. The same on the GPU backends:
tests/test_gpu_index_layouts.py."""
import pytest
import torch

import fivar
from fivar.testing import INDEX_LAYOUTS, _ragged_reference, _to_paged, compare, example_params

DTYPE = torch.float16  # the interpreter has no bfloat16 arithmetic
HQ, HKV, D = 2, 1, 16  # GQA; each head is one more interpreted program per block


@pytest.fixture(autouse=True, scope="module")
def interpret():
    """Triton picks interpreted vs compiled when a kernel is defined: set the mode for this module only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _lengths(n, lo, hi):
    return [int(x) for x in torch.randint(lo, hi, (n,))]


def _indptr(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _params(v, batch, max_len):
    p = example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=batch, max_len=max_len, device="cpu")
    if "window" in v.params:
        p["window"] = int(torch.randint(2, max(3, max_len // 2), (1,)))
    return p


def _check(name, case, got, want, ref):
    assert torch.equal(got, want), f"{name} {case}: differs from the contiguous int32 call"
    r = compare(name, case, got, ref, DTYPE)
    assert r.passed, r


@pytest.mark.parametrize("name", ["softcap", "document_mask"])
def test_ragged_index_layouts_give_the_contiguous_result(name):
    v = fivar.load(name)
    qo_lens, kv_lens = _lengths(3, 1, 17), _lengths(3, 1, 29)
    q, k, vv = (torch.randn(n, h, D, dtype=DTYPE) for n, h in ((sum(qo_lens), HQ), (sum(kv_lens), HKV),
                                                                (sum(kv_lens), HKV)))
    params = _params(v, 3, max(kv_lens))
    qo, kv = _indptr(qo_lens), _indptr(kv_lens)
    want = v.batch_prefill_ragged(q, k, vv, qo, kv, causal=True, backend="triton", **params)
    ref = _ragged_reference(v, q, k, vv, qo_lens, kv_lens, True, params, float_dtype=torch.float64)
    for form, f in INDEX_LAYOUTS.items():
        got = v.batch_prefill_ragged(q, k, vv, f(qo), f(kv), causal=True, backend="triton", **params)
        _check(name, f"ragged {form} {qo_lens} {kv_lens}", got, want, ref)


@pytest.mark.parametrize("name", ["softcap", "sliding_window"])
def test_decode_index_layouts_give_the_contiguous_result(name):
    """Every request's last page holds the same count, so the broadcast form passes kv_last_page_len with stride 0."""
    v = fivar.load(name)
    page, r = 4, int(torch.randint(1, 5, ()))
    kv_lens = [page * n + r for n in _lengths(3, 0, 6)]
    q = torch.randn(3, HQ, D, dtype=DTYPE)
    k, vv = torch.randn(sum(kv_lens), HKV, D, dtype=DTYPE), torch.randn(sum(kv_lens), HKV, D, dtype=DTYPE)
    params = _params(v, 3, max(kv_lens))
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=page)
    want = v.decode(q, cache, indptr, indices, last, backend="triton", **params)
    ref = _ragged_reference(v, q, k, vv, [1] * 3, kv_lens, False, params, float_dtype=torch.float64)
    for form, f in INDEX_LAYOUTS.items():
        got = v.decode(q, cache, f(indptr), f(indices), f(last), backend="triton", **params)
        _check(name, f"decode {form} {kv_lens}", got, want, ref)
    assert INDEX_LAYOUTS["broadcast"](last).stride() == (0,)


def test_attention_gradients_with_index_layouts():
    """variant.attention's forward and its Triton backward read the indptrs too."""
    v = fivar.load("softcap")
    qo_lens, kv_lens = _lengths(2, 1, 13), _lengths(2, 1, 13)
    qo, kv = _indptr(qo_lens), _indptr(kv_lens)
    base = [torch.randn(n, h, D, dtype=DTYPE) for n, h in ((sum(qo_lens), HQ), (sum(kv_lens), HKV),
                                                            (sum(kv_lens), HKV))]
    do = torch.randn(sum(qo_lens), HQ, D, dtype=DTYPE)

    def grads(qo_, kv_):
        leaves = [x.clone().requires_grad_() for x in base]
        out = v.attention(*leaves, causal=True, backend="triton", qo_indptr=qo_, kv_indptr=kv_, softcap=20.0)
        return [out, *torch.autograd.grad(out, leaves, do)]

    want = grads(qo, kv)
    for form in ("transposed_sliced", "int64_transposed_sliced", "every_other"):
        f = INDEX_LAYOUTS[form]
        for g, w, what in zip(grads(f(qo), f(kv)), want, ("out", "dq", "dk", "dv")):
            assert torch.equal(g, w), f"{form}: {what} differs from the contiguous int32 call"


def test_plan_decode_with_a_list_for_kv_indptr_is_one_line():
    with pytest.raises(fivar.FivarError, match=r"^variant 'softcap': kv_indptr must be a 1-D int32 tensor .*got "
                                               r"list$"):
        fivar.load("softcap").plan_decode([0, 1], torch.tensor([0]), torch.tensor([1]), num_qo_heads=4,
                                          num_kv_heads=4, head_dim=128, page_size=16)
