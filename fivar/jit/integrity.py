"""Whether a module in the cache is sound and current, and what in the cache is never trusted.

`verify_entry` checks a module against its own manifest and content (library size, mtime and sha256; sources
hashing to the URI; no file a build does not write). `staleness` decides whether the current toolchain and
variant sources would ever load it again: it re-renders the variant found *by name* on the user's variant
search path (what `fivar list` loads), never from a path a manifest names and never from under the caches
(`untrusted_roots`), whose content builds and archives wrote.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import FivarError
from . import locks
from . import manifest as manifests

if TYPE_CHECKING:
    from .store import Entry


#: where the arch comes from when no GPU is visible (`--arch` belongs to the group: `fivar cache --arch 9.0a ls`)
ARCH_HINT = "set FLASHINFER_CUDA_ARCH_LIST or pass `fivar cache --arch 9.0a <command>`"
UNKNOWN_TOOLCHAIN = f"unknown: no arch or nvcc to compare with ({ARCH_HINT}, and CUDA_HOME)"


#: an entry with objects but no manifest: a build that did not finish, or a library `verify --fix` removed
NO_MANIFEST = "no manifest (an interrupted or failed build, or removed by verify --fix): rebuilds on next use"


def staleness(e: Entry, tc: dict, variants: dict) -> tuple[bool | None, list[str]]:
    """True (with reasons) when the entry can never be loaded again by the current toolchain and variant
    sources; None when it cannot be decided (variant file not found)."""
    man = e.manifest
    if man is None:
        if locks.build_lock_held(Path(e.lock_path).parent):  # a build is writing it
            return None, ["being built (its lock is held)"]
        if e.manifest_problem not in (None, "missing"):
            return True, [f"{e.manifest_problem} (`fivar cache verify --fix` removes it: rebuilds on next use)"]
        return True, [NO_MANIFEST]
    schema = man.get("schema", 1)
    if schema < manifests.SCHEMA_VERSION:  # its URI was named by an older scheme: never fresh
        return True, [f"built by an older fivar (manifest schema {schema})"]
    reasons = [f"built with {k} {man.get(k)} (now {tc[k]})" for k in ("arch", "flashinfer", "nvcc")
               if tc.get(k) is not None and man.get(k) != tc[k]]
    if reasons:
        return True, reasons
    try:
        size = e.library_path.stat().st_size
    except OSError:
        return True, ["library missing"]
    if man.get("so_size") not in (None, size):
        return True, [f"library size {size} != manifest {man['so_size']} (truncated?)"]
    foreign = manifests.origin_problem(man)
    if foreign:
        return True, [f"{foreign}: never loaded, rebuilds on next use"]
    if man.get("provenance", {}).get("kind") == "unsigned":
        return None, ["imported from an unsigned archive: its variant is not looked up by a name the archive "
                      "chose, so staleness is not decided"]
    if tc.get("arch") is None or tc.get("nvcc") is None:  # the variant cannot be rendered for comparison
        return None, [UNKNOWN_TOOLCHAIN]
    v = _load_variant(man, variants, e.uri)
    if isinstance(v, str):
        return None, [v]
    from .build import gen_module
    from .module_key import ModuleKey
    try:
        if getattr(v, "kind", None) == "fusion":
            from ..fusion.build import gen_fusion_module
            now = gen_fusion_module(v, man["dtype"]).uri
        else:
            # rendered the way it was built (its recorded config), not as this process's environment would
            # render it now
            key, config = ModuleKey.from_options(man["op"], man.get("target", "fa2"), man["dtype"], man["head_dim"],
                                                 man.get("options", {}))
            now = gen_module(v, key, **config).uri
    except Exception as ex:  # noqa: BLE001 - an edited variant may no longer be valid at all
        return True, [f"variant '{man.get('variant')}' no longer builds: {str(ex).splitlines()[0]}"]
    if now != e.uri:
        from .build import variant_file_sha256
        built_from, file_now = man.get("variant_file_sha256"), variant_file_sha256(v)
        if built_from is None or file_now is None:
            why = "was edited, or fivar's code generation changed,"
        elif built_from != file_now:
            why = "was edited"
        else:
            why = "is unchanged but fivar's code generation changed"
        return True, [f"variant '{man.get('variant')}' {why} (now renders {now})"]
    return False, []


def untrusted_roots() -> list[Path]:
    """Where no variant file is ever loaded from: FlashInfer's cache (workspace, generated sources) and
    fivar's own cache dir, which hold what builds and archives wrote."""
    from flashinfer.jit import env as jit_env
    from ..cache import cache_dir_path
    roots = [jit_env.FLASHINFER_CACHE_DIR, jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR]
    roots.append(cache_dir_path())
    return [Path(os.path.realpath(r)) for r in roots]


def inside(path: Path, roots: list[Path]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == r or r in real.parents for r in roots)


