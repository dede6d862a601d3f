"""FlashInfer FA3 (Hopper, sm90a) target: the variant struct for the warp-specialized TMA/wgmma kernels.

Same IR, same emitter as FA2. Differences the FA3 interface imposes: the constructor takes the mainloop
params and the block coordinate (lengths and the request index come from there: the hook's batch_idx is
always 0), params live under `params.additional_params`, the softmax scale goes to the updater
(`OnlineSoftmax`, or `DefaultUpdater` without softmax), and a mask becomes part of LogitsTransform, except
a mask that is exactly a sliding window: FA3 masks that itself (`runs_as_window`).

A mask that is more than a band (`variant.scans_mask`) gets a second form of the batch-prefill struct, the
KV-range form (fivar.runtime.kv_ranges): each FA3 request is one query block over the keys its mask can
keep, and the struct maps a request's local row/key back to the original request, query and key through
the `fv_blocks` table ([request] -> batch, q_idx of its first row, kv_idx of its first key). Causal is a
runtime flag there, since FA3's own causal rule would align the diagonal to the block, not the request.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import re

from ..errors import FivarError
from ..spec import ir
from .cuda import CppEmitter, Member, additional_params
from .fa2 import MASK_CAUSAL, MASK_NONE, VariantDecl, render, softmax_scale_log2, struct_name

#: The KV-range form's per-request table: int32 [requests, BLOCK_FIELDS] = (batch, q_idx of row 0, kv_idx of
#: key 0, then for the mask form [full_lo, full_hi): the keys every row of the block keeps (request kv_idx);
#: for the row-run form the offset of the block's first row in ROW_RUNS and the stride of a query head there).
BLOCKS, BLOCK_FIELDS, ROW_RUNS = "fv_blocks", 5, "fv_row_runs"


def uses_kv_ranges(variant, op: str) -> bool:
    """Batch prefill of a mask that is more than a band is built in the KV-range form (single prefill of
    such a variant runs as a batch of one through it)."""
    return op == "batch_prefill" and variant.scans_mask


def runs_as_window(variant) -> bool:
    """True when the mask is exactly `kv_idx >= q_idx - left` (a sliding window, causal or not): FA3's own
    sliding-window schedule then masks it, on the window's boundary tiles only, so the struct carries no
    mask (fivar.runtime.attention passes `window_left = left`, negative values included: FA3's kernel
    applies any value it is given once built with the window)."""
    band = variant.kv_band
    return variant.lowered.mask is not None and band.exact and band.left is not None and band.right is None


#: MUFU ops per call of a function in the emitted code (sigmoid: an exp and a reciprocal).
_MUFU_OPS = {"tanh": 1, "exp": 1, "exp2": 1, "log": 1, "sqrt": 1, "sigmoid": 2}
#: Of every 8 score columns, how many compute their softmax exp2 on the FMA pipe when the logits transform
#: itself needs the MUFU pipe. Measured on an H200 with single prefill, bf16, hd128, S=8192 only (`bench_fa3.py
#: --exp2-splits 2,4,6`, benchmarks/results/bench_exp2_h200.json): against stock FA3 in the same run, 2 gave
#: 0.98-1.04x on soft-capped variants (timing noise there is up to 3.5%), 4 and 6 were 4-9% slower than 2 (the
#: FMA and issue slots are not idle either). Batch prefill and head dims 64/256 take the same split, unmeasured.
EXP2_EMULATED_OF_8 = 2
EXP2_EMULATION_ENV = "FIVAR_FA3_EXP2_EMULATION"


def mufu_ops_per_score(variant) -> int:
    """MUFU (special function unit) ops the logits transform and mask cost per score, hoisted values aside:
    transcendental calls and divisions by a non-constant (a mask FA3 runs as its own window costs none)."""
    lowered, count = variant.lowered, 0
    for prog in (lowered.logits, None if runs_as_window(variant) else lowered.mask):
        if prog is None:
            continue
        for expr in [e for _, e in prog.lets] + [prog.result]:
            for node in ir.walk(expr):
                if isinstance(node, ir.Call):
                    count += _MUFU_OPS.get(node.fn, 0)
                elif (isinstance(node, ir.Binary) and node.op in ("div", "floordiv", "mod")
                      and not isinstance(node.b, ir.Const)):  # a reciprocal, also in integer division
                    count += 1
    return count


def exp2_emulated_of_8(variant) -> int:
    """How many of every 8 score columns take fivar::exp2_fma instead of the MUFU exp2 (csrc/fivar_fa3_softmax.cuh):
    0 for a variant without softmax or whose logits transform needs no MUFU op (the softmax's exp2 alone does not
    keep the MUFU pipe longer than the wgmmas), else EXP2_EMULATED_OF_8. FIVAR_FA3_EXP2_EMULATION=0..8 overrides
    it for every softmax variant (it changes the generated source, so the module URI)."""
    if not variant.softmax:
        return 0
    override = os.environ.get(EXP2_EMULATION_ENV, "").strip()
    if override:
        if override not in tuple("012345678"):
            raise FivarError(f"variant '{variant.name}': {EXP2_EMULATION_ENV}={override!r}: expected an integer from 0 "
                             "to 8 (how many of every 8 score columns compute exp2 on the FMA pipe)")
        return int(override)
    return EXP2_EMULATED_OF_8 if mufu_ops_per_score(variant) else 0


def exp2_split_for(variant, requested: int | None) -> int:
    """The split a module is rendered with: `requested`, else the variant's default (exp2_emulated_of_8)."""
    if requested is None:
        return exp2_emulated_of_8(variant)
    if not 0 <= requested <= 8:
        raise FivarError(f"variant '{variant.name}': exp2_emulated_of_8={requested}: expected 0 to 8")
    return requested if variant.softmax else 0


