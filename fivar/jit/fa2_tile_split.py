"""FA2 prefill compiled one kernel unit per CTA tile (`split_cta_tiles`): the same kernels as FlashInfer's unit per
mask mode, cut so that ninja runs them side by side, from the installed FlashInfer's own launcher text and
instantiations (fivar.flashinfer_compat.fa2_launchers)."""
from __future__ import annotations

import logging
import re
import time

from ..codegen import fa2
from ..flashinfer_compat import fa2_launchers
from ..flashinfer_compat.templates import release_kwargs, render_template
from ..flashinfer_layout import FA2_LAYOUT
from . import toolchain

log = logging.getLogger("fivar")

#: The header the host unit of each FA2 prefill op's split includes (see _fa2_tile_split).
_SPLIT_HOST_INCLUDES = {"single_prefill": ("fivar_single_prefill_dispatch.cuh",), "batch_prefill": ()}
_split_warned: set[str] = set()


def _fa2_reachable_tiles(head_dim_qk: int, head_dim_vo: int) -> list[int]:
    """The CTA_TILE_Q values FlashInfer's FA2DetermineCtaTileQ can return for these head dims (FlashInfer
    0.7.2, include/flashinfer/utils.cuh:411-470: 128 only for head_dim_vo < 256). This only groups tiles
    into units: which tiles get instantiated stays FlashInfer's choice, and a tile it never picks (no valid
    kernel there: KernelTraits::IsInvalid) shares a unit instead of costing a compiler run of its own."""
    if head_dim_vo >= 512:
        return [32, 16]
    if head_dim_qk >= 512:
        return [16]
    return ([128] if head_dim_vo < 256 else []) + [64, 16]


def _tile_groups(tiles: list[int], head_dim_qk: int, head_dim_vo: int) -> list[list[int]]:
    """One kernel unit per tile FlashInfer can pick, largest first; the others join the last unit."""
    tiles = sorted(set(tiles), reverse=True)
    reachable = _fa2_reachable_tiles(head_dim_qk, head_dim_vo)
    groups = [[t] for t in tiles if t in reachable] or [[]]
    groups[-1] += [t for t in tiles if t not in reachable]
    return groups


#: fivar's cut of FlashInfer's launchers is checked against the installed FlashInfer in fivar.flashinfer_compat.
_dispatch_cta_tiles = fa2_launchers.dispatch_cta_tiles
_single_prefill_split_problem = fa2_launchers.single_prefill_split_problem
_inst_statements = fa2_launchers.inst_statements


def _fa2_tile_split(op: str, variant, kwargs: dict, modes: list[str]):
    """FA2 prefill kernel units, one per (mask mode, CTA_TILE_Q), or None to keep FlashInfer's layout.

    FlashInfer's FA2 prefill kernel units hold every CTA tile (and, below each, every NUM_MMA_KV) of one mask
    mode, so the longest unit bounds a cold build however many cores there are. Here each tile that
    FA2DetermineCtaTileQ can pick gets a unit of its own; the kernels, their launch configuration and the
    tile choice at run time are FlashInfer's:
      - single_prefill: FlashInfer's SinglePrefillWithKVCacheDispatched picks the tile at run time inside one
        function; the installed text is cut at that switch (fivar.flashinfer_compat.fa2_launchers.
        single_prefill_cut: the per-tile function, and the preamble and switch compiled into the host unit),
        each unit instantiating the tile function with FlashInfer's own instantiation's arguments. Used where
        the function has that form (_single_prefill_split_problem).
      - batch_prefill: CTA_TILE_Q is already a template parameter, picked by FlashInfer's host code; the
        units hold FlashInfer's own explicit instantiations, paged and ragged, grouped by tile (checked
        statement for statement against FlashInfer's rendered *_kernel_inst.jinja).
    The split-KV merge (MergeStates & co.) is instantiated in one unit per module, extern in the others.

    Returns (kernel units, headers, host-unit includes).
    """
    if op not in ("single_prefill", "batch_prefill"):
        return None
    from flashinfer.jit.utils import mask_mode_literal
    problem = (_single_prefill_split_problem() if op == "single_prefill" else
               fa2_launchers.batch_prefill_split_problem())
    flashinfer_units: dict[int, str] = {}
    release_args: dict = {}  # what the installed release's instantiations take beyond fivar's kwargs (0.7.4's SF flag)
    for inst_t in FA2_LAYOUT[op][1]:
        release_args.update({k: v for k, v in release_kwargs(inst_t, kwargs).items() if k not in kwargs})
    if problem is None:
        for mode in modes:
            code = fa2.MASK_CODES[mode]
            flashinfer_units[code] = "".join(
                render_template(inst_t, mask_mode=mask_mode_literal[code], **kwargs)
                for inst_t in FA2_LAYOUT[op][1])
    if op == "single_prefill":
        tiles = list(_dispatch_cta_tiles())
    else:
        tiles = [int(c) for c in re.findall(r"/\*CTA_TILE_Q=\*/(\d+)", "".join(flashinfer_units.values()))]
        if not tiles and problem is None:
            problem = "FlashInfer's batch prefill instantiations name no CTA_TILE_Q"
    units: dict[str, str] = {}
    if problem is None:
        groups = _tile_groups(tiles, kwargs["head_dim_qk"], kwargs["head_dim_vo"])
        for i, mode in enumerate(modes):
            code = fa2.MASK_CODES[mode]
            texts = []
            for j, group in enumerate(groups):
                # single prefill: FlashInfer's own instantiations, of the per-tile function (any release's arguments)
                statements = [st for t in group for st in fa2_launchers.single_prefill_tile_statements(
                    flashinfer_units[code], t)] if op == "single_prefill" else []
                if op == "single_prefill" and len(statements) != len(group):
                    problem = "FlashInfer's single prefill unit does not instantiate its launcher once"
                    break
                text = fa2.render(f"fa2/{op}_tile_inst.jinja", op=op, mask_mode=mask_mode_literal[code],
                                  tiles=group, merge_here=i == 0 and j == 0, softmax=variant.softmax,
                                  instantiations=statements, **kwargs, **release_args)
                suffix = "" if j == 0 and op == "single_prefill" else "_cta" + "_".join(map(str, group))
                units[f"{op}_kernel_mask_{code}{suffix}.cu"] = text
                texts.append(text)
            if problem is not None:
                break
            if op == "batch_prefill" and _inst_statements("".join(texts)) != _inst_statements(
                    flashinfer_units[code]):
                problem = "fivar's batch prefill units do not instantiate what FlashInfer's do"
                break
    if problem is not None:
        if problem not in _split_warned:
            _split_warned.add(problem)
            log.warning("fivar: FlashInfer %s: %s; compiling its %s kernels unsplit (one unit per mask mode; "
                        "`fivar doctor` lists every coupling)", toolchain.flashinfer_version(), problem, op)
        return None
    headers = fa2_launchers.single_prefill_cut() if op == "single_prefill" else {}
    return units, headers, _SPLIT_HOST_INCLUDES[op]
