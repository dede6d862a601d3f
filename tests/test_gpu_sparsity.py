"""Skipping what a mask removes, on every path, against the torch reference (marked `gpu`).

The masks real models use, written as a user would: Gemma-2's local layer (soft-cap + causal window), chunked
local attention, StreamingLLM's sinks + window, prefix-LM. Each runs on every entry point (single, ragged, paged
prefill on fa2 and fa3; decode) at awkward shapes (lengths off the tile sizes, GQA 32/8 and 4/4, page 16), the
window ones across window sizes from empty to wider than the sequence; the one-shot calls must agree with the
planned ones, and a param tensor written in place between two one-shot calls must be seen by the second.
"""
import pytest
import torch

from fivar import AttentionVariant, Scalar, Tensor, tanh
from fivar.testing import _ragged_reference, _to_paged, check_batch_prefill, check_single_prefill, compare

pytestmark = pytest.mark.gpu


def _gemma_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.cap * tanh(score / params.cap)


def _gemma_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window


def _chunk_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx // params.chunk == kv_idx // params.chunk and kv_idx <= q_idx


def _sinks_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < params.n_sink or q_idx - kv_idx < params.window


def _prefix_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < params.prefix[batch] or kv_idx <= q_idx


GEMMA = AttentionVariant(name="gemma2_local_probe", logits=_gemma_logits, mask=_gemma_mask,
                         params={"cap": Scalar(float, default=50.0), "window": Scalar(int, default=333)})
CHUNKED = AttentionVariant(name="chunked_probe", mask=_chunk_mask, params={"chunk": Scalar(int, default=96)})
SINKS = AttentionVariant(name="sinks_window_probe", mask=_sinks_mask,
                         params={"n_sink": Scalar(int, default=4), "window": Scalar(int, default=200)})
PREFIX = AttentionVariant(name="prefix_lm_probe", mask=_prefix_mask,
                          params={"prefix": Tensor("int32", ("batch",))})
def _document_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.doc[batch, q_idx] == params.doc[batch, kv_idx]


def _head_window_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.head_window[qo_head]


DOCUMENTS = AttentionVariant(name="documents_probe", mask=_document_mask,
                             params={"doc": Tensor("int32", ("batch", "position"))})
HEAD_WINDOW = AttentionVariant(name="head_window_probe", logits=_gemma_logits, mask=_head_window_mask,
                               params={"cap": Scalar(float, default=50.0),
                                       "head_window": Tensor("int32", ("qo_head",))})
VARIANTS = {"gemma": GEMMA, "chunked": CHUNKED, "sinks": SINKS, "prefix": PREFIX}
DECODE_ONLY = {"documents": DOCUMENTS, "head_window": HEAD_WINDOW}
HEADS = [(32, 8), (4, 4)]


def _params(name, batch, kv_len, device="cuda", num_qo_heads=32):
    if name == "prefix":
        return {"prefix": torch.randint(0, kv_len + 1, (batch,), dtype=torch.int32, device=device)}
    if name == "documents":  # a few documents per request, sorted ids
        starts = torch.rand(batch, kv_len, device=device) < 4.0 / kv_len
        return {"doc": starts.to(torch.int32).cumsum(1).to(torch.int32)}
    if name == "head_window":
        return {"head_window": torch.randint(-3, 700, (num_qo_heads,), dtype=torch.int32, device=device)}
    return {}


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}-{h[1]}")
@pytest.mark.parametrize("qo_len,kv_len,causal", [(37, 129, True), (300, 1000, True), (1000, 1000, True),
                                                  (257, 1000, False)])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_single_prefill(name, backend, qo_len, kv_len, causal, heads):
    r = check_single_prefill(VARIANTS[name], qo_len=qo_len, kv_len=kv_len, causal=causal, backend=backend,
                             num_qo_heads=heads[0], num_kv_heads=heads[1], params=_params(name, 1, kv_len))
    assert r.passed, r


@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}-{h[1]}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_batch_prefill(name, backend, causal, heads, paged):
    qo_lens, kv_lens = [17, 1, 300, 700], [17, 70, 900, 700]
    r = check_batch_prefill(VARIANTS[name], qo_lens=qo_lens, kv_lens=kv_lens, paged=paged, causal=causal,
                            backend=backend, num_qo_heads=heads[0], num_kv_heads=heads[1],
                            params=_params(name, len(qo_lens), max(kv_lens)))
    assert r.passed, r