#: The bounded softmax (on unless FIVAR_FA3_BOUNDED_SOFTMAX=0; gen_module(bounded_softmax=False),
#: `with bounded_softmax(False)`): a softmax variant whose logits transform is bounded (fivar.spec.ranges:
#: soft-capping's tanh, in [-1, 1]) gets FA3 modules whose softmax takes its max from the bound, with no running
#: max and no output rescale per tile (csrc/fivar_fa3_softmax.cuh), used for a launch when bounded_softmax_applies;
#: the running-max module is built next to it for the launches it does not apply to. Measured faster than the
#: running max on soft-cap (README, session 9).
BOUNDED_SOFTMAX_ENV = "FIVAR_FA3_BOUNDED_SOFTMAX"
#: With the max at hi * scale, every unmasked probability is at least 2^-((hi - lo) * scale). Up to this span it,
#: and p * v for |v| >= 2^-30, stay normal floats; beyond it a row whose logits all sit low could lose every weight.
BOUNDED_SOFTMAX_SPAN = 96.0


def softmax_range(variant, dtype: str, requested: bool | None = None) -> tuple[float, float] | None:
    """The range [lo, hi] of the logits transform FA3's softmax takes its max from, or None for the running max:
    `requested`, else FIVAR_FA3_BOUNDED_SOFTMAX (default 1), says whether to; it applies to softmax variants with a
    bounded transform, in bf16 only (an fp16 probability under 2^-24 is zero, so a row whose logits all sit far below
    the bound would lose every weight; bf16 keeps float's exponent range)."""
    if requested is None:
        text = os.environ.get(BOUNDED_SOFTMAX_ENV, "").strip()
        if text not in ("", "0", "1"):
            raise FivarError(f"variant '{variant.name}': {BOUNDED_SOFTMAX_ENV}={text!r}: expected 0 or 1")
        requested = text != "0"
    if not requested or not variant.softmax or dtype != "bf16":
        return None
    return variant.logits_range


