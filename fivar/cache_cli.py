"""`fivar cache`: look at, verify, prune, clear, export and import fivar's modules in FlashInfer's JIT cache.

An *entry* is one fivar module directory, `<FlashInfer cache>/<flashinfer version>/<arch>/cached_ops/fivar_*`,
with its generated sources beside it in `.../generated/<uri>`. Every FlashInfer-version/arch workspace under
FlashInfer's cache dir (FLASHINFER_WORKSPACE_BASE/.cache/flashinfer) is scanned, so modules left behind by an
older FlashInfer or another arch show up as stale. Usage (hits, last use, holders) comes from the records
database (fivar.jit.records, under FIVAR_CACHE_DIR); whether a module is in use or being built comes from
its own directory (fivar.jit.locks), whoever's FIVAR_CACHE_DIR recorded it.

Nothing here executes a file the cache holds: manifests are data (validated by fivar.jit.manifest), staleness
re-renders a variant found *by name* on the user's variant search path (what `fivar list` loads), never from a
path a manifest names, and an import takes only manifests and C++/CUDA sources whose content hash is the URI's,
plus libraries only from an archive signed by a trusted key (fivar.trust; `--trust-unsigned` overrides).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import json
import os
import re
import shutil
import socket
import sqlite3
import statistics
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import click
from rich.console import Console
from rich.table import Column, Table

from .console import console_width
from .errors import FivarError
from .jit import locks
from .jit import manifest as manifests

console = Console(width=console_width())
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


def _flashinfer_cache_root() -> Path:
    from flashinfer.jit import env as jit_env
    return jit_env.FLASHINFER_CACHE_DIR


#: where the arch comes from when no GPU is visible (`--arch` belongs to the group: `fivar cache --arch 9.0a ls`)
ARCH_HINT = "set FLASHINFER_CUDA_ARCH_LIST or pass `fivar cache --arch 9.0a <command>`"
UNKNOWN_TOOLCHAIN = f"unknown: no arch or nvcc to compare with ({ARCH_HINT}, and CUDA_HOME)"


#: an entry with objects but no manifest: a build that did not finish, or a library `verify --fix` removed
NO_MANIFEST = "no manifest (an interrupted or failed build, or removed by verify --fix): rebuilds on next use"


def current_toolchain() -> dict:
    """arch / flashinfer / nvcc of this process (None where it cannot be determined)."""
    from .jit import toolchain
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
    root = _flashinfer_cache_root()
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
    from .jit import records
    records.flush()
    return records


def annotate(entries: list[Entry], check_stale: bool = True) -> list[Entry]:
    """Fill hits / last use / compile seconds / holders from the records, and staleness."""
    records = _records()
    con = records.connect()
    try:
        usage = _tolerant(lambda: records.usage(con), {})
        for e in entries:
            u = usage.get(e.uri, {})
            man = e.manifest or {}
            e.hits = _number(u.get("hits"), int) or 0
            fallback = man.get("created") or _mtime(e.build_dir)
            e.last_use = max(_number(u.get("last_use")) or 0.0, fallback or 0.0) or None
            e.compile_seconds = man.get("compile_seconds", _number(u.get("compile_seconds")))  # the build's
            e.holders = _tolerant(lambda: records.live_holders(con, e.uri), [])
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


def _tolerant(read, fallback):
    """What a records query gives, or `fallback` where the database holds rows of the wrong types (SQLite
    keeps whatever was written): usage figures are advice, and `clear --records` resets them."""
    try:
        return read()
    except (TypeError, ValueError, sqlite3.DatabaseError) as ex:
        _warn_records(ex)
        return fallback


_records_warned: list[bool] = []


def _warn_records(ex: BaseException) -> None:
    if not _records_warned:
        _records_warned.append(True)
        click.echo(f"warning: fivar's build records hold malformed rows ({type(ex).__name__}: {ex}); usage is not "
                   "shown (`fivar cache clear --records` resets them)", err=True)


def _mtime(p: Path) -> float | None:
    try:
        return p.stat().st_mtime
    except OSError:
        return None


def staleness(e: Entry, tc: dict, variants: dict) -> tuple[bool | None, list[str]]:
    """True (with reasons) when the entry can never be loaded again by the current toolchain and variant
    sources; None when it cannot be decided (variant file not found)."""
    man = e.manifest
    if man is None:
        if lock_is_held(e.lock_path):
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
    from .jit.build import gen_module
    try:
        if getattr(v, "kind", None) == "fusion":
            from .fusion.build import gen_fusion_module
            now = gen_fusion_module(v, man["dtype"]).uri
        else:
            # rendered the way it was built (its recorded config), not as this process's environment would
            # render it now
            options = dict(man.get("options", {}))
            now = gen_module(v, op=man["op"], target=man.get("target", "fa2"), dtype=man["dtype"],
                             head_dim=man["head_dim"], **options).uri
    except Exception as ex:  # noqa: BLE001 - an edited variant may no longer be valid at all
        return True, [f"variant '{man.get('variant')}' no longer builds: {str(ex).splitlines()[0]}"]
    if now != e.uri:
        from .jit.build import variant_file_sha256
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
    roots = [jit_env.FLASHINFER_CACHE_DIR, jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR]
    roots.append(Path(os.environ.get("FIVAR_CACHE_DIR") or Path.home() / ".cache" / "fivar"))
    return [Path(os.path.realpath(r)) for r in roots]


def _inside(path: Path, roots: list[Path]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == r or r in real.parents for r in roots)


def _load_variant(man: dict, cache: dict, uri: str | None = None):
    """The variant the manifest names, as its file reads *now*, or a reason staleness cannot be decided.

    Found by NAME on the registry's search path (FIVAR_VARIANT_PATH, ./variants, fivar's bundled variants: the
    user's own files, which `fivar list` loads anyway), never from the manifest's `variant_file` path and never
    under the caches. Where the manifest says it was built from another file than the one the name finds, that
    file is not loaded: undecidable."""
    from . import registry
    name = man.get("variant")
    if not re.fullmatch(r"[A-Za-z_]\w*", name or ""):
        return f"variant name {name!r} in the manifest is not an identifier: not looked up"
    if uri is not None and not _variant_matches_uri(man, uri):
        return (f"the manifest names variant {name!r}, but {uri} is not a module of it (tampered?): no variant "
                "is looked up")
    if name in cache:
        return cache[name]
    roots = untrusted_roots()
    found = [f for f in registry.all_variant_files().get(name, []) if not _inside(f, roots)]
    built_from = man.get("variant_file")
    if not found:
        v = (f"variant '{name}' is not on the variant search path ({', '.join(map(str, registry.search_path()))}; "
             "FIVAR_VARIANT_PATH adds a directory): cannot re-render it")
    elif built_from and Path(os.path.realpath(built_from)) != Path(os.path.realpath(found[0])):
        where = "inside fivar's or FlashInfer's cache" if _inside(Path(built_from), roots) else "elsewhere"
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


def _find(uri: str) -> Entry:
    entries = scan_entries()
    hits = [e for e in entries if e.uri == uri] or [e for e in entries if e.uri.startswith(uri)]
    if not hits:
        raise FivarError(f"no fivar module {uri!r} in FlashInfer's JIT cache ({_flashinfer_cache_root()}); "
                         "see `fivar cache ls`")
    if len(hits) > 1:
        raise FivarError(f"{uri!r} matches {len(hits)} modules: {', '.join(e.uri for e in hits[:5])}")
    return hits[0]


def lock_is_held(lock_path: Path) -> bool:
    """Whether a build holds the module lock `lock_path` (`<build dir>/.fivar.lock`, fivar.jit.locks)."""
    return locks.build_lock_held(Path(lock_path).parent)


BUILD_RUNNING = "its build lock is held (a build is running)"


def _in_use(e: Entry) -> str | None:
    """Whether a live process has the module loaded: its hold lock, in the module's own directory."""
    if not locks.holders_present(e.build_dir):
        return None
    pids = f" (pid {', '.join(map(str, e.holders))} per the records)" if e.holders else ""
    return f"held by live process(es) that loaded it{pids}"


