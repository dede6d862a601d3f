"""An FA2 module's sources: FlashInfer's templates around fivar's variant struct (fivar.codegen.fa2), with the
build-time cuts its config asks for: kernel units per CTA tile (fivar.jit.fa2_tile_split), pinned KV tiles
(fivar.jit.pinned_kv_tiles), headers a module does not use left out (fivar.jit.unused_headers)."""
from __future__ import annotations

import re

from .. import config as fivar_config
from ..codegen import fa2, fa3
from ..config import FA2BuildConfig
from ..errors import FivarError
from ..flashinfer_compat.templates import release_kwargs, render_template as _render_flashinfer
from ..flashinfer_layout import FA2_LAYOUT
from . import pinned_kv_tiles, toolchain, unused_headers
from .fa2_tile_split import _fa2_tile_split
from .module_key import ModuleKey
from .sources import (Rendered, add_host_sources, dispatch_override, fivar_headers, flashinfer_kwargs,
                      mask_mode_units)

#: The tile-list module's ragged entry-point stubs: a header its host unit includes (fa2/tile_list_ragged_stubs.inc)
RAGGED_STUBS = "fivar_fa2_ragged_stubs.inc"


def fa2_sources(variant, key: ModuleKey, given: FA2BuildConfig, nvcc_parallel_passes: bool, cta_tile=None,
                schedule=None) -> Rendered:
    """`variant`'s FA2 module of form `key`; `given`: the asked build config (fivar.config resolves the rest).
    `cta_tile` and `schedule` are FA3's: refused here unless they ask for FlashInfer's own."""
    from flashinfer.jit.utils import mask_mode_literal

    if cta_tile and cta_tile != fa3.FLASHINFER_TILES:
        raise FivarError(f"variant '{variant.name}': cta_tile={cta_tile!r}: only FA3 single prefill takes a CTA "
                         "tile")
    if schedule not in (None, "grid"):
        raise FivarError(f"variant '{variant.name}': schedule={schedule!r}: only FA3 single prefill takes a "
                         "schedule")
    op, tile_list = key.op, key.tile_list
    build_config = fivar_config.fa2_build_config(given)
    decl = fa2.variant_decl(variant, kv_segments=key.kv_segments, mask_free=key.mask_free,  # fa2.KV_SEGMENTS
                            tile_list=tile_list)
    kwargs = flashinfer_kwargs(variant, key, decl)
    config_t, inst_ts, host_files, config_name = FA2_LAYOUT[op]
    config = _render_flashinfer(config_t, **kwargs)
    modes = ([fa2.MASK_NONE] if tile_list else
             fa2.mask_modes(variant, kv_segments=key.kv_segments, mask_free=key.mask_free))
    sources = {config_name: config + dispatch_override(config, variant, modes), **fivar_headers(decl.source)}
    split = (_fa2_tile_split(op, variant, kwargs, modes) if build_config.split_cta_tiles and not tile_list
             else None)
    host_includes: tuple[str, ...] = ()
    if split is not None:
        units, headers, host_includes = split
        sources.update(units)
        sources.update(headers)
    else:
        for inst_t in inst_ts:
            stem = inst_t.removesuffix("_inst.jinja")
            if tile_list:  # FlashInfer's paged kernels in kNone; the ragged entry point's stubs in the host unit
                code = fa2.MASK_CODES[fa2.MASK_NONE]
                inst = _render_flashinfer(inst_t, mask_mode=mask_mode_literal[code], **kwargs)
                if "paged" in inst_t:
                    sources[f"{stem}_mask_{code}.cu"] = inst
                else:
                    sources[RAGGED_STUBS] = fa2.render(  # with the release's template parameters (0.7.4's SF flag)
                        "fa2/tile_list_ragged_stubs.inc.jinja", **release_kwargs(inst_t, kwargs),
                        tiles=sorted({int(t) for t in re.findall(r"/\*CTA_TILE_Q=\*/(\d+)", inst)}))
                    host_includes += (RAGGED_STUBS,)
            elif op != "batch_decode":  # decode has no mask-mode dispatch
                sources.update(mask_mode_units(inst_t, modes, kwargs))
            else:
                sources[f"{stem}.cu"] = _render_flashinfer(inst_t, **kwargs)
    pinned = (pinned_kv_tiles.pinned_smem(toolchain.target_archs(), build_config.pin_kv_tiles)
              if op in ("single_prefill", "batch_prefill") else None)
    if pinned:
        for name in [n for n in sources if n.endswith(".cu")]:  # the kernel units (the host unit comes next)
            sources[name] = pinned_kv_tiles.unit_prefix(pinned) + sources[name]
        sources[pinned_kv_tiles.HEADER] = pinned_kv_tiles.header_text()
    add_host_sources(sources, host_files, host_includes)
    skipped = unused_headers.skipped(sources, build_config.skip_unused_headers)
    if skipped:
        for name in [n for n in sources if n.endswith(".cu")]:
            sources[name] = unused_headers.prefix(skipped) + sources[name]
        sources.update(unused_headers.stand_in_sources(skipped))
    cuda_cflags = (toolchain.split_compile_flags(build_config.nvcc_split_compile)
                   + toolchain.parallel_passes_flags(nvcc_parallel_passes))
    built = FA2BuildConfig(split_cta_tiles=bool(split), nvcc_split_compile=build_config.nvcc_split_compile,
                           pin_kv_tiles=bool(pinned), skip_unused_headers=tuple(h.name for h in skipped),
                           nvcc_parallel_passes=nvcc_parallel_passes)
    return Rendered(sources, cuda_cflags, decl.additional, built)