def bounded_softmax_applies(logits_range: tuple[float, float], output_factor: float) -> bool:
    """Whether a launch may run the bounded module: the softmax scale is log2(e) times the logits factor folded
    out of the transform (fivar.spec.optimize.split_output_scale; 1 without one), and the range times it must
    span at most BOUNDED_SOFTMAX_SPAN. A cap of 30 spans 86.6 and may; Gemma 2's cap of 50 spans 144 and runs the
    module with the running max."""
    lo, hi = logits_range
    scale_log2 = output_factor / math.log(2.0)
    return scale_log2 > 0 and (hi - lo) * scale_log2 <= BOUNDED_SOFTMAX_SPAN


def bounded_softmax(on: bool = True):
    """Like exp2_split, for the bounded softmax (softmax_range)."""
    return env_set(BOUNDED_SOFTMAX_ENV, "1" if on else "0")


@contextlib.contextmanager
def env_set(var: str, value: str):
    """Within the block, environment variable `var` is `value` (the knobs fivar's module memo and runtime read)."""
    before = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = before


def exp2_split(k: int):
    """Generate (and, through fivar's module memo, run) FA3 modules with k of every 8 exp2 columns on the FMA
    pipe while inside: for benchmarks and tests that compare splits in one process."""
    return env_set(EXP2_EMULATION_ENV, str(k))


def cta_tile(tile: str):
    """Like exp2_split, for FA3 single prefill's CTA tile ("128x176", or "128x176,128x128": non-causal, causal)."""
    return env_set(CTA_TILE_ENV, tile)


#: FA3 single prefill's CTA tile (CTA_Q x CTA_KV) is FlashInfer's choice (getCTATileSize in prefill_sm90.cuh: 128 x 192
#: non-causal and 128 x 128 causal at hd128) unless a module asks for another, or the variant is one whose transform
#: costs MUFU ops (the soft-caps): those run 128 x 128 at hd128 (but see the window and, non-causal from LONG_QO_LEN
#: rows, 192 x 64 below). Measured on an H200, S=8192 non-causal (benchmarks/results/bench_tiles*_h200.json): soft-cap
#: 532 and 534 TF/s at 128x128 vs 507 at 128x192 in two runs, the soft-capped window 493 vs 477 (one run); 128x176 and
#: 128x160 lay between, 192x128 lost 40% (160 registers per thread for three consumer warpgroups). With a left window
#: too, the causal kernel (persistent, default_schedule) runs 192 x 64 (MUFU_BOUND_WINDOW_TILE): three warpgroups share
#: each K/V tile of a ~9-tile loop, and the half-width score tile fits their registers. Soft-capped window 1024, H200,
#: TF/s at S=8192 / 16384 in two runs (bench_window_q192{,b}_h200_session18.json): 389 / 406 and 388 / 407 vs 387 / 379
#: and 385 / 383 at 128x128; 192x48 357 / 385, 192x80 364 / 389, 192x96 and 192x128 spill (258 / 286, 202 / 222). At
#: S=4096 192x64 then lost (332 vs 380): its 22 query tiles per head aliased with 132 CTAs on the persistent schedule's
#: head-major order, so a CTA ran the same (light or heavy) tile of six heads. With the query-tile-major, boustrophedon
#: order (csrc/fivar_fa3_persistent.cuh) 192x64 wins at every length: 407 / 417 / 419 vs 396 / 395 / 396 TF/s at S=4096
#: / 8192 / 16384 (bench_window_tiles_order_h200_session19.json). Without the cap (no MUFU op) 192x64 lost on the old
#: order (396 / 415 vs 431 / 430), so sliding_window keeps FlashInfer's. fivar renders an explicit specialization of
#: SinglePrefillWithKVCacheDispatched with the tile (templates/fa3/cta_tile_inst.cu.jinja); a tile given as alternatives
#: (cta_tiles) is picked per launch.
#: The soft-caps' non-causal kernel runs 192 x 64 from LONG_QO_LEN query rows, 128 x 128 below. Every FA3 kernel here
#: runs at the board's power limit (700 W on an H100, clock 1.5-1.8 GHz of 1.98), and 192 x 64 does more work per
#: clock (H100, session 22; each kernel alone for 3 s, TF/s at S=8192 / 16384: soft-cap 577 / 587 vs 529 / 537, the
#: soft-capped window 535 / 564 vs 499 / 531; soft-cap interleaved with the others: 557 / 557-563 vs 544 / 548;
#: benchmarks/results/*_h100_session22.json). At S=4096 its 22 query tiles per head leave the last wave a third full
#: and it loses (487 vs 508 alone, 497-499 vs 520-524 interleaved). The choice keys on the launch's rows only, so
#: every launch of a wave split (runtime/wave_split.py, which cuts the keys in whole CTA_KV tiles) runs one tile.
CTA_TILE_ENV = "FIVAR_FA3_CTA_TILE"
LONG_QO_LEN = 6144
MUFU_BOUND_TILE = "192x64|128x128,128x128"
MUFU_BOUND_WINDOW_TILE = "192x64|128x128,192x64"
FLASHINFER_TILES = "flashinfer"
_SMEM_BYTES = 227 * 1024 - 1024  # Hopper's per-block limit, less the pipeline barriers