def _evict(e: Entry) -> str | None:
    """Delete an entry under its locks. Returns why it was skipped, or None when it was removed."""
    with locks.evict_lock(e.build_dir) as why:
        if why:
            return (_in_use(e) or why) if "held by" in why else why
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


def _out(as_json: bool, data, render) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=1, default=str))
    else:
        render()


# --------------------------------------------------------------------------------------------- commands

def arch_option(f):
    """`--arch` on every subcommand too (`fivar cache ls --arch 9.0a`), the same as the group's."""
    def set_arch(ctx, param, value):
        if value is not None:
            from .jit.toolchain import set_arch_env
            set_arch_env(value)
    return click.option("--arch", default=None, expose_value=False, is_eager=True, callback=set_arch,
                        help="target arch of the current toolchain, e.g. 9.0a (as `fivar cache --arch`)")(f)


@click.group()
@click.option("--arch", default=None, help="target arch of the current toolchain, e.g. 9.0a (default: "
              "FLASHINFER_CUDA_ARCH_LIST or the visible GPU)")
def cache(arch):
    """fivar's modules in FlashInfer's JIT cache: ls, show, stats, verify, prune, clear, export, import; keygen
    and trust for signed archives."""
    from .jit.toolchain import set_arch_env
    set_arch_env(arch)