def _load_variant(man: dict, cache: dict, uri: str | None = None):
    """The variant the manifest names, as its file reads *now*, or a reason staleness cannot be decided.

    Found by NAME on the registry's search path (FIVAR_VARIANT_PATH, ./variants, fivar's bundled variants: the
    user's own files, which `fivar list` loads anyway), never from the manifest's `variant_file` path and never
    under the caches. Where the manifest says it was built from another file than the one the name finds, that
    file is not loaded: undecidable."""
    from .. import registry
    name = man.get("variant")
    if not re.fullmatch(r"[A-Za-z_]\w*", name or ""):
        return f"variant name {name!r} in the manifest is not an identifier: not looked up"
    if uri is not None and not variant_matches_uri(man, uri):
        return (f"the manifest names variant {name!r}, but {uri} is not a module of it (tampered?): no variant "
                "is looked up")
    if name in cache:
        return cache[name]
    roots = untrusted_roots()
    found = [f for f in registry.all_variant_files().get(name, []) if not inside(f, roots)]
    built_from = man.get("variant_file")
    if not found:
        v = (f"variant '{name}' is not on the variant search path ({', '.join(map(str, registry.search_path()))}; "
             "FIVAR_VARIANT_PATH adds a directory): cannot re-render it")
    elif built_from and Path(os.path.realpath(built_from)) != Path(os.path.realpath(found[0])):
        where = "inside fivar's or FlashInfer's cache" if inside(Path(built_from), roots) else "elsewhere"
        v = (f"built from {built_from} ({where}), but variant '{name}' on the search path is {found[0]}: the "
             "manifest's file is never loaded, so staleness cannot be decided")
    else:
        p = Path(os.path.realpath(found[0]))
        old = registry._loaded.pop(p, None)
        try:
            v = registry.load_named(name, p)
        except FivarError as ex:
            v = f"variant '{name}' cannot be loaded: {str(ex).splitlines()[0]}"
        finally:
            if old is not None:
                registry._loaded[p] = old
            else:
                registry._loaded.pop(p, None)
    cache[name] = v
    return v


def verify_entry(e: Entry) -> list[str]:
    """Problems with an entry: manifest (shape, library size/mtime and sha256), generated sources (the URI's
    content hash, no stray file), and anything a tampered archive could have planted."""
    from .build import _sha256
    man = e.manifest
    if man is None:
        return [NO_MANIFEST if e.manifest_problem in (None, "missing") else e.manifest_problem]
    problems = []
    try:
        st = e.library_path.stat()
    except OSError:
        return ["library missing"]
    if man["uri"] != e.uri:
        problems.append(f"manifest names {man['uri']}")
    if man["so_size"] != st.st_size:
        problems.append(f"library size {st.st_size} != manifest {man['so_size']} (truncated?)")
    elif man["so_mtime_ns"] != st.st_mtime_ns:
        problems.append("library modified after its build")
    if _sha256(e.library_path) != man["so_sha256"]:
        problems.append("library sha256 does not match its manifest")
    if man.get("variant_file") and inside(Path(man["variant_file"]), untrusted_roots()):
        problems.append(f"manifest names a variant file inside the cache ({man['variant_file']}): tampered; "
                        "it is never loaded")
    if not variant_matches_uri(man, e.uri):
        problems.append(f"manifest names variant {man['variant']!r}, but the URI is not a module of it: tampered")
    foreign = manifests.origin_problem(man)
    if foreign:
        problems.append(f"library {foreign}: untrusted, never loaded")
    problems += _foreign_files(e)
    missing = [s for s in man["sources"] if not (e.gen_dir / s).exists()]
    if missing:
        problems.append(f"generated sources missing ({', '.join(missing)}); regenerated on the next rebuild")
    elif "cuda_cflags" in man and not sources_match_uri(e.uri, e.gen_dir, man):
        problems.append("generated sources do not hash to the URI (edited or tampered)")
    return problems


def _foreign_files(e: Entry) -> list[str]:
    """Files no fivar build writes: a generated file the manifest does not list, or anything executable by
    Python anywhere in the module (an archive that ships code)."""
    listed = set((e.manifest or {}).get("sources", []))
    stray = [p.name for p in (sorted(e.gen_dir.iterdir()) if e.gen_dir.is_dir() else [])
             if not p.name.startswith(".") and p.name not in listed]
    stray += [str(p.relative_to(e.build_dir)) for p in (sorted(e.build_dir.rglob("*")) if e.build_dir.is_dir()
                                                        else []) if p.suffix in (".py", ".pyc", ".pyw")]
    return [f"files no build writes: {', '.join(stray[:5])} (tampered?)"] if stray else []


def sources_match_uri(uri: str, gen_dir: Path, man: dict) -> bool:
    """The URI ends in the content hash of the module's sources and flags (fivar.jit.build.content_hash)."""
    from .build import content_hash
    try:
        sources = {n: (gen_dir / n).read_bytes().decode() for n in man["sources"]}
    except (OSError, UnicodeDecodeError):
        return False
    return uri.endswith("_" + content_hash(sources, man["cuda_cflags"]))


def variant_matches_uri(man: dict, uri: str) -> bool:
    """The manifest's variant, target, op, dtype and head dim are the ones its URI was made of (the URI's hash
    covers the sources; its name part is how gen_module names the module): a manifest cannot point a reader at
    another variant than the one its sources were rendered from."""
    from ..codegen.tile_list import BITS_KERNEL
    from .build import uri_name
    target = man.get("target", "fa2")
    op_part = f"{target}_" + ("" if target == "fusion" else f"{man['op']}")
    # a tile-list module reading bits, and FA3's mask-free segments module, are the ones every variant of its logits
    # shares (tile_list.bits_kernel): the manifest names the variant that built it; re-rendering that variant gives
    # this URI (staleness)
    heads = [f"fivar_{uri_name(man['variant'])}_{op_part}"] + (
        [f"fivar_{BITS_KERNEL}_{op_part}_tiles_", f"fivar_{BITS_KERNEL}_{op_part}_free_"]
        if man.get("op") == "batch_prefill" else [])
    tail = rf"_{re.escape(man['dtype'])}_hd{man['head_dim']}_[0-9a-f]{{12}}$"
    return any(uri.startswith(h) for h in heads) and bool(re.search(tail, uri))

