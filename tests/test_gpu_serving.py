"""Speculative verify batches with a custom mask on the GPU (marked `gpu`): FA3's tile-list form and the Triton twin
against the torch reference, bf16 hd128 GQA 32/8, chain and tree masks over pages of 16 and 1, and one-shot calls
equal to their plan. Few cases: every FA3 module is a long build (soft-cap, sliding window and gpt-oss get the custom-mask
module form, documents keep their own tile-list module)."""
import random

import pytest
import torch

import fivar
from fivar.codegen.torch_ref import reference_attention
from fivar.integrations.serving import chain_parents, tree_mask, tree_rows
from fivar.testing import _to_paged, compare, example_params

pytestmark = pytest.mark.gpu
DTYPE, HQ, HKV, D = torch.bfloat16, 32, 8, 128


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _batch(form: str):
    drafts = [random.randint(1, 16) for _ in range(4)] + [64]
    prefixes = [random.randint(0, 700) for _ in drafts]
    parents = [chain_parents(n) if form == "chain" else [-1] + [random.randrange(-1, j) for j in range(1, n)]
               for n in drafts]
    masks = [torch.cat([torch.ones(n, p, dtype=torch.bool), tree_rows(par)], 1).cuda()
             for n, p, par in zip(drafts, prefixes, parents)]
    return drafts, [p + n for p, n in zip(prefixes, drafts)], prefixes, parents, masks


def _reference(v, q, k, vv, qo, kv, causal, params, masks, batch_size=None, float_dtype=torch.float32):
    """`batch_size`: the params' batch (a CUDA-graph plan's max_batch), else the step's."""
    outs, a, b = [], 0, 0
    for i, (lq, lk) in enumerate(zip(qo, kv)):
        outs.append(reference_attention(v, q[a:a + lq], k[b:b + lk], vv[b:b + lk], causal=causal, params=params,
                                        batch_idx=i, batch_size=batch_size or len(qo), custom_mask=masks[i],
                                        float_dtype=float_dtype))
        a, b = a + lq, b + lk
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["fa3", "fa2", "auto", "triton"])
@pytest.mark.parametrize("name", ["softcap", "sliding_window", "gpt_oss", "document_mask"])
@pytest.mark.parametrize("page", [16, 1])
def test_verify_matches_the_reference_and_its_plan(backend, name, page):
    if backend == "fa3" and not _sm90():
        pytest.skip("FA3 needs an sm90 GPU")
    v = fivar.load(name)
    for form, causal in (("chain", True), ("chain", False), ("tree", False), ("tree", True)):
        qo, kv, prefixes, parents, masks = _batch(form)
        if backend == "auto":  # short requests only (the 64-draft one left out): auto picks FA2's tile list
            qo, kv, prefixes, parents, masks = (x[:-1] for x in (qo, kv, prefixes, parents, masks))
        params = example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=len(qo), max_len=max(kv),
                                device="cuda")
        q = torch.randn(sum(qo), HQ, D, dtype=DTYPE, device="cuda")
        k, vv = (torch.randn(sum(kv), HKV, D, dtype=DTYPE, device="cuda") for _ in range(2))
        cache, kv_indptr, kv_indices, last = _to_paged(k, vv, kv, page)
        qo_indptr = torch.tensor([0] + list(torch.tensor(qo).cumsum(0)), dtype=torch.int32, device="cuda")
        packed, mask_indptr = tree_mask(prefixes, parents, device="cuda")
        out = v.batch_prefill_paged(q, cache, qo_indptr, kv_indptr, kv_indices, last, causal=causal, backend=backend,
                                    packed_custom_mask=packed, mask_indptr=mask_indptr, **params)
        ref = _reference(v, q, k, vv, qo, kv, causal, params, masks)
        r = compare(v.name, f"verify {form} page {page}{' causal' if causal else ''} [{backend}]", out, ref, DTYPE)
        assert r.passed, r
        if backend == "auto":
            assert torch.equal(out, v.batch_prefill_paged(q, cache, qo_indptr, kv_indptr, kv_indices, last,
                                                          causal=causal, backend="fa2", packed_custom_mask=packed,
                                                          mask_indptr=mask_indptr, **params))
        if backend != "triton":  # the twin has no plan step
            plan = v.plan_paged(qo_indptr, kv_indptr, kv_indices, last, num_qo_heads=HQ, num_kv_heads=HKV,
                                head_dim=D, page_size=page, dtype=DTYPE, causal=causal, backend=backend,
                                packed_custom_mask=packed, mask_indptr=mask_indptr, **params)
            assert torch.equal(plan.run(q, cache), out)
            if form == "chain":  # the bits add nothing to causal: the band form runs, reading none
                assert not plan.reads_custom_mask