@cache.command("ls")
@arch_option
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-stale-check", is_flag=True, help="skip re-rendering each variant (faster)")
def ls_cmd(as_json, no_stale_check):
    """Every fivar module: size, compile seconds, hits, last use, provenance, stale or not."""
    entries = annotate(scan_entries(), check_stale=not no_stale_check)

    def render():
        t = Table(Column("module", overflow="fold"), "size", "compile s", "hits", "last use", "variant / op / dtype / hd", "status",
                  title=f"fivar cache: {len(entries)} module(s), "
                        f"{human_size(sum(e.size for e in entries))} in {_flashinfer_cache_root()}")
        unknown = any(e.reasons == [UNKNOWN_TOOLCHAIN] for e in entries)
        for e in entries:
            status = ("[red]stale[/]: " + "; ".join(e.reasons)) if e.stale else \
                ("[green]ok[/]" if e.stale is False else
                 "?" if e.reasons == [UNKNOWN_TOOLCHAIN] else "? " + "; ".join(e.reasons))
            if e.holders:
                status += f" (in use: pid {', '.join(map(str, e.holders))})"
            t.add_row(e.uri, human_size(e.size), "-" if e.compile_seconds is None else f"{e.compile_seconds:.1f}",
                      str(e.hits), human_age(e.last_use), e.provenance, status)
        console.print(t)
        if unknown:
            console.print(f"?: {UNKNOWN_TOOLCHAIN}", highlight=False)
    _out(as_json, [e.to_json() for e in entries], render)


@cache.command()
@arch_option
@click.argument("uri")
@click.option("--json", "as_json", is_flag=True)
@click.option("--events", default=20, show_default=True, help="how many recent events to show")
def show(uri, as_json, events):
    """One module: manifest, files, staleness, live holders and its recent build/load events."""
    e = annotate([_find(uri)])[0]
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
    data = {**e.to_json(), "manifest": e.manifest, "files": files, "events": evs}

    def render():
        console.print(f"[bold]{e.uri}[/]  {e.provenance}")
        for k in ("path", "generated", "size_bytes", "compile_seconds", "hits", "arch", "flashinfer", "nvcc"):
            console.print(f"  {k}: {data[k]}", highlight=False)
        console.print(f"  last use: {human_age(e.last_use)}   stale: {e.stale} {'; '.join(e.reasons)}",
                      highlight=False)
        console.print(f"  live holders: {e.holders or '-'}", highlight=False)
        t = Table("when", "action", "kind", "count", "seconds", "host", "pid", title="recent events")
        for ev in evs:
            t.add_row(human_age(ev["time"]), ev["action"], ev["kind"], str(ev["count"]), f"{ev['seconds']:.3f}",
                      ev["host"], str(ev["pid"]))
        console.print(t)
    _out(as_json, data, render)


