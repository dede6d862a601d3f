"""The benchmark suites, one module each; `cases(quick)` lists a suite's cases without touching a GPU."""
from __future__ import annotations

import importlib

SUITES = {"attention": "attention", "decode": "decode", "zoo": "zoo", "masks": "masks", "fusions": "fusions",
          "triton-ops": "triton_ops", "compile": "compile", "train": "train",
          "serving": "serving", "context-parallel": "context_parallel"}


def cases_of(suite: str, quick: bool = False) -> list:
    if suite not in SUITES:
        raise ValueError(f"no suite named {suite!r} (have {', '.join(SUITES)})")
    return importlib.import_module(f"{__name__}.{SUITES[suite]}").cases(quick=quick)
