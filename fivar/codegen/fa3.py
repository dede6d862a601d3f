"""FlashInfer FA3 (Hopper, sm90a) target: the variant struct for the warp-specialized TMA/wgmma kernels.

Same IR, same emitter as FA2. Differences the FA3 interface imposes: the constructor takes the mainloop
params and the block coordinate (lengths and the request index come from there: the hook's batch_idx is
always 0), params live under `params.additional_params`, the softmax scale goes to the updater
(`OnlineSoftmax`, or `DefaultUpdater` without softmax), and a mask becomes part of LogitsTransform, except
a mask that is exactly a sliding window: FA3 masks that itself (`runs_as_window`).

A mask that is more than a band (`variant.scans_mask`) gets the tile-list form of the batch-prefill struct
(fivar.runtime.fa3_tile_list): each FA3 request is one query tile over the non-empty key tiles of the device block
map, and the struct maps a request's local row/key back to the original request, query and key through the
`fv_blocks` and `fv_tile_keys` tables; whole tiles skip the mask, cut tiles read bits. Causal is the map's (and the
bits'), since FA3's own causal rule would align the diagonal to the query tile, not the request.
"""
from __future__ import annotations

import dataclasses
import math
import re

from .. import config
from ..errors import FivarError
from ..flashinfer_compat import active as coupling_active, fa3_launchers
from ..spec import ir
from .cuda import CppEmitter, Member, additional_params, source_label
from .fa2 import MASK_CAUSAL, MASK_CODES, MASK_NONE, VariantDecl, render, softmax_scale_log2, struct_name
# the tile-list form's tables and struct lines, shared with FA2 (BLOCKS... re-exported: the runtime reads them here)
from .tile_list import (BLOCKS, CUT_BITS, TILE_FIELDS, TILE_KEYS, TILE_WIDTH, mask_reads_head,  # noqa: F401
                        struct_parts as tile_list_struct_parts, tables as tile_list_tables)


def uses_tile_list(variant, op: str) -> bool:
    """Batch prefill of a mask that is more than a band is built in the tile-list form (single prefill of such a
    variant runs as a batch of one through it)."""
    return op == "batch_prefill" and variant.scans_mask


def runs_as_window(variant) -> bool:
    """True when the mask is exactly `kv_idx >= q_idx - left` (a sliding window, causal or not), or that and
    `kv_idx <= q_idx` (a causal window, run in FA3's causal mode however called: runtime_mask_code): FA3's own
    sliding-window schedule then masks it, on the window's boundary tiles only, so the struct carries no
    mask (fivar.runtime.attention passes `window_left = left`, negative values included: FA3's kernel
    applies any value it is given once built with the window)."""
    return variant.lowered.mask is not None and variant.kv_band.window


#: MUFU ops per call of a function in the emitted code (sigmoid: an exp and a reciprocal).
_MUFU_OPS = {"tanh": 1, "exp": 1, "exp2": 1, "log": 1, "sqrt": 1, "sigmoid": 2}
#: Of every 8 score columns, how many compute their softmax exp2 on the FMA pipe when the logits transform itself
#: needs the MUFU pipe: 2 measured best against 4 and 6 on soft-capped variants (docs/tuning.md).
EXP2_EMULATED_OF_8 = 2
EXP2_EMULATION_ENV = config.ENV["exp2_emulated_of_8"]


def mufu_ops_per_score(variant, mask: bool = True) -> int:
    """MUFU (special function unit) ops the logits transform and mask cost per score, hoisted values aside:
    transcendental calls and divisions by a non-constant (a mask FA3 runs as its own window costs none, and so does
    one the module never evaluates per score: `mask` False, the tile-list form reading bits)."""
    lowered, count = variant.lowered, 0
    for prog in (lowered.logits, None if runs_as_window(variant) or not mask else lowered.mask):
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


def exp2_emulated_of_8(variant, mask: bool = True) -> int:
    """How many of every 8 score columns take fivar::exp2_fma instead of the MUFU exp2 (csrc/fivar_fa3_softmax.cuh):
    0 for a variant without softmax or whose logits transform needs no MUFU op (the softmax's exp2 alone does not
    keep the MUFU pipe longer than the wgmmas), else EXP2_EMULATED_OF_8. fivar.config's override or
    FIVAR_FA3_EXP2_EMULATION=0..8 sets it for every softmax variant (it changes the generated source, so the URI)."""
    if not variant.softmax:
        return 0
    override, where = config.setting("exp2_emulated_of_8")
    if override:
        if override not in tuple("012345678"):
            raise FivarError(f"variant '{variant.name}': {where}={override!r}: expected an integer from 0 "
                             "to 8 (how many of every 8 score columns compute exp2 on the FMA pipe)")
        return int(override)
    return EXP2_EMULATED_OF_8 if mufu_ops_per_score(variant, mask) else 0