@cache.command()
@arch_option
@click.option("--window", default="7d", show_default=True, help="how far back, e.g. 12h, 7d, 4w")
@click.option("--json", "as_json", is_flag=True)
def stats(window, as_json):
    """Hit rate and compile-time distribution over a time window."""
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
    data = {"window": window, "since": since, "requests": total, "cold": cold, "disk_hits": disk,
            "memory_hits": mem, "hit_rate": (disk + mem) / total if total else None,
            "disk_hit_rate": disk / (disk + cold) if disk + cold else None,
            "compile_seconds": {"count": len(colds), "total": sum(colds),
                                "mean": statistics.fmean(colds) if colds else None,
                                "min": colds[0] if colds else None, "p50": q(0.5), "p90": q(0.9),
                                "max": colds[-1] if colds else None},
            "per_variant": [{"variant": v, "cold": c, "hits": h, "compile_seconds": s}
                            for v, c, h, s in per_variant]}

    def render():
        hr = "-" if data["hit_rate"] is None else f"{100 * data['hit_rate']:.1f}%"
        console.print(f"[bold]last {window}[/]: {total} requests, {cold} cold compiles, {disk} disk hits, "
                      f"{mem} memory hits; hit rate {hr}", highlight=False)
        cs = data["compile_seconds"]
        if colds:
            console.print(f"compile seconds: n={cs['count']} total={cs['total']:.1f} mean={cs['mean']:.1f} "
                          f"min={cs['min']:.1f} p50={cs['p50']:.1f} p90={cs['p90']:.1f} max={cs['max']:.1f}",
                          highlight=False)
        t = Table("variant", "cold", "hits", "compile s")
        for r in data["per_variant"]:
            t.add_row(str(r["variant"]), str(r["cold"]), str(r["hits"]), f"{r['compile_seconds']:.1f}")
        console.print(t)
    _out(as_json, data, render)


def verify_entry(e: Entry) -> list[str]:
    """Problems with an entry: manifest (shape, library size/mtime and sha256), generated sources (the URI's
    content hash, no stray file), and anything a tampered archive could have planted."""
    from .jit.build import _sha256
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
    if man.get("variant_file") and _inside(Path(man["variant_file"]), untrusted_roots()):
        problems.append(f"manifest names a variant file inside the cache ({man['variant_file']}): tampered; "
                        "it is never loaded")
    if not _variant_matches_uri(man, e.uri):
        problems.append(f"manifest names variant {man['variant']!r}, but the URI is not a module of it: tampered")
    foreign = manifests.origin_problem(man)
    if foreign:
        problems.append(f"library {foreign}: untrusted, never loaded")
    problems += _foreign_files(e)
    missing = [s for s in man["sources"] if not (e.gen_dir / s).exists()]
    if missing:
        problems.append(f"generated sources missing ({', '.join(missing)}); regenerated on the next rebuild")
    elif "cuda_cflags" in man and not _sources_match_uri(e.uri, e.gen_dir, man):
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


def _sources_match_uri(uri: str, gen_dir: Path, man: dict) -> bool:
    """The URI ends in the content hash of the module's sources and flags (fivar.jit.build.content_hash)."""
    from .jit.build import content_hash
    try:
        sources = {n: (gen_dir / n).read_bytes().decode() for n in man["sources"]}
    except (OSError, UnicodeDecodeError):
        return False
    return uri.endswith("_" + content_hash(sources, man["cuda_cflags"]))


@cache.command()
@arch_option
@click.option("--fix", is_flag=True, help="delete invalid libraries (and their manifests) so the next build "
              "rebuilds them")
@click.option("--json", "as_json", is_flag=True)
@click.argument("prefix", required=False, default="")
@disk_errors("verify the cache")
def verify(fix, as_json, prefix):
    """Check modules' libraries against their manifests (size, mtime, sha256) and generated sources.

    PREFIX limits the check to modules whose URI starts with it (default: every module).
    """
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

    def render():
        for r in results:
            status = ("[yellow]being built[/]" if r.get("building") else "[green]ok[/]" if r["ok"]
                      else "[red]" + "; ".join(r["problems"]) + "[/]")
            console.print(f"{r['uri']}: {status}{' (removed: rebuilds on next use)' if r['fixed'] else ''}",
                          highlight=False)
        console.print(f"{sum(r['ok'] for r in results)}/{len(results)} ok")
    _out(as_json, results, render)
    if any(not r["ok"] and not r["fixed"] for r in results):
        raise SystemExit(1)


@cache.command()
@arch_option
@click.option("--max-size", default=None, help="evict least-recently-used modules until the total is under "
              "this, e.g. 20G")
@click.option("--older-than", default=None, help="evict modules not used for this long, e.g. 30d")
@click.option("--stale", "stale_only", is_flag=True, help="evict stale modules (other toolchain, edited "
              "variant, interrupted build)")