def default_cta_tile(variant, op: str, head_dim: int) -> str:
    """MUFU_BOUND_TILE for single prefill of a softmax variant whose transform costs MUFU ops, at hd128 (the one
    head dim measured), MUFU_BOUND_WINDOW_TILE if it has a left window too; else FlashInfer's own tiles."""
    if op == "single_prefill" and head_dim == 128 and variant.softmax and mufu_ops_per_score(variant):
        return MUFU_BOUND_WINDOW_TILE if variant.kv_band.left is not None else MUFU_BOUND_TILE
    return FLASHINFER_TILES


def cta_tiles(variant, op: str, head_dim: int, requested: str | None) -> dict[str, tuple[tuple[int, int], ...]]:
    """The tiles per mask mode ({MASK_NONE: ((q, kv),), MASK_CAUSAL: ((q, kv), ...)}) a module's FA3 kernels use
    instead of FlashInfer's, {} for FlashInfer's own: `requested`, else FIVAR_FA3_CTA_TILE (single prefill only),
    else default_cta_tile. "QxKV" sets both modes, "QxKV,QxKV" non-causal then causal, "flashinfer" FlashInfer's.
    Either may name alternatives, "QxKV|QxKV": the module holds one kernel per tile and each launch picks one
    (templates/fa3/cta_tile_inst.cu.jinja). Non-causal: two tiles, the first for launches of at least LONG_QO_LEN
    query rows, the second below (non_causal_tile says which, for the wave split's plan). Causal: the tile whose last
    wave idles the fewest SM-rows (fewest waves x CTA_Q; a tie goes to the first named). That rule counts waves of
    equal tiles; on the persistent schedule's balanced order it picked 128x128 where 192x64 ran 3-6% faster (S=4096
    and 8192, session 19), so no default names a causal choice."""
    where = "cta_tile" if requested is not None else CTA_TILE_ENV
    text = requested if requested is not None else os.environ.get(CTA_TILE_ENV, "").strip()
    if not text or (requested is None and op != "single_prefill"):
        text = default_cta_tile(variant, op, head_dim)
    if text == FLASHINFER_TILES:
        return {}
    if op != "single_prefill":
        raise FivarError(f"variant '{variant.name}': cta_tile={text!r}: only FA3 single prefill takes a CTA tile")
    problem = flashinfer_dispatch_problem()
    if problem and requested is None and not os.environ.get(CTA_TILE_ENV, "").strip():
        return {}  # fivar's default tile is an optimisation: FlashInfer's own tiles are always right
    if problem:
        raise FivarError(f"variant '{variant.name}': {where}={text!r}: {problem}; only FlashInfer's own tiles "
                         f"({FLASHINFER_TILES!r}) can be built")
    parts = [[t.strip() for t in p.split("|")] for p in text.split(",")]
    if len(parts) > 2:
        raise FivarError(f"variant '{variant.name}': {where}={text!r}: {_TILE_FORMAT}")
    per_mode = [tuple(_checked_tile(variant, where, text, t, head_dim) for t in p) for p in parts]
    non_causal, causal = per_mode[0], per_mode[-1]
    if len(non_causal) > 2 or (len(non_causal) == 2 and non_causal[0] == non_causal[1]):
        raise FivarError(f"variant '{variant.name}': {where}={text!r}: a non-causal choice must name two different "
                         f"tiles, the first for launches of at least {LONG_QO_LEN} query rows, the second below")
    choice_q = [q for q, _ in causal]
    if len(set(choice_q)) < len(choice_q):  # the kernel picks by waves x CTA_Q: the later tile would never run
        hint = " (a choice given once applies to both modes; A|B,C makes it non-causal only)" if len(parts) == 1 else ""
        raise FivarError(f"variant '{variant.name}': {where}={text!r}: the tiles of a causal choice must differ in "
                         "CTA_Q (each launch picks by waves x CTA_Q, so a second tile with the same CTA_Q would never "
                         f"run){hint}")
    return {MASK_NONE: non_causal, MASK_CAUSAL: causal}


