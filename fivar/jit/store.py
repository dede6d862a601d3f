"""fivar's modules in FlashInfer's JIT cache, as data: scan, annotate, verify, prune, clear (`fivar cache`).

An *entry* is one fivar module directory, `<FlashInfer cache>/<flashinfer version>/<arch>/cached_ops/fivar_*`,
with its generated sources beside it in `.../generated/<uri>`. Every FlashInfer-version/arch workspace under
FlashInfer's cache dir (FLASHINFER_WORKSPACE_BASE/.cache/flashinfer) is scanned, so modules left behind by an
older FlashInfer or another arch show up as stale. Usage (hits, last use, holders) comes from the records
database (fivar.jit.records, under FIVAR_CACHE_DIR); whether a module is in use or being built comes from
its own directory (fivar.jit.locks), whoever's FIVAR_CACHE_DIR recorded it.

Nothing here executes a file the cache holds (fivar.jit.integrity says how a module is checked and how its
staleness is decided); archives are fivar.jit.archive. Functions return data and raise FivarError; they print
nothing (a warning goes to the `warn` callable a caller passes, else to the "fivar" logger).
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
import sqlite3
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import FivarError
from . import locks
from . import manifest as manifests
from .integrity import ARCH_HINT, NO_MANIFEST, UNKNOWN_TOOLCHAIN, staleness, verify_entry

__all__ = ["ARCH_HINT", "BUILD_RUNNING", "NO_MANIFEST", "UNKNOWN_TOOLCHAIN", "Entry", "Warn", "annotate", "clear",
           "current_toolchain", "details", "disk_error", "disk_errors", "evict", "find", "flashinfer_cache_root",
           "human_age", "human_size", "in_use", "lock_is_held", "log_warning", "parse_duration", "parse_size",
           "prune", "scan_entries", "stale_staging", "staleness", "usage_stats", "verify", "verify_entry",
           "workspace_dirs"]

log = logging.getLogger("fivar")
#: where a warning goes: one line of text (the CLI writes it to stderr)
Warn = Callable[[str], None]


# --------------------------------------------------------------------------------------------- helpers

def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise FivarError(f"cannot read size {text!r}: use e.g. 500M, 2G, 1.5GiB or a byte count")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smhdw])\s*", text.lower())  # a unit is required: is "7" days?
    if not m:
        raise FivarError(f"cannot read duration {text!r}: a number and a unit, e.g. 45s, 30m, 12h, 7d, 2w")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def human_age(t: float | None) -> str:
    if not t:
        return "-"
    d = max(0.0, time.time() - t)
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= s:
            return f"{d / s:.0f}{unit} ago"
    return f"{d:.0f}s ago"


def disk_error(e: OSError, doing: str) -> FivarError:
    """One line for a filesystem failure of a cache command (full disk, read-only workspace, ...)."""
    where = f"{e.filename}: " if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "no space left on device; free space (`fivar cache prune --max-size ...`) or use a disk with room"
    elif e.errno == errno.EROFS:
        hint = "read-only file system; run it where the cache is writable (FLASHINFER_WORKSPACE_BASE)"
    else:
        hint = e.strerror or str(e) or type(e).__name__
    return FivarError(f"cannot {doing}: {where}{hint}; nothing was left half-written")


def disk_errors(doing: str):
    """A cache command whose filesystem failures (OSError, SQLite's full or read-only disk) are one line."""
    def wrap(f):
        @functools.wraps(f)
        def run(*args, **kwargs):
            try:
                return f(*args, **kwargs)
            except OSError as e:
                raise disk_error(e, doing) from None
            except sqlite3.OperationalError as e:
                if not re.search(r"full|readonly|read-only|disk I/O", str(e)):
                    raise
                raise FivarError(f"cannot {doing}: fivar's records: {e}") from None
        return run
    return wrap


def flashinfer_cache_root() -> Path:
    from flashinfer.jit import env as jit_env
    return jit_env.FLASHINFER_CACHE_DIR


def workspace_dirs() -> tuple[Path, Path]:
    """This FlashInfer's and arch's module directory and generated-sources directory (where imports go)."""
    from flashinfer.jit import env as jit_env
    return jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR


def current_toolchain() -> dict:
    """arch / flashinfer / nvcc of this process (None where it cannot be determined)."""
    from . import toolchain
    out = {"flashinfer": toolchain.flashinfer_version(), "arch": None, "nvcc": None}
    try:
        toolchain.ensure_arch_env()
        out["arch"] = toolchain.arch_tag() or None
    except FivarError:
        pass
    try:
        out["nvcc"] = toolchain.nvcc_version()
    except FivarError:
        pass
    return out


def _dir_size(d: Path) -> int:
    total = 0
    if d.is_dir():
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except OSError:
                    pass
    return total


@dataclass
class Entry:
    uri: str
    build_dir: Path
    gen_dir: Path
    lock_path: Path
    manifest: dict | None
    size: int
    #: why the manifest is unusable ('missing', or 'malformed manifest: ...'); None when it is valid
    manifest_problem: str | None = None
    hits: int = 0
    last_use: float | None = None
    compile_seconds: float | None = None
    stale: bool | None = None
    reasons: list[str] = field(default_factory=list)
    holders: list[int] = field(default_factory=list)

    @property
    def provenance(self) -> str:
        m = self.manifest or {}
        if not m:
            return "-"
        text = f"{m.get('variant')} {m.get('target')} {m.get('op')} {m.get('dtype')} hd{m.get('head_dim')}"
        return " ".join([text, *_option_labels(m.get("options") or {})])

    @property
    def library_path(self) -> Path:
        return self.build_dir / f"{self.uri}.so"

    def to_json(self) -> dict:
        m = self.manifest or {}
        return {"uri": self.uri, "path": str(self.build_dir), "generated": str(self.gen_dir),
                "size_bytes": self.size, "compile_seconds": self.compile_seconds, "hits": self.hits,
                "last_use": self.last_use, "variant": m.get("variant"), "target": m.get("target"),
                "op": m.get("op"), "dtype": m.get("dtype"), "head_dim": m.get("head_dim"),
                "arch": m.get("arch"), "flashinfer": m.get("flashinfer"), "nvcc": m.get("nvcc"),
                "stale": self.stale, "stale_reasons": self.reasons, "live_holders": self.holders,
                "provenance": m.get("provenance", {"kind": "build"} if m and not m.get("imported_from") else None)}


def _option_labels(options: dict) -> list[str]:
    """What tells apart two modules of one (variant, op, dtype, head dim): the FA3 softmax, split, tile and
    schedule; FA2's CTA-tile split and nvcc --split-compile (labelled when off, its default being on)."""
    out = []
    if options.get("bounded_softmax"):
        out.append("bounded")
    if options.get("exp2_emulated_of_8") is not None:
        out.append(f"exp2/8={options['exp2_emulated_of_8']}")
    if options.get("cta_tile"):
        out.append(f"tile {options['cta_tile']}")
    if options.get("schedule", "grid") != "grid":
        out.append(f"schedule {options['schedule']}")
    if options.get("tile_list"):
        out.append("tile-list")
    if options.get("split_cta_tiles"):
        out.append("cta-split")
    if options.get("nvcc_split_compile") is False:
        out.append("no-split-compile")
    if options.get("nvcc_parallel_passes") is False:
        out.append("serial-passes")
    return out


def scan_entries() -> list[Entry]:
    root = flashinfer_cache_root()
    out = []
    ops_dirs = sorted(set(root.glob("*/cached_ops")) | set(root.glob("*/*/cached_ops")))
    for ops in ops_dirs:
        for d in sorted(ops.glob("fivar_*")):
            if not d.is_dir():
                continue
            man, problem = manifests.read(d / manifests.NAME)
            gen = ops.parent / "generated" / d.name
            out.append(Entry(d.name, d, gen, d / locks.BUILD_LOCK, man, _dir_size(d) + _dir_size(gen),
                             manifest_problem=problem))
    return out

def _records():
    from . import records
    records.flush()
    return records


def annotate(entries: list[Entry], check_stale: bool = True, warn: Warn | None = None) -> list[Entry]:
    """Fill hits / last use / compile seconds / holders from the records, and staleness."""
    records = _records()
    con = records.connect()
    try:
        usage = _tolerant(lambda: records.usage(con), {}, warn)
        for e in entries:
            u = usage.get(e.uri, {})
            man = e.manifest or {}
            e.hits = _number(u.get("hits"), int) or 0
            fallback = man.get("created") or _mtime(e.build_dir)
            e.last_use = max(_number(u.get("last_use")) or 0.0, fallback or 0.0) or None
            e.compile_seconds = man.get("compile_seconds", _number(u.get("compile_seconds")))  # the build's
            e.holders = _tolerant(lambda: records.live_holders(con, e.uri), [], warn)
    finally:
        con.close()
    if check_stale:
        tc = current_toolchain()
        variants: dict = {}
        for e in entries:
            e.stale, e.reasons = staleness(e, tc, variants)
    return entries


def _number(x, kind=float):
    """A records value as a number, None where a damaged database holds something else there."""
    try:
        return None if x is None or isinstance(x, (str, bytes)) else kind(x)
    except (TypeError, ValueError):
        return None


def _tolerant(read, fallback, warn: Warn | None = None):
    """What a records query gives, or `fallback` where the database holds rows of the wrong types (SQLite
    keeps whatever was written): usage figures are advice, and `clear --records` resets them."""
    try:
        return read()
    except (TypeError, ValueError, sqlite3.DatabaseError) as ex:
        _warn_records(ex, warn)
        return fallback


_records_warned: list[bool] = []


def log_warning(text: str) -> None:
    log.warning("%s", text)


def _warn_records(ex: BaseException, warn: Warn | None) -> None:
    if not _records_warned:  # once per process
        _records_warned.append(True)
        (warn or log_warning)(f"warning: fivar's build records hold malformed rows ({type(ex).__name__}: {ex}); "
                               "usage is not shown (`fivar cache clear --records` resets them)")


def _mtime(p: Path) -> float | None:
    try:
        return p.stat().st_mtime
    except OSError:
        return None


def find(uri: str) -> Entry:
    entries = scan_entries()
    hits = [e for e in entries if e.uri == uri] or [e for e in entries if e.uri.startswith(uri)]
    if not hits:
        raise FivarError(f"no fivar module {uri!r} in FlashInfer's JIT cache ({flashinfer_cache_root()}); "
                         "see `fivar cache ls`")
    if len(hits) > 1:
        raise FivarError(f"{uri!r} matches {len(hits)} modules: {', '.join(e.uri for e in hits[:5])}")
    return hits[0]


def lock_is_held(lock_path: Path) -> bool:
    """Whether a build holds the module lock `lock_path` (`<build dir>/.fivar.lock`, fivar.jit.locks)."""
    return locks.build_lock_held(Path(lock_path).parent)


BUILD_RUNNING = "its build lock is held (a build is running)"


def in_use(e: Entry) -> str | None:
    """Whether a live process has the module loaded: its hold lock, in the module's own directory."""
    if not locks.holders_present(e.build_dir):
        return None
    pids = f" (pid {', '.join(map(str, e.holders))} per the records)" if e.holders else ""
    return f"held by live process(es) that loaded it{pids}"


def evict(e: Entry) -> str | None:
    """Delete an entry under its locks. Returns why it was skipped, or None when it was removed."""
    with locks.evict_lock(e.build_dir) as why:
        if why:
            return (in_use(e) or why) if "held by" in why else why
        _rmtree(e.gen_dir)
        _remove_module_dir(e.build_dir)
    return None


def _rmtree(d: Path) -> None:
    """rmtree that lets a real failure through (a read-only workspace must not be reported as cleared); a file
    a concurrent process removed first is fine."""
    def onerror(func, path, exc_info):
        if not isinstance(exc_info[1], FileNotFoundError):
            raise exc_info[1]
    if os.path.lexists(d):
        shutil.rmtree(d, onerror=onerror)


def _remove_module_dir(d: Path) -> None:
    """Everything but the lock files first (a library never outlives its manifest half-deleted), then the
    directory: a process waiting on the lock finds its file unlinked and starts over (fivar.jit.locks)."""
    for name in (manifests.NAME,):
        (d / name).unlink(missing_ok=True)
    _rmtree(d)


def stale_staging(dirs: list[Path] | None = None) -> list[Path]:
    """Staging folders of imports that are not running (killed midway): nobody holds their lock. One made a
    moment ago, before its importer could lock it, is left alone."""
    if dirs is None:
        root = flashinfer_cache_root()
        dirs = sorted(set(root.glob("*/cached_ops")) | set(root.glob("*/*/cached_ops")))
    out = []
    for ops in dirs:
        for d in sorted(Path(ops).glob(".import-*")):
            if not d.is_dir() or d.is_symlink():
                continue
            if (d / locks.BUILD_LOCK).exists() and not locks.build_lock_held(d) or \
                    not (d / locks.BUILD_LOCK).exists() and time.time() - (_mtime(d) or 0) > 60:
                out.append(d)
    return out


# --------------------------------------------------------------------------------------------- operations

def details(uri: str, events: int = 20, warn: Warn | None = None) -> tuple[Entry, dict]:
    """The module `uri` names (or the one whose URI starts with it), annotated, and what `fivar cache show`
    gives: its manifest, files and `events` most recent build/load events."""
    e = annotate([find(uri)], warn=warn)[0]
    records = _records()
    con = records.connect()
    try:
        cur = con.execute("SELECT time, action, kind, count, seconds, host, pid FROM events WHERE uri=? "
                          "ORDER BY time DESC LIMIT ?", (e.uri, events))
        evs = [dict(zip(("time", "action", "kind", "count", "seconds", "host", "pid"), r)) for r in cur]
    finally:
        con.close()
    files = sorted(str(p.relative_to(e.build_dir.parent.parent)) for d in (e.build_dir, e.gen_dir)
                   if d.is_dir() for p in d.rglob("*") if p.is_file())
    return e, {**e.to_json(), "manifest": e.manifest, "files": files, "events": evs}


def usage_stats(window: str) -> dict:
    """Hit rate and compile-time distribution over the last `window` (e.g. 12h, 7d, 4w)."""
    since = time.time() - parse_duration(window)
    records = _records()
    con = records.connect()
    try:
        counts = dict(con.execute("SELECT kind, SUM(count) FROM events WHERE time >= ? GROUP BY kind", (since,)))
        colds = [r[0] for r in con.execute("SELECT seconds FROM events WHERE time >= ? AND kind='cold' "
                                           "ORDER BY seconds", (since,))]
        per_variant = con.execute(
            "SELECT variant, SUM(CASE WHEN kind='cold' THEN count ELSE 0 END), "
            "SUM(CASE WHEN kind!='cold' THEN count ELSE 0 END), "
            "SUM(CASE WHEN kind='cold' THEN seconds ELSE 0 END) FROM events WHERE time >= ? "
            "GROUP BY variant ORDER BY 4 DESC", (since,)).fetchall()
    finally:
        con.close()
    cold, disk, mem = (counts.get(k, 0) for k in ("cold", "disk", "memory"))
    total = cold + disk + mem

    def q(p):
        return colds[min(len(colds) - 1, int(round(p * (len(colds) - 1))))] if colds else None
    return {"window": window, "since": since, "requests": total, "cold": cold, "disk_hits": disk,
            "memory_hits": mem, "hit_rate": (disk + mem) / total if total else None,
            "disk_hit_rate": disk / (disk + cold) if disk + cold else None,
            "compile_seconds": {"count": len(colds), "total": sum(colds),
                                "mean": statistics.fmean(colds) if colds else None,
                                "min": colds[0] if colds else None, "p50": q(0.5), "p90": q(0.9),
                                "max": colds[-1] if colds else None},
            "per_variant": [{"variant": v, "cold": c, "hits": h, "compile_seconds": s}
                            for v, c, h, s in per_variant]}


@disk_errors("verify the cache")
def verify(prefix: str = "", fix: bool = False) -> list[dict]:
    """Every module whose URI starts with `prefix` checked (verify_entry), one result each; with `fix`, a broken
    one is removed so its next use rebuilds it. Without a prefix, also the staging folders killed imports left."""
    results = []
    for e in scan_entries():
        if not e.uri.startswith(prefix):
            continue
        if e.manifest is None and lock_is_held(e.lock_path):  # not broken: its build has not finished yet
            results.append({"uri": e.uri, "ok": True, "problems": [], "fixed": False, "building": True})
            continue
        problems = verify_entry(e)
        fixed = False
        if problems and fix and any("sources missing" not in p for p in problems):
            with locks.evict_lock(e.build_dir) as why:  # a build writing this library, or a holder, wins
                if why is None:
                    if any(w in p for p in problems for w in ("tampered", "malformed", "do not hash", "untrusted")):
                        # nothing of it is trusted: the next use rebuilds it from the variant
                        _rmtree(e.gen_dir)
                        _remove_module_dir(e.build_dir)
                    else:  # the library only: the next build relinks it from the objects
                        (e.build_dir / manifests.NAME).unlink(missing_ok=True)
                        e.library_path.unlink(missing_ok=True)
                    fixed = True
                else:
                    problems.append(f"not fixed: {why}")
        results.append({"uri": e.uri, "ok": not problems, "problems": problems, "fixed": fixed})
    if prefix and not results:
        raise FivarError(f"no module in the cache has a URI starting with {prefix!r} (`fivar cache ls` lists them)")
    for d in [] if prefix else stale_staging():  # what a killed import left
        if fix:
            _rmtree(d)
        results.append({"uri": d.name, "ok": False, "problems": [f"staging folder of an interrupted import ({d})"],
                        "fixed": fix, "staging": True})
    return results


@disk_errors("prune the cache")
def prune(max_size: str | None = None, older_than: str | None = None, stale_only: bool = False,
          dry_run: bool = False, warn: Warn | None = None) -> dict:
    """Evict least-recently-used modules (over `max_size`, unused for `older_than`, and/or stale); never one a
    live process has loaded or one being built. Returns what was (or, with dry_run, would be) evicted and kept."""
    if not (max_size or older_than or stale_only):
        raise FivarError("say what to prune: --max-size SIZE, --older-than DURATION and/or --stale")
    if stale_only:
        tc = current_toolchain()
        if tc["arch"] is None or tc["nvcc"] is None:
            raise FivarError("cannot tell which modules are stale without the current arch and nvcc: "
                             f"{ARCH_HINT}, and CUDA_HOME")
    entries = annotate(scan_entries(), check_stale=stale_only, warn=warn)
    entries.sort(key=lambda e: e.last_use or 0.0)  # least recently used first
    chosen: dict[str, str] = {}
    if stale_only:
        chosen.update({e.uri: "stale: " + "; ".join(e.reasons) for e in entries if e.stale})
    if older_than:
        cutoff = time.time() - parse_duration(older_than)
        chosen.update({e.uri: f"unused since {human_age(e.last_use)}" for e in entries
                       if (e.last_use or 0) < cutoff and e.uri not in chosen})
    def evictable(e):
        return not in_use(e) and not lock_is_held(e.lock_path)
    if max_size:
        limit = parse_size(max_size)  # what stays: everything not chosen, and what is chosen but cannot go
        total = sum(e.size for e in entries if e.uri not in chosen or not evictable(e))
        for e in entries:
            if total <= limit:
                break
            if e.uri not in chosen:  # one in use is reported as kept below, and counts as still there
                chosen[e.uri] = f"LRU, over --max-size {max_size}"
                if evictable(e):
                    total -= e.size
    evicted, skipped = [], []
    for e in entries:
        if e.uri not in chosen:
            continue
        why_not = in_use(e) or (BUILD_RUNNING if lock_is_held(e.lock_path) else None)
        if why_not is None and not dry_run:
            why_not = evict(e)
        row = {"uri": e.uri, "size_bytes": e.size, "reason": chosen[e.uri], "last_use": e.last_use}
        if why_not:
            skipped.append({**row, "skipped": why_not})
        else:
            evicted.append(row)
    if not dry_run:
        records = _records()
        con = records.connect()
        try:
            _tolerant(lambda: records.forget_dead_holders(con), 0, warn)
        finally:
            con.close()
    return {"dry_run": dry_run, "evicted": evicted, "skipped": skipped,
            "freed_bytes": sum(r["size_bytes"] for r in evicted)}


@disk_errors("clear the cache")
def clear(entries: list[Entry], wipe_records: bool = False) -> dict:
    """Delete these entries (scan_entries()), except ones in use or being built; with wipe_records also the
    build/load records."""
    removed, kept = [], []
    for e in entries:
        why = evict(e)
        (kept if why else removed).append({"uri": e.uri, **({"skipped": why} if why else {})})
    if wipe_records:
        records = _records()
        con = records.connect()
        try:
            try:
                con.execute("DELETE FROM events")
                con.execute("DELETE FROM holders")
            except sqlite3.DatabaseError:  # tables of another shape: made anew
                con.executescript("DROP TABLE IF EXISTS events; DROP TABLE IF EXISTS holders;" + records.SCHEMA)
        finally:
            con.close()
    return {"removed": removed, "kept": kept, "records_cleared": wipe_records}