@click.option("--dry-run", is_flag=True, help="list what would be evicted, evict nothing")
@click.option("--json", "as_json", is_flag=True)
@disk_errors("prune the cache")
def prune(max_size, older_than, stale_only, dry_run, as_json):
    """Evict least-recently-used modules; never one a live process has loaded or one being built."""
    if not (max_size or older_than or stale_only):
        raise FivarError("say what to prune: --max-size SIZE, --older-than DURATION and/or --stale")
    if stale_only:
        tc = current_toolchain()
        if tc["arch"] is None or tc["nvcc"] is None:
            raise FivarError("cannot tell which modules are stale without the current arch and nvcc: "
                             f"{ARCH_HINT}, and CUDA_HOME")
    entries = annotate(scan_entries(), check_stale=stale_only)
    entries.sort(key=lambda e: e.last_use or 0.0)  # least recently used first
    chosen: dict[str, str] = {}
    if stale_only:
        chosen.update({e.uri: "stale: " + "; ".join(e.reasons) for e in entries if e.stale})
    if older_than:
        cutoff = time.time() - parse_duration(older_than)
        chosen.update({e.uri: f"unused since {human_age(e.last_use)}" for e in entries
                       if (e.last_use or 0) < cutoff and e.uri not in chosen})
    def evictable(e):
        return not _in_use(e) and not lock_is_held(e.lock_path)
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
        why_not = _in_use(e) or (BUILD_RUNNING if lock_is_held(e.lock_path) else None)
        if why_not is None and not dry_run:
            why_not = _evict(e)
        row = {"uri": e.uri, "size_bytes": e.size, "reason": chosen[e.uri], "last_use": e.last_use}
        if why_not:
            skipped.append({**row, "skipped": why_not})
        else:
            evicted.append(row)
    if not dry_run:
        records = _records()
        con = records.connect()
        try:
            _tolerant(lambda: records.forget_dead_holders(con), 0)
        finally:
            con.close()
    data = {"dry_run": dry_run, "evicted": evicted, "skipped": skipped,
            "freed_bytes": sum(r["size_bytes"] for r in evicted)}

    def render():
        verb = "would evict" if dry_run else "evicted"
        for r in evicted:
            console.print(f"{verb} {r['uri']} ({human_size(r['size_bytes'])}; {r['reason']})", highlight=False)
        for r in skipped:
            console.print(f"[yellow]kept[/] {r['uri']}: {r['skipped']}", highlight=False)
        console.print(f"{verb} {len(evicted)} module(s), {human_size(data['freed_bytes'])}")
    _out(as_json, data, render)


@cache.command()
@arch_option
@click.option("--records", "wipe_records", is_flag=True, help="also delete the build/load records")
@click.option("--yes", is_flag=True, help="do not ask")
@click.option("--json", "as_json", is_flag=True)
@disk_errors("clear the cache")
def clear(wipe_records, yes, as_json):
    """Delete every fivar module (not FlashInfer's own), except ones in use or being built."""
    entries = annotate(scan_entries(), check_stale=False)
    if not yes and not as_json and entries:
        in_use = sum(bool(_in_use(e)) or lock_is_held(e.lock_path) for e in entries)
        click.confirm(f"delete {len(entries) - in_use} fivar module(s) from {_flashinfer_cache_root()}"
                      + (f" ({in_use} in use or being built stay)" if in_use else "") + "?", abort=True)
    removed, kept = [], []
    for e in entries:
        why = _evict(e)
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
    data = {"removed": removed, "kept": kept, "records_cleared": wipe_records}
    _out(as_json, data, lambda: console.print(
        f"removed {len(removed)} module(s)" + (f", kept {len(kept)} in use" if kept else "")))


@cache.command("export")
@arch_option
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--variant", "variants", multiple=True, help="only these variants (repeatable)")
@click.option("--include-stale", is_flag=True, help="also pack modules whose variant now renders another URI")
@click.option("--sign", "sign_key", type=click.Path(dir_okay=False), default=None,
              help="sign with this ed25519 private key (default: the key `fivar cache keygen` made, if any)")
