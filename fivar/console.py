"""The width of the CLI's rich consoles, so that module URIs and paths are never cut."""
from __future__ import annotations

import os
import sys


def console_width(stream=None) -> int | None:
    """None (the terminal's own width, or COLUMNS) on a terminal; 200 columns when piped (logs, CI, `| grep`),
    where rich would otherwise assume 80 and cut or wrap URIs and paths."""
    stream = stream or sys.stdout
    if os.environ.get("COLUMNS") or (hasattr(stream, "isatty") and stream.isatty()):
        return None
    return 200
