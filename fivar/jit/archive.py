"""Export and import fivar's modules as one archive (`fivar cache export` / `fivar cache import`).

An archive is a .tar.gz of each module's library, manifest and generated sources, with an index
(fivar_export.json: every member's sha256 and size, and what each module is), signed with an ed25519 key
(fivar.trust). An import takes only manifests and C++/CUDA sources whose content hash is the URI's, plus
libraries only from an archive signed by a trusted key (`trust_unsigned` overrides); every member is checked
before a byte is written, and a bad one leaves the cache as it was. Nothing here executes a file an archive
holds, and nothing here prints: the functions return data and raise FivarError.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import socket
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

from ..errors import FivarError
from . import locks
from . import manifest as manifests
from .integrity import (ARCH_HINT, inside, sources_match_uri, staleness, untrusted_roots, variant_matches_uri,
                        verify_entry)
from .store import (Entry, Warn, current_toolchain, disk_errors, human_size, log_warning, scan_entries, stale_staging,
                    workspace_dirs)

EXPORT_FORMAT = "fivar-cache-export/2"
#: /1 has no per-member list (and was never signed): its sources still import, checked against their URIs
FORMATS_READ = ("fivar-cache-export/1", EXPORT_FORMAT)
META_NAME = "fivar_export.json"
#: the detached ed25519 signature over the exact bytes of META_NAME (fivar.trust)
SIG_NAME = "fivar_export.sig"
#: per module in the index: what decides what runs (the manifest, which holds them too, is hashed in `files`)
INDEXED_FIELDS = ("so_sha256", "variant", "target", "op", "dtype", "head_dim")
#: caps checked on the tar headers before a byte is written (a few KB of gzip can claim gigabytes)
META_MAX, SIG_MAX, MANIFEST_MAX, SOURCE_MAX = 16 << 20, 64 << 10, 1 << 20, 64 << 20


@disk_errors("export the cache")
def export(file, variants=(), include_stale: bool = False, sign_key=None, no_sign: bool = False) -> dict:
    """Pack this toolchain's current modules (.so, manifest, generated sources) into the .tar.gz `file`,
    signed with `sign_key` or the default key (none with no_sign). A module whose variant now renders another
    URI stays out unless include_stale. Returns what was packed, skipped and left out."""
    from .. import trust
    if sign_key and no_sign:
        raise FivarError("--sign and --no-sign contradict each other: pick one")
    key = Path(sign_key) if sign_key else None if no_sign else (
        trust.default_key_path() if trust.default_key_path().is_file() else None)
    if key is not None:
        trust.load_private_key(key)  # a bad key is refused before anything is written
    if not Path(file).parent.is_dir() or not os.access(Path(file).parent, os.W_OK):
        raise FivarError(f"cannot export to {file}: {Path(file).parent} is not a writable directory")
    tc = current_toolchain()
    if tc["arch"] is None or tc["nvcc"] is None:
        raise FivarError(f"cannot tell the current arch/nvcc: {ARCH_HINT}, and CUDA_HOME")
    jit_dir = workspace_dirs()[0]
    packed, skipped, stale, rendered = [], [], [], {}
    for e in scan_entries():
        man = e.manifest or {}
        if e.build_dir.parent != jit_dir or any(man.get(k) != tc[k] for k in ("arch", "flashinfer", "nvcc")):
            continue
        if variants and man.get("variant") not in variants:
            continue
        problems = [p for p in verify_entry(e) if "sources missing" not in p]
        if "cuda_cflags" not in man:  # an importer checks sources against the URI: it needs the flags
            problems.append("built by an older fivar (manifest schema 1): rebuild it to export it")
        if problems:
            skipped.append({"uri": e.uri, "problems": problems})
            continue
        if not include_stale:
            is_stale, reasons = staleness(e, tc, rendered)
            if is_stale:  # None (its variant file cannot be found): undecided, packed
                stale.append({"uri": e.uri, "reasons": reasons})
                continue
        packed.append(e)
    if not packed:
        which = f" of variant(s) {', '.join(sorted(variants))}" if variants else ""
        raise FivarError(f"nothing to export: no valid{'' if include_stale else ', current'} fivar module{which} for "
                         f"arch {tc['arch']}, flashinfer {tc['flashinfer']}, nvcc {tc['nvcc']} in {jit_dir}"
                         + (f" ({len(stale)} stale: --include-stale packs them)" if stale else ""))
    import torch
    files: dict[str, dict] = {}
    tmp = Path(file).with_name(f".{Path(file).name}.{os.getpid()}.tmp")
    signer = None
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for e in packed:
                _add_member(tar, e.library_path, f"cached_ops/{e.uri}/{e.uri}.so", files)
                _add_member(tar, e.build_dir / manifests.NAME, f"cached_ops/{e.uri}/{manifests.NAME}", files)
                for name in sorted(e.manifest["sources"]):  # what the manifest lists, nothing else found there
                    if (e.gen_dir / name).is_file():
                        _add_member(tar, e.gen_dir / name, f"generated/{e.uri}/{name}", files)
            # the index goes last: it holds the sha256 of exactly the bytes written above
            meta = {"format": EXPORT_FORMAT, **tc, "torch": torch.__version__, "host": socket.gethostname(),
                    "created": time.time(),
                    "entries": [{"uri": e.uri, **{k: e.manifest.get(k) for k in INDEXED_FIELDS}} for e in packed],
                    "files": files}
            index = json.dumps(meta, indent=1).encode()
            _add_bytes(tar, META_NAME, index)
            if key is not None:
                sig, signer = trust.sign(index, key)
                _add_bytes(tar, SIG_NAME, sig)
        replaced = Path(file).exists()
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; a failed write leaves nothing half-written
    return {"file": str(file), "replaced": replaced, "modules": [e.uri for e in packed], "skipped": skipped,
            "stale": stale, "signed_by": signer,
            "bytes": os.path.getsize(file), **{k: tc[k] for k in ("arch", "flashinfer", "nvcc")}}


class _Hashing:
    """A file object that hashes what is read through it (the archive index then holds the sha256 of exactly
    the bytes that went in or came out)."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def read(self, n=-1):
        data = self.f.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data


