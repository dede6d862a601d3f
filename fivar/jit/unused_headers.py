"""A header FlashInfer's FA2 sources include but never use, left out of fivar's FA2 units.

FlashInfer's permuted_smem.cuh includes libcu++'s <cuda/pipeline>, and through it the memcpy_async and barrier
machinery, yet no FA2 source uses any of it (FlashInfer 0.7.2). Parsing it is about a fifth of an FA2 unit's
front end: 9.3 -> 7.3 s for a single-prefill kernel unit, 6.4 -> 5.4 s for the host unit, on a 2-core host
(benchmarks/results/nvcc_phases_fa2_unit_cpu_session13.txt); the SASS is the same (tests/unit/test_build.py).
fivar defines the header's include guard at the top of each FA2 unit, but only after checking that every libcu++
name (`cuda::...`) the FlashInfer files reachable from the module's sources use is one that comes from elsewhere.
Any other name, in a later FlashInfer, keeps the header. FIVAR_SKIP_UNUSED_HEADERS=0 keeps it always.
"""
from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

log = logging.getLogger("fivar")

ENV = "FIVAR_SKIP_UNUSED_HEADERS"
GUARD = "_CUDA_PIPELINE"  # <cuda/pipeline>'s include guard (libcu++ in FlashInfer's bundled CCCL)
#: libcu++ names FA2 sources may use with <cuda/pipeline> left out: each comes from a header the user includes itself
#: (<cuda/std/limits> in math.cuh and prefill.cuh, <cuda/cmath> in fastdiv.cuh).
PROVIDED_ELSEWHERE = re.compile(r"cuda::std::\w+|cuda::fast_mod_div")
_INCLUDE = re.compile(r'#\s*include\s*[<"]([^>"]+)[>"]')
_CUDA_NAME = re.compile(r"\bcuda::\w+(?:::\w+)*")
_warned: set[str] = set()


def _flashinfer_dirs() -> tuple[Path, Path]:
    from flashinfer.jit import env as jit_env
    return Path(jit_env.FLASHINFER_INCLUDE_DIR), Path(jit_env.FLASHINFER_CSRC_DIR)


def reachable(texts: list[str], include_dir: Path, csrc_dir: Path) -> list[Path]:
    """The FlashInfer files (under include_dir or csrc_dir) that these sources include, directly or not."""
    seen: set[Path] = set()
    todo = [(None, name) for text in texts for name in _INCLUDE.findall(text)]
    while todo:
        parent, name = todo.pop()
        for base in ([parent] if parent else []) + [include_dir, csrc_dir]:
            path = (base / name).resolve()
            if path.is_file():
                if path not in seen:
                    seen.add(path)
                    todo += [(path.parent, n) for n in _INCLUDE.findall(path.read_text(errors="replace"))]
                break
    return sorted(seen)


def problem(texts: list[str], include_dir: Path, csrc_dir: Path) -> str | None:
    """Why <cuda/pipeline> must stay for sources `texts`, or None."""
    for path in reachable(texts, include_dir, csrc_dir):
        code = re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(errors="replace"), flags=re.S)
        used = {n for n in _CUDA_NAME.findall(code) if not PROVIDED_ELSEWHERE.fullmatch(n)}
        if used:
            return f"{path.name} uses {', '.join(sorted(used))}, which <cuda/pipeline> may provide"
    return None


@functools.lru_cache(maxsize=64)
def _problem_for(includes: tuple[str, ...]) -> str | None:
    return problem(["\n".join(f"#include <{n}>" for n in includes)], *_flashinfer_dirs())


def prefix(sources: dict[str, str], on: bool | None = None) -> str:
    """What each FA2 unit of a module with these sources starts with: the guard, or "" to keep the header.
    `on=None`: FIVAR_SKIP_UNUSED_HEADERS (unset or 1: on)."""
    from .toolchain import switch
    if not switch(ENV, on, "skip_unused_headers"):
        return ""
    own = set(sources)
    includes = tuple(sorted({n for text in sources.values() for n in _INCLUDE.findall(text)} - own))
    why = _problem_for(includes)
    if why:
        if why not in _warned:
            _warned.add(why)
            log.warning("fivar: %s; FA2 units keep it", why)
        return ""
    return (f"#define {GUARD}  // fivar: FlashInfer includes <cuda/pipeline> but uses none of it "
            "(fivar/jit/unused_headers.py)\n")