@pytest.mark.parametrize("backend", ["fa2", "auto", "triton"])
def test_a_compiled_verify_call_keeps_its_mask(backend):
    """torch.compile(fullgraph=True) over the one-shot verify call with a packed tree mask: one graph, equal to the
    eager call, which passes the float64 reference."""
    v = fivar.load("softcap")
    qo, kv, prefixes, parents, masks = (x[:-1] for x in _batch("tree"))  # short requests: FA2 under auto
    params = example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=len(qo), max_len=max(kv), device="cuda")
    q = torch.randn(sum(qo), HQ, D, dtype=DTYPE, device="cuda")
    k, vv = (torch.randn(sum(kv), HKV, D, dtype=DTYPE, device="cuda") for _ in range(2))
    cache, kv_indptr, kv_indices, last = _to_paged(k, vv, kv, 16)
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo).cumsum(0)), dtype=torch.int32, device="cuda")
    packed, mask_indptr = tree_mask(prefixes, parents, device="cuda")

    def step(q, c0, c1, packed, mask_indptr):
        return v.batch_prefill_paged(q, (c0, c1), qo_indptr, kv_indptr, kv_indices, last, causal=True,
                                     backend=backend, packed_custom_mask=packed, mask_indptr=mask_indptr, **params)

    explanation = torch._dynamo.explain(step)(q, *cache, packed, mask_indptr)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    got = torch.compile(step, fullgraph=True)(q, *cache, packed, mask_indptr)
    assert torch.equal(got, step(q, *cache, packed, mask_indptr))
    r = compare(v.name, f"compiled verify [{backend}]", got, _reference(v, q, k, vv, qo, kv, True, params, masks),
                DTYPE)
    assert r.passed, r


