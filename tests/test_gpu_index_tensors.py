"""Index tensors on the FlashInfer paths (marked `gpu`): strided views and other integer dtypes of the indptrs, page
tables and last-page lengths give the contiguous int32 call's result on FA2 and FA3, one-shot and planned; an index
or param tensor written behind its version counter (through `.data`) is seen by the next one-shot call, and by an
explicit plan after `invalidate()`."""
import pytest
import torch

import fivar
from fivar.testing import _ragged_reference, _to_paged, compare, example_params

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16
HQ, HKV, D = 32, 8, 128


def _column(t, dtype=torch.int32):
    """t's values as a column of a 2-D tensor (stride 2), poison in the other column."""
    buf = torch.full((t.numel(), 2), -5, dtype=dtype, device=t.device)
    buf[:, 0] = t
    return buf[:, 0]


FORMS = {
    "column": _column,
    "every_other": lambda t: torch.stack([t, torch.full_like(t, 7)], 1).reshape(-1)[::2],
    "int64": lambda t: t.long(),
    "host_int64_column": lambda t: _column(t.cpu(), torch.int64),
}


def _qkv(lq, lk, hq=HQ, hkv=HKV):
    return (torch.randn(lq, hq, D, dtype=DTYPE, device="cuda"), torch.randn(lk, hkv, D, dtype=DTYPE, device="cuda"),
            torch.randn(lk, hkv, D, dtype=DTYPE, device="cuda"))


def _indptr(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _params(v, batch, max_len, hq=HQ, hkv=HKV):
    p = example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=batch, max_len=max_len, device="cuda")
    if "window" in v.params:
        p["window"] = max(2, max_len // 3)
    return p


QO, KV = [37, 1, 200], [300, 64, 200]


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("name", ["softcap", "document_mask"])
def test_ragged_index_tensors_of_any_layout(name, backend, form):
    v = fivar.load(name)
    q, k, vv = _qkv(sum(QO), sum(KV))
    params = _params(v, len(QO), max(KV))
    qo, kv = _indptr(QO), _indptr(KV)
    want = v.batch_prefill_ragged(q, k, vv, qo, kv, causal=True, backend=backend, **params)
    f = FORMS[form]
    got = v.batch_prefill_ragged(q, k, vv, f(qo), f(kv), causal=True, backend=backend, **params)
    r = compare(name, f"ragged {backend} {form}", got, _ragged_reference(v, q, k, vv, QO, KV, True, params), DTYPE)
    assert r.passed, r
    assert torch.equal(got, want)
    plan = v.plan_ragged(f(qo), f(kv), num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=DTYPE, causal=True,
                         backend=backend, **params)
    assert torch.equal(plan.run(q, k, vv), want)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("name", ["softcap", "document_mask"])
def test_paged_index_tensors_of_any_layout(name, backend, form):
    v = fivar.load(name)
    q, k, vv = _qkv(sum(QO), sum(KV))
    params = _params(v, len(QO), max(KV))
    cache, indptr, indices, last = _to_paged(k, vv, KV, page_size=16)
    qo = _indptr(QO)
    want = v.batch_prefill_paged(q, cache, qo, indptr, indices, last, causal=True, backend=backend, **params)
    f = FORMS[form]
    got = v.batch_prefill_paged(q, cache, f(qo), f(indptr), f(indices), f(last), causal=True, backend=backend,
                                **params)
    r = compare(name, f"paged {backend} {form}", got, _ragged_reference(v, q, k, vv, QO, KV, True, params), DTYPE)
    assert r.passed, r
    assert torch.equal(got, want)
    plan = v.plan_paged(f(qo), f(indptr), f(indices), f(last), num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                        page_size=16, dtype=DTYPE, causal=True, backend=backend, **params)
    assert torch.equal(plan.run(q, cache), want)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["tensor-core", "decode-kernel"])
