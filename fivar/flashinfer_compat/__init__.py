"""Every place fivar relies on FlashInfer's text or internals, in one package.

Each coupling (fa2_launchers, fa2_headers, fa3_launchers, wrappers) is a named check of the installed FlashInfer.
A check runs once per process; where it fails, the optimisation it enables is turned off (or, for a required one,
the feature refuses to run) and fivar says so once in its log. `fivar doctor` lists them all (report()), and
tests/unit/test_flashinfer_compat.py fails when one no longer matches the installed FlashInfer.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import fa2_headers, fa2_launchers, fa3_launchers, wrappers
from ._base import Coupling, warn_once

#: The FlashInfer release fivar's couplings and the JIT template variables it passes are written against (the range
#: pyproject.toml accepts).
WRITTEN_AGAINST = "0.7.2"

COUPLINGS: dict[str, Coupling] = {c.name: c for m in (fa2_launchers, fa2_headers, fa3_launchers, wrappers)
                                  for c in m.COUPLINGS}


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


__all__ = ["COUPLINGS", "Coupling", "Status", "active", "problem", "report"]
