"""Speculative verify batches with an engine's custom mask (fivar.runtime.custom_mask, fivar.integrations.serving), on
the CPU: the Triton twin under TRITON_INTERPRET=1 against the float64 reference, and FA3's tile-list form read the
way its struct reads it (test_fa3_tile_list's emulation) against every pair.

Random batches: 1..3 requests of 1..16 draft tokens as a chain or a random tree over a random prefix, pages of 1 or
16 keys, causal on and off, variants without a mask (soft-cap), with a window, with sinks and a window, and with a
mask beyond a band (documents). Dropping the custom mask must fail the same checks.
"""
import itertools
import random

import numpy as np
import pytest
import torch

import fivar
from fivar.codegen.fa3 import TILE_WIDTH
from fivar.codegen.torch_ref import reference_attention
from fivar.integrations.serving import chain_parents, tree_mask, tree_rows
from fivar.runtime.custom_mask import check_custom_mask, pack
from fivar.runtime.fa2_blocks import tile_list_rows
from fivar.runtime.fa3_tile_list import block_map, page_size_for, tile_list
from fivar.runtime.launch import _prepare
from fivar.runtime.plans import refuse_custom_mask
from fivar.testing import _to_paged, example_params

from test_fa3_tile_list import ROWS, _ind, _paged, list_errors

HQ, HKV, D = 2, 1, 16  # GQA; each head is one more interpreted program per block
VARIANTS = {"softcap": {}, "sliding_window": {"window": 9}, "gpt_oss": {"window": 12}, "document_mask": {}}


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _tree(n: int) -> list[int]:
    return [-1] + [random.randrange(-1, j) for j in range(1, n)]


def _verify_batch(form: str, causal: bool):
    """(qo lens, kv lens, per-request bool masks): draft tokens after a random prefix, their tree's mask."""
    batch = random.randint(1, 3)
    drafts = [random.randint(1, 16) for _ in range(batch)]
    prefixes = [random.randint(0, 40) for _ in range(batch)]
    parents = [chain_parents(n) if form == "chain" else _tree(n) for n in drafts]
    masks = [torch.cat([torch.ones(n, p, dtype=torch.bool), tree_rows(par)], 1)
             for n, p, par in zip(drafts, prefixes, parents)]
    return drafts, [p + n for p, n in zip(prefixes, drafts)], masks, prefixes, parents


def _params(name, batch, max_len):
    v = fivar.load(name)
    params = {**example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=batch, max_len=max_len,
                               device="cpu"), **VARIANTS[name]}
    return v, params


def _reference(v, q, k, vv, qo, kv, causal, params, masks):
    outs, a, b = [], 0, 0
    for i, (lq, lk) in enumerate(zip(qo, kv)):
        outs.append(reference_attention(v, q[a:a + lq], k[b:b + lk], vv[b:b + lk], causal=causal, params=params,
                                        batch_idx=i, batch_size=len(qo), float_dtype=torch.float64,
                                        custom_mask=None if masks is None else masks[i]))
        a, b = a + lq, b + lk
    return torch.cat(outs)


def test_pack_is_segment_packbits_little_endian():
    """Each request's flattened matrix packed from its own byte, bit 0 first, as numpy.packbits(bitorder='little')
    per segment (FlashInfer's segment_packbits layout)."""
    for _ in range(5):
        qo = torch.randint(1, 9, (random.randint(1, 4),))
        kv = qo + torch.randint(0, 30, qo.shape)
        flat = torch.rand(int((qo * kv).sum())) < 0.5
        got = pack(flat, qo, kv)
        want, start, indptr = [], 0, [0]
        for n in (qo * kv).tolist():
            seg = np.packbits(flat[start:start + n].numpy(), bitorder="little")
            want.append(seg)
            indptr.append(indptr[-1] + len(seg))
            start += n
        assert got.packed.tolist() == np.concatenate(want).tolist()
        assert got.indptr.tolist() == indptr
        a = 0
        for b, (lq, lk) in enumerate(zip(qo.tolist(), kv.tolist())):
            assert torch.equal(got.request(b, lq, lk), flat[a:a + lq * lk].view(lq, lk))
            a += lq * lk


