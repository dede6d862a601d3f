"""What every FlashInfer coupling is: a named check of FlashInfer's text or internals, and what it enables."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("fivar")
_warned: set[str] = set()


#: The FlashInfer release fivar's copies of FlashInfer's text (the FA2 launcher cut, the pinned KV tiles, the per-tile
#: batch units, the FA3 hashes) are taken from.
WRITTEN_AGAINST = "0.7.2"
#: The FlashInfer releases fivar is tested against, oldest first: pyproject.toml's range.
SUPPORTED = ("0.7.2.post1", "0.7.4")


@dataclass(frozen=True)
class Coupling:
    """One thing fivar relies on inside FlashInfer. `check()` says why the installed FlashInfer does not match
    (None: it does). Where it does not, fivar gives up `enables` and does `fallback` instead; a `required`
    coupling has no fallback (the feature it serves refuses to run, naming the reason)."""
    name: str
    relies_on: str
    enables: str
    fallback: str
    check: Callable[[], str | None]
    required: bool = False


def norm(text: str) -> str:
    """Text with its whitespace collapsed: what fivar compares FlashInfer's sources by."""
    return " ".join(text.split())


def include_dir() -> Path:
    from flashinfer.jit import env as jit_env
    return Path(jit_env.FLASHINFER_INCLUDE_DIR)


def csrc_dir() -> Path:
    from flashinfer.jit import env as jit_env
    return Path(jit_env.FLASHINFER_CSRC_DIR)


def safe(check: Callable[[], str | None]) -> Callable[[], str | None]:
    """A check that cannot raise: a FlashInfer file gone or renamed is a mismatch, said in one line."""
    @functools.wraps(check)
    def run() -> str | None:
        try:
            return check()
        except Exception as e:  # noqa: BLE001 - any failure to read FlashInfer means it is not the one fivar knows
            return f"checking it failed ({type(e).__name__}: {e})"
    return run


def warn_once(coupling: Coupling, why: str) -> None:
    """Say once per process which optimisation a mismatch turns off, and why."""
    key = f"{coupling.name}: {why}"
    if key in _warned:
        return
    _warned.add(key)
    from ..jit.toolchain import flashinfer_version
    log.warning("fivar: FlashInfer %s: %s; %s is off (%s). `fivar doctor` lists every coupling.",
                flashinfer_version(), why, coupling.enables, coupling.fallback)
