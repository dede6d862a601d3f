"""FA2 units leave out <cuda/pipeline> and stand in for <cooperative_groups.h> (fivar.jit.unused_headers) only
after checking every FlashInfer file the module's sources reach: libcu++ names (`cuda::...`) must all come from
headers that stay, cooperative groups may only be used as `auto b = cg::this_thread_block(); ... b.sync();`, and the
header the compiler would find must have the include guard fivar defines."""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ._base import Coupling, csrc_dir as flashinfer_csrc_dir, include_dir, safe

#: libcu++ names FA2 sources may use with the headers below left out: each comes from a header that stays
#: (<cuda/std/limits> in math.cuh and prefill.cuh, <cuda/cmath> in fastdiv.cuh).
PROVIDED_ELSEWHERE = frozenset({"cuda::std::numeric_limits", "cuda::fast_mod_div"})
INCLUDE = re.compile(r'#\s*include\s*[<"]([^>"]+)[>"]')
_INCLUDE = INCLUDE
_CUDA_NAME = re.compile(r"cuda::\w+(?:::\w+)*")
#: comments, string literals and character literals ('"' would otherwise open a string)
_CODE_ONLY = re.compile(r"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])'""", re.S)


@dataclass(frozen=True)
class UnusedHeader:
    name: str  # as FlashInfer includes it
    guard: str  # its include guard
    #: why the header must stay for one reachable file (file name, its code without comments and strings), or None
    check: Callable[[str, str, str], str | None]
    stand_in: str | None = None  # fivar's header under csrc/ defining the guard and what FlashInfer uses of it

    def prefix(self) -> str:
        if self.stand_in:  # the path in these comments is in every FA2 unit's text, so in its URI
            return f'#include "{self.stand_in}"  // fivar: stands in for <{self.name}> (fivar/jit/unused_headers.py)\n'
        return f"#define {self.guard}  // fivar: FlashInfer includes <{self.name}> but uses none of it " \
               "(fivar/jit/unused_headers.py)\n"


def _words(pattern: str | re.Pattern, code: str) -> list[re.Match]:
    """Matches of `pattern` that start a word: what a leading \\b would say, but a pattern that starts with plain text
    lets re skip to that text, while a leading \\b makes it try every position (~50x slower on FlashInfer's headers,
    10 ms a scan, and gen_module runs these checks on its first call in a process)."""
    return [m for m in re.finditer(pattern, code)
            if m.start() == 0 or not (code[m.start() - 1].isalnum() or code[m.start() - 1] == "_")]


def _libcu_names(header: str, fname: str, code: str) -> str | None:
    used = {m.group() for m in _words(_CUDA_NAME, code) if m.group() not in PROVIDED_ELSEWHERE}
    if used:
        return f"{fname} uses {', '.join(sorted(used))}, which <{header}> may provide"
    return None


def _thread_block_sync_only(header: str, fname: str, code: str) -> str | None:
    """Cooperative groups used only as `auto b = cg::this_thread_block(); ... b.sync();` (what fivar_thread_block.cuh
    has)."""
    problem = _libcu_names(header, fname, code)  # the header brings <cuda/atomic> and libcu++ type traits
    if problem or "cooperative_groups" not in code:
        return problem
    aliases = {"cooperative_groups",
               *(m.group(1) for m in _words(r"namespace\s+(\w+)\s*=\s*cooperative_groups\s*;", code))}
    ns = "(?:" + "|".join(sorted(aliases)) + ")"
    if _words(rf"using\s+namespace\s+{ns}\b", code):
        return f"{fname} has `using namespace` cooperative groups"
    other = {m.group(1) for m in _words(rf"{ns}::(\w+)", code)} - {"this_thread_block", "thread_block"}
    if other:
        return f"{fname} uses cooperative_groups::{', '.join(sorted(other))}"
    blocks = [m.group(1) for m in _words(rf"(?:auto|{ns}::thread_block)\s+(\w+)\s*=\s*{ns}::this_thread_block\(\)\s*;",
                                         code)]
    if len(blocks) != len(_words(r"this_thread_block\b", code)):
        return f"{fname} uses this_thread_block() other than as `auto block = cg::this_thread_block();`"
    for var in set(blocks):
        uses = len(_words(rf"{var}\b", code))
        if uses != blocks.count(var) + len(_words(rf"{var}\s*\.\s*sync\s*\(\s*\)", code)):
            return f"{fname} uses its thread block `{var}` for more than {var}.sync()"
    return None