def _request_bits(kind: str, qo: int, kv: int) -> torch.Tensor:
    """bool [qo, kv] of one kind: the causal region (a chain after its prefix), every pair, a random tree, or the
    causal region with one pair added or taken away."""
    inside = torch.arange(kv)[None, :] <= kv - qo + torch.arange(qo)[:, None]
    if kind == "all":
        return torch.ones(qo, kv, dtype=torch.bool)
    if kind == "tree":
        rows = tree_rows([-1] + [random.randrange(-1, j) for j in range(1, qo)]) if qo else torch.zeros(0, 0)
        return torch.cat([torch.ones(qo, kv - qo, dtype=torch.bool), rows.bool()], 1) if kv >= qo else inside
    bits = inside.clone()
    if kind in ("plus", "minus") and qo * kv:
        where = (~inside if kind == "plus" else inside).nonzero()
        if len(where):
            i, j = where[random.randrange(len(where))].tolist()
            bits[i, j] = kind == "plus"
    return bits


@pytest.mark.parametrize("chunk", [7, 1 << 24])
def test_causal_implied_names_the_causal_flag_a_mask_adds_nothing_to(chunk, monkeypatch):
    """The flag returned keeps exactly the pairs the bits and the call's causal keep together (None where the bits
    are more than that), against per-request matrices, and the float64 reference agrees: attention with the flag
    and no mask equals attention with the bits."""
    from fivar.runtime import custom_mask as cm
    monkeypatch.setattr(cm, "_IMPLIED_CHUNK", chunk)  # the device pass in pieces too (a bit's request per piece)
    v = fivar.load("softcap")
    seen = set()
    for kind, causal, _ in itertools.product(["causal", "all", "tree", "plus", "minus"], [False, True], range(10)):
        qo = torch.randint(0, 7, (random.randint(1, 4),))
        kv = (qo + torch.randint(-2, 20, qo.shape)).clamp(min=0)
        mats = [_request_bits(kind if random.random() < 0.75 else "causal", lq, lk)
                for lq, lk in zip(qo.tolist(), kv.tolist())]
        got = cm.causal_implied(pack(torch.cat([m.reshape(-1) for m in mats]), qo, kv), qo, kv, causal)
        want = None
        regions = [torch.arange(lk)[None, :] <= lk - lq + torch.arange(lq)[:, None]
                   for lq, lk in zip(qo.tolist(), kv.tolist())]
        kept = [m & r if causal else m for m, r in zip(mats, regions)]
        if all(torch.equal(k, r) for k, r in zip(kept, regions)):
            want = True
        elif not causal and all(bool(m.all()) for m in mats):
            want = False
        assert got is want, (kind, causal, qo.tolist(), kv.tolist(), got, want)
        seen.add(got)
        if got is not None and int(qo.sum()):
            b = int(torch.argmax(qo))  # a request with queries: the reference with the flag alone
            lq, lk = int(qo[b]), int(kv[b])
            q = torch.randn(lq, 4, 32, dtype=torch.float64)
            k, vv = (torch.randn(lk, 2, 32, dtype=torch.float64) for _ in range(2))
            params = example_params(v, num_qo_heads=4, num_kv_heads=2, batch_size=1, max_len=max(lk, 1),
                                    device="cpu")
            with_bits = reference_attention(v, q, k, vv, causal=causal, custom_mask=mats[b], params=params,
                                            float_dtype=torch.float64)
            flag = reference_attention(v, q, k, vv, causal=got, params=params, float_dtype=torch.float64)
            assert torch.allclose(with_bits, flag, equal_nan=True), (kind, causal, lq, lk)
    assert seen == {True, False, None}