def exp2_split_for(variant, requested: int | None, mask: bool = True) -> int:
    """The split a module is rendered with: `requested`, else the variant's default (exp2_emulated_of_8; `mask`
    False for a module that evaluates no mask per score)."""
    if requested is None:
        return exp2_emulated_of_8(variant, mask)
    if not 0 <= requested <= 8:
        raise FivarError(f"variant '{variant.name}': exp2_emulated_of_8={requested}: expected 0 to 8")
    return requested if variant.softmax else 0


#: The bounded softmax (FA3KernelConfig.bounded_softmax, on by default): a softmax variant whose logits transform is
#: bounded (fivar.spec.ranges: soft-capping's tanh, in [-1, 1]) gets FA3 modules whose softmax takes its max from the
#: bound, with no running max and no output rescale per tile (csrc/fivar_fa3_softmax.cuh), used for a launch when
#: bounded_softmax_applies; the running-max module is built next to it for the launches it does not apply to.
BOUNDED_SOFTMAX_ENV = config.ENV["bounded_softmax"]
#: With the max at hi * scale, every unmasked probability is at least 2^-((hi - lo) * scale). Up to this span it,
#: and p * v for |v| >= 2^-30, stay normal floats; beyond it a row whose logits all sit low could lose every weight.
BOUNDED_SOFTMAX_SPAN = 96.0


def softmax_range(variant, dtype: str, requested: bool | None = None) -> tuple[float, float] | None:
    """The range [lo, hi] of the logits transform FA3's softmax takes its max from, or None for the running max:
    `requested`, else fivar.config's setting (default on), says whether to; it applies to softmax variants with a
    bounded transform, in bf16 only (an fp16 probability under 2^-24 is zero, so a row whose logits all sit far below
    the bound would lose every weight; bf16 keeps float's exponent range)."""
    if requested is None:
        requested = config.flag("bounded_softmax", True, f"variant '{variant.name}': ")
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
    """Shorthand for fivar.config.override(bounded_softmax=on) (the process environment is left alone)."""
    return config.override(bounded_softmax=on)


def exp2_split(k: int):
    """Shorthand for fivar.config.override(exp2_emulated_of_8=k): for benchmarks and tests comparing splits."""
    return config.override(exp2_emulated_of_8=k)


def cta_tile(tile: str):
    """Shorthand for fivar.config.override(cta_tile=tile)."""
    return config.override(cta_tile=tile)