@click.option("--no-sign", is_flag=True, help="write an unsigned archive even where a default key exists")
@click.option("--json", "as_json", is_flag=True)
@disk_errors("export the cache")
def export_cmd(file, variants, include_stale, sign_key, no_sign, as_json):
    """Pack this toolchain's current modules (.so, manifest, generated sources) into one .tar.gz. A module whose
    variant was edited since it was built (it now renders another URI, so nothing loads it) stays out unless
    --include-stale. The archive's index (every member's sha256 and size, and what each module is) is signed
    with --sign KEY or the default key: only a signed archive's libraries are imported where that key is
    trusted; an unsigned one gives its importers sources only."""
    from . import trust
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
    from flashinfer.jit import env as jit_env
    jit_dir = jit_env.FLASHINFER_JIT_DIR
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
    data = {"file": str(file), "replaced": replaced, "modules": [e.uri for e in packed], "skipped": skipped,
            "stale": stale, "signed_by": signer,
            "bytes": os.path.getsize(file), **{k: tc[k] for k in ("arch", "flashinfer", "nvcc")}}
    _out(as_json, data, lambda: console.print(
        f"exported {len(packed)} module(s) to {file}{' (replacing the file that was there)' if replaced else ''} "
        f"({human_size(data['bytes'])}; arch {tc['arch']}, flashinfer {tc['flashinfer']}, nvcc {tc['nvcc']}); "
        + (f"signed by key {signer}" if signer else
           "[yellow]unsigned[/]: importers take its sources only (`fivar cache keygen` makes a signing key)")
        + (f"; skipped {len(skipped)} invalid" if skipped else "")
        + (f"; left out {len(stale)} stale (--include-stale packs them)" if stale else ""), highlight=False))


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


def stale_staging(dirs: list[Path] | None = None) -> list[Path]:
    """Staging folders of imports that are not running (killed midway): nobody holds their lock. One made a
    moment ago, before its importer could lock it, is left alone."""
    if dirs is None:
        root = _flashinfer_cache_root()
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


def _new_staging(jit_dir: Path, uri: str, held: contextlib.ExitStack) -> Path:
    """A staging folder for `uri`, locked (fivar.jit.locks) until the import ends, so a concurrent import's
    cleanup never takes it for a dead one."""
    staging = Path(tempfile.mkdtemp(prefix=f".import-{uri[:40]}-", dir=jit_dir))
    held.enter_context(locks.build_lock(staging))
    return staging


@cache.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--trust-unsigned", is_flag=True, help="import the libraries of an unsigned or untrusted archive "
              "too (they are native code that runs on load: only for archives you made yourself)")
@click.option("--max-member-size", default="2G", show_default=True, help="largest library an archive may hold")
@click.option("--max-total-size", default="16G", show_default=True, help="largest total an archive may unpack to")
@click.option("--json", "as_json", is_flag=True)
@arch_option
@disk_errors("import the archive")
def import_cmd(file, trust_unsigned, max_member_size, max_total_size, as_json):
    """Unpack an export into FlashInfer's JIT cache; refuses one built for another arch/FlashInfer/nvcc.

    Libraries are imported only from an archive signed by a trusted key (`fivar cache trust`); from an unsigned
    or untrusted one only the C++/CUDA sources are, and the modules build here on first use (--trust-unsigned
    takes the libraries anyway). Per module an archive holds a library, its manifest and the sources the
    manifest lists, which must hash to the module's URI; every member must match the sha256 and size in the
    archive's index. Anything else (a Python file, a file the manifest does not list) refuses the whole archive.
    """
    from . import trust
    member_cap, total_cap = parse_size(max_member_size), parse_size(max_total_size)
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
        from flashinfer.jit import env as jit_env
        jit_dir, gen_root = jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR
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
                click.echo(f"WARNING: importing the native libraries of {file} although it is {whose} "
                           "(--trust-unsigned): they run with your privileges when loaded", err=True)
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
    data = {"file": str(file), "imported": imported, "sources_only": sources_only, "already_present": present,
            "skipped": skipped, "trust": verdict.status, "signer": verdict.signer}
    why_not = ("unsigned" if verdict.status == "unsigned" else f"signed by key {verdict.signer}, which is not "
               "trusted here (`fivar cache trust KEY.pub`)")
    _out(as_json, data, lambda: console.print(
        (f"imported {len(imported)} module(s) into {jit_dir}" if binaries else
         f"[yellow]{file} is {why_not}[/]: imported the sources of {len(sources_only)} module(s) into {gen_root}, "
         "not their libraries; they build here on first use (`fivar build --prewarm` builds them now; "
         "--trust-unsigned takes the libraries)") +
        (f" (signed by trusted key {verdict.signer})" if verdict.status == "trusted" else "") +
        (f"; {len(present)} already present" if present else "") +
        "".join(f"; kept {r['uri']} as it is: {r['skipped']}" for r in skipped), highlight=False))


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


