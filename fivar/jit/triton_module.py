"""A variant's Triton twin as a module: rendered, written to fivar's cache dir under a content-hashed name,
executed from the text just rendered (never from the file), once per process.

The name hashes the rendered text, so an edited variant (or a new fivar template) gets a new file and an
unchanged one reuses both the file and Triton's own compile cache, which keys on the kernel source.
Triton decides at decoration time whether a kernel is compiled or interpreted (TRITON_INTERPRET=1), so
a process keeps one imported copy per mode.
"""
from __future__ import annotations

import hashlib
import linecache
import os
import sys
from pathlib import Path
from types import ModuleType

from ..cache import cache_dir
from ..codegen.triton import render_attention
from ..errors import FivarError

_loaded: dict[str, ModuleType] = {}  # module name (content hash, mode) -> imported module
_by_variant: dict[tuple, tuple[object, ModuleType]] = {}  # (id(variant), mode) -> (variant, module)


def module_name(variant, text: str) -> str:
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    name = variant.name if len(variant.name) <= 64 else \
        f"{variant.name[:48]}_{hashlib.sha256(variant.name.encode()).hexdigest()[:8]}"  # a file name has 255 bytes
    return f"fivar_{name}_triton_{digest}"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def load_triton_module(variant, training: bool = False) -> ModuleType:
    """The variant's Triton twin; `training`: the module that also holds the backward kernels
    (fivar.codegen.triton_bwd)."""
    from ..config import lowering_config, triton_config
    # the lowering decides the text; the Triton settings what its import makes of it (autotuning, TMA)
    key = (id(variant), _interpreting(), training, lowering_config(), triton_config())
    hit = _by_variant.get(key)
    if hit is not None and hit[0] is variant:
        return hit[1]
    mod = _import(variant, training)
    _by_variant[key] = (variant, mod)
    return mod


def _import(variant, training: bool = False) -> ModuleType:
    """Executes the text it just rendered, never what a file in the cache holds: the file is written for
    tracebacks and readers, and its lines are handed to linecache, so Triton's inspect.getsource reads the
    verified text too (a file swapped in the cache dir after the write is never imported or read)."""
    if training:
        from ..codegen.triton_bwd import render_training
        text = render_training(variant)
    else:
        text = render_attention(variant)
    from ..config import TritonConfig, triton_config
    name = module_name(variant, text)
    settings = triton_config()  # read when the text is executed: another setting is another import of it
    import_name = name + ("_interpreted" if _interpreting() else "") + "".join(
        f"_no_{f}" for f in ("autotune", "tma", "gluon") if getattr(settings, f) != getattr(TritonConfig(), f))
    mod = _loaded.get(import_name)
    if mod is not None:
        return mod
    path = _write(name, text)
    mod = ModuleType(import_name)
    mod.__file__ = str(path)
    lines = text.splitlines(keepends=True)
    linecache.cache[str(path)] = (len(text), None, lines, str(path))  # mtime None: never re-read from disk
    sys.modules[import_name] = mod  # Triton reads kernel sources through the module (inspect/linecache)
    try:
        exec(compile(text, str(path), "exec"), mod.__dict__)  # noqa: S102 - fivar's own rendering, just made
    except BaseException:
        sys.modules.pop(import_name, None)
        raise
    _loaded[import_name] = mod
    return mod


def _write(name: str, text: str) -> Path:
    """Where the module's text is kept for readers: fivar's cache dir, else (read-only) a name only."""
    try:
        path = cache_dir() / "triton" / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != text.encode():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)  # atomic: a reader never sees a torn file
        return path
    except (OSError, FivarError):
        return Path(f"<fivar triton {name}>")