#: FA3 single prefill's CTA tile (CTA_Q x CTA_KV) is FlashInfer's choice (getCTATileSize) unless a module asks for
#: another or the variant's transform costs MUFU ops (the soft-caps). Those run 192 x 64 non-causal from LONG_QO_LEN
#: query rows (three warpgroups do more work per clock at the power limit) and 128 x 128 below (192 x 64 leaves the
#: last wave a third full there); causal 128 x 128, or 192 x 64 with a left window (three warpgroups share each K/V
#: tile of a short loop). Without a MUFU op FlashInfer's tiles measured best. Measurements: docs/tuning.md. fivar
#: renders an explicit specialization of SinglePrefillWithKVCacheDispatched with the tile
#: (templates/fa3/cta_tile_inst.cu.jinja); a tile given as alternatives (cta_tiles) is picked per launch, on the
#: launch's rows only, so every launch of a wave split (runtime/wave_split.py) runs one tile.
CTA_TILE_ENV = config.ENV["cta_tile"]
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
    instead of FlashInfer's, {} for FlashInfer's own: `requested`, else fivar.config's setting (FIVAR_FA3_CTA_TILE;
    single prefill only), else default_cta_tile. "QxKV" sets both modes, "QxKV,QxKV" non-causal then causal, "flashinfer" FlashInfer's.
    Either may name alternatives, "QxKV|QxKV": the module holds one kernel per tile and each launch picks one
    (templates/fa3/cta_tile_inst.cu.jinja). Non-causal: two tiles, the first for launches of at least LONG_QO_LEN
    query rows, the second below (non_causal_tile says which, for the wave split's plan). Causal: the tile whose last
    wave idles the fewest SM-rows (fewest waves x CTA_Q; a tie goes to the first named). That rule counts waves of
    equal tiles; on the persistent schedule's balanced order it picked 128x128 where 192x64 ran faster, so no default
    names a causal choice."""
    forced, where = config.setting("cta_tile") if requested is None else ("", "cta_tile")
    text = requested if requested is not None else forced
    if not text or (requested is None and op != "single_prefill"):
        text = default_cta_tile(variant, op, head_dim)
    if text == FLASHINFER_TILES:
        return {}
    if op != "single_prefill":
        raise FivarError(f"variant '{variant.name}': cta_tile={text!r}: only FA3 single prefill takes a CTA tile")
    problem = flashinfer_dispatch_problem()
    if problem and requested is None and not forced:
        coupling_active("fa3_cta_tile")  # says once which optimisation this turns off, and why
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


def flashinfer_dispatch_problem() -> str | None:
    """Why the installed FlashInfer's FA3 single-prefill dispatch is not the one fivar's tile specialization
    mirrors, or None (fivar.flashinfer_compat.fa3_launchers)."""
    return fa3_launchers.dispatch_problem()


def flashinfer_launcher_problem() -> str | None:
    """Why the installed FlashInfer's FA3 single-prefill launcher is not the one the persistent schedule mirrors."""
    return fa3_launchers.launcher_problem()


#: FA3 single prefill's schedule per mask mode: "grid", FlashInfer's (SingleTileScheduler: one CTA per query tile and
#: head), or "persistent" (csrc/fivar_fa3_persistent.cuh: one CTA per SM walks the tiles heavy-first, loading the next
#: tile's first K and its Q while it finishes the current one). FA3KernelConfig.schedule, else fivar.config's setting
#: (FIVAR_FA3_SCHEDULE), else default_schedule; "S" for both modes or "S,S" non-causal then causal, like the CTA tile.
SCHEDULE_ENV = config.ENV["schedule"]
SCHEDULES = ("grid", "persistent")


def default_schedule(variant, op: str, head_dim: int = 128) -> str:
    """Persistent for the causal kernel of a variant with a left window at hd128, the head dim measured (FA3's
    own sliding window: each query tile visits ~window / CTA_KV + 1 KV tiles, so a tile's start and end weigh),
    grid otherwise: where tile costs differ (causal without a window, a window non-causal) CTAs drift apart on a
    static schedule and the tiles in flight spread over more heads than L2 holds (docs/tuning.md)."""
    window = op == "single_prefill" and head_dim == 128 and variant.kv_band.left is not None
    return "grid,persistent" if window else "grid"


def schedules(variant, op: str, requested: str | None, head_dim: int = 128) -> dict[str, str]:
    """{MASK_NONE: schedule, MASK_CAUSAL: schedule} of a module (schedules other than single prefill's are
    FlashInfer's: "grid" here, and batch prefill's planned persistent one is FlashInfer's own)."""
    if op != "single_prefill" and requested is None:  # a forced schedule is single prefill's, like its CTA tile
        return {MASK_NONE: "grid", MASK_CAUSAL: "grid"}
    forced, where = config.setting("schedule") if requested is None else ("", "schedule")
    override = requested if requested is not None else forced
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
        problem = fa3_launchers.persistent_problem()
        if problem and not override:  # the default is an optimisation: FlashInfer's grid is always right
            coupling_active("fa3_persistent_schedule")  # says once which optimisation this turns off, and why
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
    """Shorthand for fivar.config.override(schedule=name) ("grid", "persistent" or "grid,persistent")."""
    return config.override(schedule=name)


def tile_text(tiles: dict[str, tuple[tuple[int, int], ...]]) -> str:
    """The canonical text of cta_tiles' result, what a module records (and cta_tiles reads back as it is)."""
    if not tiles:
        return FLASHINFER_TILES
    a, b = ("|".join("x".join(map(str, t)) for t in tiles[m]) for m in (MASK_NONE, MASK_CAUSAL))
    return a if a == b else f"{a},{b}"


#: FlashInfer's own single-prefill tiles: head dim -> ((CTA_Q, CTA_KV) non-causal, (CTA_Q, CTA_KV) causal), checked
#: against the installed getCTATileSize by fivar.flashinfer_compat.
FLASHINFER_SINGLE_PREFILL_TILES = fa3_launchers.SINGLE_PREFILL_TILES


def non_causal_tile(tile: str | None, head_dim: int, qo_len: int) -> tuple[int, int]:
    """(CTA_Q, CTA_KV) that a launch of `qo_len` query rows runs on a single-prefill module's non-causal kernel, from
    the `cta_tile` it records: fivar's tile (of a choice, the one cta_tile_inst.cu.jinja picks), or FlashInfer's
    (FLASHINFER_SINGLE_PREFILL_TILES) for 'flashinfer'."""
    if tile and tile != FLASHINFER_TILES:
        choice = [tuple(int(n) for n in t.lower().split("x")) for t in tile.split(",")[0].split("|")]
        return choice[0] if qo_len >= LONG_QO_LEN else choice[-1]
    return FLASHINFER_SINGLE_PREFILL_TILES[head_dim][0]


def tile_units(tiles: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """The tiles of one mask mode's choice that compile in a unit of their own: every one after the first. A module's
    cold build on a many-core host lasts as long as its longest unit (ninja runs the units side by side), and a unit
    of two FA3 kernels took 1.5x one of a single kernel; split, each unit holds one kernel, like FlashInfer's own
    per mask mode (docs/compile-time.md). The kernels and the choice between them are the same."""
    return tuple(range(1, len(tiles)))


def single_prefill_kernel_units(stem: str, tiles: dict, chosen_schedules: dict, head_dim: int, **kwargs) -> dict[str, str]:
    """The kernel units of an FA3 single-prefill module on fivar's tiles, per mask mode: `{stem}_mask_{code}.cu`
    (the specialization of SinglePrefillWithKVCacheDispatched, holding its first tile's kernel) and one
    `{stem}_mask_{code}_tile{i}.cu` per tile_units entry. `kwargs`: FlashInfer's config template arguments."""
    units = {}
    for mode, mode_tiles in tiles.items():
        code, own = MASK_CODES[mode], tile_units(mode_tiles)
        common = dict(head_dim=head_dim, mask_mode=mode, mask_code=code, causal=str(mode == MASK_CAUSAL).lower(),
                      persistent=chosen_schedules[mode] == "persistent", **kwargs)
        units[f"{stem}_mask_{code}.cu"] = render("fa3/cta_tile_inst.cu.jinja", tiles=mode_tiles, own_units=own,
                                                 long_qo_len=LONG_QO_LEN, **common)
        for i in own:
            units[f"{stem}_mask_{code}_tile{i}.cu"] = render("fa3/cta_tile_unit.cu.jinja", index=i,
                                                             tile=mode_tiles[i], **common)
    return units


def mask_modes(variant) -> list[str]:
    return [MASK_NONE, MASK_CAUSAL]


def runtime_mask_code(variant, causal: bool) -> int:
    return 1 if causal or kernel_causal(variant) else 0


def kernel_causal(variant) -> bool:
    """The kernel's causal mode computes part of the mask whatever the call's causal flag: a causal window."""
    return runs_as_window(variant) and variant.kv_band.causal_window


def _tile_list_decl(variant, exp2_emulated_of_8, logits_range) -> VariantDecl:
    """The tile-list form's struct (fivar.codegen.tile_list.struct_parts), rendered from a bits_kernel: the updater
    applies the cut tiles' bits once a KV tile (csrc/fivar_tile_mask.cuh); no mask is evaluated."""
    emit, members, lines, keep_cut = tile_list_struct_parts(variant, lambda n: f"params.additional_params.{n}",
                                                            per_tile=True)
    scale = softmax_scale_log2(variant, emit)
    source = _struct_source(variant, emit, variant.lowered, members, scale, lines, exp2_emulated_of_8, logits_range,
                            tile_list=True, window=False, keep_cut=keep_cut)
    return VariantDecl(source, variant.lowered, additional_params(variant, with_causal_flag=False,
                                                                  extra_tensors=tile_list_tables()))


def variant_decl(variant, exp2_emulated_of_8: int | None = None, logits_range: tuple[float, float] | None = None,
                 tile_list: bool = False) -> VariantDecl:
    """`logits_range`: the softmax takes its max from it (softmax_range). `tile_list`: the tile-list form
    (fivar.runtime.fa3_tile_list) of a bits_kernel (fivar.codegen.tile_list): batch prefill of a mask that is more
    than a band, or of an engine's custom mask."""
    if tile_list:
        return _tile_list_decl(variant, exp2_emulated_of_8, logits_range)
    param_ref = lambda n: f"params.additional_params.{n}"  # noqa: E731
    emit = CppEmitter(variant, param_ref, index_init={"batch": "fv_batch_idx"})
    lowered = variant.lowered
    as_window = runs_as_window(variant)
    if as_window:
        lowered = dataclasses.replace(lowered, mask=None)
    extra = [lowered.output_scale] if lowered.output_scale is not None else []
    sink = variant.ir.sink
    members = emit.members(lowered, extra + (list(sink.exprs()) if sink is not None else []))
    # FA3 reads the request's lengths from the block coordinate; q_offset needs them in scope
    for m in members:
        if m.name == "fv_q_offset":
            m.init = "int32_t(kv_len) - int32_t(qo_len)"
    if any("fv_batch" in line for line in emit.prologue(lowered.logits, lowered.mask, sink)):
        members.insert(0, Member("int32_t", "fv_batch_idx", "int32_t(batch_idx)"))
    scale = softmax_scale_log2(variant, emit)
    lines = emit.prologue(lowered.logits, lowered.mask)
    if lowered.mask:
        mask_lines, keep = emit.statements(lowered.mask)
        lines += ["bool fv_keep;", "{"] + ["  " + ln for ln in mask_lines] + [f"  fv_keep = {keep};", "}"]
    source = _struct_source(variant, emit, lowered, members, scale, lines, exp2_emulated_of_8, logits_range,
                            tile_list=False, window=as_window)
    return VariantDecl(source, lowered, additional_params(variant, with_causal_flag=False))


def _struct_source(variant, emit, lowered, members, scale, lines, exp2_emulated_of_8, logits_range, *, tile_list,
                   window, keep_cut: str | None = None) -> str:
    """The struct's text: `lines` (the mask's, setting fv_keep where there is one), then the logits transform.
    `keep_cut`: the body of fv_cut_word(qo_idx, word), where the updater applies the mask instead."""
    logit_lines, value = emit.statements(lowered.logits)
    if lowered.mask and keep_cut is None:
        value = f"fv_keep ? {value} : {'-INFINITY' if variant.softmax else '0.f'}"
    sink = variant.ir.sink
    return render("fa3/variant.cuh.jinja", name=variant.name, struct_name=struct_name(variant),
                  source=source_label(variant), softmax=variant.softmax,
                  members=members, sm_scale_log2=scale, body="\n    ".join(lines + logit_lines + [f"return {value};"]),
                  tile_list=tile_list, window=window, keep_cut=keep_cut, exp2_emulated_of_8=exp2_split_for(variant, exp2_emulated_of_8),
                  logits_range=logits_range and tuple(repr(float(x)) for x in logits_range),
                  # FA3 has no output hook: the sink joins in the updater's finalize (csrc/fivar_sink.cuh); a
                  # CTA serves one query head of one request, so it is read once, in the constructor
                  sink_body="\n    ".join(emit.sink_lines(sink)) if sink is not None else None)


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """An FA3 module's kernel config as chosen (`config`, what its manifest records), with what rendering needs."""
    config: config.FA3KernelConfig
    tiles: dict  # cta_tiles' result
    schedules: dict  # schedules' result
    logits_range: tuple[float, float] | None  # softmax_range's result

    @property
    def exp2_emulated_of_8(self) -> int:
        return self.config.exp2_emulated_of_8


def kernel_config(variant, op: str, head_dim: int, dtype: str,
                  requested: config.FA3KernelConfig | None = None, mask_per_score: bool = True) -> KernelChoice:
    """The heuristic: every field `requested` leaves None is fivar.config's override or environment setting, else the
    choice for this variant (its MUFU cost, window and bound), op and head dim (exp2_emulated_of_8, default_cta_tile,
    default_schedule, softmax_range's defaults). `mask_per_score` False: the module evaluates no mask per score (the
    tile-list form reading bits), so the mask's MUFU ops do not count."""
    requested = requested or config.FA3KernelConfig()
    tiles = cta_tiles(variant, op, head_dim, requested.cta_tile)
    chosen = schedules(variant, op, requested.schedule, head_dim)
    logits_range = softmax_range(variant, dtype, requested.bounded_softmax)
    resolved = config.FA3KernelConfig(exp2_emulated_of_8=exp2_split_for(variant, requested.exp2_emulated_of_8,
                                                                        mask_per_score),
                                      cta_tile=tile_text(tiles), schedule=schedule_text(chosen),
                                      bounded_softmax=logits_range is not None,
                                      nvcc_parallel_passes=requested.nvcc_parallel_passes)
    return KernelChoice(resolved, tiles, chosen, logits_range)
