"""FA2 batch prefill in the tile-list form (fivar.codegen.fa2._tile_list_decl, planned by fivar.runtime.fa3_tile_list).

End to end on the CPU: FA2 plans (ragged and paged, causal and not, GQA) of masks beyond a band plan the same
requests as FA3's form, at FA2's query tile, and test_fa2_block_form's stand-in of FlashInfer's FA2 paged kernel runs
them in kNone mode the way the generated struct reads them (each request's local row and key mapped back through
fv_blocks and fv_tile_keys, whole tiles kept with one compare, cut tiles from the bits or the mask): the whole batch
must be the reference's, and corrupted tables must not be. Then the module's sources, and (nvcc) its build.
"""
import dataclasses
import shutil
import subprocess
import zlib

import pytest
import torch

from fivar.testing import _ragged_reference

import fivar
from fivar.codegen import tile_list
from fivar.errors import FivarError
from fivar.jit.targets import FA2, target_of
from fivar.spec import AttentionVariant
from fivar.runtime import attention, explain, fa2_blocks, fa3_tile_list, plans
from fivar.testing import _to_paged

from test_fa2_block_form import cpu_fa2, interpret  # noqa: F401  (the stand-in plans, the interpreter)
from test_sparsity import (_variant, m_causal_window, m_chunk_causal, m_document, m_hole, m_mod_keys, m_per_head_window,
                           m_periodic_holes, m_sinks_window)

def _softcap(score, b, h, kh, q, kv, p):
    return 20.0 * fivar.tanh(score / 20.0)


PLAIN = fivar.AttentionVariant(name="softcap_only", logits=_softcap)  # no mask
MASKS = [m_document, m_chunk_causal, m_sinks_window, m_hole, m_periodic_holes, m_per_head_window, m_mod_keys]


def _params(gen, group, width):
    return {"w": int(torch.randint(8, 40, (), generator=gen)), "r": 3, "c": int(torch.randint(20, 70, (), generator=gen)),
            "n_sink": 5, "hole": 2,
            "doc": torch.randint(0, 4, (3, width), generator=gen).sort(1).values.to(torch.int32),
            "prefix": torch.tensor([5, 40, 17], dtype=torch.int32),
            "hw": torch.randint(0, 60, (2 * group,), generator=gen).to(torch.int32)}


def _distance_bias(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score - 0.002 * (q_idx - kv_idx) * (q_idx - kv_idx)  # not a shift a tile's keys share


def _run(mask, kv_form, causal, group, rows, seed, monkeypatch, cpu_fa2, biased=False):  # noqa: F811
    """(plan, out, lse, reference out, reference lse) of a random batch: one request with fewer keys than queries'
    reach, one of a single query, one over several key tiles with a short last one. `biased`: the mask's variant
    with a logits transform reading kv_idx."""
    current, made = cpu_fa2
    monkeypatch.setattr(fa2_blocks, "tile_list_rows", lambda g, d: rows)  # finer than a GPU's, for more tiles
    gen = torch.Generator().manual_seed(seed)
    v = _variant(mask)
    if biased:
        v = AttentionVariant(name=f"{mask.__name__}_biased", mask=mask, logits=_distance_bias, params=v.params)
    current[0] = v
    kv_lens = [int(torch.randint(20, 60, (), generator=gen)), 9, int(torch.randint(100, 200, (), generator=gen))]
    qo_lens = [kv_lens[0] - 3, 1, kv_lens[2] - int(torch.randint(0, 40, (), generator=gen))]
    hq, hkv = 2 * group, 2
    params = _params(gen, group, max(kv_lens))
    q = torch.randn(sum(qo_lens), hq, 16, generator=gen).half()
    k = torch.randn(sum(kv_lens), hkv, 16, generator=gen).half()
    vv = torch.randn(sum(kv_lens), hkv, 16, generator=gen).half()
    qo = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32)
    common = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=16, dtype=torch.float16, causal=causal, backend="fa2",
                  device="cpu", params=params)
    if kv_form == "ragged":
        plan = attention.RaggedAttentionPlan(v, qo, torch.tensor([0] + kv_lens).cumsum(0).to(torch.int32), **common)
        out, lse = plan.run(q, k, vv, return_lse=True)
        tiles = plan._tile_list
    else:
        page = int(torch.randint(1, 40, (), generator=gen))
        (k_cache, v_cache), indptr, indices, last = _to_paged(k, vv, kv_lens, page)
        plan = attention.PagedAttentionPlan(v, qo, indptr, indices, last, page_size=page, **common)
        out, lse = plan.run(q, (k_cache, v_cache), return_lse=True)
        tiles = plan._tiles
    if kv_form == "ragged" and causal and mask in (m_document, m_chunk_causal):  # documents: the segments form
        assert tiles is None and plan.segments is not None
    else:
        assert tiles is not None and made[-1].tile_list and made[-1].target == "fa2"
    ref, ref_lse = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, causal, params,
                                     return_lse=True)
    return tiles, out.double(), lse.double(), ref.double(), ref_lse.double()