HEADERS = (UnusedHeader("cuda/pipeline", "_CUDA_PIPELINE", _libcu_names),
           UnusedHeader("cooperative_groups.h", "_COOPERATIVE_GROUPS_H_", _thread_block_sync_only,
                        stand_in="fivar_thread_block.cuh"))
BY_NAME = {h.name: h for h in HEADERS}


def _flashinfer_dirs() -> tuple[Path, Path]:
    return include_dir(), flashinfer_csrc_dir()


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


def _code_of(paths: list[Path]) -> tuple[tuple[str, str], ...]:
    """(file name, its code without comments and literals) per file: what the checks read."""
    def code(text: str) -> str:
        return _CODE_ONLY.sub(lambda m: '""' if m.group()[0] in "\"'" else "", text)
    return tuple((p.name, code(p.read_text(errors="replace"))) for p in paths)


def _first_problem(header: UnusedHeader, files: tuple[tuple[str, str], ...]) -> str | None:
    return next((why for name, code in files if (why := header.check(header.name, name, code))), None)


def problem(header: UnusedHeader, texts: list[str], include_dir: Path, csrc_dir: Path) -> str | None:
    """Why `header` must stay for sources `texts`, judging by the FlashInfer files they reach, or None."""
    return _first_problem(header, _code_of(reachable(texts, include_dir, csrc_dir)))


def _search_path() -> list[Path]:
    """Where nvcc looks for these headers, first match wins: fivar's -I dirs, FlashInfer's CCCL (-I), the toolkit."""
    from flashinfer.jit import env as jit_env

    from ..jit.toolchain import cuda_home, extra_include_paths
    return [Path(d) for d in extra_include_paths()] + [Path(d) for d in jit_env.CCCL_INCLUDE_DIRS] + \
        [Path(cuda_home()) / "include"]


def guard_problem(header: UnusedHeader, search_path: list[Path]) -> str | None:
    """Why defining header.guard would not keep the compiler's copy of the header out, or None."""
    found = next((d / header.name for d in search_path if (d / header.name).is_file()), None)
    if found is None:
        return f"<{header.name}> is not under {', '.join(map(str, search_path))}"
    if not re.search(rf"^#ifndef {header.guard}\s*\n#define {header.guard}\b", found.read_text(errors="replace"), re.M):
        return f"{found} has no include guard {header.guard}"
    return None


@functools.lru_cache(maxsize=64)
def _reachable_code(includes: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The FlashInfer files these includes reach, read once per process for every header's check."""
    return _code_of(reachable(["\n".join(f"#include <{n}>" for n in includes)], *_flashinfer_dirs()))


@functools.lru_cache(maxsize=64)
def problem_for(name: str, includes: tuple[str, ...]) -> str | None:
    header = BY_NAME[name]
    return guard_problem(header, _search_path()) or _first_problem(header, _reachable_code(includes))



#: What an FA2 prefill module's sources include from FlashInfer (its host sources and kernel instantiations):
#: what doctor checks the headers against. Decode keeps <cooperative_groups.h> by design (it uses this_grid()).
PREFILL_SOURCES = ("single_prefill.cu", "single_prefill_jit_binding.cu", "single_prefill_kernel_inst.jinja",
                   "single_prefill_customize_config.jinja", "batch_prefill.cu", "batch_prefill_jit_binding.cu",
                   "batch_prefill_paged_kernel_inst.jinja", "batch_prefill_ragged_kernel_inst.jinja")


def prefill_includes() -> tuple[str, ...]:
    return tuple(sorted({n for f in PREFILL_SOURCES for n in INCLUDE.findall((flashinfer_csrc_dir() / f).read_text())}
                        - {"single_prefill_config.inc", "batch_prefill_config.inc"}))


def _prefill_problem(name: str):
    def check() -> str | None:
        return problem_for(name, prefill_includes())
    check.__name__ = f"prefill_{name}_problem"
    return functools.lru_cache(maxsize=None)(safe(check))


COUPLINGS = [
    Coupling("fa2_skip_cuda_pipeline", "the FlashInfer files FA2 prefill reaches use nothing of <cuda/pipeline>, "
             "whose include guard is _CUDA_PIPELINE", "FA2 units without <cuda/pipeline> (faster compile)",
             "FA2 units include it", _prefill_problem("cuda/pipeline")),
    Coupling("fa2_thread_block_stand_in", "FA2 prefill uses cooperative groups only as this_thread_block().sync(), "
             "and <cooperative_groups.h>'s include guard is _COOPERATIVE_GROUPS_H_",
             "FA2 units with csrc/fivar_thread_block.cuh in place of <cooperative_groups.h> (faster compile)",
             "FA2 units include it", _prefill_problem("cooperative_groups.h")),
]
