"""Why fivar runs a variant the way it does: the lines `fivar show --explain` prints, rendered from the same config
objects (fivar.config, fivar.codegen.fa3.kernel_config) that generate its modules and fill their manifests."""
from __future__ import annotations

from . import config


def _fa3_single_prefill(v):
    """FA3 single prefill's kernel config at hd128, bf16 (what --explain describes), chosen as gen_module chooses it."""
    from .codegen import fa3
    return fa3.kernel_config(v, "single_prefill", 128, "bf16")


def lines(v, arch: str | None, where: str) -> list[str]:
    """Every line after the per-op target choice: what each path skips of the mask, FA2 KV tiles, FA3 softmax, tile, schedule and
    wave split, and how the Triton twin reads each tensor."""
    from .codegen.triton import TritonEmitter
    from .runtime.explain import mask_skipping
    out = [*mask_skipping(v), fa2_kv_tiles(arch, where), fa3_softmax(v), fa3_tile(v), fa3_schedule(v),
           fa3_wave_split(v)]
    return out + [f"triton reads {read}: {how}" for read, how in TritonEmitter(v).read_plan()]


def short(v, arch: str | None, where: str) -> list[str]:
    """The short answer after the per-op targets: the mask and each path in a line, then FA3's tile, schedule and
    softmax and FA2's KV tiles in two, read off the same choices as `lines`."""
    from .codegen import fa3
    from .runtime.explain import short_paths
    tile = _fa3_tile_choice(v)
    if tile is None:
        fa3_line = "fa3 single prefill: FlashInfer's tile and schedule (it runs as batch prefill in the tile-list form)"
    else:
        schedules = _fa3_schedule_choice(v)[0]
        fa3_line = (f"fa3 single prefill at hd128: tile {tile[0]}; schedule {schedules[fa3.MASK_NONE]} non-causal, "
                    f"{schedules[fa3.MASK_CAUSAL]} causal")
    wave = {"split": "last wave: key chunks where it pays", "persistent": "last wave unsplit",
            "never": "last wave unsplit"}[_wave_split_form(v)]
    kv = _fa2_kv_tiles_choice(arch, where)
    kv_line = ("fa2 prefill KV tiles: depend on the target archs (give --arch)" if kv is None else
               f"fa2 prefill KV tiles: fixed at compile time for {kv[0][0]} bytes of shared memory per SM ({kv[2]})"
               if kv[0] else f"fa2 prefill KV tiles: chosen at run time by FlashInfer ({kv[2]}: {kv[1]})")
    return [*short_paths(v), f"{fa3_line}; softmax: {_fa3_softmax_short(v)}; {wave}", kv_line]


def _fa3_softmax_short(v) -> str:
    from .codegen import fa3
    if not v.softmax:
        return "none"
    k = _fa3_single_prefill(v).exp2_emulated_of_8
    rng = fa3.softmax_range(v, "bf16", True)
    exp2 = f"{k} of 8 exp2 on FMA" if k else "exp2 on MUFU"
    return exp2 + (", running max" if rng is None else
                   ", max from the bound" if _fa3_single_prefill(v).logits_range else ", running max (bound unused)")


def fa3_softmax(v) -> str:
    from .codegen import fa3
    if not v.softmax:
        return "fa3 softmax: none (the variant's weights are used as they are)"
    mufu, k = fa3.mufu_ops_per_score(v), _fa3_single_prefill(v).exp2_emulated_of_8
    cost = f"the logits transform costs {mufu} MUFU op(s) per score"
    rng = fa3.softmax_range(v, "bf16", True)
    bounded = ("; the transform is unbounded, so the max is a running one" if rng is None else
               f"; the transform stays in [{rng[0]:g}, {rng[1]:g}], and unless {fa3.BOUNDED_SOFTMAX_ENV}=0 (bf16) the "
               f"softmax takes its max from the bound where the range times the softmax scale spans at most "
               f"{fa3.BOUNDED_SOFTMAX_SPAN:g} powers of two, {'on' if _fa3_single_prefill(v).logits_range else 'off'} here")
    if not k:
        return f"fa3 softmax: FlashInfer's OnlineSoftmax, every exp2 on the MUFU pipe ({cost}{bounded})"
    unmasked = ""
    if fa3.uses_tile_list(v, "batch_prefill") and not fa3.exp2_emulated_of_8(v, mask=False):
        unmasked = ("; prefill in the tile-list form reads the mask's bits, evaluates no mask per score and keeps "
                    "FlashInfer's OnlineSoftmax")
    return (f"fa3 softmax: {k} of every 8 score columns compute exp2 on the FMA pipe ({cost}{unmasked}; "
            f"{fa3.EXP2_EMULATION_ENV}=0..8 overrides{bounded})")


def _fa3_tile_choice(v) -> tuple[str, str] | None:
    """(FA3 single prefill's CTA tiles at hd128, why), or None where it runs as batch prefill in the tile-list form."""
    from .codegen import fa3
    from .jit.build import serving_op
    if serving_op(v, "single_prefill", "fa3") != "single_prefill":
        return None
    tiles = _fa3_single_prefill(v).config.cta_tile
    forced, where = config.setting("cta_tile")
    if forced:
        why = where
    elif tiles in (fa3.MUFU_BOUND_TILE, fa3.MUFU_BOUND_WINDOW_TILE):
        why = (f"the transform costs MUFU ops: smaller score tiles measured faster; non-causal, 192x64 from "
               f"{fa3.LONG_QO_LEN} query rows (three warpgroups, more work per clock at the power limit), 128x128 "
               "below" + ("; causal, 192x64 (three warpgroups share each K/V tile of the window)"
                          if tiles == fa3.MUFU_BOUND_WINDOW_TILE else ""))
    elif tiles != fa3.FLASHINFER_TILES:
        why = "the transform costs MUFU ops: a smaller score tile measured faster"
    elif fa3.default_cta_tile(v, "single_prefill", 128) != fa3.FLASHINFER_TILES:
        why = f"FlashInfer's: {fa3.flashinfer_dispatch_problem()}"
    else:
        why = "FlashInfer's choice"
    if tiles == fa3.FLASHINFER_TILES:
        tiles = "{}x{} non-causal, {}x{} causal".format(*sum(fa3.FLASHINFER_SINGLE_PREFILL_TILES[128], ()))
    return tiles, why