_TILE_FORMAT = (f"expected QxKV or QxKV,QxKV (non-causal, causal), e.g. 128x176, either optionally a choice "
                f"QxKV|QxKV, or {FLASHINFER_TILES!r}")


def _checked_tile(variant, where: str, text: str, tile: str, head_dim: int) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)[xX](\d+)", tile)
    if not m:
        raise FivarError(f"variant '{variant.name}': {where}={text!r}: {_TILE_FORMAT}")
    q, kv = int(m.group(1)), int(m.group(2))
    smem = 2 * head_dim * (q + 2 * kv + max(2 * kv, q))  # Q, K (2 stages), V (2 stages) or O in its place
    # CTA_Q: FA3's warp scheduler (hopper/named_barrier.cuh) static_asserts two or three consumer warpgroups
    broken = (f"CTA_Q is {q}; it must be 128 or 192 (two or three consumer warpgroups)" if q not in (128, 192) else
              f"CTA_KV is {kv}; it must be a multiple of 16 from 16 to 256" if kv % 16 or not 16 <= kv <= 256 else
              f"Q, K and V take {smem // 1024} KiB of shared memory; at most {_SMEM_BYTES // 1024} fit"
              if smem > _SMEM_BYTES else None)
    if broken:
        raise FivarError(f"variant '{variant.name}': {where}={text!r}: tile {q}x{kv} at head dim {head_dim} is "
                         f"not one FA3 can run: {broken}")
    return q, kv


#: sha256 of FlashInfer 0.7.2's SinglePrefillWithKVCacheDispatched body (hopper/prefill_sm90.cuh), whitespace
#: collapsed: the function templates/fa3/cta_tile_inst.cu.jinja specializes with everything but the tile kept.
_FLASHINFER_DISPATCH_SHA256 = "838afb1277820d5e386dedbaf33a5f2960e16a9f13e1eb49a2383e9bc547f436"
#: ... and of its SinglePrefillWithKVCacheKernelTraitsDispatched, the launcher csrc/fivar_fa3_persistent.cuh mirrors
#: with another scheduler and grid.
_FLASHINFER_LAUNCHER_SHA256 = "74f4778633778607070f182460914ee924f134174c53ddc5bf98e80a0a31d33b"


def _mirrored_function_problem(signature: str, sha256: str, what: str) -> str | None:
    from flashinfer.jit import env as jit_env
    path = jit_env.FLASHINFER_INCLUDE_DIR / "flashinfer" / "attention" / "hopper" / "prefill_sm90.cuh"
    name = re.search(r"(\w+)\\\(Params", signature).group(1)
    m = re.search(signature + r" \{\n(.*?)\n\}\n", path.read_text(), re.S)
    if m is None:
        return f"{path} has no {name} of the form fivar's {what} mirrors"
    if hashlib.sha256(" ".join(m.group(1).split()).encode()).hexdigest() != sha256:
        return f"FlashInfer's {name} ({path}) changed since fivar's {what} was written against 0.7.2"
    return None


