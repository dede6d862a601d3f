"""Every bundled variant, every entry point, against its torch reference on the GPU (marked `gpu`)."""
import contextlib

import pytest
import torch

import fivar
from fivar import AttentionVariant
from fivar.codegen.fa3 import (LONG_QO_LEN, MUFU_BOUND_TILE, bounded_softmax, cta_tile, exp2_split, non_causal_tile,
                               schedule)
from fivar.jit.build import module_for
from fivar.runtime import wave_split
from fivar.testing import (BATCH_CASES, DECODE_CASES, SINGLE_CASES, check_batch_prefill, check_decode,
                           check_single_prefill, compare)

BUNDLED = ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask", "relative_bias",
           "softcap_sliding_window"]
pytestmark = pytest.mark.gpu


BACKENDS = ["fa2", "fa3"]


@pytest.mark.parametrize("qo_len,kv_len,causal", SINGLE_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", BUNDLED)
def test_single_prefill(name, backend, qo_len, kv_len, causal):
    r = check_single_prefill(fivar.load(name), qo_len=qo_len, kv_len=kv_len, causal=causal, backend=backend)
    assert r.passed, r


@pytest.mark.parametrize("dtype,head_dim,heads", [(torch.float16, 64, (32, 8)), (torch.bfloat16, 256, (8, 8)),
                                                  (torch.float16, 128, (32, 32))])
@pytest.mark.parametrize("name,backend", [("softcap", "fa2"), ("softcap", "fa3"), ("alibi", "fa2"),
                                          ("document_mask", "fa2"), ("document_mask", "fa3")])
def test_single_prefill_dtypes_and_head_dims(name, backend, dtype, head_dim, heads):
    r = check_single_prefill(fivar.load(name), qo_len=77, kv_len=301, causal=True, dtype=dtype, backend=backend,
                             head_dim=head_dim, num_qo_heads=heads[0], num_kv_heads=heads[1])
    assert r.passed, r


@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("qo_lens,kv_lens,causal", BATCH_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", BUNDLED)
def test_batch_prefill(name, backend, qo_lens, kv_lens, causal, paged):
    r = check_batch_prefill(fivar.load(name), qo_lens=qo_lens, kv_lens=kv_lens, paged=paged, causal=causal,
                            backend=backend)
    assert r.passed, r


# Band skipping: FA3's sliding-window schedule and the Triton loop bounds skip KV tiles left of the
# band read off the mask. Windows from empty (0) to wider than the sequence, aligned and not, and negative
# ones (keys right of the diagonal only; none kept under causal): FA3 gets window_left = window - 1 as is,
# which relies on FlashInfer's FA3 kernel treating -1 and below like any other window_left (0.7.x does).
WINDOWS = [-5000, -37, -1, 0, 1, 37, 128, 700, 5000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("qo_len,kv_len,causal", [(1000, 1000, False), (1000, 1000, True), (300, 1500, False),
                                                  (300, 1500, True)])
@pytest.mark.parametrize("backend", ["fa3", "triton"])
@pytest.mark.parametrize("name", ["sliding_window", "softcap_sliding_window"])
def test_window_tile_skipping(name, backend, qo_len, kv_len, causal, window):
    r = check_single_prefill(fivar.load(name), qo_len=qo_len, kv_len=kv_len, causal=causal, backend=backend,
                             params={"window": window})
    assert r.passed, r


@pytest.mark.parametrize("window", [-37, 0, 1, 100])
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("causal", [False, True])
def test_window_tile_skipping_batch(paged, causal, window):
    r = check_batch_prefill(fivar.load("sliding_window"), qo_lens=[300, 1, 700], kv_lens=[900, 250, 700],
                            paged=paged, causal=causal, backend="fa3", params={"window": window})
    assert r.passed, r


# FA3's softmax with none and with every one of its exp2s on the FMA pipe (fivar_fa3_softmax.cuh; the default
# split lies between), with the bounded softmax (the default here) and the running max: the reference's results,
# rows with no kept key included (window -37: the last 37 rows).
@pytest.mark.parametrize("split,bounded", [(0, True), (8, True), (0, False), (8, False)])
@pytest.mark.parametrize("window,causal", [(100, False), (100, True), (-37, False)])
def test_fa3_exp2_split_extremes(split, bounded, window, causal):
    v = fivar.load("softcap_sliding_window")
    with exp2_split(split), bounded_softmax(bounded):
        # the module this runs is the split's (the memo is keyed by it), not one an earlier test left loaded
        updater = (f"Fa3OnlineSoftmax<NUM_ROWS_PER_THREAD, {split}, /*BOUNDED=*/true>" if bounded else
                   "flashinfer::OnlineSoftmax<" if split == 0 else f"Fa3OnlineSoftmax<NUM_ROWS_PER_THREAD, {split}>")
        assert updater in module_for(v, "single_prefill", "fa3", "bf16", 128).sources["single_prefill_sm90_config.inc"]
        r = check_single_prefill(v, qo_len=1000, kv_len=1000, causal=causal, backend="fa3", params={"window": window})
    assert r.passed, r


# FA3 single prefill at CTA tiles FlashInfer never instantiates at hd128 (its own: 128x192 non-causal, 128x128
# causal), and at fivar's default for soft-caps (128x128 in both): the reference's results at lengths that leave
# partial tiles, qo_len < kv_len and (non-causal: causal refuses it) qo_len > kv_len, MHA and GQA 32/8. 192x64
# non-causal (three consumer warpgroups) is the soft-caps' non-causal tile for long queries (docs/tuning.md).
@pytest.mark.parametrize("qo_len,kv_len,causal,heads", [
    (1000, 1000, False, (32, 32)), (300, 1111, False, (32, 8)), (777, 200, False, (32, 32)),
    (1000, 1000, True, (32, 8)), (300, 1111, True, (32, 32))])
@pytest.mark.parametrize("tile", ["128x176,192x128", "128x128", "192x64,128x128"])
def test_fa3_cta_tile_override(tile, qo_len, kv_len, causal, heads):
    v = fivar.load("softcap")
    with cta_tile(tile):
        sources = module_for(v, "single_prefill", "fa3", "bf16", 128).sources
        tile_none, tile_causal = (tile.split(",") * 2)[:2]
        q_none, kv_none = tile_none.split("x")
        unit_none = sources["single_prefill_sm90_kernel_mask_0.cu"]
        assert f"/*CTA_Q_=*/{q_none}," in unit_none and f"/*CTA_KV_=*/{kv_none}," in unit_none
        assert f"/*CTA_Q_=*/{tile_causal.split('x')[0]}," in sources["single_prefill_sm90_kernel_mask_1.cu"]
        r = check_single_prefill(v, qo_len=qo_len, kv_len=kv_len, causal=causal, backend="fa3",
                                 num_qo_heads=heads[0], num_kv_heads=heads[1])
    assert r.passed, r


# FA3 single prefill on fivar's persistent schedule (csrc/fivar_fa3_persistent.cuh): a grid of one CTA per SM, each
# running tile after tile, heavy-first (causal: the last query tile first; with a window, query tile after query tile
# across the heads), in boustrophedon rounds. Enough tiles that every CTA runs several, ending on a part round taken in
# reverse (4000 rows x 32 heads in 192-row tiles: 672 tiles, 5.1 rounds of 132), partial tiles, qo_len < kv_len and > kv_len, GQA 32/8, a window whose last rows
# keep no key (-37), soft-cap's non-causal choice at both tiles (192x64 from LONG_QO_LEN rows), and variants on
# FlashInfer's own tiles (alibi, sliding_window), rendered by fivar here.
@pytest.mark.parametrize("name,qo_len,kv_len,causal,params,dtype,head_dim", [
    ("softcap_sliding_window", 4000, 4000, True, {"window": 1024}, torch.bfloat16, 128),  # causal tile 192x64
    ("softcap_sliding_window", 300, 1111, True, {"window": 100}, torch.bfloat16, 128),
    ("softcap_sliding_window", 1000, 1000, False, {"window": 100}, torch.bfloat16, 128),
    ("softcap", 3000, 3000, True, {}, torch.bfloat16, 128),
    ("softcap", 300, 1111, False, {}, torch.bfloat16, 128),
    ("softcap", LONG_QO_LEN + 56, LONG_QO_LEN + 56, False, {}, torch.bfloat16, 128),  # the choice's 192x64 kernel
    ("softcap", 777, 200, False, {}, torch.bfloat16, 128),
    ("softcap", 300, 1111, True, {"softcap": 50.0}, torch.bfloat16, 128),  # the running-max module
    ("softcap", 2000, 2000, True, {}, torch.float16, 64),
    ("softcap", 1000, 1500, False, {}, torch.bfloat16, 256),
    ("alibi", 1000, 1500, True, {}, torch.bfloat16, 128),
    ("sliding_window", 1000, 1000, False, {"window": -37}, torch.bfloat16, 128),
])
def test_fa3_persistent_schedule(name, qo_len, kv_len, causal, params, dtype, head_dim):
    v = fivar.load(name)
    with schedule("persistent"):
        dt = "bf16" if dtype == torch.bfloat16 else "fp16"
        unit = module_for(v, "single_prefill", "fa3", dt, head_dim).sources["single_prefill_sm90_kernel_mask_1.cu"]
        assert "fivar::single_prefill_persistent<" in unit
        r = check_single_prefill(v, qo_len=qo_len, kv_len=kv_len, causal=causal, backend="fa3", params=params,
                                 dtype=dtype, head_dim=head_dim)
    assert r.passed, r


# A causal kernel may hold a choice of tiles (cta_tile "A,B|C"), and each launch takes the one whose last wave idles
# fewer SM-rows: a shape for each, on this GPU's SM count, checked against the reference (the soft-capped window).
@pytest.mark.parametrize("wanted", [(192, 64), (128, 128)])
def test_fa3_causal_window_runs_the_tile_the_wave_rule_picks(wanted):
    v = fivar.load("softcap_sliding_window")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads = 4
    qo_len = 128 * -(-(sms + 1) // heads) if wanted == (192, 64) else 1000
    with cta_tile("128x128,192x64|128x128"):
        unit = module_for(v, "single_prefill", "fa3", "bf16", 128).sources["single_prefill_sm90_kernel_mask_1.cu"]
        assert "const int cta_q[] = {192, 128};" in unit

        def rows(cta_q):  # waves x CTA_Q, as the unit computes it
            return -(-(-(-qo_len // cta_q) * heads) // sms) * cta_q
        assert min((192, 64), (128, 128), key=lambda t: rows(t[0])) == wanted
        r = check_single_prefill(v, qo_len=qo_len, kv_len=qo_len, causal=True, backend="fa3",
                                 params={"window": 700}, num_qo_heads=heads, num_kv_heads=1)
    assert r.passed, r


def _kernel_tiles(prof) -> set[tuple[int, int]]:
    """(CTA_Q, CTA_KV) of every FA3 kernel a profile saw, read from its name: the integers after
    AttentionKernelTraits hold (HEAD_DIM_QK, HEAD_DIM_VO, CTA_Q, CTA_KV) in a row, demangled or not."""
    import re
    tiles = set()
    for e in prof.events():
        if "AttentionKernelTraits" in e.name:
            ints = [int(n) for n in re.findall(r"\d+", e.name.split("AttentionKernelTraits", 1)[1])]
            tiles.add(next((ints[i + 2], ints[i + 3]) for i in range(len(ints) - 3) if ints[i:i + 2] == [128, 128]))
    return tiles


# The soft-caps' non-causal default holds 192x64 and 128x128 (fivar.codegen.fa3.LONG_QO_LEN): a launch of LONG_QO_LEN
# rows runs 192x64, one row fewer 128x128, as non_causal_tile (the wave split's plan) says; both against the reference.
@pytest.mark.parametrize("qo_len,wanted", [(LONG_QO_LEN, (192, 64)), (LONG_QO_LEN - 1, (128, 128))])
def test_fa3_non_causal_choice_runs_the_tile_its_rows_pick(qo_len, wanted):
    v = fivar.load("softcap")
    tile = module_for(v, "single_prefill", "fa3", "bf16", 128).options["cta_tile"]
    assert tile == MUFU_BOUND_TILE and non_causal_tile(tile, 128, qo_len) == wanted
    q = torch.randn(qo_len, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, vv = (torch.randn(700, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v.prefill(q, k, vv, backend="fa3", softcap=30.0)  # loaded outside the profile
    with wave_split.wave_split(False), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = v.prefill(q, k, vv, backend="fa3", softcap=30.0)
        torch.cuda.synchronize()
    assert _kernel_tiles(prof) == {wanted}
    r = compare(v.name, f"single_prefill[fa3] {qo_len} rows, last 512 vs reference", out[-512:],
                v.reference(q[-512:], k, vv, softcap=30.0), torch.bfloat16)
    assert r.passed, r


# An empty query on the persistent launcher (the window variants' causal default): nothing to launch, and no host
# division by zero in its scheduler's FastDivmod (which killed the process with SIGFPE). The same call then still
# works on a real shape, checked against the reference.
@pytest.mark.parametrize("name", ["sliding_window", "softcap_sliding_window"])
def test_fa3_persistent_empty_query(name):
    v = fivar.load(name)
    unit = module_for(v, "single_prefill", "fa3", "bf16", 128).sources["single_prefill_sm90_kernel_mask_1.cu"]
    assert "fivar::single_prefill_persistent<" in unit  # the causal kernel's default schedule
    k, val = (torch.randn(300, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(0, 4, 128, device="cuda", dtype=torch.bfloat16)
    out = v.prefill(q, k, val, causal=True, backend="fa3", window=100)
    torch.cuda.synchronize()
    assert out.shape == q.shape
    r = check_single_prefill(v, qo_len=200, kv_len=300, causal=True, backend="fa3", params={"window": 100})
    assert r.passed, r


# FA3's bounded softmax (the default; FIVAR_FA3_BOUNDED_SOFTMAX=0 turns it off): soft-capping's range gives the softmax its max. Cap 30
# runs it; cap 50 spans too many powers of two and the kernel keeps the running max. Partial tiles, causal, rows
# with no kept key (window -37), the batch forms, and rows whose every logit sits at the bottom of the range
# (each probability about e^-2cap, the case a fixed max must still get right).
@pytest.mark.parametrize("cap", [30.0, 50.0])
@pytest.mark.parametrize("case", ["single", "single_causal", "no_key_rows", "ragged", "paged", "bottom_rows"])
def test_fa3_bounded_softmax(case, cap):
    v = fivar.load("softcap_sliding_window" if case == "no_key_rows" else "softcap")
    with bounded_softmax():
        op = "batch_prefill" if case in ("ragged", "paged") else "single_prefill"
        assert "/*BOUNDED=*/true" in module_for(v, op, "fa3", "bf16", 128).sources[f"{op}_sm90_config.inc"]
        if case in ("single", "single_causal", "no_key_rows"):
            qo, kv, causal = {"single": (1000, 1000, False), "single_causal": (300, 1111, True),
                              "no_key_rows": (1000, 1000, False)}[case]
            params = {"softcap": cap, **({"window": -37} if case == "no_key_rows" else {})}
            r = check_single_prefill(v, qo_len=qo, kv_len=kv, causal=causal, backend="fa3", params=params)
        elif case in ("ragged", "paged"):
            r = check_batch_prefill(v, qo_lens=[300, 1, 700], kv_lens=[900, 250, 700], paged=case == "paged",
                                    causal=True, backend="fa3", params={"softcap": cap})
        else:
            n, heads, d = 700, 8, 128
            u = torch.randn(d, device="cuda")
            k = (u + 0.1 * torch.randn(n, heads, d, device="cuda")).bfloat16()
            q = torch.randn(n, heads, d, device="cuda")
            q[::2] = -20.0 * u + 0.1 * torch.randn_like(q[::2])  # q.k * sm_scale ~ -226: tanh at -1 on every key
            q = q.bfloat16()
            vv = torch.randn(n, heads, d, device="cuda").bfloat16()
            out = v.prefill(q, k, vv, backend="fa3", softcap=cap)
            ref = v.reference(q, k, vv, softcap=cap)
            r = compare(v.name, f"single_prefill[fa3] bounded softmax, every other row at the bottom (cap {cap})",
                        out, ref, torch.bfloat16)
    assert r.passed, r


# FA3 single prefill's last wave run as key chunks merged through their LSE (fivar/runtime/wave_split.py), forced:
# MHA and GQA, chunks of uneven length and a last partial tile, bf16 with the bounded softmax (cap 30) and with the
# running max (cap 50), fp16, FlashInfer's tiles at head dims 64 and 256, and a 192-row non-causal tile (key chunks
# of whole 64-key tiles, query tiles of 192 rows to plan the wave by). The split must have run (wave_split.run
# called) and match the reference.
@pytest.mark.parametrize("setting,heads,kv_len,dtype,cap,head_dim,tile", [
    ("1x2", (32, 32), 1000, torch.bfloat16, 30.0, 128, None), ("4x4", (32, 8), 1111, torch.bfloat16, 30.0, 128, None),
    ("8x8", (32, 8), 4500, torch.float16, 30.0, 128, None), ("2x8", (16, 16), 5000, torch.bfloat16, 50.0, 128, None),
    ("4x2", (32, 8), 1500, torch.float16, 30.0, 64, None), ("1x4", (8, 8), 1300, torch.bfloat16, 30.0, 256, None),
    ("1x2", (32, 32), 1000, torch.bfloat16, 30.0, 128, "192x64,128x128"),
    ("4x4", (32, 8), 1111, torch.float16, 30.0, 128, "192x64,128x128")])
def test_fa3_wave_split(setting, heads, kv_len, dtype, cap, head_dim, tile, monkeypatch):
    runs = []
    real = wave_split.run
    monkeypatch.setattr(wave_split, "run", lambda *a, **kw: runs.append(a[-2]) or real(*a, **kw))
    with cta_tile(tile) if tile else contextlib.nullcontext(), wave_split.wave_split(setting):
        r = check_single_prefill(fivar.load("softcap"), qo_len=777, kv_len=kv_len, num_qo_heads=heads[0],
                                 num_kv_heads=heads[1], dtype=dtype, head_dim=head_dim, backend="fa3",
                                 params={"softcap": cap})
    assert r.passed, r
    assert [f"{s.tail_heads}x{s.chunks}" for s in runs] == [setting]


# The plan's own choice where it splits on a 132-SM Hopper (32 heads), on each tile of the default's choice: S=8192 runs
# 192x64 (2 tail heads in 2 chunks), S=6000 128x128 (2 in 4). The whole output against the unsplit kernel's (checked
# against the reference everywhere else), and the last rows against the reference.
@pytest.mark.parametrize("seqlen", [8192, 6000])
def test_fa3_wave_split_planned(seqlen):
    v = fivar.load("softcap")
    q, k, vv = (torch.randn(seqlen, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tile = non_causal_tile(module_for(v, "single_prefill", "fa3", "bf16", 128).options["cta_tile"], 128, seqlen)
    split = wave_split.plan_for(v, q, k, tile)
    if split is None:
        pytest.skip(f"no split planned on {torch.cuda.get_device_name()} for this shape")
    out = v.prefill(q, k, vv, backend="fa3", softcap=30.0)
    with wave_split.wave_split(False):
        whole = v.prefill(q, k, vv, backend="fa3", softcap=30.0)
    r = compare(v.name, f"single_prefill[fa3] split {split.tail_heads}x{split.chunks} vs unsplit", out, whole,
                torch.bfloat16)
    assert r.passed, r
    r = compare(v.name, "single_prefill[fa3] split, last 256 rows vs reference", out[-256:],
                v.reference(q[-256:], k, vv, softcap=30.0), torch.bfloat16)
    assert r.passed, r


@pytest.mark.parametrize("kv_lens", DECODE_CASES)
@pytest.mark.parametrize("name", BUNDLED)
def test_decode(name, kv_lens):
    r = check_decode(fivar.load(name), kv_lens=kv_lens)
    assert r.passed, r


# A mask that is neither causal- nor window-shaped: it removes a band in the middle of the keys. A kernel
# that applies masks only on the tiles at the diagonal or the window's edges skips the band's interior tiles.
def _middle_band(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < 64 or kv_idx >= 320


MIDDLE_BAND = AttentionVariant(name="middle_band", mask=_middle_band)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_mask_applies_on_interior_tiles(causal, backend):
    r = check_single_prefill(MIDDLE_BAND, qo_len=500, kv_len=1000, causal=causal, backend=backend)
    assert r.passed, r
    r = check_batch_prefill(MIDDLE_BAND, qo_lens=[300, 450], kv_lens=[700, 1000], paged=True, causal=causal,
                            backend=backend)
    assert r.passed, r


# Logits factors folded into the softmax scale with the sign the spec fixes kept per element
# (fivar.spec.optimize.split_output_scale): an inverse temperature with a sign, and a negated soft-cap, which is
# bounded (FA3's bounded softmax in bf16).
def _negated_temperature(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return -score / params.temp


def _negative_cap(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return -20.0 * fivar.tanh(score / 20.0)


SIGNED_FACTORS = [AttentionVariant(name="gpu_negated_temperature", logits=_negated_temperature,
                                   params={"temp": fivar.Scalar(float, default=0.5)}),
                  AttentionVariant(name="gpu_negative_cap", logits=_negative_cap)]


@pytest.mark.parametrize("backend", BACKENDS + ["triton"])
@pytest.mark.parametrize("v", SIGNED_FACTORS, ids=lambda v: v.name)
def test_signed_logits_factors(v, backend):
    for causal in (False, True):
        r = check_single_prefill(v, qo_len=300, kv_len=1000, causal=causal, backend=backend)
        assert r.passed, r


# FA3's tile-list form (fivar.runtime.fa3_tile_list): masks that are more than a band, many query tiles per
# request, requests of one row to several tiles, qo_len < kv_len, GQA, per-head masks.
def _per_head_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.windows[qo_head] and kv_idx <= q_idx + 5


PER_HEAD_WINDOW = AttentionVariant(name="gpu_per_head_window", mask=_per_head_window,
                                   params={"windows": fivar.Tensor("int32", ("qo_head",))})


def _kv_range_cases():
    docs = lambda lengths: torch.repeat_interleave(  # noqa: E731
        torch.arange(len(lengths)), torch.tensor(lengths)).to(torch.int32)
    doc_ids = torch.stack([docs([1, 130, 3, 700, 1166]), docs([1000, 1000]), docs([2000])]).cuda()
    windows = torch.randint(0, 400, (32,), dtype=torch.int32, device="cuda")
    return [(fivar.load("document_mask"), {"doc_ids": doc_ids}), (MIDDLE_BAND, {}),
            (PER_HEAD_WINDOW, {"windows": windows})]


@pytest.mark.parametrize("causal", [False, True])
def test_fa3_tile_list_ragged_paged_and_planned(causal):
    from fivar.testing import _ragged_reference, compare
    qo_lens, kv_lens = [1000, 1, 300], [2000, 700, 300]
    qo_indptr = torch.tensor([0] + qo_lens, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    kv_indptr = torch.tensor([0] + kv_lens, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    q = torch.randn(sum(qo_lens), 32, 128, dtype=torch.bfloat16, device="cuda")
    k, vv = (torch.randn(sum(kv_lens), 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    for v, params in _kv_range_cases():
        assert v.scans_mask
        ref = _ragged_reference(v, q, k, vv, qo_lens, kv_lens, causal, params)
        out = v.batch_prefill_ragged(q, k, vv, qo_indptr, kv_indptr, causal=causal, backend="fa3", **params)
        r = compare(v.name, f"fa3 tile list ragged causal={causal}", out, ref, torch.bfloat16)
        assert r.passed, r
        plan = v.plan_ragged(qo_indptr, kv_indptr, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                             causal=causal, backend="fa3", **params)
        for _ in range(2):
            r = compare(v.name, f"fa3 tile list planned causal={causal}", plan.run(q, k, vv), ref, torch.bfloat16)
            assert r.passed, r
        r = check_batch_prefill(v, qo_lens=qo_lens, kv_lens=kv_lens, paged=True, causal=causal, backend="fa3",
                                params=params)
        assert r.passed, r
    with pytest.raises(fivar.FivarError, match="do not match the plan"):
        plan.run(q[:-1], k, vv)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_planned_ragged_without_tile_lists(causal, backend):
    """`plan_ragged` for variants that run through one planned FlashInfer wrapper (no tile-list lowering):
    logits only, a per-head tensor param, and a window FA3 applies itself (window 0 included: keys right of
    the diagonal only). The plan is reused across runs and layers."""
    from fivar.testing import _ragged_reference, compare, example_params
    qo_lens, kv_lens = [700, 1, 300], [1500, 700, 300]
    qo_indptr = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32).cuda()
    kv_indptr = torch.tensor([0] + kv_lens).cumsum(0).to(torch.int32).cuda()
    for name, extra in (("softcap", {}), ("alibi", {}), ("softcap_sliding_window", {"window": 200}),
                        ("sliding_window", {"window": 0})):
        v = fivar.load(name)
        params = {**example_params(v, num_qo_heads=32, num_kv_heads=8, batch_size=3, max_len=1500, device="cuda"),
                  **extra}
        plan = v.plan_ragged(qo_indptr, kv_indptr, num_qo_heads=32, num_kv_heads=8, head_dim=128, causal=causal,
                             backend=backend, **params)
        assert plan._tile_list is None
        for _ in range(2):  # two layers, fresh inputs, one plan
            q = torch.randn(sum(qo_lens), 32, 128, dtype=torch.bfloat16, device="cuda")
            k, vv = (torch.randn(sum(kv_lens), 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            ref = _ragged_reference(v, q, k, vv, qo_lens, kv_lens, causal, params)
            r = compare(name, f"{backend} planned ragged causal={causal}", plan.run(q, k, vv), ref, torch.bfloat16)
            assert r.passed, r


def test_auto_picks_fa3_on_hopper_and_fa2_for_decode():
    from fivar.runtime.attention import choose_target
    v = fivar.load("softcap")
    want = "fa3" if torch.cuda.get_device_capability() == (9, 0) else "fa2"
    assert choose_target(v, "auto", "single_prefill")[0] == want
    assert choose_target(v, "auto", "batch_decode")[0] == "fa2"


def test_loaded_module_is_cached_in_memory():
    from fivar.jit.build import _loaded, module_for
    v = fivar.load("softcap")
    m = module_for(v, "single_prefill", "fa2", "bf16", 128)
    first = m.load()
    assert m.build() == "memory" and m.load() is first and _loaded[m.uri] is first


def test_bad_inputs_are_clear_errors_before_launch():
    v = fivar.load("alibi")
    q = torch.randn(8, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(8, 8, 128, dtype=torch.bfloat16, device="cuda")
    slopes = torch.rand(32, device="cuda")
    with pytest.raises(fivar.FivarError, match="missing parameter 'slopes'"):
        v.prefill(q, k, k)
    with pytest.raises(fivar.FivarError, match="float16 or all bfloat16"):
        v.prefill(q.float(), k.float(), k.float(), slopes=slopes)
    with pytest.raises(fivar.FivarError, match="multiple of"):
        v.prefill(q[:, :30], k[:, :8], k[:, :8], slopes=slopes[:30])
    with pytest.raises(fivar.FivarError, match="head_dim 96"):
        v.prefill(q[..., :96], k[..., :96], k[..., :96], slopes=slopes)
    with pytest.raises(fivar.FivarError, match="is on cpu"):
        v.prefill(q, k, k, slopes=slopes.cpu())
    with pytest.raises(fivar.FivarError, match="qo_len \\(8\\) > kv_len \\(4\\)"):
        v.prefill(q, k[:4], k[:4], causal=True, slopes=slopes)
    with pytest.raises(fivar.FivarError, match="must be a positive finite number"):
        fivar.load("softcap").prefill(q, k, k, softcap=-5.0)


@pytest.mark.parametrize("name", ["softcap", "alibi", "document_mask", "sigmoid"])
def test_decode_cuda_core_path(name):
    """Few query heads per KV head: decode runs FlashInfer's CUDA-core decode kernel."""
    r = check_decode(fivar.load(name), kv_lens=[1, 33, 517, 1000], num_qo_heads=16, num_kv_heads=16)
    assert r.passed, r


@pytest.mark.parametrize("name", ["softcap", "document_mask", "sigmoid"])
def test_planned_decode_matches_reference(name):
    from fivar.testing import _ragged_reference, _to_paged, compare, example_params
    v = fivar.load(name)
    kv_lens = [5, 300, 1000]
    q = torch.randn(3, 32, 128, dtype=torch.bfloat16, device="cuda")
    k, vv = (torch.randn(sum(kv_lens), 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, 16)
    params = example_params(v, num_qo_heads=32, num_kv_heads=8, batch_size=3, max_len=1000, device="cuda")
    plan = v.plan_decode(indptr, indices, last, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                         dtype=torch.bfloat16, **params)
    ref = _ragged_reference(v, q, k, vv, [1, 1, 1], kv_lens, False, params)
    for _ in range(2):  # a plan runs many times
        r = compare(name, "planned decode", plan.run(q, cache), ref, torch.bfloat16)
        assert r.passed, r
    with pytest.raises(fivar.FivarError, match="do not match the plan"):
        plan.run(q[:, :16], cache)


def test_fa2_module_pinned_for_other_shared_memory_refuses_to_launch(monkeypatch):
    """An FA2 prefill module whose KV tile was pinned for GPUs of another shared-memory size (here: 100 KB, as on
    sm_86/89) does not launch a kernel picked for them: the launch fails and says why (fivar_pinned_kv_tiles.cuh)."""
    from fivar.flashinfer_compat import problem
    from fivar.jit import build, pinned_kv_tiles
    if problem("fa2_pinned_kv_tiles"):  # the installed FlashInfer's launchers keep their own run-time choice
        pytest.skip(f"FA2 KV tiles are not pinned with this FlashInfer: {problem('fa2_pinned_kv_tiles')}")
    monkeypatch.setitem(pinned_kv_tiles.SMEM_BY_ARCH, (9, 0), (102400, 101376))
    monkeypatch.setattr(build, "_memo", {})
    for qo_len in (512, 4):  # CTA_TILE_Q 128 and 16
        with pytest.raises(Exception, match="compiled for GPUs with 102400 bytes of shared memory per SM.*"
                                            "FIVAR_PIN_KV_TILES=0"):
            check_single_prefill(fivar.load("softcap"), qo_len=qo_len, kv_len=600, causal=False, backend="fa2")