# FA2 now skips the tiles left of the window and runs the exact window in kCausal mode (tiles inside the window
# and left of the diagonal unmasked): every window from empty/negative to wider than the sequence.
@pytest.mark.parametrize("window", [-5000, -37, -1, 0, 1, 37, 128, 700, 5000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", ["single", "ragged", "paged"])
def test_fa2_window_forms(op, causal, window):
    if op == "single":
        r = check_single_prefill(GEMMA, qo_len=300, kv_len=1500, causal=causal, backend="fa2",
                                 params={"window": window})
    else:
        r = check_batch_prefill(GEMMA, qo_lens=[300, 1, 700], kv_lens=[900, 250, 700], paged=op == "paged",
                                causal=causal, backend="fa2", params={"window": window})
    assert r.passed, r


def _decode_inputs(kv_lens, heads, page_size=16, dtype=torch.bfloat16):
    hq, hkv = heads
    q = torch.randn(len(kv_lens), hq, 128, dtype=dtype, device="cuda")
    k = torch.randn(sum(kv_lens), hkv, 128, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    cache, indptr, indices, last = _to_paged(k, v, kv_lens, page_size)
    return q, k, v, cache, indptr, indices, last


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}-{h[1]}")
@pytest.mark.parametrize("name,params", [
    ("gemma", {"window": 1}), ("gemma", {"window": 100}), ("gemma", {"window": 517}), ("gemma", {"window": 5000}),
    ("gemma", {"window": -3}), ("chunked", {"chunk": 64}), ("chunked", {"chunk": 1000}), ("sinks", {}),
    ("sinks", {"n_sink": 0, "window": 37}), ("sinks", {"n_sink": 21, "window": 5000}), ("prefix", None),
    ("documents", None), ("head_window", None)])
def test_decode_plain_and_planned(name, params, heads):
    """Windows read only the window (window_left); sinks + window, documents and per-head windows read the
    trimmed pages (key-segments form); prefix-LM keeps every key. Plain and planned decode both match."""
    v = {**VARIANTS, **DECODE_ONLY}[name]
    kv_lens = [1, 33, 517, 1000, 2049]
    q, k, vv, cache, indptr, indices, last = _decode_inputs(kv_lens, heads)
    params = params if params is not None else _params(name, len(kv_lens), max(kv_lens), num_qo_heads=heads[0])
    ref = _ragged_reference(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params)
    out = v.decode(q, cache, indptr, indices, last, **params)
    r = compare(v.name, f"decode {heads} {params if name != 'prefix' else ''}", out, ref, torch.bfloat16)
    assert r.passed, r
    again = v.decode(q, cache, indptr, indices, last, **params)  # the kept plan
    assert torch.equal(again, out)
    for backend in ("fa2", "auto"):  # FA2 plans of one query per request trim pages too
        plan = v.plan_decode(indptr, indices, last, num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim=128,
                             page_size=16, dtype=torch.bfloat16, backend=backend, **params)
        planned = plan.run(q, cache)
        r = compare(v.name, f"planned decode [{backend}]", planned, ref, torch.bfloat16)
        assert r.passed, r
        if backend == "fa2" and name in ("chunked", "documents", "head_window") or (name, params) == (
                "sinks", {"n_sink": 0, "window": 37}):
            assert plan.pages_read is not None and plan.pages_read[0] < plan.pages_read[1], plan.pages_read


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_one_shot_sees_a_param_written_in_place(backend):
    """The one-shot calls keep their plans keyed by tensor identity and version: an in-place write to a param
    tensor or an indptr between two calls is planned again, never served the old plan."""
    qo_lens = kv_lens = [300, 517]
    q = torch.randn(sum(qo_lens), 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(sum(kv_lens), 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    indptr = torch.tensor([0, 300, 817], dtype=torch.int32, device="cuda")
    prefix = torch.tensor([10, 200], dtype=torch.int32, device="cuda")
    for step in range(3):
        out = PREFIX.batch_prefill_ragged(q, k, v, indptr, indptr, causal=False, backend=backend, prefix=prefix)
        ref = _ragged_reference(PREFIX, q, k, v, qo_lens, kv_lens, False, {"prefix": prefix})
        r = compare(PREFIX.name, f"one-shot step {step}", out, ref, torch.bfloat16)
        assert r.passed, r
        prefix.add_(97)  # in place: the next call must see it
    # and a single prefill whose window changes between calls (a scalar: part of the key)
    qs, ks, vs = q[:300], k[:300], v[:300]
    for window in (50, 51, 50):
        out = GEMMA.prefill(qs, ks, vs, causal=True, backend=backend, window=window)
        ref = GEMMA.reference(qs, ks, vs, causal=True, window=window)
        assert compare(GEMMA.name, f"window {window}", out, ref, torch.bfloat16).passed


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("name", ["gemma", "chunked", "prefix"])
def test_plain_and_planned_prefill_agree(name, backend):
    v = VARIANTS[name]
    qo_lens, kv_lens = [1000, 37], [1000, 129]
    q = torch.randn(sum(qo_lens), 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(sum(kv_lens), 8, 128, dtype=torch.bfloat16, device="cuda")
    vv = torch.randn_like(k)
    qo = torch.tensor([0, 1000, 1037], dtype=torch.int32, device="cuda")
    kv = torch.tensor([0, 1000, 1129], dtype=torch.int32, device="cuda")
    params = _params(name, 2, 1000)
    plain = v.batch_prefill_ragged(q, k, vv, qo, kv, causal=True, backend=backend, **params)
    plan = v.plan_ragged(qo, kv, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, causal=True,
                         backend=backend, **params)
    planned = plan.run(q, k, vv)
    assert torch.equal(plain, planned)
    if name != "gemma" and backend == "fa2":  # called causally, chunks and a prefix are segments: a request each
        assert plan.segments is not None and plan.segments >= 2, plan.segments
    ref = _ragged_reference(v, q, k, vv, qo_lens, kv_lens, True, params)
    assert compare(v.name, "plain", plain, ref, torch.bfloat16).passed


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_one_shot_plans_beyond_the_cache_reuse_wrappers_correctly(backend):
    """More distinct batch layouts than the one-shot cache keeps: dropped plans hand their wrappers to later
    plans of the same module, which re-plan them; every result must still be the reference's."""
    v = VARIANTS["chunked"]
    for n in range(12):
        qo_lens = kv_lens = [64 + 37 * n, 129]
        q = torch.randn(sum(qo_lens), 32, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(sum(kv_lens), 8, 128, dtype=torch.bfloat16, device="cuda")
        vv = torch.randn_like(k)
        indptr = torch.tensor([0, qo_lens[0], sum(qo_lens)], dtype=torch.int32, device="cuda")
        out = v.batch_prefill_ragged(q, k, vv, indptr, indptr, causal=True, backend=backend)
        ref = _ragged_reference(v, q, k, vv, qo_lens, kv_lens, True, {})
        r = compare(v.name, f"layout {n}", out, ref, torch.bfloat16)
        assert r.passed, r


def _zoo(name):
    from fivar.bench.suites.zoo import load
    return load(name)


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["document_mask", "packed_documents", "per_head_window", "prefix_lm"])
def test_fa3_paged_prefill_reads_only_the_kept_pages(name, causal, page_size):
    """FA3 paged prefill of a mask that is more than a band: each query tile runs over the keys of its non-empty key
    tiles, found through the page table (fivar.runtime.fa3_tile_list). Ragged lengths off 16 and off the page size, a request with no rows,
    GQA 32/8; the one-shot call, the plan (the same split) and the reference agree."""
    import fivar
    v = fivar.load("document_mask") if name == "document_mask" else _zoo(name)
    qo_lens, kv_lens = [300, 0, 77, 1000, 1], [517, 40, 301, 1000, 129]
    hq, hkv = 32, 8
    q = torch.randn(sum(qo_lens), hq, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(sum(kv_lens), hkv, 128, dtype=torch.bfloat16, device="cuda")
    vv = torch.randn_like(k)
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size)
    qo_indptr = torch.tensor([0] + qo_lens, device="cuda").cumsum(0).to(torch.int32)
    if name == "per_head_window":  # local heads only (a global head would make every key kept)
        params = {"windows": torch.randint(1, 400, (hq,), dtype=torch.int32, device="cuda")}
    elif name == "prefix_lm":
        params = {"prefix_len": torch.tensor([5, 0, 200, 333, 1], dtype=torch.int32, device="cuda")}
    else:
        params = {"doc_ids": (torch.rand(len(kv_lens), max(kv_lens), device="cuda") < 6.0 / max(kv_lens))
                  .to(torch.int32).cumsum(1).to(torch.int32)}
    ref = _ragged_reference(v, q, k, vv, qo_lens, kv_lens, causal, params)
    out = v.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, causal=causal, backend="fa3", **params)
    r = compare(v.name, f"paged fa3 page {page_size}{' causal' if causal else ''}", out, ref, torch.bfloat16)
    assert r.passed, r
    plan = v.plan_paged(qo_indptr, indptr, indices, last, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128,
                        page_size=page_size, dtype=torch.bfloat16, causal=causal, backend="fa3", **params)
    planned = plan.run(q, cache)
    assert torch.equal(planned, out)
    assert plan.keys_read is not None and plan.keys_read[0] < plan.keys_read[1], plan.keys_read