def _variant_matches_uri(man: dict, uri: str) -> bool:
    """The manifest's variant, target, op, dtype and head dim are the ones its URI was made of (the URI's hash
    covers the sources; its name part is how gen_module names the module): a manifest cannot point a reader at
    another variant than the one its sources were rendered from."""
    from .jit.build import uri_name
    target = man.get("target", "fa2")
    head = f"fivar_{uri_name(man['variant'])}_{target}_" + ("" if target == "fusion" else f"{man['op']}")
    return uri.startswith(head) and bool(re.search(rf"_{re.escape(man['dtype'])}_hd{man['head_dim']}_[0-9a-f]{{12}}$",
                                                   uri))


def _check_staged(file, uri: str, ent: dict, staging: Path, binaries: bool = True) -> dict:
    """The staged module of `uri`, checked against its own content: its manifest (validated, of this URI, naming
    what the URI names and what the index says), its library (sha256 of the manifest and of the index; only
    where libraries are imported), its sources (exactly the manifest's, hashing to the URI). Returns the
    manifest; FivarError when anything is off (nothing is imported then)."""
    from .jit.build import _sha256
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
    if not _variant_matches_uri(man, uri):
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
    if not _sources_match_uri(uri, gen, man):
        raise FivarError(f"{file}: the sources of {uri} do not hash to its URI (tampered, or another fivar's "
                         "hash); nothing was imported")
    if man.get("variant_file") and _inside(Path(man["variant_file"]), untrusted_roots()):
        man["variant_file"] = None  # a path into the cache is never a variant file (and never loaded)
    man.pop("provenance", None)  # an archive never says where its library came from: the importer does
    return man


# --------------------------------------------------------------------------------------------- keys

@cache.command("keygen")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="where the private key goes (default: cache_signing_key.pem in FIVAR_CONFIG_DIR or ~/.config/fivar)")
@click.option("--force", is_flag=True, help="replace an existing key")
@click.option("--json", "as_json", is_flag=True)
def keygen_cmd(out, force, as_json):
    """Make an ed25519 key pair for signing exports. The private key is written 0600; share the .pub with the
    machines that import your archives (`fivar cache trust FILE.pub` there). It is trusted here too."""
    from . import trust
    key, pub, fp = trust.keygen(Path(out) if out else None, force=force)
    data = {"private_key": str(key), "public_key": str(pub), "fingerprint": fp}
    _out(as_json, data, lambda: console.print(
        f"wrote private key {key} (0600) and public key {pub} (fingerprint {fp}); `fivar cache export` signs "
        f"with it{'' if out is None else ' given --sign ' + str(key)}; on importing machines: "
        f"`fivar cache trust {pub.name}`", highlight=False))


@cache.command("trust")
@click.argument("pubkey", required=False, type=click.Path(dir_okay=False))
@click.option("--list", "list_", is_flag=True, help="list the trusted keys")
@click.option("--remove", default=None, help="stop trusting the key with this fingerprint (or its start)")
@click.option("--json", "as_json", is_flag=True)
@disk_errors("change the trusted keys")
def trust_cmd(pubkey, list_, remove, as_json):
    """Trust the public key in PUBKEY: archives it signed import with their libraries. A module imported under a
    key that is later removed no longer loads (it is rebuilt)."""
    from . import trust
    if sum(map(bool, (pubkey, list_, remove))) != 1:
        raise FivarError("say one of: a public key file to trust, --list, or --remove FINGERPRINT")
    if pubkey:
        fp = trust.trust(Path(pubkey))
        _out(as_json, {"trusted": fp, "dir": str(trust.trusted_dir())}, lambda: console.print(
            f"trusting key {fp} (in {trust.trusted_dir()})", highlight=False))
    elif remove:
        gone = trust.untrust(remove)
        _out(as_json, {"removed": gone.stem}, lambda: console.print(f"no longer trusting key {gone.stem}",
                                                                    highlight=False))
    else:
        keys = sorted(trust.trusted_keys())
        _out(as_json, {"trusted": keys, "dir": str(trust.trusted_dir())}, lambda: console.print(
            "\n".join(keys) if keys else f"no trusted keys in {trust.trusted_dir()}", highlight=False))
