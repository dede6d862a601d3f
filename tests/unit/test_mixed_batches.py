"""Mixed steps: prefill chunks and decodes (one query) of the same variant in one paged batch, on the CPU.

The metadata of a step from an engine's inputs (`fivar.integrations.serving.mixed_step`); the Triton twin under
TRITON_INTERPRET=1 against the float64 reference, output and LSE, and against the step run as two calls (its
chunks, then its decodes through `decode`); FA2's plan end to end through the stand-in wrapper of
test_fa2_block_form (a mask beyond a band on the tile list, a batch of decodes alone on decode's forms); FA3's tile
list of a mixed step read as its struct reads it (test_fa3_tile_list's emulation) against every pair.
"""
import random
import zlib

import pytest
import torch

import fivar
from fivar.codegen.torch_ref import reference_attention
from fivar.integrations.serving import mixed_step
from fivar.runtime import attention, fa2_blocks, plans
from fivar.testing import example_params

from test_block_map import _variant as map_variant
from test_fa2_block_form import cpu_fa2, interpret  # noqa: F401  (the stand-in plans, the interpreter)
from test_fa2_tile_list import _params as fa2_params
from test_fa3_tile_list import _paged, _plan, list_errors
from test_sparsity import _variant as mask_variant, m_causal_window, m_document, m_sinks_window

HQ, HKV, D = 4, 2, 16
TWIN_HEADS = (2, 1)  # the interpreted twin's checks: GQA still, half the programs of 4/2


def _step(rng: random.Random, chunks=(2, 3), decodes=(2, 4), chunk_len=(5, 40), context=(0, 60)):
    """(cached lens, new lens) of a random mixed step: a few prefill chunks (some continuing a cached prefix, some
    from scratch) and decodes over cached contexts, shuffled."""
    reqs = [(rng.choice([0, rng.randint(*context)]), rng.randint(*chunk_len)) for _ in range(rng.randint(*chunks))]
    reqs += [(rng.randint(max(1, context[0]), context[1]), 1) for _ in range(rng.randint(*decodes))]
    rng.shuffle(reqs)
    return [c for c, _ in reqs], [n for _, n in reqs]