def fa3_tile(v) -> str:
    from .codegen import fa3
    choice = _fa3_tile_choice(v)
    if choice is None:
        return ("fa3 single prefill CTA tile: FlashInfer's (it runs as batch prefill in the tile-list form, whose "
                f"tiles fivar does not change; {fa3.CTA_TILE_ENV} does not apply)")
    tiles, why = choice
    return (f"fa3 single prefill CTA tile at hd128: {tiles} ({why}; {fa3.CTA_TILE_ENV}=QxKV[|QxKV][,QxKV[|QxKV]] "
            "or flashinfer overrides)")


def _fa3_schedule_choice(v) -> tuple[dict, str] | None:
    """(FA3 single prefill's schedule per mask mode at hd128, why), or None in the tile-list form."""
    from .codegen import fa3
    from .jit.build import serving_op
    if serving_op(v, "single_prefill", "fa3") != "single_prefill":
        return None
    chosen = _fa3_single_prefill(v).schedules
    forced, where = config.setting("schedule")
    if forced:
        why = where
    elif "persistent" in chosen.values():
        why = ("a window makes every causal query tile about as long as the next: one CTA per SM walking them "
               "measured faster")
    elif fa3.default_schedule(v, "single_prefill", 128) != "grid":
        why = f"FlashInfer's grid: {fa3.flashinfer_dispatch_problem() or fa3.flashinfer_launcher_problem()}"
    else:
        why = "FlashInfer's grid; a static persistent schedule measured slower where tile costs differ"
    return chosen, why


def fa3_schedule(v) -> str:
    from .codegen import fa3
    choice = _fa3_schedule_choice(v)
    if choice is None:
        return ("fa3 single prefill schedule: FlashInfer's (it runs as batch prefill in the tile-list form, on "
                f"FlashInfer's planned schedule; {fa3.SCHEDULE_ENV} does not apply)")
    chosen, why = choice
    return (f"fa3 single prefill schedule at hd128: {chosen[fa3.MASK_NONE]} non-causal, {chosen[fa3.MASK_CAUSAL]} "
            f"causal ({why}; {fa3.SCHEDULE_ENV}=grid|persistent[,grid|persistent] overrides)")


def _wave_split_form(v) -> str:
    """Whether FA3 single prefill's last wave may split: "split", "persistent" (not: the kernel holds every SM) or
    "never" (not: the variant cannot run as key chunks)."""
    from .codegen import fa3
    from .runtime import wave_split
    if not wave_split.applies(v, causal=False, window_left=-1):
        return "never"
    return "split" if _fa3_single_prefill(v).schedules[fa3.MASK_NONE] == "grid" else "persistent"


def fa3_wave_split(v) -> str:
    from .runtime import wave_split
    form = _wave_split_form(v)
    if form == "persistent":
        return ("fa3 single prefill last wave: never split (the non-causal kernel is persistent: it holds every SM "
                "to its end, so the tail's launches could only start after it)")
    if form == "never":
        return ("fa3 single prefill last wave: never split (only softmax variants whose logits read nothing but the "
                "score and scalar params, with no mask, non-causal, can run as key chunks merged through their LSE)")
    return ("fa3 single prefill last wave, non-causal: the last heads run as key chunks merged through their LSE "
            "where a simulated schedule says it saves at least "
            f"{wave_split.MIN_GAIN:.1%} (with 32 heads on 132 SMs, S=8192 on the 192x64 tile does; "
            f"{wave_split.ENV}=0 turns it off)")


def _fa2_kv_tiles_choice(arch: str | None, where: str):
    """(pinned_kv_tiles.decide's (smem, why), what the archs are) for these archs, else the visible GPU's; None
    with neither."""
    from .jit import pinned_kv_tiles
    if arch:
        archs = {(int(a.split(".")[0]), a.split(".")[1]) for a in arch.split()}
        built = f"{where} {arch}"
    else:
        import torch
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        archs, built = {(major, str(minor))}, f"this GPU, sm{major}{minor}"
    return (*pinned_kv_tiles.decide(archs), built)


def fa2_kv_tiles(arch: str | None, where: str) -> str:
    """How FA2 prefill modules built for these archs (else the visible GPU's) choose their KV tile."""
    from .jit import pinned_kv_tiles
    choice = _fa2_kv_tiles_choice(arch, where)
    if choice is None:
        return "fa2 prefill KV tiles: depend on the target archs (give --arch)"
    smem, why, built = choice
    if smem:
        return (f"fa2 prefill KV tiles: fixed at compile time for {smem[0]} bytes of shared memory per SM ({built}): one "
                f"kernel per CTA tile instead of one per NUM_MMA_KV ({pinned_kv_tiles.ENV}=0 keeps FlashInfer's "
                "run-time choice)")
    return f"fa2 prefill KV tiles: chosen at run time by FlashInfer ({built}: {why})"
