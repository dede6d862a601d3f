"""The `fivar` command line: one thin click module per command over fivar's library functions."""
from __future__ import annotations

from . import bench, build, cache, check, doctor, new_variant, show  # noqa: F401 - each registers its command on `main`
from ._common import main

__all__ = ["main"]
