"""FlashInfer's JIT log on a read-only workspace.

FlashInfer opens `<workspace>/flashinfer_jit.log` for appending while `flashinfer.jit.core` is imported, so a
read-only prebuilt workspace (a fleet's mounted cache) fails every import with a raw OSError before a module is even
looked at. `install()` puts an import hook in front of that one module: while it executes, a log handler
for that file which could not write it opens the file only once something is logged (`delay`), which loading
prebuilt modules never does. Logging is left as it was once the module is imported; nothing else is touched.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import sys

MODULE = "flashinfer.jit.core"
LOG_NAME = "flashinfer_jit.log"


@contextlib.contextmanager
def _handlers_open_lazily_where_read_only():
    plain = logging.FileHandler.__init__

    def init(self, filename, mode="a", encoding=None, delay=False, errors=None):
        path = os.path.abspath(os.fspath(filename))
        if not delay and os.path.basename(path) == LOG_NAME and \
                not os.access(path if os.path.exists(path) else os.path.dirname(path), os.W_OK):
            delay = True
        plain(self, filename, mode, encoding, delay, errors)
    logging.FileHandler.__init__ = init
    try:
        yield
    finally:
        logging.FileHandler.__init__ = plain


class _Loader(importlib.abc.Loader):
    """FlashInfer's own loader of MODULE, its execution inside the handler patch."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        with _handlers_open_lazily_where_read_only():
            self.inner.exec_module(module)

    def __getattr__(self, name):  # get_source, get_data, ... as FlashInfer's loader answers them
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Stays on sys.meta_path, so a retried import or a reload of MODULE runs inside the patch too."""

    def __init__(self):
        self._finding = False

    def find_spec(self, name, path, target=None):
        if name != MODULE or self._finding:
            return None
        self._finding = True  # the finders after this one find the module itself
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _Loader):
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Before FlashInfer is first imported (fivar.jit calls it); a no-op once hooked."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
