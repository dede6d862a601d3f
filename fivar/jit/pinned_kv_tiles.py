"""FA2 prefill kernel units that compile one KV tile per CTA tile instead of four (csrc/fivar_pinned_kv_tiles.cuh).

FlashInfer's FA2 prefill launchers choose NUM_MMA_KV from the device's shared memory at run time, so its units
compile a kernel for each of 1, 2, 4 and 8 under every CTA tile. Shared memory is fixed by the arch, so for a
build whose archs all have the same amount (a single-arch build: FLASHINFER_CUDA_ARCH_LIST=9.0a) the choice is
known at compile time; fivar makes it there and compiles only the kernel the GPU will run. Single prefill then
compiles 3 prefill kernels per mask mode instead of 11 (hd128, bf16, sm_90).

The build's shared memory goes into the unit's text (so into the URI); FIVAR_PIN_KV_TILES=0 keeps FlashInfer's
run-time dispatch. A build for archs of different shared memory, or for an arch not in SMEM_BY_ARCH, keeps it too.
"""
from __future__ import annotations

import functools
import logging
import re

from ..paths import csrc_dir, templates_dir

log = logging.getLogger("fivar")

ENV = "FIVAR_PIN_KV_TILES"
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

# The steps of FlashInfer's launchers that fivar_pinned_kv_tiles.cuh repeats with the build's shared memory, and
# the dispatch that takes their result (include/flashinfer/attention/prefill.cuh, FlashInfer 0.7.2), whitespace aside.
_LAUNCHER_STEPS = (
    "const int num_ctas_per_sm = max_smem_per_sm >= 2 * (kFixedSmem + kMinValidMmaKV * kKVSmemPerMmaKV) ? 2 : 1;",
    "const int max_smem_per_threadblock = min(max_smem_per_sm / num_ctas_per_sm, max_smem_per_block_optin);",
    "const int max_num_mma_kv_smem = (max_smem_per_threadblock - static_cast<int>(kFixedSmem)) / "
    "static_cast<int>(kKVSmemPerMmaKV);",
    "DISPATCH_NUM_MMA_KV( min(static_cast<uint32_t>(max_num_mma_kv_smem), max_num_mma_kv_reg), NUM_MMA_KV, {",
)
_DISPATCH_CASES = re.compile(r"#define DISPATCH_NUM_MMA_KV\(max_mma_kv, NUM_MMA_KV, \.\.\.\)((?:[^\n]*\\\n)+)")
_warned: set[str] = set()


def _norm(text: str) -> str:
    return " ".join(text.split())


def flashinfer_problem(prefill: str, utils: str, tile_template: str = "") -> str | None:
    """Why the pinned dispatch does not fit these launcher sources (prefill.cuh, utils.cuh and fivar's copy of the
    single-prefill launcher), or None: every DISPATCH_NUM_MMA_KV must follow FlashInfer 0.7.2's three steps, with
    their locals, and the macro's cases must be 8, 4, 2, 1."""
    m = _DISPATCH_CASES.search(utils)
    if not m or re.findall(r"NUM_MMA_KV = (\d+);", m.group(1)) != ["8", "4", "2", "1"]:
        return "DISPATCH_NUM_MMA_KV in utils.cuh is not the 8/4/2/1 dispatch fivar pins"
    for name, text in (("prefill.cuh", prefill), ("fivar's single-prefill launcher", tile_template)):
        # every launcher: from its num_ctas_per_sm to its DISPATCH_NUM_MMA_KV, the steps in order
        starts = [i.start() for i in re.finditer(r"DISPATCH_NUM_MMA_KV\(", text)]
        if name == "prefill.cuh" and not starts:
            return "prefill.cuh has no DISPATCH_NUM_MMA_KV"
        for start in starts:
            launcher = _norm(text[max(0, start - 4000):start + 200])
            at = 0
            for step in _LAUNCHER_STEPS:
                at = launcher.find(_norm(step), at)
                if at < 0:
                    return f"a DISPATCH_NUM_MMA_KV in {name} does not follow '{step}'"
    return None


@functools.lru_cache(maxsize=None)
def _installed_problem() -> str | None:
    from flashinfer.jit import env as jit_env

    include = jit_env.FLASHINFER_INCLUDE_DIR / "flashinfer"
    return flashinfer_problem((include / "attention" / "prefill.cuh").read_text(), (include / "utils.cuh").read_text(),
                              (templates_dir() / "fa2" / "single_prefill_tile.cuh").read_text())


def decide(archs, on: bool | None = None) -> tuple[tuple[int, int] | None, str]:
    """(shared memory per SM and per block that FA2 prefill units of a build for `archs` pin their KV tiles to, or
    None to keep FlashInfer's run-time choice; why). `archs`: FlashInfer's TARGET_CUDA_ARCHS, (major, "0a") pairs.
    `on=None`: FIVAR_PIN_KV_TILES (unset or 1: on)."""
    from .toolchain import switch
    if not switch(ENV, on, "pin_kv_tiles"):
        return None, f"{ENV}=0" if on is None else "pin_kv_tiles=False"
    smem = {SMEM_BY_ARCH.get((int(major), int(re.match(r"\d+", str(minor)).group()))) for major, minor in archs}
    if None in smem:
        return None, "an arch whose shared memory fivar does not know"
    if len(smem) != 1:
        return None, "archs of different shared memory"
    problem = _installed_problem()
    if problem:
        return None, problem
    return smem.pop(), "every target arch has the same shared memory"


def pinned_smem(archs, on: bool | None = None) -> tuple[int, int] | None:
    """decide()'s shared memory; says once in the log when FlashInfer's launchers do not fit the pinned dispatch."""
    smem, why = decide(archs, on)
    if smem is None and why == _installed_problem() and why not in _warned:
        _warned.add(why)
        log.warning("fivar: %s; FA2 prefill keeps FlashInfer's run-time KV tile choice", why)
    return smem


def unit_prefix(smem: tuple[int, int]) -> str:
    """What a kernel unit starts with to compile pinned KV tiles: before any FlashInfer header."""
    per_sm, per_block = smem
    return (f"// fivar: KV tiles pinned to {per_sm} bytes of shared memory per SM ({HEADER})\n"
            f"#define FIVAR_PINNED_SMEM_PER_SM {per_sm}\n"
            f"#define FIVAR_PINNED_SMEM_PER_BLOCK_OPTIN {per_block}\n"
            f'#include "{HEADER}"\n')


def header_text() -> str:
    return (csrc_dir() / HEADER).read_text()
