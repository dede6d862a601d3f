"""`fivar cache`: look at, verify, prune, clear, export and import fivar's modules in FlashInfer's JIT cache.

An *entry* is one fivar module directory, `<FlashInfer cache>/<flashinfer version>/<arch>/cached_ops/fivar_*`,
with its generated sources beside it in `.../generated/<uri>`. Every FlashInfer-version/arch workspace under
FlashInfer's cache dir (FLASHINFER_WORKSPACE_BASE/.cache/flashinfer) is scanned, so modules left behind by an
older FlashInfer or another arch show up as stale. Usage (hits, last use, holders) comes from the records
database (fivar.jit.records, under FIVAR_CACHE_DIR); whether a module is in use or being built comes from
its own directory (fivar.jit.locks), whoever's FIVAR_CACHE_DIR recorded it.

Nothing here executes a file the cache holds: manifests are data (validated by fivar.jit.manifest), staleness
re-renders a variant found *by name* on the user's variant search path (what `fivar list` loads), never from a
path a manifest names, and an import takes only libraries, manifests and C++/CUDA sources whose content hash
is the URI's.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
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
EXPORT_FORMAT = "fivar-cache-export/1"
META_NAME = "fivar_export.json"


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
                "stale": self.stale, "stale_reasons": self.reasons, "live_holders": self.holders}


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
    if options.get("row_runs"):
        out.append("two-row-runs" if options["row_runs"] == 2 else "row-runs")
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
        usage = records.usage(con)
        for e in entries:
            u = usage.get(e.uri, {})
            man = e.manifest or {}
            e.hits = u.get("hits", 0)
            fallback = man.get("created") or _mtime(e.build_dir)
            e.last_use = max(u.get("last_use") or 0.0, fallback or 0.0) or None
            e.compile_seconds = man.get("compile_seconds", u.get("compile_seconds"))  # the build's, not a hit's
            e.holders = records.live_holders(con, e.uri)
    finally:
        con.close()
    if check_stale:
        tc = current_toolchain()
        variants: dict = {}
        for e in entries:
            e.stale, e.reasons = staleness(e, tc, variants)
    return entries


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
    if tc.get("arch") is None or tc.get("nvcc") is None:  # the variant cannot be rendered for comparison
        return None, [UNKNOWN_TOOLCHAIN]
    v = _load_variant(man, variants)
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


def _load_variant(man: dict, cache: dict):
    """The variant the manifest names, as its file reads *now*, or a reason staleness cannot be decided.

    Found by NAME on the registry's search path (FIVAR_VARIANT_PATH, ./variants, fivar's bundled variants: the
    user's own files, which `fivar list` loads anyway), never from the manifest's `variant_file` path and never
    under the caches. Where the manifest says it was built from another file than the one the name finds, that
    file is not loaded: undecidable."""
    from . import registry
    name = man.get("variant")
    if not re.fullmatch(r"[A-Za-z_]\w*", name or ""):
        return f"variant name {name!r} in the manifest is not an identifier: not looked up"
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
        shutil.rmtree(e.gen_dir, ignore_errors=True)
        _remove_module_dir(e.build_dir)
    return None


def _remove_module_dir(d: Path) -> None:
    """Everything but the lock files first (a library never outlives its manifest half-deleted), then the
    directory: a process waiting on the lock finds its file unlinked and starts over (fivar.jit.locks)."""
    for name in (manifests.NAME,):
        (d / name).unlink(missing_ok=True)
    shutil.rmtree(d, ignore_errors=True)


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
    """fivar's modules in FlashInfer's JIT cache: ls, show, stats, verify, prune, clear, export, import."""
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
                    if any(w in p for p in problems for w in ("tampered", "malformed", "do not hash")):
                        # nothing of it is trusted: the next use rebuilds it from the variant
                        shutil.rmtree(e.gen_dir, ignore_errors=True)
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
            records.forget_dead_holders(con)
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
            con.execute("DELETE FROM events")
            con.execute("DELETE FROM holders")
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
@click.option("--json", "as_json", is_flag=True)
def export_cmd(file, variants, include_stale, as_json):
    """Pack this toolchain's current modules (.so, manifest, generated sources) into one .tar.gz. A module whose
    variant was edited since it was built (it now renders another URI, so nothing loads it) stays out unless
    --include-stale."""
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
    meta = {"format": EXPORT_FORMAT, **tc, "torch": torch.__version__, "host": socket.gethostname(),
            "created": time.time(),
            "entries": [{"uri": e.uri, "so_sha256": e.manifest.get("so_sha256"),
                         **{k: e.manifest.get(k) for k in ("variant", "target", "op", "dtype", "head_dim")}}
                        for e in packed]}
    tmp = Path(file).with_name(f".{Path(file).name}.{os.getpid()}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        blob = json.dumps(meta, indent=1).encode()
        info = tarfile.TarInfo(META_NAME)
        info.size, info.mtime = len(blob), int(time.time())
        tar.addfile(info, io.BytesIO(blob))
        for e in packed:
            tar.add(e.library_path, f"cached_ops/{e.uri}/{e.uri}.so")
            tar.add(e.build_dir / "fivar_manifest.json", f"cached_ops/{e.uri}/fivar_manifest.json")
            for name in sorted(e.manifest["sources"]):  # what the manifest lists, nothing else found there
                if (e.gen_dir / name).is_file():
                    tar.add(e.gen_dir / name, f"generated/{e.uri}/{name}")
    replaced = Path(file).exists()
    os.replace(tmp, file)
    data = {"file": str(file), "replaced": replaced, "modules": [e.uri for e in packed], "skipped": skipped,
            "stale": stale,
            "bytes": os.path.getsize(file), **{k: tc[k] for k in ("arch", "flashinfer", "nvcc")}}
    _out(as_json, data, lambda: console.print(
        f"exported {len(packed)} module(s) to {file}{' (replacing the file that was there)' if replaced else ''} "
        f"({human_size(data['bytes'])}; arch {tc['arch']}, flashinfer {tc['flashinfer']}, nvcc {tc['nvcc']})"
        + (f"; skipped {len(skipped)} invalid" if skipped else "")
        + (f"; left out {len(stale)} stale (--include-stale packs them)" if stale else ""), highlight=False))


def read_export_meta(tar: tarfile.TarFile, file) -> dict:
    try:
        meta = json.loads(tar.extractfile(META_NAME).read())
    except (KeyError, AttributeError, ValueError):
        raise FivarError(f"{file} is not a fivar cache export (no valid {META_NAME})") from None
    if not isinstance(meta, dict):
        raise FivarError(f"{file} is not a fivar cache export ({META_NAME} is not a JSON object)")
    if meta.get("format") != EXPORT_FORMAT:
        raise FivarError(f"{file}: unknown export format {meta.get('format')!r} (expected {EXPORT_FORMAT})")
    entries = meta.get("entries", [])
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("uri"), str) and re.fullmatch(r"fivar_\w+", e["uri"])
            for e in entries):
        raise FivarError(f"{file}: {META_NAME} has malformed entries (each must be an object whose uri is "
                         "fivar_<letters, digits, _>); refusing to import")
    return meta


#: what an archive may hold per module: its library and manifest, and the C++/CUDA sources the manifest lists
def _member_ok(kind: str, uri: str, name: str) -> bool:
    if kind == "cached_ops":
        return name in (f"{uri}.so", manifests.NAME)
    return name.endswith(manifests.SOURCE_SUFFIXES) and not name.startswith(".")


@cache.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
@arch_option
def import_cmd(file, as_json):
    """Unpack an export into FlashInfer's JIT cache; refuses one built for another arch/FlashInfer/nvcc.

    An archive carries data only: per module a library, its manifest and the C++/CUDA sources the manifest
    lists, which must hash to the module's URI; the library must match the sha256 in both the manifest and the
    archive's index. Anything else (a Python file, a file the manifest does not list) refuses the whole archive.
    """
    from .jit.build import _sha256
    tc = current_toolchain()
    try:
        tar = tarfile.open(file, "r:gz")
        tar.getmembers()  # reads the whole archive: a truncated or corrupt one fails here, not midway
    except (tarfile.TarError, OSError, EOFError, zlib.error) as ex:
        raise FivarError(f"{file} is not a readable fivar cache export (a gzip tar archive): "
                         f"{ex or type(ex).__name__}") from None
    with tar:
        meta = read_export_meta(tar, file)
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
        uris = {e["uri"] for e in meta.get("entries", [])}
        members = {}
        for mem in tar.getmembers():
            if mem.name == META_NAME:
                continue
            parts = mem.name.split("/")
            if not (mem.isfile() and len(parts) == 3 and parts[0] in ("cached_ops", "generated")
                    and parts[1] in uris and parts[2] and not parts[2].startswith(".") and ".." not in parts):
                raise FivarError(f"{file}: unexpected member {mem.name!r}; refusing to import")
            if not _member_ok(parts[0], parts[1], parts[2]):
                raise FivarError(f"{file}: member {mem.name!r} is not a library, manifest or C++/CUDA source (an "
                                 "archive carries no code fivar would run); refusing to import")
            members.setdefault(parts[1], []).append(mem)
        from flashinfer.jit import env as jit_env
        jit_dir, gen_root = jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR
        jit_dir.mkdir(parents=True, exist_ok=True)
        imported, present, skipped = [], [], []
        staged: list[tuple[str, Path, dict]] = []
        try:
            # every entry is unpacked and checked first (library hash, manifest, sources against the URI), so a
            # bad one leaves the cache as it was instead of half imported
            for ent in meta.get("entries", []):
                uri = ent["uri"]
                staging = Path(tempfile.mkdtemp(prefix=f".import-{uri[:40]}-", dir=jit_dir))
                staged.append((uri, staging, {}))
                for mem in members.get(uri, []):
                    kind, _, name = mem.name.split("/")
                    dest = staging / kind / name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(mem) as src, open(dest, "wb") as out:
                        shutil.copyfileobj(src, out)
                    os.chmod(dest, 0o644)  # data: never an executable bit from the archive
                staged[-1][2].update(_check_staged(file, uri, ent, staging, _sha256))
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
                    for p in entry.build_dir.iterdir() if entry.build_dir.is_dir() else []:
                        if p.name not in (locks.BUILD_LOCK, locks.HOLD_LOCK):
                            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                    entry.build_dir.mkdir(parents=True, exist_ok=True)
                    for p in (staging / "cached_ops").iterdir():
                        if p.name != manifests.NAME:
                            os.replace(p, entry.build_dir / p.name)
                    if (staging / "generated").is_dir():
                        shutil.rmtree(entry.gen_dir, ignore_errors=True)
                        entry.gen_dir.mkdir(parents=True, exist_ok=True)
                        for p in (staging / "generated").iterdir():
                            os.replace(p, entry.gen_dir / p.name)
                    st = entry.library_path.stat()
                    man.update(so_size=st.st_size, so_mtime_ns=st.st_mtime_ns, imported_from=str(file),
                               imported=time.time())
                    tmp = entry.build_dir / f".{manifests.NAME}.{os.getpid()}.tmp"
                    tmp.write_text(json.dumps(man, indent=1))
                    os.replace(tmp, entry.build_dir / manifests.NAME)  # last: the module is whole once it exists
                    imported.append(uri)
        finally:
            for _, staging, _ in staged:
                shutil.rmtree(staging, ignore_errors=True)
    data = {"file": str(file), "imported": imported, "already_present": present, "skipped": skipped}
    _out(as_json, data, lambda: console.print(
        f"imported {len(imported)} module(s) into {jit_dir}" +
        (f"; {len(present)} already present" if present else "") +
        "".join(f"; kept {r['uri']} as it is: {r['skipped']}" for r in skipped), highlight=False))


def _check_staged(file, uri: str, ent: dict, staging: Path, sha256) -> dict:
    """The staged module of `uri`, checked against its own content: its manifest (validated, of this URI), its
    library (sha256 of the manifest and of the archive's index), its sources (exactly the manifest's, hashing to
    the URI). Returns the manifest; FivarError when anything is off (nothing is imported then)."""
    man, problem = manifests.read(staging / "cached_ops" / manifests.NAME)
    if man is None:
        why = "manifest missing" if problem == "missing" else problem
        raise FivarError(f"{file}: {uri}: {why}; nothing was imported")
    if man["uri"] != uri:
        raise FivarError(f"{file}: the manifest of {uri} names {man['uri']}; nothing was imported")
    so = staging / "cached_ops" / f"{uri}.so"
    if not so.exists() or sha256(so) != man["so_sha256"] or ent.get("so_sha256") not in (None, man["so_sha256"]):
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
    return man
