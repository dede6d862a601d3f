"""fivar's own cache directory (FIVAR_CACHE_DIR, default ~/.cache/fivar)."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import FivarError


def cache_dir_path() -> Path:
    """Where fivar's cache directory is, without creating or checking it (for telling whether a path is in it)."""
    from .config import cache_dir_setting
    return Path(cache_dir_setting() or Path.home() / ".cache" / "fivar")


def cache_dir() -> Path:
    d = cache_dir_path()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FivarError(f"cannot create fivar's cache directory {d} ({e.strerror}); "
                         "set FIVAR_CACHE_DIR to a writable directory") from None
    if not os.access(d, os.W_OK):
        raise FivarError(f"fivar's cache directory {d} is not writable; set FIVAR_CACHE_DIR to a "
                         "writable directory")
    return d
