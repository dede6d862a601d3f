"""A Hopper (FA3) module's sources: FlashInfer's sm90 templates around fivar's variant struct, its kernels on
fivar's CTA tiles and schedules where the variant's config picks them (fivar.codegen.fa3), or the tile-list form's
one paged kernel (fivar.runtime.fa3_tile_list)."""
from __future__ import annotations

from ..codegen import fa2, fa3
from ..config import FA3KernelConfig
from ..flashinfer_compat.templates import render_template as _render_flashinfer
from ..flashinfer_layout import FA3_LAYOUT
from . import toolchain
from .module_key import ModuleKey
from .sources import (Rendered, add_host_sources, dispatch_override, fivar_headers, flashinfer_kwargs,
                      mask_mode_units)

#: The mask-free module's paged entry-point stubs: a header its host unit includes (fa3/paged_stubs.inc.jinja)
PAGED_STUBS = "fivar_fa3_paged_stubs.inc"


def fa3_sources(user_variant, variant, key: ModuleKey, given: FA3KernelConfig, nvcc_parallel_passes: bool,
                shared: bool) -> Rendered:
    """`variant`'s (the struct's: `user_variant` or the shared bits_kernel, `shared`) FA3 module of form `key`;
    `given`: the asked config, resolved here by fa3.kernel_config (tiles, schedules, exp2 split, softmax range)."""
    from flashinfer.jit.core import sm90a_nvcc_flags
    from flashinfer.jit.utils import mask_mode_literal

    op, head_dim = key.op, key.head_dim
    # the tile-list form evaluates no mask per score: its MUFU ops do not count (the user's variant: its errors
    # name it; the choice depends on the logits alone, so the shared module's sources stay the same)
    kernel = fa3.kernel_config(user_variant, op, head_dim, key.dtype, given, mask_per_score=not shared)
    tiles, schedules = kernel.tiles, kernel.schedules
    if "persistent" in schedules.values() and not tiles:  # FlashInfer's tiles, through fivar's launcher
        tiles = {mode: (tile,) for mode, tile in zip((fa2.MASK_NONE, fa2.MASK_CAUSAL),
                                                      fa3.FLASHINFER_SINGLE_PREFILL_TILES[head_dim])}
    decl = fa3.variant_decl(variant, exp2_emulated_of_8=kernel.exp2_emulated_of_8, logits_range=kernel.logits_range,
                            tile_list=key.tile_list)
    kwargs = flashinfer_kwargs(variant, key, decl)
    config_t, inst_ts, host_files, config_name = FA3_LAYOUT[op]
    config = _render_flashinfer(config_t, **kwargs)
    if tiles:
        config += fa3.render("fa3/cta_tile_decl.inc.jinja", head_dim=head_dim, mask_modes=list(tiles), **kwargs)
    # the tile list runs kNone with its bits; the mask-free module, a causal batch's segments in kCausal
    modes = [fa2.MASK_NONE] if key.tile_list else [fa2.MASK_CAUSAL] if key.mask_free else fa3.mask_modes(variant)
    sources = {config_name: config + dispatch_override(config, variant, modes), **fivar_headers(decl.source)}
    host_includes: list[str] = []
    for inst_t in inst_ts:
        stem = inst_t.removesuffix("_inst.jinja")
        if key.tile_list:  # the per-head paged kernel alone (fa3/tile_list_unit.cu.jinja), stubs for the rest
            if "paged" in inst_t:
                sources[f"{stem}_mask_0.cu"] = fa3.render("fa3/tile_list_unit.cu.jinja", **kwargs)
        elif key.mask_free and "paged" in inst_t:  # it runs ragged requests alone (fivar.runtime.segments): the
            # paged entry points are stubs, defined in the host unit (no nvcc run of their own)
            sources[PAGED_STUBS] = fa3.render("fa3/paged_stubs.inc.jinja", mask_modes=[
                mask_mode_literal[fa2.MASK_CODES[m]] for m in modes], **kwargs)
            host_includes.append(PAGED_STUBS)
        elif tiles:  # FA3 single prefill on fivar's tiles: its units are fivar's (fa3.single_prefill_kernel_units)
            sources.update(fa3.single_prefill_kernel_units(stem, tiles, schedules, head_dim, **kwargs))
        else:
            sources.update(mask_mode_units(inst_t, modes, kwargs))
    if "persistent" in schedules.values():
        sources.update(fivar_headers('#include "fivar_fa3_persistent.cuh"'))
    add_host_sources(sources, host_files, tuple(host_includes))
    cuda_cflags = list(sm90a_nvcc_flags) + toolchain.parallel_passes_flags(nvcc_parallel_passes)
    built = FA3KernelConfig(**{**vars(kernel.config), "nvcc_parallel_passes": nvcc_parallel_passes})
    return Rendered(sources, cuda_cflags, decl.additional, built)
