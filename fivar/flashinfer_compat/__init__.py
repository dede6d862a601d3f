"""Every place fivar relies on FlashInfer's text or internals, in one package.

Each coupling (fa2_launchers, fa2_headers, fa3_launchers, wrappers) is a named check of the installed FlashInfer.
A check runs once per process; where it fails, the optimisation it enables is turned off (or, for a required one,
the feature refuses to run) and fivar says so once in its log. `fivar doctor` lists them all (report()), and
tests/unit/test_flashinfer_compat.py fails when one no longer matches the installed FlashInfer.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import fa2_headers, fa2_launchers, fa3_launchers, wrappers
from ._base import SUPPORTED, WRITTEN_AGAINST, Coupling, warn_once  # noqa: F401 (re-exported)

#: Per supported release line, the couplings whose FlashInfer text changed in it, so that their optimisation is off
#: there and the module is built FlashInfer's way. Doctor and the tests expect exactly these.
OFF_IN_RELEASE = {
    "0.7.2": frozenset(),
    "0.7.4": frozenset(),
}

COUPLINGS: dict[str, Coupling] = {c.name: c for m in (fa2_launchers, fa2_headers, fa3_launchers, wrappers)
                                  for c in m.COUPLINGS}


def release(version: str | None = None) -> str | None:
    """The supported release line (a key of OFF_IN_RELEASE) of FlashInfer `version` (default: the installed one),
    or None for a release fivar is not tested against."""
    if version is None:
        from ..jit.toolchain import flashinfer_version
        version = flashinfer_version()
    from packaging.version import InvalidVersion, Version
    try:
        line = ".".join(map(str, Version(version).release[:3]))
    except InvalidVersion:
        return None
    return line if line in OFF_IN_RELEASE else None


def problem(name: str) -> str | None:
    """Why coupling `name` does not match the installed FlashInfer (None: it does); logged once when it does not."""
    coupling = COUPLINGS[name]
    why = coupling.check()
    if why is not None:
        warn_once(coupling, why)
    return why


def active(name: str) -> bool:
    return problem(name) is None


@dataclass(frozen=True)
class Status:
    name: str
    active: bool
    enables: str
    relies_on: str
    reason: str  # why it is off, or what it relies on
    fallback: str
    required: bool


def report() -> list[Status]:
    """Every coupling, checked against the installed FlashInfer (without logging: the report says it)."""
    out = []
    for c in COUPLINGS.values():
        why = c.check()
        out.append(Status(c.name, why is None, c.enables, c.relies_on, why or "matches", c.fallback, c.required))
    return out


__all__ = ["COUPLINGS", "OFF_IN_RELEASE", "SUPPORTED", "WRITTEN_AGAINST", "Coupling", "Status", "active", "problem",
           "release", "report"]