@functools.lru_cache(maxsize=None)
def flashinfer_dispatch_problem() -> str | None:
    """Why the installed FlashInfer's FA3 single-prefill dispatch is not the one fivar's tile specialization
    mirrors (kernel traits, stages, TMA), or None."""
    return _mirrored_function_problem(
        r"template <uint32_t HEAD_DIM_QK, uint32_t HEAD_DIM_VO, MaskMode MASK_MODE, bool LEFT_SLIDING_WINDOW,\s*"
        r"typename AttentionVariant, typename Params>\s*cudaError_t SinglePrefillWithKVCacheDispatched\(Params& "
        r"params, cudaStream_t stream\)", _FLASHINFER_DISPATCH_SHA256, "CTA-tile specialization")


@functools.lru_cache(maxsize=None)
def flashinfer_launcher_problem() -> str | None:
    """Why the installed FlashInfer's FA3 single-prefill launcher is not the one fivar's persistent schedule
    mirrors (its mainloop and epilogue arguments), or None."""
    return _mirrored_function_problem(
        r"template <typename KernelTraits, bool LEFT_SLIDING_WINDOW, bool CAUSAL, typename Params>\s*cudaError_t "
        r"SinglePrefillWithKVCacheKernelTraitsDispatched\(Params& params, cudaStream_t stream\)",
        _FLASHINFER_LAUNCHER_SHA256, "persistent schedule")


#: FA3 single prefill's schedule per mask mode: "grid", FlashInfer's (SingleTileScheduler: one CTA per query tile and
#: head), or "persistent" (csrc/fivar_fa3_persistent.cuh: one CTA per SM walks the tiles heavy-first, loading the next
#: tile's first K and its Q while it finishes the current one). gen_module(schedule=...), else FIVAR_FA3_SCHEDULE,
#: else default_schedule; "S" for both modes or "S,S" non-causal then causal, like the CTA tile.
SCHEDULE_ENV = "FIVAR_FA3_SCHEDULE"
SCHEDULES = ("grid", "persistent")


def default_schedule(variant, op: str, head_dim: int = 128) -> str:
    """Persistent for the causal kernel of a variant with a left window at hd128, the head dim measured (FA3's
    own sliding window: each query tile visits ~window / CTA_KV + 1 KV tiles, so a tile's start and end weigh),
    grid otherwise. Measured on an H200, causal, window 1024 (benchmarks/results/bench_persistent_h200_session18.json):
    soft-capped 379/385/387 vs 360/374/375 TF/s on the grid at S=4096/8192/16384, no cap 425/428/429 vs
    401/400/398. Where tile costs differ (causal without a window, a window non-causal) CTAs drift apart on a
    static schedule and the tiles in flight spread over more heads than L2 holds: soft-cap causal at S=16384 fell
    from 515 to 430 (session 17), so those stay on the grid."""
    window = op == "single_prefill" and head_dim == 128 and variant.kv_band.left is not None
    return "grid,persistent" if window else "grid"


def schedules(variant, op: str, requested: str | None, head_dim: int = 128) -> dict[str, str]:
    """{MASK_NONE: schedule, MASK_CAUSAL: schedule} of a module (schedules other than single prefill's are
    FlashInfer's: "grid" here, and batch prefill's planned persistent one is FlashInfer's own)."""
    if op != "single_prefill" and requested is None:  # FIVAR_FA3_SCHEDULE is single prefill's, like its CTA tile
        return {MASK_NONE: "grid", MASK_CAUSAL: "grid"}
    where = "schedule" if requested is not None else SCHEDULE_ENV
    override = requested if requested is not None else os.environ.get(SCHEDULE_ENV, "").strip()
    text = override or default_schedule(variant, op, head_dim)
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 2 or any(p not in SCHEDULES for p in parts):
        raise FivarError(f"variant '{variant.name}': {where}={text!r}: expected {' or '.join(SCHEDULES)}, or two of "
                         "them, non-causal then causal (e.g. grid,persistent)")
    chosen = {MASK_NONE: parts[0], MASK_CAUSAL: parts[-1]}
    if op != "single_prefill":
        if requested is not None and set(parts) != {"grid"}:
            raise FivarError(f"variant '{variant.name}': schedule={text!r}: only FA3 single prefill takes a schedule "
                             "(batch prefill runs FlashInfer's planned persistent one)")
        return {MASK_NONE: "grid", MASK_CAUSAL: "grid"}
    if "persistent" in parts:
        problem = flashinfer_dispatch_problem() or flashinfer_launcher_problem()
        if problem and not override:  # the default is an optimisation: FlashInfer's grid is always right
            return {MASK_NONE: "grid", MASK_CAUSAL: "grid"}
        if problem:
            raise FivarError(f"variant '{variant.name}': {where}={text!r}: {problem}; the persistent schedule is "
                             "built on it, so only 'grid' can be")
    return chosen


