"""Headers FlashInfer's FA2 sources include but hardly use, left out of fivar's FA2 units.

Once a unit holds few kernels (fivar.jit.pinned_kv_tiles), parsing headers is most of its compile, and two that
FlashInfer 0.7.2's FA2 sources include do nothing for them:
- <cuda/pipeline> (permuted_smem.cuh): libcu++'s memcpy_async and barrier machinery; no FA2 source uses any of it.
  Left out, a single-prefill kernel unit took 9.3 -> 7.3 s and the host unit 6.4 -> 5.4 s.
- <cooperative_groups.h> (prefill.cuh, decode.cuh): prefill uses only `cg::this_thread_block()` and that group's
  `sync()`, which csrc/fivar_thread_block.cuh defines as the header does (with its include guard). The kernel unit
  then took 6.9 -> 5.9 s. Decode also uses `this_grid()`, so decode modules keep the header.
(2-core host, nvcc --time; docs/tuning.md.) The kernels' SASS is the same either way (tests/unit/test_build.py).

A header is left out by defining its include guard (or including its stand-in) at the top of each FA2 unit, and only
after fivar.flashinfer_compat.fa2_headers checked every FlashInfer file reachable from the module's sources; a
FlashInfer or toolkit that differs keeps the header (and says so once). FA2BuildConfig.skip_unused_headers
(fivar.config) chooses which to leave out.
"""
from __future__ import annotations

import logging
from collections.abc import Collection

from .. import config
from ..errors import FivarError
from ..flashinfer_compat import fa2_headers as _checks
from ..flashinfer_compat import problem as coupling_problem
from ..flashinfer_compat.fa2_headers import (BY_NAME, HEADERS, PROVIDED_ELSEWHERE, UnusedHeader,  # noqa: F401
                                              _search_path, guard_problem, problem, reachable)
from ..paths import csrc_dir

log = logging.getLogger("fivar")
ENV = config.ENV["skip_unused_headers"]
_INCLUDE = _checks.INCLUDE
_warned: set[str] = set()
_COUPLING_OF = {"cuda/pipeline": "fa2_skip_cuda_pipeline", "cooperative_groups.h": "fa2_thread_block_stand_in"}


def wanted(setting: bool | Collection[str] | None) -> tuple[str, ...]:
    """The headers gen_module's `skip_unused_headers` asks to leave out where their checks pass: True (and None with
    fivar.config's FA2BuildConfig) all of them, False none, or the names given (what a manifest records)."""
    if setting is None:
        from ..config import fa2_build_config
        setting = fa2_build_config().skip_unused_headers
    if isinstance(setting, bool):
        return tuple(BY_NAME) if setting else ()
    if isinstance(setting, str) or not all(isinstance(n, str) for n in setting):
        raise FivarError(f"skip_unused_headers={setting!r}: expected True or False (or a list of header names)")
    unknown = sorted(set(setting) - set(BY_NAME))
    if unknown:
        raise FivarError(f"skip_unused_headers: fivar cannot leave out {', '.join(unknown)} "
                         f"(it can leave out {', '.join(BY_NAME)})")
    return tuple(n for n in BY_NAME if n in setting)


def skipped(sources: dict[str, str], setting: bool | Collection[str] | None = None) -> list[UnusedHeader]:
    """The headers the FA2 units of a module with these sources leave out (see `wanted`)."""
    own = set(sources)
    includes = tuple(sorted({n for text in sources.values() for n in _INCLUDE.findall(text)} - own))
    out = []
    for name in wanted(setting):
        why = _checks.problem_for(name, includes)
        if why is None:
            out.append(BY_NAME[name])
        elif why not in _warned:
            _warned.add(why)
            # decode keeps <cooperative_groups.h> by design (it uses this_grid()); a prefill module's mismatch is
            # the coupling's, said once as a warning by fivar.flashinfer_compat
            log.info("fivar: %s; FA2 units keep <%s>", why, name)
            if why == _checks.problem_for(name, _checks.prefill_includes()):
                coupling_problem(_COUPLING_OF[name])
    return out


def prefix(headers: list[UnusedHeader]) -> str:
    """What each FA2 unit starts with to leave these headers out: before any other include."""
    return "".join(h.prefix() for h in headers)


def stand_in_sources(headers: list[UnusedHeader]) -> dict[str, str]:
    return {h.stand_in: (csrc_dir() / h.stand_in).read_text() for h in headers if h.stand_in}