def _add_member(tar: tarfile.TarFile, path: Path, arcname: str, files: dict) -> None:
    info = tar.gettarinfo(str(path), arcname)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    with open(path, "rb") as f:
        h = _Hashing(f)
        tar.addfile(info, h)
    files[arcname] = {"sha256": h.sha.hexdigest(), "size": info.size}


def _add_bytes(tar: tarfile.TarFile, name: str, blob: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(blob), int(time.time()), 0o644
    tar.addfile(info, io.BytesIO(blob))


def read_export_meta(blob: bytes | None, file) -> dict:
    try:
        meta = json.loads(blob) if blob is not None else None
    except (ValueError, RecursionError):  # RecursionError: arrays nested past the JSON reader's depth
        meta = None
    if meta is None:
        raise FivarError(f"{file} is not a fivar cache export (no valid {META_NAME})") from None
    if not isinstance(meta, dict):
        raise FivarError(f"{file} is not a fivar cache export ({META_NAME} is not a JSON object)")
    if meta.get("format") not in FORMATS_READ:
        raise FivarError(f"{file}: unknown export format {meta.get('format')!r} (expected {EXPORT_FORMAT})")
    entries = meta.get("entries", [])
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("uri"), str) and re.fullmatch(r"fivar_\w+", e["uri"])
            for e in entries) or len({e["uri"] for e in entries}) != len(entries):
        raise FivarError(f"{file}: {META_NAME} has malformed entries (each must be an object whose uri is "
                         "fivar_<letters, digits, _>, each uri once); refusing to import")
    files = meta.get("files")
    if meta["format"] == EXPORT_FORMAT and not (isinstance(files, dict) and all(
            isinstance(f, dict) and isinstance(f.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", f["sha256"])
            and type(f.get("size")) is int and f["size"] >= 0 for f in files.values())):
        raise FivarError(f"{file}: {META_NAME} has a malformed file list (each member: sha256 and size); refusing "
                         "to import")
    return meta


#: what an archive may hold per module: its library and manifest, and the C++/CUDA sources the manifest lists
def _member_ok(kind: str, uri: str, name: str) -> bool:
    if kind == "cached_ops":
        return name in (f"{uri}.so", manifests.NAME)
    return name.endswith(manifests.SOURCE_SUFFIXES) and not name.startswith(".")


def _read_small(tar: tarfile.TarFile, name: str, cap: int, file) -> bytes | None:
    """A metadata member's bytes (None where absent), refused over `cap` before it is read."""
    hits = [m for m in tar.getmembers() if m.name == name]
    if not hits:
        return None
    if len(hits) > 1 or not hits[0].isfile() or hits[0].size > cap:
        what = "listed twice" if len(hits) > 1 else f"not a file of at most {human_size(cap)}"
        raise FivarError(f"{file}: {name} is {what}; refusing to import")
    return tar.extractfile(hits[0]).read()


def _checked_members(tar: tarfile.TarFile, meta: dict, file, member_cap: int, total_cap: int) -> dict:
    """uri -> its members, every one checked before anything is written: a name of the two trees, a library,
    manifest or C++/CUDA source, no larger than its cap, listed in the index at this size (and the total under
    `total_cap`)."""
    uris = {e["uri"] for e in meta.get("entries", [])}
    files = meta.get("files")
    members, seen, total = {}, set(), 0
    mems = [m for m in tar.getmembers() if m.name not in (META_NAME, SIG_NAME)]
    for mem in mems:  # what kind of file first: an archive that ships code is named as such
        parts = mem.name.split("/")
        if not (mem.isfile() and len(parts) == 3 and parts[0] in ("cached_ops", "generated")
                and parts[1] in uris and parts[2] and not parts[2].startswith(".") and ".." not in parts):
            raise FivarError(f"{file}: unexpected member {mem.name!r}; refusing to import")
        if not _member_ok(parts[0], parts[1], parts[2]):
            raise FivarError(f"{file}: member {mem.name!r} is not a library, manifest or C++/CUDA source (an "
                             "archive carries no code fivar would run); refusing to import")
    for mem in mems:
        parts = mem.name.split("/")
        if mem.name in seen:
            raise FivarError(f"{file}: member {mem.name!r} appears twice; refusing to import")
        seen.add(mem.name)
        what, cap = (("library", member_cap) if parts[2].endswith(".so") else
                     ("manifest", MANIFEST_MAX) if parts[2] == manifests.NAME else
                     ("source", min(SOURCE_MAX, member_cap)))
        if mem.size > cap:
            raise FivarError(f"{file}: member {mem.name!r} is {human_size(mem.size)}, over the {human_size(cap)} cap "
                             f"on a {what}{' (--max-member-size raises it)' if what == 'library' else ''}; refusing "
                             "to import; nothing was written")
        total += mem.size
        if total > total_cap:
            raise FivarError(f"{file}: its members add up to more than {human_size(total_cap)} (--max-total-size "
                             "raises the cap); refusing to import; nothing was written")
        if files is not None and (files.get(mem.name) or {}).get("size") != mem.size:
            how = "not in" if mem.name not in files else "another size than"
            raise FivarError(f"{file}: member {mem.name!r} is {how} the archive's index; refusing to import")
        members.setdefault(parts[1], []).append(mem)
    missing = sorted(set(files or ()) - seen)
    if missing:
        raise FivarError(f"{file}: the archive's index lists {missing[0]!r}, which the archive does not hold; "
                         "refusing to import")
    return members


def _new_staging(jit_dir: Path, uri: str, held: contextlib.ExitStack) -> Path:
    """A staging folder for `uri`, locked (fivar.jit.locks) until the import ends, so a concurrent import's
    cleanup never takes it for a dead one."""
    staging = Path(tempfile.mkdtemp(prefix=f".import-{uri[:40]}-", dir=jit_dir))
    held.enter_context(locks.build_lock(staging))
    return staging


@disk_errors("import the archive")
def import_archive(file, trust_unsigned: bool = False, member_cap: int = 2 << 30, total_cap: int = 16 << 30,
                   warn: Warn | None = None) -> dict:
    """Unpack the export `file` into FlashInfer's JIT cache; refuses one built for another arch/FlashInfer/nvcc.

    Libraries are imported only from an archive signed by a trusted key (fivar.trust); from an unsigned or
    untrusted one only the C++/CUDA sources are, and the modules build here on first use (trust_unsigned takes
    the libraries anyway, after a warning to `warn`). No library over `member_cap` bytes, no more than
    `total_cap` in all. Returns what was imported, imported as sources only, already present and kept as it was.
    """
    from .. import trust
    tc = current_toolchain()
    try:
        tar = tarfile.open(file, "r:gz")
        tar.getmembers()  # reads the whole archive: a truncated or corrupt one fails here, not midway
    except (tarfile.TarError, OSError, EOFError, zlib.error) as ex:
        raise FivarError(f"{file} is not a readable fivar cache export (a gzip tar archive): "
                         f"{ex or type(ex).__name__}") from None
    with tar:
        index = _read_small(tar, META_NAME, META_MAX, file)
        meta = read_export_meta(index, file)
        verdict = trust.check(index, _read_small(tar, SIG_NAME, SIG_MAX, file), file)
        bad = [k for k in ("arch", "flashinfer", "nvcc") if meta.get(k) != tc.get(k)]
        unknown = [k for k in ("arch", "nvcc") if tc.get(k) is None]
        if unknown:
            raise FivarError(f"cannot import {file} (built for arch {meta.get('arch')}): this machine's "
                             f"{' and '.join(unknown)} is unknown; {ARCH_HINT}, and CUDA_HOME")
        if bad:
            side = lambda d: ", ".join(f"{k} {d.get(k)}" for k in ("arch", "flashinfer", "nvcc"))  # noqa: E731
            raise FivarError(f"cannot import {file}: it was built for {side(meta)}, but this machine has "
                             f"{side(tc)} (mismatch: {', '.join(bad)}); rebuild with `fivar build --prewarm` "
                             "instead")
        members = _checked_members(tar, meta, file, member_cap, total_cap)
        binaries = verdict.status == "trusted" or trust_unsigned
        provenance = ({"kind": "signed", "signer": verdict.signer} if verdict.status == "trusted" else
                      {"kind": "unsigned", **({"signer": verdict.signer} if verdict.signer else {})})
        jit_dir, gen_root = workspace_dirs()
        jit_dir.mkdir(parents=True, exist_ok=True)
        for d in stale_staging([jit_dir]):  # left by an import that was killed
            shutil.rmtree(d, ignore_errors=True)
        imported, sources_only, present, skipped = [], [], [], []
        staged: list[tuple[str, Path, dict]] = []
        held = contextlib.ExitStack()
        try:
            # every entry is unpacked and checked first (index hashes, manifest, sources against the URI), so a
            # bad one leaves the cache as it was instead of half imported
            for ent in meta.get("entries", []):
                uri = ent["uri"]
                staging = _new_staging(jit_dir, uri, held)
                staged.append((uri, staging, {}))
                for mem in members.get(uri, []):
                    kind, _, name = mem.name.split("/")
                    if kind == "cached_ops" and name.endswith(".so") and not binaries:
                        continue  # native code from an archive nobody trusted: never written
                    _extract(tar, mem, staging / kind / name, (meta.get("files") or {}).get(mem.name), file)
                staged[-1][2].update(_check_staged(file, uri, ent, staging, binaries))
            if verdict.status != "trusted" and trust_unsigned:  # checked whole: about to install
                whose = f"signed by key {verdict.signer}, which is not trusted here" if verdict.signer else "unsigned"
                (warn or log_warning)(f"WARNING: importing the native libraries of {file} although it is {whose} "
                                       "(--trust-unsigned): they run with your privileges when loaded")
            for uri, staging, man in staged:
                entry = Entry(uri, jit_dir / uri, gen_root / uri, jit_dir / uri / locks.BUILD_LOCK, None, 0)
                with locks.evict_lock(entry.build_dir) as why:
                    entry.manifest, entry.manifest_problem = manifests.read(entry.build_dir / manifests.NAME)
                    if entry.manifest and not [p for p in verify_entry(entry) if "sources missing" not in p]:
                        present.append(uri)
                        continue
                    if why:  # being built here, or loaded by a live process: left alone
                        skipped.append({"uri": uri, "skipped": why})
                        continue
                    if binaries:
                        _install(entry, staging, {**man, "provenance": provenance}, file)
                        imported.append(uri)
                    else:
                        _install_sources(entry, staging)
                        sources_only.append(uri)
        finally:
            held.close()
            for _, staging, _ in staged:
                shutil.rmtree(staging, ignore_errors=True)
    return {"file": str(file), "imported": imported, "sources_only": sources_only, "already_present": present,
            "skipped": skipped, "trust": verdict.status, "signer": verdict.signer}


def _extract(tar: tarfile.TarFile, mem: tarfile.TarInfo, dest: Path, listed: dict | None, file) -> None:
    """One member into the staging folder (at most its checked size), as data: never an executable bit; its
    sha256 must be the index's."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tar.extractfile(mem) as src, open(dest, "wb") as out:
        h = _Hashing(src)
        shutil.copyfileobj(h, out)
    os.chmod(dest, 0o644)
    if listed is not None and (h.sha.hexdigest() != listed["sha256"] or h.size != listed["size"]):
        raise FivarError(f"{file}: {mem.name} does not match its sha256 in the archive's index (altered); "
                         "nothing was imported")


def _install(entry: Entry, staging: Path, man: dict, file) -> None:
    """Move a checked module into place under its lock, its manifest (with where the library came from) last:
    the module is whole once that exists. Any failure takes back what was moved."""
    moved: list[Path] = []
    tmp = entry.build_dir / f".{manifests.NAME}.{os.getpid()}.tmp"
    try:
        for p in entry.build_dir.iterdir() if entry.build_dir.is_dir() else []:
            if p.name not in (locks.BUILD_LOCK, locks.HOLD_LOCK):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        entry.build_dir.mkdir(parents=True, exist_ok=True)
        for p in (staging / "cached_ops").iterdir():
            if p.name != manifests.NAME:
                os.replace(p, entry.build_dir / p.name)
                moved.append(entry.build_dir / p.name)
        if (staging / "generated").is_dir():
            shutil.rmtree(entry.gen_dir, ignore_errors=True)
            entry.gen_dir.mkdir(parents=True, exist_ok=True)
            for p in (staging / "generated").iterdir():
                os.replace(p, entry.gen_dir / p.name)
        st = entry.library_path.stat()
        man.update(so_size=st.st_size, so_mtime_ns=st.st_mtime_ns, imported_from=str(file), imported=time.time())
        tmp.write_text(json.dumps(man, indent=1))
        os.replace(tmp, entry.build_dir / manifests.NAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        for p in moved:
            p.unlink(missing_ok=True)
        raise


def _install_sources(entry: Entry, staging: Path) -> None:
    """An untrusted archive's sources only (they hash to the URI, so they are what this machine renders too);
    the module has no library or manifest, so its first use builds it here."""
    if not (staging / "generated").is_dir():
        return
    entry.gen_dir.mkdir(parents=True, exist_ok=True)
    for p in (staging / "generated").iterdir():
        os.replace(p, entry.gen_dir / p.name)


def _check_staged(file, uri: str, ent: dict, staging: Path, binaries: bool = True) -> dict:
    """The staged module of `uri`, checked against its own content: its manifest (validated, of this URI, naming
    what the URI names and what the index says), its library (sha256 of the manifest and of the index; only
    where libraries are imported), its sources (exactly the manifest's, hashing to the URI). Returns the
    manifest; FivarError when anything is off (nothing is imported then)."""
    from .build import _sha256
    man, problem = manifests.read(staging / "cached_ops" / manifests.NAME)
    if man is None:
        why = "manifest missing" if problem == "missing" else problem
        raise FivarError(f"{file}: {uri}: {why}; nothing was imported")
    if man["uri"] != uri:
        raise FivarError(f"{file}: the manifest of {uri} names {man['uri']}; nothing was imported")
    differ = [k for k in INDEXED_FIELDS if k in ent and ent[k] != man.get(k)]
    if "so_sha256" in differ:
        raise FivarError(f"{file}: the library of {uri} is missing or corrupt (sha256 mismatch between its "
                         "manifest and the archive's index); nothing was imported")
    if differ:
        raise FivarError(f"{file}: the manifest of {uri} and the archive's index disagree on "
                         f"{', '.join(differ)}; nothing was imported")
    if not variant_matches_uri(man, uri):
        raise FivarError(f"{file}: the manifest of {uri} names variant {man['variant']!r} ({man.get('target')} "
                         f"{man['op']} {man['dtype']} hd{man['head_dim']}), not the module its URI names; nothing "
                         "was imported")
    so = staging / "cached_ops" / f"{uri}.so"
    if binaries and (not so.exists() or _sha256(so) != man["so_sha256"] or
                     ent.get("so_sha256") not in (None, man["so_sha256"])):
        raise FivarError(f"{file}: the library of {uri} is missing or corrupt (sha256 mismatch); "
                         "nothing was imported")
    if "cuda_cflags" not in man:
        raise FivarError(f"{file}: the manifest of {uri} predates content checks (schema 1: no cuda_cflags), so its "
                         "sources cannot be checked against its URI; re-export it with this fivar. Nothing was "
                         "imported")
    gen = staging / "generated"
    shipped = sorted(p.name for p in gen.iterdir()) if gen.is_dir() else []
    if shipped != sorted(man["sources"]):
        raise FivarError(f"{file}: the generated sources of {uri} are not the ones its manifest lists "
                         f"(extra: {sorted(set(shipped) - set(man['sources']))[:3]}, missing: "
                         f"{sorted(set(man['sources']) - set(shipped))[:3]}); nothing was imported")
    if not sources_match_uri(uri, gen, man):
        raise FivarError(f"{file}: the sources of {uri} do not hash to its URI (tampered, or another fivar's "
                         "hash); nothing was imported")
    if man.get("variant_file") and inside(Path(man["variant_file"]), untrusted_roots()):
        man["variant_file"] = None  # a path into the cache is never a variant file (and never loaded)
    man.pop("provenance", None)  # an archive never says where its library came from: the importer does
    return man