def schedule_text(chosen: dict[str, str]) -> str:
    """The canonical text of schedules' result, what a module records."""
    a, b = chosen[MASK_NONE], chosen[MASK_CAUSAL]
    return a if a == b else f"{a},{b}"


def schedule(name: str):
    """Like exp2_split, for FA3 single prefill's schedule ("grid", "persistent" or "grid,persistent")."""
    return env_set(SCHEDULE_ENV, name)


def tile_text(tiles: dict[str, tuple[tuple[int, int], ...]]) -> str:
    """The canonical text of cta_tiles' result, what a module records (and cta_tiles reads back as it is)."""
    if not tiles:
        return FLASHINFER_TILES
    a, b = ("|".join("x".join(map(str, t)) for t in tiles[m]) for m in (MASK_NONE, MASK_CAUSAL))
    return a if a == b else f"{a},{b}"


#: FlashInfer 0.7.2's own single-prefill tiles (getCTATileSize, hopper/prefill_sm90.cuh): head dim -> ((CTA_Q,
#: CTA_KV) non-causal, (CTA_Q, CTA_KV) causal)
FLASHINFER_SINGLE_PREFILL_TILES = {64: ((192, 128), (192, 128)), 128: ((128, 192), (128, 128)),
                                   256: ((128, 64), (128, 64))}


def non_causal_tile(tile: str | None, head_dim: int, qo_len: int) -> tuple[int, int]:
    """(CTA_Q, CTA_KV) that a launch of `qo_len` query rows runs on a single-prefill module's non-causal kernel, from
    the `cta_tile` it records: fivar's tile (of a choice, the one cta_tile_inst.cu.jinja picks), or FlashInfer's
    (FLASHINFER_SINGLE_PREFILL_TILES) for 'flashinfer'."""
    if tile and tile != FLASHINFER_TILES:
        choice = [tuple(int(n) for n in t.lower().split("x")) for t in tile.split(",")[0].split("|")]
        return choice[0] if qo_len >= LONG_QO_LEN else choice[-1]
    return FLASHINFER_SINGLE_PREFILL_TILES[head_dim][0]


def mask_modes(variant) -> list[str]:
    return [MASK_NONE, MASK_CAUSAL]


def runtime_mask_code(variant, causal: bool) -> int:
    return 1 if causal else 0


