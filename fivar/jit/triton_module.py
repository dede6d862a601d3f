"""A variant's Triton twin as an importable module: rendered, written to fivar's cache dir under a
content-hashed name, imported once per process.

The name hashes the rendered text, so an edited variant (or a new fivar template) gets a new file and an
unchanged one reuses both the file and Triton's own compile cache, which keys on the kernel source.
Triton decides at decoration time whether a kernel is compiled or interpreted (TRITON_INTERPRET=1), so
a process keeps one imported copy per mode.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from types import ModuleType

from ..cache import cache_dir
from ..codegen.triton import render_attention

_loaded: dict[str, ModuleType] = {}  # module name (content hash, mode) -> imported module
_by_variant: dict[tuple, tuple[object, ModuleType]] = {}  # (id(variant), mode) -> (variant, module)


def module_name(variant, text: str) -> str:
    return f"fivar_{variant.name}_triton_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def load_triton_module(variant, training: bool = False) -> ModuleType:
    """The variant's Triton twin; `training`: the module that also holds the backward kernels
    (fivar.codegen.triton_bwd)."""
    key = (id(variant), _interpreting(), training)
    hit = _by_variant.get(key)
    if hit is not None and hit[0] is variant:
        return hit[1]
    mod = _import(variant, training)
    _by_variant[key] = (variant, mod)
    return mod


def _import(variant, training: bool = False) -> ModuleType:
    if training:
        from ..codegen.triton_bwd import render_training
        text = render_training(variant)
    else:
        text = render_attention(variant)
    name = module_name(variant, text)
    import_name = name + ("_interpreted" if _interpreting() else "")
    mod = _loaded.get(import_name)
    if mod is not None:
        return mod
    path = cache_dir() / "triton" / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # atomic: a concurrent process never imports a torn file
    spec = importlib.util.spec_from_file_location(import_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[import_name] = mod  # Triton reads kernel sources through the module (inspect/linecache)
    spec.loader.exec_module(mod)
    _loaded[import_name] = mod
    return mod