@pytest.mark.parametrize("name", ["softcap", "sliding_window"])
def test_decode_index_tensors_of_any_layout(name, heads, form):
    v = fivar.load(name)
    hq, hkv = heads
    kv_lens = [1, 77, 300]
    q = torch.randn(len(kv_lens), hq, D, dtype=DTYPE, device="cuda")
    _, k, vv = _qkv(1, sum(kv_lens), hq, hkv)
    params = _params(v, len(kv_lens), max(kv_lens), hq, hkv)
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=16)
    want = v.decode(q, cache, indptr, indices, last, **params)
    f = FORMS[form]
    got = v.decode(q, cache, f(indptr), f(indices), f(last), **params)
    r = compare(name, f"decode {heads} {form}", got,
                _ragged_reference(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params), DTYPE)
    assert r.passed, r
    assert torch.equal(got, want)
    plan = v.plan_decode(f(indptr), f(indices), f(last), num_qo_heads=hq, num_kv_heads=hkv, head_dim=D, page_size=16,
                         dtype=DTYPE, **params)
    assert torch.equal(plan.run(q, cache), want)


def _two_documents(width, cut):
    doc_ids = torch.zeros(2, width, dtype=torch.int32, device="cuda")
    doc_ids[0, cut:] = 1
    return doc_ids


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_one_shot_sees_writes_after_invalidate_plans(backend):
    """doc_ids, then the indptrs, written through .data (their _version unchanged) between one-shot calls, each write
    followed by fivar.invalidate_plans() (device tensors are keyed by their version counter: comparing their contents
    would sync every call): each call is the reference's for the contents it was given, not a replay of the plan of
    the old ones. A write through torch (zero_) needs no call."""
    v = fivar.load("document_mask")
    lens = [300, 200]
    q, k, vv = _qkv(500, 500)
    doc_ids, qo, kv = _two_documents(350, 150), _indptr(lens), _indptr(lens)
    call = lambda: v.batch_prefill_ragged(q, k, vv, qo, kv, causal=True, backend=backend,  # noqa: E731
                                          doc_ids=doc_ids)
    call()
    doc_ids[0, 150:].zero_()  # a write through torch: its version moves
    r = compare("document_mask", f"{backend} doc_ids via zero_", call(),
                _ragged_reference(v, q, k, vv, lens, lens, True, {"doc_ids": doc_ids}), DTYPE)
    assert r.passed, r
    doc_ids.data[0, 150:] = 1
    fivar.invalidate_plans()
    call()
    doc_ids.data[0, 150:] = 0  # one document: keys the old plan's blocks skip
    fivar.invalidate_plans()
    r = compare("document_mask", f"{backend} doc_ids via .data", call(),
                _ragged_reference(v, q, k, vv, lens, lens, True, {"doc_ids": doc_ids}), DTYPE)
    assert r.passed, r
    doc_ids.data[0, 150:] = 1
    fivar.invalidate_plans()
    call()
    for t in (qo, kv):
        t.data[1] = 350  # request 0 grows past its document boundary
    fivar.invalidate_plans()
    r = compare("document_mask", f"{backend} indptrs via .data", call(),
                _ragged_reference(v, q, k, vv, [350, 150], [350, 150], True, {"doc_ids": doc_ids}), DTYPE)
    assert r.passed, r


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_explicit_plan_invalidate_plans_from_the_new_contents(backend):
    v = fivar.load("document_mask")
    lens = [300, 200]
    q, k, vv = _qkv(500, 500)
    doc_ids, qo, kv = _two_documents(300, 150), _indptr(lens), _indptr(lens)
    plan = v.plan_ragged(qo, kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=DTYPE, causal=True,
                         backend=backend, doc_ids=doc_ids)
    r = compare("document_mask", f"{backend} planned", plan.run(q, k, vv),
                _ragged_reference(v, q, k, vv, lens, lens, True, {"doc_ids": doc_ids}), DTYPE)
    assert r.passed, r
    doc_ids.data[0, 150:] = 0
    plan.invalidate()
    r = compare("document_mask", f"{backend} after invalidate()", plan.run(q, k, vv),
                _ragged_reference(v, q, k, vv, lens, lens, True, {"doc_ids": doc_ids}), DTYPE)
    assert r.passed, r