def variant_decl(variant, kv_ranges: bool = False, row_runs: bool = False,
                 exp2_emulated_of_8: int | None = None, logits_range: tuple[float, float] | None = None) -> VariantDecl:
    """`logits_range`: the softmax takes its max from it (softmax_range). `kv_ranges`: the KV-range form.
    `row_runs` (with it): the form for a batch whose every row keeps one run of keys (a document mask always
    does): the mask pre-pass stored each row's run (made relative to its block's first key, causal folded in) and
    the kernel checks it with one 8-byte load per row, instead of evaluating the mask per element (its gathers
    spill registers in FA3's consumer warps)."""
    param_ref = lambda n: f"params.additional_params.{n}"  # noqa: E731
    lowered = variant.lowered
    block = lambda i: f"{param_ref(BLOCKS)}[{BLOCK_FIELDS} * batch_idx + {i}]"  # noqa: E731
    index_init = {"batch": "fv_batch_idx"}
    if kv_ranges:
        index_init["kv_idx"] = "int32_t(kv_idx) + fv_kv_offset"
    emit = CppEmitter(variant, param_ref, index_init=index_init)
    as_window = not kv_ranges and runs_as_window(variant)
    if as_window:
        lowered = dataclasses.replace(lowered, mask=None)
    extra = [lowered.output_scale] if lowered.output_scale is not None else []
    members = emit.members(lowered, extra)
    # FA3 reads the request's lengths from the block coordinate; q_offset needs them in scope
    for m in members:
        if m.name == "fv_q_offset":
            m.init = block(1) if kv_ranges else "int32_t(kv_len) - int32_t(qo_len)"
    if kv_ranges:
        if not any(m.name == "fv_q_offset" for m in members):
            members.insert(0, Member("int32_t", "fv_q_offset", block(1)))
        keys = ([Member("const int32_t*", "fv_runs", f"{param_ref(ROW_RUNS)} + {block(3)} + {block(4)} * "
                                                      "int32_t(qo_head_idx)")] if row_runs else
                [Member("int32_t", "fv_full_lo", block(3)), Member("int32_t", "fv_full_hi", block(4))])
        causal = [] if row_runs else [Member("bool", "fv_causal", f"{param_ref('fv_causal')} != 0")]
        members[1:1] = [Member("int32_t", "fv_kv_offset", block(2)), *keys, *causal]
    if kv_ranges or any("fv_batch" in line for line in emit.prologue(lowered.logits, lowered.mask)):
        members.insert(0, Member("int32_t", "fv_batch_idx", block(0) if kv_ranges else "int32_t(batch_idx)"))
    scale = softmax_scale_log2(variant, emit)
    lines = emit.prologue(lowered.logits, None if row_runs else lowered.mask)
    if lowered.mask and row_runs:
        # runs are relative to the block's first key, causal already folded in (fivar.runtime.kv_ranges)
        lines += ["const int2 fv_run = __ldg(reinterpret_cast<const int2*>(fv_runs) + int32_t(qo_idx));",
                  "bool fv_keep = (int32_t(kv_idx) >= fv_run.x) & (int32_t(kv_idx) < fv_run.y);"]
    elif lowered.mask and kv_ranges:
        # Keys every row of the block keeps skip the mask: interior tiles of a document run no loads (and, the
        # loads being under a branch, the compiler does not keep a tile's worth of them in flight: spills).
        mask_lines, keep = emit.statements(lowered.mask)
        kv = "(int32_t(kv_idx) + fv_kv_offset)"
        lines += [f"bool fv_keep = {kv} >= fv_full_lo && {kv} < fv_full_hi;", "if (!fv_keep) {"]
        lines += ["  " + ln for ln in mask_lines] + [f"  fv_keep = {keep};", "}"]
        lines.append(f"if (fv_causal && {kv} > int32_t(qo_idx) + fv_q_offset) fv_keep = false;")
    elif lowered.mask:
        mask_lines, keep = emit.statements(lowered.mask)
        lines += ["bool fv_keep;", "{"] + ["  " + ln for ln in mask_lines] + [f"  fv_keep = {keep};", "}"]
    logit_lines, value = emit.statements(lowered.logits)
    lines += logit_lines
    if lowered.mask:
        fill = "-INFINITY" if variant.softmax else "0.f"
        value = f"fv_keep ? {value} : {fill}"
    lines.append(f"return {value};")
    source = render("fa3/variant.cuh.jinja", name=variant.name, struct_name=struct_name(variant),
                    source=os.path.basename(variant.source_file or "<unknown>"), softmax=variant.softmax,
                    members=members, sm_scale_log2=scale, body="\n    ".join(lines), kv_ranges=kv_ranges,
                    window=as_window, exp2_emulated_of_8=exp2_split_for(variant, exp2_emulated_of_8),
                    logits_range=logits_range and tuple(repr(float(x)) for x in logits_range))
    tables = [BLOCKS, ROW_RUNS] if row_runs else [BLOCKS] if kv_ranges else []
    return VariantDecl(source, lowered, additional_params(variant, with_causal_flag=kv_ranges and not row_runs,
                                                          extra_tensors=tables))