def _cache(kv, page, rng: random.Random, pad=2, heads=HKV):
    """A shuffled page pool and a vLLM-style block table [batch, max_pages] (padded rows: entries past a request's
    last page are junk the step must not read)."""
    n_pages = [-(-n // page) for n in kv]
    perm = torch.randperm(sum(n_pages) + pad, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    width = max(n_pages) + pad
    table = torch.full((len(kv), width), 10 ** 6, dtype=torch.int32)
    at = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[at:at + n]
        at += n
    k_cache = torch.randn(sum(n_pages) + pad, page, heads, D).half()
    v_cache = torch.randn(sum(n_pages) + pad, page, heads, D).half()
    return (k_cache, v_cache), table


def _keys(cache, table, b, kv_len, page):
    pages = table[b, :-(-kv_len // page)].long()
    return tuple(c[pages].reshape(-1, c.shape[2], D)[:kv_len] for c in cache)


def _reference(v, q, cache, table, new, kv, page, causal, params, float_dtype=torch.float64):
    outs, lses, a = [], [], 0
    for b, (lq, lk) in enumerate(zip(new, kv)):
        k, vv = _keys(cache, table, b, lk, page)
        o, lse = reference_attention(v, q[a:a + lq].to(float_dtype), k.to(float_dtype), vv.to(float_dtype),
                                     causal=causal, params=params, batch_idx=b, batch_size=len(new),
                                     float_dtype=float_dtype, return_lse=True)
        outs.append(o), lses.append(lse)
        a += lq
    return torch.cat(outs).double(), torch.cat(lses).double()


# ------------------------------------------------------------------------------------------------ the metadata

def test_mixed_step_builds_the_paged_metadata_of_the_step():
    rng = random.Random(1)
    for page in (1, 16, 5):
        cached, new = _step(rng)
        kv = [c + n for c, n in zip(cached, new)]
        _, table = _cache(kv, page, rng)
        for pt in (table, [row.tolist() for row in table]):  # a block table or per-request lists
            step = mixed_step(cached, new, pt, page)
            assert step.qo_indptr.tolist() == [0] + torch.tensor(new).cumsum(0).tolist()
            pages = [-(-n // page) for n in kv]
            assert step.kv_indptr.tolist() == [0] + torch.tensor(pages).cumsum(0).tolist()
            for b, n in enumerate(pages):
                assert step.kv_indices[step.kv_indptr[b]:step.kv_indptr[b + 1]].tolist() == table[b, :n].tolist()
            # the keys the metadata names are each request's kv_len: full pages, then the last one's share
            assert [(n - 1) * page + int(x) for n, x in zip(pages, step.kv_last_page_len)] == kv
            assert all(1 <= int(x) <= page for x in step.kv_last_page_len)
            assert all(t.dtype == torch.int32 for t in step)


@pytest.mark.parametrize("args,words", [
    (([0, 3], [4], [[0], [1]], 16), ("2 cached", "1 new")),
    (([0], [0], [[0]], 16), ("new-token counts >= 1",)),
    (([-1], [2], [[0]], 16), ("cached lengths must be >= 0",)),
    (([30], [5], [[0, 1]], 16), ("request 0", "35 keys", "3 page(s)", "has 2")),
    (([3], [1], [[0]], 0), ("page_size",)),
    (([3], [1], [[0], [1]], 16), ("2 rows", "1 requests")),
    (([3], [1.5], [[0]], 16), ("new_lens", "integers")),
    (([3], [1], [[-2]], 16), ("request 0", "pages")),
])
def test_bad_step_inputs_are_one_line_errors(args, words):
    with pytest.raises(fivar.FivarError) as e:
        mixed_step(*args)
    text = str(e.value)
    assert "\n" not in text and "mixed_step" in text and all(w in text for w in words), text


# ------------------------------------------------------------------------------------------- the Triton twin

def _battery(name):
    from fivar.bench.suites.masks import load
    return load(name)


TWIN_VARIANTS = {"softcap": lambda: fivar.load("softcap"), "document_mask": lambda: fivar.load("document_mask"),
                 "gpt_oss": lambda: fivar.load("gpt_oss"), "causal_window_global": lambda: _battery(
                     "causal_window_global")}


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("name", sorted(TWIN_VARIANTS))
def test_triton_mixed_step_matches_the_reference_and_two_calls(name, page):
    rng = random.Random(zlib.crc32(f"{name} {page}".encode()))
    torch.manual_seed(rng.randrange(1 << 30))
    v = TWIN_VARIANTS[name]()
    cached, new = _step(rng)
    kv = [c + n for c, n in zip(cached, new)]
    hq, hkv = TWIN_HEADS
    cache, table = _cache(kv, page, rng, heads=hkv)
    params = example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=len(new), max_len=max(kv), device="cpu")
    step = mixed_step(cached, new, table, page)
    q = torch.randn(sum(new), hq, D).half()
    out, lse = v.batch_prefill_paged(q, cache, *step, causal=True, backend="triton", return_lse=True, **params)
    ref, ref_lse = _reference(v, q, cache, table, new, kv, page, True, params)
    assert (out.double() - ref).abs().max() < 2e-2, (name, cached, new)
    kept = ref_lse > -1e30  # rows keeping a key
    lse_err = (lse.double()[kept] - ref_lse[kept]).abs().max()
    assert lse_err < 2e-3, lse_err
    # the same step as an engine without mixed batches runs it: the decodes through decode, their rows the same
    dec = [b for b, n in enumerate(new) if n == 1]
    rows = step.qo_indptr[torch.tensor(dec)].long()
    kv_ind = torch.tensor([0] + [-(-kv[b] // page) for b in dec]).cumsum(0).to(torch.int32)
    pages = torch.cat([table[b, :-(-kv[b] // page)] for b in dec])
    last = step.kv_last_page_len[torch.tensor(dec)]
    # the decodes' own batch: their params rows (documents are per batch entry) follow them
    dparams = {k: (x[torch.tensor(dec)] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == len(new) else x)
               for k, x in params.items()}
    alone, alone_lse = v.decode(q[rows], cache, kv_ind, pages, last, backend="triton", return_lse=True, **dparams)
    assert (alone.double() - out[rows].double()).abs().max() < 2e-3
    assert torch.allclose(alone_lse.double(), lse[rows].double(), atol=1e-3)


# ---------------------------------------------------------------------------------------- FA2's plan (stand-in)

# a band (the stand-in evaluates a mask: soft-cap alone runs in the GPU test)
FA2_VARIANTS = {"causal_window": lambda: mask_variant(m_causal_window), "document": lambda: mask_variant(m_document),
                "sinks_window": lambda: mask_variant(m_sinks_window)}


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("name", sorted(FA2_VARIANTS))
def test_fa2_mixed_plan_matches_the_reference(cpu_fa2, monkeypatch, name, page):  # noqa: F811
    """A mixed step on FA2: a mask beyond a band takes the tile list (a batch of decodes alone takes decode's
    forms), a variant without one FlashInfer's paged kernel; output and LSE against the reference."""
    current, made = cpu_fa2
    monkeypatch.setattr(fa2_blocks, "tile_list_rows", lambda g, d: 16)
    rng = random.Random(zlib.crc32(f"fa2 {name} {page}".encode()))
    v = current[0] = FA2_VARIANTS[name]()
    cached, new = _step(rng, context=(1, 70))
    kv = [c + n for c, n in zip(cached, new)]
    cache, table = _cache(kv, page, rng)
    params = fa2_params(torch.Generator().manual_seed(rng.randrange(1 << 30)), 2, max(kv))
    params = {k: (x[:1].expand(len(new), -1).contiguous() if k == "doc" else x) for k, x in params.items()}
    params["prefix"] = torch.randint(0, 9, (len(new),), dtype=torch.int32)
    params = {k: x for k, x in params.items() if k in v.params}
    step = mixed_step(cached, new, table, page)
    common = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=page, dtype=torch.float16, causal=True,
                  backend="fa2", device="cpu", params=params)
    plan = attention.PagedAttentionPlan(v, *step, **common)
    assert (plan._tiles is not None) == v.scans_mask
    if v.scans_mask:
        assert made[-1].tile_list and made[-1].target == "fa2"
    q = torch.randn(sum(new), HQ, D).half()
    out, lse = plan.run(q, cache, return_lse=True)
    ref, ref_lse = _reference(v, q, cache, table, new, kv, page, True, params, float_dtype=torch.float32)
    assert torch.allclose(out.double(), ref, atol=2e-3), (out.double() - ref).abs().max()
    kept = ref_lse > -1e30
    lse_err = (lse.double()[kept] - ref_lse[kept]).abs().max()
    assert lse_err < 1e-3, lse_err
    # the step's decodes alone: decode's forms, not the tile list (trimmed pages or the block form), same rows
    dec = [b for b, n in enumerate(new) if n == 1]
    dparams = {k: (x[torch.tensor(dec)] if k in ("doc", "prefix") else x) for k, x in params.items()}
    dstep = mixed_step([cached[b] for b in dec], [1] * len(dec), table[torch.tensor(dec)], page)
    alone = attention.PagedAttentionPlan(v, *dstep, **{**common, "params": dparams})
    assert alone._tiles is None
    rows = step.qo_indptr[torch.tensor(dec)].long()
    got, got_lse = alone.run(q[rows], cache, return_lse=True)
    assert torch.allclose(got.double(), ref[rows], atol=2e-3), (got.double() - ref[rows]).abs().max()
    assert torch.allclose(got_lse.double(), ref_lse[rows], atol=1e-3)


# ----------------------------------------------------------------------------------------- FA3's tile list

@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["document_window", "head_window_sinks", "dilated"])
def test_fa3_tile_list_of_a_mixed_step_keeps_exactly_the_pairs(name, causal, page):
    """FA3 runs a mask beyond a band on its tile list whatever the query counts: a mixed step's list, read as the
    struct reads it, keeps exactly the reference's pairs, each decode one request of one row."""
    from fivar.runtime.fa3_tile_list import page_size_for
    rng = random.Random(zlib.crc32(f"fa3 {name} {causal} {page}".encode()))
    random.seed(rng.randrange(1 << 30))  # the mask's param draw
    v, draw = map_variant(name)
    cached, new = _step(rng, chunk_len=(5, 70), context=(1, 150))
    kv = [c + n for c, n in zip(cached, new)]
    params = draw(len(new), max(kv))
    token_of, key_at = _paged(kv, page)
    layout, bound = _plan(v, params, new, kv, causal, token_of, page_size_for(cache_page_size=page))
    assert list_errors(v, bound, layout, new, kv, causal, key_at) == []
    rows = layout.qo_indptr.diff()
    for b in (b for b, n in enumerate(new) if n == 1):  # a decode: one request of its one row
        mine = (layout.blocks[:, 0] == b).nonzero().view(-1)
        assert mine.numel() == 1 and int(rows[mine]) == 1
    assert plans.tile_list_form(v, "fa3", one_query=False) and plans.tile_list_form(v, "fa3", one_query=True)


# ------------------------------------------------------------------------------ the serving suite's mixed step

@pytest.mark.parametrize("name", ["document_mask", "softcap"])
def test_the_suites_mixed_step_its_check_and_its_flex_contender(monkeypatch, name):
    """The bench's mixed step at a tiny shape on the CPU: the Triton twin passes the case's check, Flex over the
    step packed into one sequence (eager) computes the same rows, and a wrong result fails the check."""
    from fivar.bench.contenders import Contender
    from fivar.bench.suites import serving
    for attr, value in (("BATCH", 5), ("CONTEXT", 40), ("HEADS", TWIN_HEADS), ("HEAD_DIM", D), ("PAGE", 16),
                        ("DTYPE", torch.float16)):
        monkeypatch.setattr(serving, attr, value)
    torch.manual_seed(zlib.crc32(name.encode()))
    v, t, params = serving._mixed_problem(name, ((0, 19), (9, 30)), 3, device="cpu")
    assert t["decodes"] == 3 and t["new"] == [1, 1, 1, 19, 30] and t["kv"] == [40, 40, 40, 19, 39]
    check = serving._mixed_check(v, t, params)
    twin = lambda: v.batch_prefill_paged(t["q"], t["cache"], *t["step"], causal=True, backend="triton",  # noqa: E731
                                         **params)
    assert check(Contender("triton", twin)).passed
    flex = serving._mixed_flex(v, t, params, compiled=False)
    assert (flex().float() - twin().float()).abs().max() < 2e-2
    assert check(Contender("flex", flex)).passed
    wrong = lambda: twin() * 1.1  # noqa: E731
    assert not check(Contender("wrong", wrong)).passed