def _graph_step(batch, max_qo, max_prefix, page, pool, uniform: bool = False, chain: bool = False):
    """A verify step over a shared pool of pages: (qo lens, kv lens, masks, (qo_indptr, kv_indptr, kv_indices, last),
    the packed mask's kwargs), draft trees (chain: chains) of 1..max_qo tokens (uniform: max_qo each) after prefixes
    of up to max_prefix keys."""
    drafts = [max_qo if uniform else random.randint(1, max_qo) for _ in range(batch)]
    prefixes = [random.randint(0, max_prefix) for _ in range(batch)]
    parents = [chain_parents(n) if chain else [-1] + [random.randrange(-1, j) for j in range(1, n)] for n in drafts]
    masks = [torch.cat([torch.ones(n, p, dtype=torch.bool), tree_rows(par)], 1).cuda()
             for n, p, par in zip(drafts, prefixes, parents)]
    kv = [p + n for p, n in zip(prefixes, drafts)]
    counts = [-(-n // page) for n in kv]
    indices = torch.randperm(pool)[:sum(counts)].to(torch.int32).cuda()
    kv_indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    last = torch.tensor([n - (c - 1) * page for n, c in zip(kv, counts)], dtype=torch.int32, device="cuda")
    qo_indptr = torch.tensor([0, *torch.tensor(drafts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed, mask_indptr = tree_mask(prefixes, parents, device="cuda")
    return drafts, kv, masks, (qo_indptr, kv_indptr, indices, last), dict(packed_custom_mask=packed,
                                                                          mask_indptr=mask_indptr)


def _gathered(cache, kv_indptr, indices, kv):
    """Contiguous K (or V) of every request, read back out of its pages."""
    return torch.cat([cache[indices[kv_indptr[b]:kv_indptr[b + 1]].long()].reshape(-1, *cache.shape[2:])[:n]
                      for b, n in enumerate(kv)])


@pytest.mark.parametrize("backend", ["fa2", "fa3", "triton"])
@pytest.mark.parametrize("name", ["softcap", "document_mask"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_verify_step_captured_in_a_cuda_graph_replays_new_steps(backend, name, causal):
    """plan_paged(cuda_graph=True): captured once, re-planned and replayed for steps of other lengths, draft trees and
    pages with fewer requests than the capacity, each against the reference; the rows past a step's are zeros."""
    _replays_new_steps(backend, name, causal, uniform=False)


@pytest.mark.parametrize("backend", ["fa2", "fa3", "triton"])
@pytest.mark.parametrize("name", ["softcap", "gpt_oss", "document_mask"])
@pytest.mark.parametrize("drafts", [4, 31, 40])  # FA2's tile-list tile at GQA 32/8: 32 rows
def test_a_uniform_verify_plan_replays_steps_of_fewer_requests(backend, name, drafts):
    """uniform_qo_len=True (every request max_qo_len drafts; on FA2 below its query tile, padding requests of those
    rows and no keys cover q's rows past a step's, and FlashInfer gets the promise): replays against the reference,
    the rows past a step's zeros (the output's memory poisoned first)."""
    _replays_new_steps(backend, name, True, uniform=True, max_qo=drafts)


@pytest.mark.parametrize("backend", ["fa2", "fa3", "auto"])
@pytest.mark.parametrize("name", ["softcap", "gpt_oss", "sliding_window", "document_mask"])
@pytest.mark.parametrize("uniform", [False, True])
def test_a_verify_plan_made_without_a_custom_mask_replays_chains(backend, name, uniform):
    """Chains planned as causal with no mask (as engines plan them): FA2 runs a band's requests in its own causal and
    window modes (no tile list), other masks and FA3 the tile list of the mask alone; steps giving a mask refused."""
    plan = _replays_new_steps(backend, name, True, uniform=uniform, max_qo=8, masked=False)
    band = plan.target == "fa2" and not fivar.load(name).scans_mask
    assert type(plan._tiles).__name__ == ("VerifyRequests" if band else "VerifyTiles"), (plan.target, name)


def _replays_new_steps(backend, name, causal, uniform, max_qo=16, masked: bool = True):
    if backend == "fa3" and not _sm90():
        pytest.skip("FA3 needs an sm90 GPU")
    v = fivar.load(name)
    max_batch, page, pool = 4, 16, 256
    k_cache = torch.randn(pool, page, HKV, D, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(pool, page, HKV, D, dtype=DTYPE, device="cuda")
    params = example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=max_batch, max_len=pool * page,
                            device="cuda")
    qo, kv, masks, meta, mask = _graph_step(max_batch, max_qo, 600, page, pool, uniform, chain=not masked)
    mask = mask if masked else {}
    plan = v.plan_paged(*meta, cuda_graph=True, max_batch=max_batch, max_qo_len=max_qo, max_pages=pool,
                        num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=page, dtype=DTYPE, causal=causal,
                        backend=backend, uniform_qo_len=uniform, **mask, **params)
    q_static = torch.zeros(max_batch * max_qo, HQ, D, dtype=DTYPE, device="cuda")

    def check(out, qo, kv, masks, meta, what):
        n = sum(qo)
        k, vv = (_gathered(c, meta[1], meta[2], kv) for c in (k_cache, v_cache))
        ref = _reference(v, q_static[:n], k, vv, qo, kv, causal, params, masks if masked else [None] * len(qo),
                         max_batch, torch.float64)
        r = compare(v.name, f"verify in a CUDA graph, {what} [{backend}]", out[:n], ref, DTYPE)
        assert r.passed, r
        assert not out[n:].any()

    q_static[:sum(qo)].normal_()
    if backend == "fa2" and uniform:  # the promise reached FlashInfer where the drafts are below its tile
        assert plan._uniform == ({"uniform_q_len": max_qo} if max_qo < 32 else {}), plan._uniform
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (module load, lazy allocations)
        # freed at once, on the stream the run allocates on: the block its output gets (rows it did not write: NaN)
        torch.full((max_batch * max_qo, HQ, D), float("nan"), dtype=DTYPE, device="cuda")
        eager = plan.run(q_static, (k_cache, v_cache))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    check(eager, qo, kv, masks, meta, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan.run(q_static, (k_cache, v_cache))
    for batch, prefix in ((2, 200), (3, 900), (1, 30)):
        qo, kv, masks, meta, mask = _graph_step(batch, max_qo, prefix, page, pool, uniform, chain=not masked)
        if not masked:
            with pytest.raises(fivar.FivarError, match="made without a custom mask"):
                plan.plan(*meta, **mask)
        plan.plan(*meta, **(mask if masked else {}))
        q_static.zero_()
        q_static[:sum(qo)].normal_()
        graph.replay()
        torch.cuda.synchronize()
        check(captured, qo, kv, masks, meta, f"{batch} of {max_batch} requests")
    with pytest.raises(fivar.FivarError, match="max_batch=4"):
        plan.plan(*_graph_step(5, max_qo, 10, page, pool)[3])
    return plan
