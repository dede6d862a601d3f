"""A module's manifest (`<build dir>/fivar_manifest.json`): what fivar recorded after a successful build, and
the one validator every reader goes through.

The manifest is data from disk, possibly from an imported archive: a reader never trusts its shape. `read`
returns a dict whose every known field has its documented type, or a one-line reason it is malformed; no
caller does `.get` on something that may be a list or None.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

NAME = "fivar_manifest.json"
#: 1: before the schema field (no cuda_cflags); 2: schema and cuda_cflags, so the sources can be checked
#: against the URI's content hash without re-rendering the variant.
SCHEMA_VERSION = 2

_STR, _INT, _NUM, _BOOL = (str,), (int,), (int, float), (bool,)
_OPT_STR = (str, type(None))
#: field -> (accepted types, required). bool is an int in Python: checked apart below.
FIELDS: dict[str, tuple[tuple, bool]] = {
    "schema": (_INT, False),
    "uri": (_STR, True),
    "variant": (_STR, True),
    "op": (_STR, True),
    "target": (_STR, False),
    "dtype": (_STR, True),
    "head_dim": (_INT, True),
    "so_size": (_INT, True),
    "so_mtime_ns": (_INT, True),
    "so_sha256": (_STR, True),
    "compile_seconds": (_NUM, False),
    "flashinfer": (_OPT_STR, False),
    "nvcc": (_OPT_STR, False),
    "arch": (_OPT_STR, False),
    "created": (_NUM, False),
    "sources": ((list,), True),
    "cuda_cflags": ((list,), False),
    "variant_file": (_OPT_STR, False),
    "variant_file_sha256": (_OPT_STR, False),
    "options": ((dict,), False),
    "imported_from": (_OPT_STR, False),
    "imported": (_NUM, False),
    #: where the library came from (see origin_problem): written by fivar on this machine, never taken from an
    #: archive
    "provenance": ((dict,), False),
}
#: provenance kinds: built here; imported from an archive signed by a trusted key; imported from an unsigned or
#: untrusted archive because the user said --trust-unsigned
ORIGINS = ("build", "signed", "unsigned")
_SOURCE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
#: what a generated source may be called: C++/CUDA text, never a Python file or a library
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".inc")


class ManifestError(ValueError):
    """A manifest that is not what fivar writes (one line: which field, what it holds)."""


def problems(man) -> list[str]:
    """Everything wrong with a parsed manifest's shape (empty: valid)."""
    if not isinstance(man, dict):
        return [f"not a JSON object (a {type(man).__name__})"]
    out = []
    schema = man.get("schema", 1)
    if type(schema) is not int or not 1 <= schema <= SCHEMA_VERSION:
        out.append(f"schema {schema!r} is not one this fivar reads (1..{SCHEMA_VERSION})")
    for key, (types, required) in FIELDS.items():
        if key not in man:
            if required or (key == "cuda_cflags" and schema == SCHEMA_VERSION):
                out.append(f"field '{key}' is missing")
            continue
        v = man[key]
        if isinstance(v, bool) and bool not in types or not isinstance(v, types):
            out.append(f"field '{key}' is a {type(v).__name__}, expected {'/'.join(t.__name__ for t in types)}")
    if not out:
        if man["so_size"] < 0 or not re.fullmatch(r"[0-9a-f]{64}", man["so_sha256"]):
            out.append("so_size/so_sha256 out of range")
        if not re.fullmatch(r"fivar_\w+", man["uri"]):
            out.append(f"uri {man['uri']!r} is not fivar_<letters, digits, _>")
        bad = [s for s in man["sources"] if not isinstance(s, str) or not _SOURCE_NAME.fullmatch(s)
               or not s.endswith(SOURCE_SUFFIXES)]
        if bad:
            out.append(f"sources name files that are not C++/CUDA sources: {bad[:3]!r}")
        if not all(isinstance(f, str) for f in man.get("cuda_cflags", [])):
            out.append("cuda_cflags holds something other than strings")
        prov = man.get("provenance", {"kind": "build"})
        if prov.get("kind") not in ORIGINS or not isinstance(prov.get("signer", ""), str):
            out.append(f"provenance {prov!r} is not one fivar writes (kind: {', '.join(ORIGINS)})")
    return out


def parse(text: str | bytes) -> dict:
    """The manifest in `text`, validated; ManifestError (one line) when it is not one."""
    try:
        man = json.loads(text)
    except ValueError as e:
        raise ManifestError(f"not JSON ({e})") from None
    except RecursionError:  # arrays/objects nested past the JSON reader's depth: no manifest fivar writes is
        raise ManifestError("not JSON fivar reads (nested too deeply)") from None
    bad = problems(man)
    if bad:
        raise ManifestError("; ".join(bad))
    return man


def read(path: Path) -> tuple[dict | None, str | None]:
    """(manifest, None), or (None, why): 'missing' when there is no file, else why it is malformed."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable ({e.strerror})"
    try:
        return parse(text), None
    except ManifestError as e:
        return None, f"malformed manifest: {e}"


def origin_problem(man: dict) -> str | None:
    """Why the library of a (valid) manifest must not be loaded for where it came from, or None: built here,
    imported from an archive signed by a key still trusted, or imported unsigned on the user's explicit word.
    A library imported before archives were signed (`imported_from`, no provenance) was never checked."""
    prov = man.get("provenance")
    if prov is None:
        return ("imported from an archive before archives were signed (its library was never checked)"
                if man.get("imported_from") else None)
    if prov["kind"] == "signed":
        from ..trust import is_trusted
        if not is_trusted(prov.get("signer")):
            return f"imported from an archive signed by key {prov.get('signer')}, which is no longer trusted"
    return None
