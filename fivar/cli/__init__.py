"""The `fivar` command line: one thin click module per command over fivar's library functions."""
from __future__ import annotations

from ..cache_cli import cache
from . import bench, build, check, doctor, new_variant, show  # noqa: F401 - each registers its command on `main`
from ._common import main

main.add_command(cache)

__all__ = ["main"]
