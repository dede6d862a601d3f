"""FA2 prefill kernel units that compile one KV tile per CTA tile instead of four (csrc/fivar_pinned_kv_tiles.cuh).

FlashInfer's FA2 prefill launchers choose NUM_MMA_KV from the device's shared memory at run time, so its units
compile a kernel for each of 1, 2, 4 and 8 under every CTA tile. Shared memory is fixed by the arch, so for a
build whose archs all have the same amount (a single-arch build: FLASHINFER_CUDA_ARCH_LIST=9.0a) the choice is
known at compile time; fivar makes it there and compiles only the kernel the GPU will run. Single prefill then
compiles 3 prefill kernels per mask mode instead of 11 (hd128, bf16, sm_90).

The build's shared memory goes into the unit's text (so into the URI); FA2BuildConfig.pin_kv_tiles=False
(FIVAR_PIN_KV_TILES=0) keeps FlashInfer's run-time dispatch. A build for archs of different shared memory, or for an arch not in SMEM_BY_ARCH, keeps it too.
"""
from __future__ import annotations

import logging
import re

from .. import config
from ..flashinfer_compat import fa2_launchers, problem as coupling_problem
from ..paths import csrc_dir

log = logging.getLogger("fivar")

ENV = config.ENV["pin_kv_tiles"]
HEADER = "fivar_pinned_kv_tiles.cuh"

#: (major, minor) -> (shared memory per SM, per block with opt-in), in bytes: cudaDevAttrMaxSharedMemoryPerMultiprocessor
#: and cudaDevAttrMaxSharedMemoryPerBlockOptin, the same on every GPU of that compute capability (CUDA C++
#: Programming Guide, "Technical Specifications per Compute Capability": 164/163 KB on 8.0, 100/99 KB on 8.6
#: and 8.9, 228/227 KB on 9.0). An arch not listed keeps FlashInfer's run-time choice.
SMEM_BY_ARCH: dict[tuple[int, int], tuple[int, int]] = {
    (8, 0): (167936, 166912),
    (8, 6): (102400, 101376),
    (8, 9): (102400, 101376),
    (9, 0): (233472, 232448),
}

_warned: set[str] = set()
#: The check that FlashInfer's launchers still take the steps the pinned dispatch repeats (fivar.flashinfer_compat).
flashinfer_problem = fa2_launchers.pinned_kv_tiles_problem_in
_installed_problem = fa2_launchers.pinned_kv_tiles_problem


def decide(archs, on: bool | None = None) -> tuple[tuple[int, int] | None, str]:
    """(shared memory per SM and per block that FA2 prefill units of a build for `archs` pin their KV tiles to, or
    None to keep FlashInfer's run-time choice; why). `archs`: FlashInfer's TARGET_CUDA_ARCHS, (major, "0a") pairs.
    `on=None`: fivar.config's setting (FIVAR_PIN_KV_TILES; unset or 1: on)."""
    if not config.switch("pin_kv_tiles", on, "pin_kv_tiles"):
        return None, config.switched_off_by("pin_kv_tiles") if on is None else "pin_kv_tiles=False"
    smem = {SMEM_BY_ARCH.get((int(major), int(re.match(r"\d+", str(minor)).group()))) for major, minor in archs}
    if None in smem:
        return None, "an arch whose shared memory fivar does not know"
    if len(smem) != 1:
        return None, "archs of different shared memory"
    problem = fa2_launchers.pinned_kv_tiles_problem()
    if problem:
        return None, problem
    return smem.pop(), "every target arch has the same shared memory"


def pinned_smem(archs, on: bool | None = None) -> tuple[int, int] | None:
    """decide()'s shared memory; says once in the log when FlashInfer's launchers do not fit the pinned dispatch."""
    smem, why = decide(archs, on)
    if smem is None and why == fa2_launchers.pinned_kv_tiles_problem():
        coupling_problem("fa2_pinned_kv_tiles")
    return smem


def unit_prefix(smem: tuple[int, int]) -> str:
    """What a kernel unit starts with to compile pinned KV tiles: before any FlashInfer header."""
    per_sm, per_block = smem
    token_head_sf = fa2_launchers.pinned_launcher_form() == "token_head_sf"  # 0.7.4's launcher steps
    return (f"// fivar: KV tiles pinned to {per_sm} bytes of shared memory per SM ({HEADER})\n"
            f"#define FIVAR_PINNED_SMEM_PER_SM {per_sm}\n"
            f"#define FIVAR_PINNED_SMEM_PER_BLOCK_OPTIN {per_block}\n"
            + ("#define FIVAR_PINNED_TOKEN_HEAD_SF 1\n" if token_head_sf else "")
            + f'#include "{HEADER}"\n')


def header_text() -> str:
    return (csrc_dir() / HEADER).read_text()