def test_tree_rows_keep_exactly_the_ancestors():
    for _ in range(20):
        parents = _tree(random.randint(1, 16))
        rows = tree_rows(parents)
        for j in range(len(parents)):
            seen, p = {j}, parents[j]
            while p >= 0:
                seen.add(p)
                p = parents[p]
            assert set(rows[j].nonzero().view(-1).tolist()) == seen
    assert torch.equal(tree_rows(chain_parents(5)), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page", [1, 16])
def test_triton_verify_matches_the_reference(name, causal, page):
    for form in ("chain", "tree"):
        qo, kv, masks, prefixes, parents = _verify_batch(form, causal)
        v, params = _params(name, len(qo), max(kv))
        q = torch.randn(sum(qo), HQ, D).half()
        k, vv = torch.randn(sum(kv), HKV, D).half(), torch.randn(sum(kv), HKV, D).half()
        cache, kv_indptr, kv_indices, last = _to_paged(k, vv, kv, page)
        qo_indptr = _ind(qo)
        packed, mask_indptr = tree_mask(prefixes, parents)
        out = v.batch_prefill_paged(q, cache, qo_indptr, kv_indptr, kv_indices, last, causal=causal,
                                    backend="triton", packed_custom_mask=packed, mask_indptr=mask_indptr, **params)
        ref = _reference(v, q, k, vv, qo, kv, causal, params, masks)
        assert (out.double() - ref).abs().max() < 2e-2, (name, form, qo, kv)
        flat = torch.cat([m.view(-1) for m in masks])
        same = v.batch_prefill_paged(q, cache, qo_indptr, kv_indptr, kv_indices, last, causal=causal,
                                     backend="triton", custom_mask=flat, **params)
        assert torch.equal(out, same)  # the bool form packs to the same bits
        unmasked = _reference(v, q, k, vv, qo, kv, causal, params, None)
        if (unmasked - ref).abs().max() > 5e-2:  # the custom mask drops pairs that weigh (a chain under causal: none)
            # the mutation: without the custom mask the same check fails
            dropped = v.batch_prefill_paged(q, cache, qo_indptr, kv_indptr, kv_indices, last, causal=causal,
                                            backend="triton", **params)
            assert (dropped.double() - ref).abs().max() > 5e-2


@pytest.mark.parametrize("target", ["fa2", "fa3"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("causal", [False, True])
def test_tile_lists_keep_exactly_the_pairs_of_the_custom_mask(name, causal, target):
    """The tile list FA3 (or FA2, at its query tile of a GQA group's packed rows) runs, planned with the custom mask
    ANDed into the map and the bits, keeps exactly the pairs of the variant's mask, causal and the custom mask;
    planned without it, the same check fails."""
    rows = ROWS if target == "fa3" else tile_list_rows(HQ // HKV, D)
    for form in ("chain", "tree"):
        qo, kv, masks, prefixes, parents = _verify_batch(form, causal)
        kv = [k + TILE_WIDTH * random.randint(0, 2) for k in kv]  # longer prefixes: whole tiles and cut ones
        masks = [torch.cat([torch.ones(lq, lk - m.shape[1], dtype=torch.bool), m], 1)
                 for lq, lk, m in zip(qo, kv, masks)]
        v, params = _params(name, len(qo), max(kv))
        cache_page = random.choice([1, 16])
        token_of, key_at = _paged(kv, cache_page)
        probe = torch.zeros(sum(qo), HQ, D, dtype=torch.float16)
        bound, sm_scale = _prepare(v, params, probe, HKV, len(qo), None)
        custom = check_custom_mask(v, torch.cat([m.view(-1) for m in masks]), None, None, torch.tensor(qo),
                                   torch.tensor(kv), "cpu")
        layouts = []
        for given in (custom, None):
            kinds, bits_of, heads = block_map(v, bound, _ind(qo), _ind(kv), HQ, HKV, D, causal, sm_scale, "cpu", rows,
                                              given)
            layouts.append(tile_list(kinds, _ind(qo), _ind(kv), rows, token_of, bits_of,
                                     page_size_for(cache_page_size=cache_page), heads))
        assert list_errors(v, bound, layouts[0], qo, kv, causal, key_at, custom=masks) == []
        # dropping the custom mask fails the check exactly when it drops pairs the variant (and causal) keep: a
        # document mask or a causal chain may already drop all of them
        drops = list_errors(v, bound, layouts[0], qo, kv, causal, key_at) != []
        assert bool(list_errors(v, bound, layouts[1], qo, kv, causal, key_at, custom=masks)) == drops


def _one_line(exc_info, *words):
    text = str(exc_info.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_bad_custom_masks_are_one_line_errors():
    v, params = _params("softcap", 2, 24)
    qo, kv = [3, 5], [10, 24]
    q = torch.randn(8, HQ, D).half()
    k, vv = torch.randn(34, HKV, D).half(), torch.randn(34, HKV, D).half()
    cache, kv_indptr, kv_indices, last = _to_paged(k, vv, kv, 16)
    good = torch.ones(3 * 10 + 5 * 24, dtype=torch.bool)
    packed, mask_indptr = tree_mask([7, 19], [chain_parents(3), chain_parents(5)])

    def call(**kw):
        return v.batch_prefill_paged(q, cache, _ind(qo), kv_indptr, kv_indices, last, backend="triton", **kw)
    for kw, words in (
            (dict(custom_mask=good[:-1]), ("softcap", "custom_mask", "150")),
            (dict(custom_mask=good.to(torch.uint8)), ("softcap", "custom_mask", "bool")),
            (dict(custom_mask=good, packed_custom_mask=packed), ("softcap", "not both")),
            (dict(packed_custom_mask=packed[:-1]), ("softcap", "packed_custom_mask", "uint8")),
            (dict(packed_custom_mask=packed.to(torch.int32)), ("softcap", "packed_custom_mask")),
            (dict(packed_custom_mask=packed, mask_indptr=mask_indptr + 1), ("softcap", "mask_indptr")),
            (dict(packed_custom_mask=packed, mask_indptr=mask_indptr[:-1]), ("softcap", "mask_indptr")),
            (dict(packed_custom_mask=packed, mask_indptr=mask_indptr.float()), ("softcap", "mask_indptr")),
            (dict(mask_indptr=mask_indptr), ("softcap", "mask_indptr", "without")),
            (dict(custom_mask=good.to("meta")), ("softcap", "custom_mask", "meta")),
            (dict(custom_mask=[True] * 150), ("softcap", "custom_mask", "list"))):
        with pytest.raises(fivar.FivarError) as e:
            call(**kw)
        _one_line(e, *words)
    # the good forms run, and give the same result
    flat = tree_mask([7, 19], [chain_parents(3), chain_parents(5)], packed=False)
    assert torch.equal(call(custom_mask=flat), call(packed_custom_mask=packed, mask_indptr=mask_indptr))
    with pytest.raises(fivar.FivarError) as e:
        tree_mask([4], [[-1, 1]])
    _one_line(e, "parents[1]")
    with pytest.raises(fivar.FivarError) as e:
        reference_attention(v, q[:3], k[:10], vv[:10], custom_mask=torch.ones(3, 9, dtype=torch.bool))
    _one_line(e, "softcap", "custom_mask", "[3, 10]")


def test_an_fp8_cache_refuses_the_custom_mask_in_one_line():
    """An FP8 cache (FA2's block form) refuses it; FA2 and FA3 take it for any mask, one reading the head too (bits
    per head)."""
    from test_block_map import _variant
    for target in ("fa2", "fa3"):
        with pytest.raises(fivar.FivarError) as e:
            refuse_custom_mask(fivar.load("softcap"), target, "fp8e4m3")
        _one_line(e, "softcap", "custom_mask", "FP8")
        refuse_custom_mask(fivar.load("document_mask"), target, None)
        refuse_custom_mask(_variant("head_window_sinks")[0], target, None)


def test_the_custom_mask_module_of_a_variant_without_a_scanned_mask_reads_bits(monkeypatch):
    """A variant with no mask, or a band, takes the tile-list module reading cut tiles' bits for a custom mask: the
    one every mask of its logits shares (a band with no logits: a document mask's); a mask beyond a band reading
    bits keeps its one module."""
    from fivar.jit.build import gen_module
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    document = gen_module(fivar.load("document_mask"), "batch_prefill", "fa3")
    for name in ("softcap", "sliding_window", "gpt_oss"):
        v = fivar.load(name)
        m = gen_module(v, "batch_prefill", "fa3", custom_mask=True)
        struct = m.sources["batch_prefill_sm90_config.inc"]
        updater = struct.split("GetAttentionUpdater")[1].split("REGISTER_LOGITS_TRANSFORM")[0]
        reader = struct.split("fv_cut_word(int32_t qo_idx, int32_t word)")[1].split("}")[0]
        assert m.uri.startswith("fivar_any_mask_fa3_batch_prefill_tiles_") and m.options["tile_list"]
        assert "fv_bits" in reader and "fv_whole" in reader
        assert (m.uri == document.uri) == (name == "sliding_window")  # no logits, no sink: the same kernel
        # the bits decide, once a KV tile: the updater drops the pairs whose bit is clear (fivar_tile_mask.cuh)
        assert "fivar::WithTileMask" in updater and "fivar_tile_mask.cuh" in m.sources
        assert m.uri != gen_module(v, "batch_prefill", "fa3").uri
        # what a manifest records renders the same module again (fivar.jit.integrity)
        assert gen_module(v, "batch_prefill", "fa3", **m.options).uri == m.uri
    tiles = gen_module(fivar.load("document_mask"), "batch_prefill", "fa3")
    assert gen_module(fivar.load("document_mask"), "batch_prefill", "fa3", **tiles.options).uri == tiles.uri
    # FA2: the tile-list module its logits share with every mask (no logits: a document mask's)
    plain = gen_module(fivar.load("document_mask"), "batch_prefill", "fa2", tile_list=True).uri
    for name in ("softcap", "sliding_window"):
        fa2 = gen_module(fivar.load(name), "batch_prefill", "fa2", custom_mask=True)
        assert fa2.uri.startswith("fivar_any_mask_fa2_batch_prefill_tiles_") and fa2.options["tile_list"]
        assert (fa2.uri == plain) == (name == "sliding_window")
    with pytest.raises(fivar.FivarError) as e:
        gen_module(fivar.load("softcap"), "single_prefill", "fa2", custom_mask=True)
    _one_line(e, "softcap", "custom-mask")


def test_the_serving_suite_lists_verify_cases_without_a_gpu():
    from fivar.bench.suites import cases_of
    names = [c.name for c in cases_of("serving")]
    for variant in ("softcap", "sliding_window", "gpt_oss"):
        for n in (8, 16, 64):
            for form in ("chain", "tree"):
                assert f"{variant} verify {form} {n} x32 ctx8192" in names
    case = cases_of("serving")[0]
    assert case.shape["page_size"] == 16 and case.shape["heads"] == "32/8" and case.baseline == ("stock", "triton")


def test_the_twin_reads_pages_in_place_from_either_cache_layout():
    """The twin's paged prefill reads each key through the page table, with the cache's own page stride: one
    [pages, 2, page, H, D] tensor (pages twice as far apart) gives what the (k_cache, v_cache) pair does."""
    v, params = _params("softcap", 2, 40)
    qo, kv = [5, 7], [21, 40]
    q = torch.randn(12, HQ, D).half()
    k, vv = torch.randn(61, HKV, D).half(), torch.randn(61, HKV, D).half()
    (k_cache, v_cache), kv_indptr, kv_indices, last = _to_paged(k, vv, kv, 16)
    packed, mask_indptr = tree_mask([16, 33], [_tree(5), _tree(7)])
    both = torch.stack([k_cache, v_cache], 1)
    outs = [v.batch_prefill_paged(q, cache, _ind(qo), kv_indptr, kv_indices, last, backend="triton",
                                  packed_custom_mask=packed, mask_indptr=mask_indptr, **params)
            for cache in ((k_cache, v_cache), both)]
    assert torch.equal(outs[0], outs[1])
    custom = check_custom_mask(v, None, packed, mask_indptr, torch.tensor(qo), torch.tensor(kv), "cpu")
    masks = [custom.request(b, lq, lk) for b, (lq, lk) in enumerate(zip(qo, kv))]
    ref = _reference(v, q, k, vv, qo, kv, False, params, masks)
    assert (outs[0].double() - ref).abs().max() < 2e-2


class _OnGPU(torch.Tensor):
    """A CPU tensor that says it lives on GPU `index` (the device check reads only `.device`)."""
    index = 0

    @property
    def device(self):
        return torch.device("cuda", self.index)


@pytest.mark.parametrize("on_gpu", ["packed_custom_mask", "mask_indptr"])
@pytest.mark.parametrize("index,ok", [(0, True), (1, False)])
def test_a_mask_on_the_current_gpu_is_on_the_inputs_device(monkeypatch, index, ok, on_gpu):
    """Inputs on "cuda" are on the current GPU: a mask (or its indptr) on cuda:0 then is on their device, one on
    cuda:1 is not (the plan's device is "cuda" where the inputs' is cuda:0)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    v = fivar.load("softcap")
    qo, kv = torch.tensor([3, 2]), torch.tensor([7, 5])
    packed = torch.zeros(8, dtype=torch.uint8)
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32)  # ceil(3 * 7 / 8) and ceil(2 * 5 / 8) bytes
    if on_gpu == "packed_custom_mask":
        packed = packed.as_subclass(_OnGPU)
        packed.index = index
    else:
        indptr = indptr.as_subclass(_OnGPU)
        indptr.index = index
    try:
        check_custom_mask(v, None, packed, indptr, qo, kv, "cuda")
        raised = ""
    except Exception as e:  # past the device check a CPU box has no GPU to copy to
        raised = str(e)
    if ok:  # through the device check: at most the copy to a GPU this box lacks fails
        assert raised in ("", "Torch not compiled with CUDA enabled") or "CUDA" in raised and "is on" not in raised, \
            raised
    else:
        assert f"{on_gpu} is on cuda:1, the inputs are on cuda" in raised, raised


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_auto_runs_a_verify_batch_of_short_requests_on_fa2(head_dim):
    """Backend auto with a custom mask: FA2 (a GQA group's rows in one query tile) while the longest request fills at
    most a quarter of FA3's query tile, FA3 past it; a backend asked for is kept, and FA2 stays FA2."""
    from fivar.runtime.fa3_tile_list import block_rows
    from fivar.runtime.plans import verify_target
    edge = block_rows(head_dim) // 4
    for _ in range(5):
        lens = torch.randint(1, edge + 1, (random.randint(1, 40),))
        assert verify_target("fa3", "auto", lens, head_dim) == "fa2"
        longer = torch.cat([lens, torch.tensor([random.randint(edge + 1, 4 * edge)])])[torch.randperm(lens.numel() + 1)]
        assert verify_target("fa3", "auto", longer, head_dim) == "fa3"
        assert verify_target("fa3", "fa3", lens, head_dim) == "fa3"
        assert verify_target("fa2", "auto", longer, head_dim) == "fa2"


def test_the_serving_suites_useful_work_counts_the_pairs_the_variant_keeps():
    """The verify cases' flops count pairs kept by the custom mask, causal and the variant's own mask (brute force
    over every pair); a window keeps fewer than the custom mask alone."""
    from fivar.bench.suites.serving import HEADS, kept_pairs
    hq = HEADS[0]
    batch, n, kv = 3, 5, 40
    rows = torch.rand(batch, n, kv) < 0.7
    window = random.randint(3, 12)
    want = 0
    for b in range(batch):
        for j in range(n):
            q = kv - n + j
            want += sum(bool(rows[b, j, t]) and t <= q and q - t < window for t in range(kv))
    assert kept_pairs(fivar.load("sliding_window"), {"window": window}, rows) == want * hq
    causal_only = sum(bool(rows[b, j, t]) and t <= kv - n + j for b in range(batch) for j in range(n)
                      for t in range(kv))
    assert kept_pairs(fivar.load("softcap"), {"softcap": 30.0}, rows) == causal_only * hq > want * hq


@pytest.mark.parametrize("name", ["gpt_oss", "softcap"])
def test_the_serving_suites_causal_contender_computes_a_chains_function(name, monkeypatch):
    """`fivar-causal` (chains only): the one-shot call with causal and no custom mask is the chain's function, as the
    suite checks it against the reference with the chain's rows (here on the twin: auto needs a GPU); a tree has no
    such contender."""
    import functools

    from fivar.bench import contenders as C
    from fivar.bench.suites import serving
    torch.manual_seed(0)
    v = fivar.load(name)
    monkeypatch.setattr(v, "batch_prefill_paged", functools.partial(type(v).batch_prefill_paged, v,
                                                                     backend="triton"))
    token = C.SELECTED.set({"fivar-causal"})
    try:
        for form in ("chain", "tree"):
            v, t, params = serving._problem(v, 6, form, VARIANTS[name], batch=3, context=40, heads=(HQ, HKV),
                                            head_dim=D, dtype=torch.float16, device="cpu")
            made = serving._contenders(v, t, params)
            assert [c.name for c in made] == (["fivar-causal"] if form == "chain" else [])
            for c in made:
                n, kv = t["drafts"], t["kv"]
                out = c.fn()
                for b in range(3):
                    qs, ks = slice(b * n, (b + 1) * n), slice(b * kv, (b + 1) * kv)
                    ref = reference_attention(v, t["q"][qs].double(), t["k"][ks].double(), t["v"][ks].double(),
                                              causal=True, params=params, batch_idx=b, batch_size=3,
                                              custom_mask=t["rows"][b], float_dtype=torch.float64)
                    torch.testing.assert_close(out[qs].double(), ref, atol=2e-3, rtol=2e-3)
    finally:
        C.SELECTED.reset(token)