@pytest.mark.parametrize("kv_form,group", [("ragged", 1), ("paged", 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", MASKS, ids=lambda f: f.__name__)
def test_tile_list_plans_match_the_reference(cpu_fa2, monkeypatch, mask, causal, kv_form, group):  # noqa: F811
    seed = zlib.crc32(f"{mask.__name__} {causal} {kv_form} {group}".encode())
    tiles, out, lse, ref, ref_lse = _run(mask, kv_form, causal, group, 16, seed, monkeypatch, cpu_fa2)
    assert torch.allclose(out, ref, atol=2e-3), (out - ref).abs().max()
    kept = ref_lse > -1e30  # rows keeping a key (the others: an empty row's LSE)
    assert torch.allclose(lse[kept], ref_lse[kept], atol=1e-3), (lse[kept] - ref_lse[kept]).abs().max()
    if tiles is not None and (mask in (m_document, m_sinks_window, m_chunk_causal) or causal):  # empty tiles unread
        assert tiles.keys_read[0] < tiles.keys_read[1], tiles.keys_read


@pytest.mark.parametrize("kv_form", ["ragged", "paged"])
@pytest.mark.parametrize("limit", [1, 2, 3])
def test_a_batch_of_more_requests_than_a_launch_takes_runs_as_several(cpu_fa2, monkeypatch, kv_form, limit):  # noqa: F811
    """FA3 launches take at most Target.tile_list_launch_requests requests (its planner's all-heads-alike kernel is
    never built): a batch of more runs as launches of consecutive requests, each indexing its own BLOCKS rows, their
    rows and LSEs put back in order (FA2 here, its stand-in reading the tables as the struct does, with a limit of
    `limit` requests)."""
    limited = dataclasses.replace(FA2, tile_list_launch_requests=limit)
    monkeypatch.setattr(fa3_tile_list, "target_of", lambda name: limited if name == "fa2" else target_of(name))
    seed = zlib.crc32(f"split {kv_form} {limit}".encode())
    tiles, out, lse, ref, ref_lse = _run(m_per_head_window, kv_form, True, 2, 16, seed, monkeypatch, cpu_fa2)
    assert len(tiles._launches) == -(-tiles.requests // limit) > 1
    assert torch.allclose(out, ref, atol=2e-3), (out - ref).abs().max()
    kept = ref_lse > -1e30
    assert torch.allclose(lse[kept], ref_lse[kept], atol=1e-3), (lse[kept] - ref_lse[kept]).abs().max()


def _corrupt(kind):
    def wrapped(*args, **kwargs):
        layout = original(*args, **kwargs)
        live = (layout.blocks[:, 3] >= 0) & (layout.kv_indptr.diff() > 0)
        if kind == "whole":  # a cut tile counted whole: its dropped pairs kept
            keys = (layout.kv_indptr.diff() - 1) * layout.page + layout.kv_last_page_len
            r = int(((layout.blocks[:, 3] >= 0) & (layout.blocks[:, 3] < keys)).nonzero()[0])
            layout.blocks[r, 3] += tile_list.TILE_WIDTH
        elif kind == "tile":  # a listed tile's first key one tile on
            layout.tile_keys[int(layout.blocks[int(live.nonzero()[0]), 2])] += tile_list.TILE_WIDTH
        elif kind == "dead":  # a live request said to keep nothing
            layout.blocks[int(live.nonzero()[0]), 3] = -1
        else:  # a kept pair's bit cleared
            at = int(layout.cut_bits.view(-1).nonzero()[0])
            word = int(layout.cut_bits.view(-1)[at])
            layout.cut_bits.view(-1)[at] = word & ~(word & -word)
        return layout
    original = fa3_tile_list.tile_list
    return wrapped


@pytest.mark.parametrize("kind", ["whole", "tile", "dead", "bit"])
def test_a_corrupted_tile_list_fails(cpu_fa2, monkeypatch, kind):  # noqa: F811
    """The stand-in reads the tables as the struct does: a plan whose tables are off by one tile, one bit or one
    request's whole count no longer gives the reference's result."""
    # a tile's kv_idx reaches the kernel only through a logits transform that reads it (the mask is bits)
    mask = m_per_head_window if kind == "tile" else m_sinks_window
    _, out, _, ref, _ = _run(mask, "ragged", False, 1, 16, 3, monkeypatch, cpu_fa2, biased=kind == "tile")
    assert torch.allclose(out, ref, atol=2e-3)  # the plan as made
    monkeypatch.setattr(fa3_tile_list, "tile_list", _corrupt(kind))
    _, out, _, ref, _ = _run(mask, "ragged", False, 1, 16, 3, monkeypatch, cpu_fa2, biased=kind == "tile")
    assert not torch.allclose(out, ref, atol=2e-3)


def test_a_planned_paged_run_folds_k_scale_in(cpu_fa2, monkeypatch):  # noqa: F811
    """plan.run(q, cache, k_scale=s) of a cache holding k / s is attention over s * cache, in the tile-list form as in
    the others (the scale goes into sm_scale per call; the plan is made once)."""
    current, _ = cpu_fa2
    monkeypatch.setattr(fa2_blocks, "tile_list_rows", lambda g, d: 16)
    gen = torch.Generator().manual_seed(21)
    v = current[0] = _variant(m_sinks_window)
    qo_lens, kv_lens = [50, 3], [90, 40]
    params = {**_params(gen, 1, max(kv_lens)), "doc": torch.zeros(2, 90, dtype=torch.int32),
              "prefix": torch.tensor([5, 40], dtype=torch.int32)}
    q = torch.randn(sum(qo_lens), 2, 16, generator=gen).half()
    k = torch.randn(sum(kv_lens), 2, 16, generator=gen).half()
    vv = torch.randn(sum(kv_lens), 2, 16, generator=gen).half()
    (k_cache, v_cache), indptr, indices, last = _to_paged(k, vv, kv_lens, 8)
    plan = attention.PagedAttentionPlan(v, torch.tensor([0, 50, 53], dtype=torch.int32), indptr, indices, last,
                                        num_qo_heads=2, num_kv_heads=2, head_dim=16, page_size=8,
                                        dtype=torch.float16, causal=False, backend="fa2", device="cpu",
                                        params=params)
    assert plan._tiles is not None
    from fivar.testing import _ragged_reference
    for scale in (1.0, 2.5, 0.5):
        out = plan.run(q, (k_cache, v_cache), k_scale=scale).double()
        ref = _ragged_reference(v, q.float(), scale * k.float(), vv.float(), qo_lens, kv_lens, False, params)
        assert torch.allclose(out, ref.double(), atol=2e-3), (scale, (out - ref.double()).abs().max())


@pytest.mark.parametrize("kv_lens", [[90, 40], [70, 130, 33], [64, 1]])
def test_a_paged_batch_reads_only_its_requests_pages(cpu_fa2, monkeypatch, kv_lens):  # noqa: F811
    """The page table holds each request's pages and no more: a request shorter than the batch's longest, ending
    inside a key tile, plans without reading past its own pages, and runs as the reference."""
    current, _ = cpu_fa2
    monkeypatch.setattr(fa2_blocks, "tile_list_rows", lambda g, d: 16)
    gen = torch.Generator().manual_seed(len(kv_lens))
    v = current[0] = _variant(m_hole)
    qo_lens = [max(1, n - 7) for n in kv_lens]
    params = {**_params(gen, 1, max(kv_lens)), "doc": torch.zeros(len(kv_lens), max(kv_lens), dtype=torch.int32),
              "prefix": torch.ones(len(kv_lens), dtype=torch.int32)}
    q = torch.randn(sum(qo_lens), 2, 16, generator=gen).half()
    k = torch.randn(sum(kv_lens), 2, 16, generator=gen).half()
    vv = torch.randn(sum(kv_lens), 2, 16, generator=gen).half()
    (k_cache, v_cache), indptr, indices, last = _to_paged(k, vv, kv_lens, 8)
    qo = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32)
    plan = attention.PagedAttentionPlan(v, qo, indptr, indices, last, num_qo_heads=2, num_kv_heads=2, head_dim=16,
                                        page_size=8, dtype=torch.float16, causal=True, backend="fa2",
                                        device="cpu", params=params)
    from fivar.testing import _ragged_reference
    ref = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, True, params).double()
    out = plan.run(q, (k_cache, v_cache)).double()
    assert plan._tiles is not None and torch.allclose(out, ref, atol=2e-3), (out - ref).abs().max()


def test_fa2_rows_fill_one_query_tile_and_are_powers_of_two():
    for group in (1, 2, 3, 4, 6, 8, 16):
        for hd in (64, 128, 256):
            rows = fa2_blocks.tile_list_rows(group, hd)
            assert rows & (rows - 1) == 0 and rows <= fa2_blocks.block_rows(group, hd) < 2 * rows


def test_fp8_caches_and_one_query_batches_keep_their_forms():
    v = _variant(m_sinks_window)
    assert plans.tile_list_form(v, "fa2") and plans.tile_list_form(v, "fa3", one_query=True)
    assert not plans.tile_list_form(v, "fa2", one_query=True)
    assert not plans.tile_list_form(v, "fa2", kv_dtype="fp8e4m3")
    assert not plans.tile_list_form(PLAIN, "fa2") and not plans.tile_list_form(_variant(m_causal_window), "fa2")


def test_the_module_is_the_paged_kernel_in_knone_alone(monkeypatch):
    """One FA2 module: FlashInfer's paged kernels in kNone only, the ragged entry points linked to stubs; every mask
    reads bits and evaluates nothing of the mask per score, one reading the head at its query head's bits (the same
    module: the struct is the mask-free bits_kernel's); the hooks' keys go through the tile list."""
    from fivar.jit.build import gen_module, serving_modules
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    holes, heads = _variant(m_hole), _variant(m_per_head_window)
    m = gen_module(holes, "batch_prefill", "fa2", tile_list=True)
    from fivar.jit.fa2_sources import RAGGED_STUBS
    units = sorted(n for n in m.sources if n.endswith(".cu"))
    assert units == ["batch_prefill_jit_binding.cu", "batch_prefill_paged_kernel_mask_0.cu"]  # stubs: no unit
    assert "_fa2_batch_prefill_tiles_" in m.uri and m.options["tile_list"]
    paged, ragged = m.sources[units[1]], m.sources[RAGGED_STUBS]
    host = m.sources[units[0]]
    assert host.index(f'#include "{RAGGED_STUBS}"') < host.index("BatchPrefillWithRaggedKVCacheDispatched")
    inst = [ln for ln in paged.splitlines() if "MaskMode::" in ln and "use_custom_mask" not in ln]
    assert paged.count("BatchPrefillWithPagedKVCacheDispatched<") == 6 and "Ragged" not in paged
    assert inst and all("MaskMode::kNone" in ln and "kCustom" not in ln for ln in inst)
    assert ragged.count("template <>") == 3 and ragged.count("cudaErrorNotSupported") == 3
    config = m.sources["batch_prefill_config.inc"]
    struct = config[config.index("struct Fivar_"):]
    transform = struct.split("REGISTER_LOGITS_TRANSFORM")[1]
    assert "REGISTER_LOGITS_MASK" not in struct and "fv_cut_bits" in struct and "fvp_hole" not in transform
    assert "case MaskMode::kNone" in config and "case MaskMode::kCustom" not in config
    assert "int32_t(qo_head_idx) * fv_head_words" in transform and "fv_causal" not in struct
    per_head = gen_module(heads, "batch_prefill", "fa2", tile_list=True)
    assert per_head.uri == m.uri and "fvp_hw" not in per_head.sources["batch_prefill_config.inc"]
    # the struct's table reads FlashInfer FA2's params (FA3's the same tables, once per KV tile)
    assert "params.fv_blocks[" in struct and "additional_params" not in struct
    prefill = [x.uri for x in serving_modules(holes, "batch_prefill", "fa2")]
    assert m.uri in prefill and len(prefill) == 4
    assert [x.uri for x in serving_modules(holes, "single_prefill", "fa2")] == [
        m.uri, gen_module(holes, "batch_prefill", "fa2", kv_segments=True, mask_free=True).uri]


@pytest.mark.parametrize("ask", [dict(target="fa3", variant="plain"), dict(op="batch_decode"), dict(variant="plain"),
                                 dict(kv_dtype="fp8e4m3"), dict(kv_segments=True)])
def test_the_form_is_refused_where_it_does_not_apply(monkeypatch, ask):
    """FA2 batch prefill of a mask in q's dtype only; on FA3 only where its batch prefill takes the form anyway (a
    manifest records tile_list=True for those, and renders the same module again)."""
    from fivar.jit.build import gen_module
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    mask = _variant(m_hole)
    assert gen_module(mask, "batch_prefill", "fa3", tile_list=True).uri == gen_module(mask, "batch_prefill", "fa3").uri
    v = PLAIN if ask.get("variant") else mask
    args = {"op": "batch_prefill", "target": "fa2", **{k: x for k, x in ask.items() if k in ("op", "target")}}
    kw = {k: x for k, x in ask.items() if k in ("kv_dtype", "kv_segments")}
    with pytest.raises(FivarError, match="tile_list=True") as e:
        gen_module(v, args["op"], args["target"], tile_list=True, **kw)
    assert "\n" not in str(e.value)


def test_explain_says_fa2_runs_the_tile_list():
    v = _variant(m_hole)
    short = [ln for ln in explain.short_paths(v) if ln.startswith("fa2 prefill")]
    assert short and "tile-list form" in short[0] and "read their pairs from precomputed bits" in short[0]
    long = [ln for ln in explain.mask_skipping(v) if ln.startswith("fa2 prefill")]
    assert "kNone" in long[0] and "FP8 cache the block form" in long[0]
    heads = [ln for ln in explain.short_paths(_variant(m_per_head_window)) if ln.startswith("fa2 prefill")]
    assert "per query head" in heads[0] and "per query head" not in short[0]


@pytest.mark.nvcc
@pytest.mark.skipif(not shutil.which("nm"), reason="no nm to read the library's symbols")
def test_the_module_compiles_and_defines_every_tile_it_links(monkeypatch):
    """The host unit dispatches the paged and ragged kernels of kNone over FlashInfer's CTA tiles: the library
    defines the ragged stubs for exactly the tiles whose paged kernels it defines (FlashInfer instantiates neither
    for a tile it never picks at these head dims)."""
    from fivar.jit.build import gen_module
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    m = gen_module(_variant(m_hole), "batch_prefill", "fa2", tile_list=True)
    assert m.build() in ("cold", "disk")
    syms = subprocess.run(["nm", "-C", str(m.library_path)], capture_output=True, text=True, check=True).stdout

    def tiles(kind, defined):
        found = [ln for ln in syms.splitlines() if f"BatchPrefillWith{kind}KVCacheDispatched<" in ln]
        args = [ln.split("Dispatched<")[1].split(",") for ln in found if (ln.split()[0] != "U") == defined]
        return sorted(int((a[1] if kind == "Paged" else a[0]).strip().rstrip("u")) for a in args)
    assert tiles("Paged", True) == sorted(2 * [16, 64, 128]) and tiles("Ragged", True) == [16, 64, 128]
    assert set(tiles("Ragged", False)) == set(tiles("Paged", False))


def test_show_prints_the_struct_that_runs_fa2_batch_prefill():
    """`fivar show NAME --target fa2 --op batch_prefill` of a mask beyond a band prints the tile-list struct (what
    runs it), single prefill's op the plain one."""
    from click.testing import CliRunner
    from fivar.cli import main
    r = CliRunner().invoke(main, ["show", "document_mask", "--target", "fa2", "--op", "batch_prefill"])
    assert r.exit_code == 0, r.output
    assert "Tile-list form (kNone)" in r.output and "fv_tile_keys" in r.output
    r = CliRunner().invoke(main, ["show", "document_mask", "--target", "fa2"])
    assert r.exit_code == 0 and "fv_tile_keys" not in r.output, r.output
