"""Where fivar's non-Python files live: beside the package in a checkout, inside it in a wheel."""
from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"fivar installation is missing its '{name}' directory "
                            f"(looked in {_PKG / '_data'} and {_PKG.parent})")


def templates_dir() -> Path:
    return _find("templates")


def csrc_dir() -> Path:
    return _find("csrc")


def bundled_variants_dir() -> Path:
    return _find("variants")
