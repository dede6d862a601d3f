"""`fivar cache`: look at, verify, prune, clear, export and import fivar's modules in FlashInfer's JIT cache.

An *entry* is one fivar module directory, `<FlashInfer cache>/<flashinfer version>/<arch>/cached_ops/fivar_*`,
with its generated sources beside it in `.../generated/<uri>`. Every FlashInfer-version/arch workspace under
FlashInfer's cache dir (FLASHINFER_WORKSPACE_BASE/.cache/flashinfer) is scanned, so modules left behind by an
older FlashInfer or another arch show up as stale. Usage (hits, last use, holders) comes from the records
database (fivar.jit.records, under FIVAR_CACHE_DIR).
"""
from __future__ import annotations

import contextlib
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
        out.append("row-runs")
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
            try:
                man = json.loads((d / "fivar_manifest.json").read_text())
            except (OSError, ValueError):
                man = None
            gen = ops.parent / "generated" / d.name
            out.append(Entry(d.name, d, gen, ops / "tmp" / f"{d.name}.lock", man,
                             _dir_size(d) + _dir_size(gen)))
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
            e.compile_seconds = man.get("compile_seconds", u.get("compile_seconds"))
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
        return True, [NO_MANIFEST]
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
            # rendered the way it was built (row-run form, CTA-tile split, FA3 exp2 split), not as this
            # process's environment would render it now
            options = dict(man.get("options", {}))
            if man.get("target") == "fa3" and "cta_tile" not in options:
                options["cta_tile"] = "flashinfer"  # recorded before fivar had tiles: built with FlashInfer's
            options.setdefault("nvcc_parallel_passes", False)  # recorded before session 14: nvcc's passes in turn
            if man.get("target") == "fa3":
                options.setdefault("bounded_softmax", False)  # recorded before fivar had it: built without
                options.setdefault("schedule", "grid")  # recorded before session 17: FlashInfer's grid launch
            else:
                options.setdefault("nvcc_split_compile", False)  # likewise: built without nvcc's --split-compile
                options.setdefault("pin_kv_tiles", False)  # and with FlashInfer's run-time KV tile choice
                options.setdefault("skip_unused_headers", False)  # and every header FlashInfer includes
                if options["skip_unused_headers"] is True:  # recorded when <cuda/pipeline> was the only one left out
                    options["skip_unused_headers"] = ["cuda/pipeline"]
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


def _load_variant(man: dict, cache: dict):
    """The variant as its file reads *now* (bypassing the registry's per-process cache)."""
    from . import registry
    path = man.get("variant_file")
    key = path or man.get("variant")
    if key in cache:
        return cache[key]
    try:
        if path and Path(path).exists():
            p = Path(path).resolve()
            old = registry._loaded.pop(p, None)
            try:
                v = registry.load_file(p)
            finally:
                if old is not None:
                    registry._loaded[p] = old
                else:
                    registry._loaded.pop(p, None)
        elif path:
            v = f"variant file {path} no longer exists"
        else:
            v = registry.load_variant(man.get("variant"))
    except FivarError as ex:
        v = f"variant '{man.get('variant')}' cannot be loaded: {str(ex).splitlines()[0]}"
    cache[key] = v
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
    from filelock import FileLock, Timeout
    if not lock_path.exists():
        return False
    lock = FileLock(str(lock_path), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    except OSError:
        return False
    lock.release()
    return False


BUILD_RUNNING = "its build lock is held (a build is running)"


@contextlib.contextmanager
def _build_lock_if_free(e: Entry):
    """Holds the entry's build lock for the block and yields True, or yields False at once when a build holds it."""
    from filelock import FileLock, Timeout
    e.lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(e.lock_path), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def _in_use(e: Entry) -> str | None:
    return f"held by live process(es) {', '.join(map(str, e.holders))}" if e.holders else None


def _evict(e: Entry) -> str | None:
    """Delete an entry under its build lock. Returns why it was skipped, or None when it was removed."""
    if _in_use(e):
        return _in_use(e)
    with _build_lock_if_free(e) as free:
        if not free:
            return BUILD_RUNNING
        shutil.rmtree(e.build_dir, ignore_errors=True)
        shutil.rmtree(e.gen_dir, ignore_errors=True)
    return None


def _out(as_json: bool, data, render) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=1, default=str))
    else:
        render()


# --------------------------------------------------------------------------------------------- commands

@click.group()
@click.option("--arch", default=None, help="target arch of the current toolchain, e.g. 9.0a (default: "
              "FLASHINFER_CUDA_ARCH_LIST or the visible GPU)")
def cache(arch):
    """fivar's modules in FlashInfer's JIT cache: ls, show, stats, verify, prune, clear, export, import."""
    from .jit.toolchain import set_arch_env
    set_arch_env(arch)


@cache.command("ls")
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
    """Problems with an entry: manifest, library size/mtime and sha256, generated sources."""
    from .jit.build import _sha256
    man = e.manifest
    if man is None:
        return [NO_MANIFEST]
    problems = []
    try:
        st = e.library_path.stat()
    except OSError:
        return ["library missing"]
    if man.get("uri") != e.uri:
        problems.append(f"manifest names {man.get('uri')}")
    if man.get("so_size") != st.st_size:
        problems.append(f"library size {st.st_size} != manifest {man.get('so_size')} (truncated?)")
    elif man.get("so_mtime_ns") != st.st_mtime_ns:
        problems.append("library modified after its build")
    if man.get("so_sha256") and _sha256(e.library_path) != man["so_sha256"]:
        problems.append("library sha256 does not match its manifest")
    missing = [s for s in man.get("sources", []) if not (e.gen_dir / s).exists()]
    if missing:
        problems.append(f"generated sources missing ({', '.join(missing)}); regenerated on the next rebuild")
    return problems


@cache.command()
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
            with _build_lock_if_free(e) as free:  # a build writing this library now wins
                if free:
                    e.library_path.unlink(missing_ok=True)
                    (e.build_dir / "fivar_manifest.json").unlink(missing_ok=True)
                    fixed = True
                else:
                    problems.append(f"not fixed: {BUILD_RUNNING}")
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
        return not e.holders and not lock_is_held(e.lock_path)
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
@click.option("--records", "wipe_records", is_flag=True, help="also delete the build/load records")
@click.option("--yes", is_flag=True, help="do not ask")
@click.option("--json", "as_json", is_flag=True)
def clear(wipe_records, yes, as_json):
    """Delete every fivar module (not FlashInfer's own), except ones in use or being built."""
    entries = annotate(scan_entries(), check_stale=False)
    if not yes and not as_json and entries:
        in_use = sum(bool(e.holders) or lock_is_held(e.lock_path) for e in entries)
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
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--variant", "variants", multiple=True, help="only these variants (repeatable)")
@click.option("--json", "as_json", is_flag=True)
def export_cmd(file, variants, as_json):
    """Pack this toolchain's modules (.so, manifest, generated sources) into one .tar.gz."""
    if not Path(file).parent.is_dir() or not os.access(Path(file).parent, os.W_OK):
        raise FivarError(f"cannot export to {file}: {Path(file).parent} is not a writable directory")
    tc = current_toolchain()
    if tc["arch"] is None or tc["nvcc"] is None:
        raise FivarError(f"cannot tell the current arch/nvcc: {ARCH_HINT}, and CUDA_HOME")
    from flashinfer.jit import env as jit_env
    jit_dir = jit_env.FLASHINFER_JIT_DIR
    packed, skipped = [], []
    for e in scan_entries():
        man = e.manifest or {}
        if e.build_dir.parent != jit_dir or any(man.get(k) != tc[k] for k in ("arch", "flashinfer", "nvcc")):
            continue
        if variants and man.get("variant") not in variants:
            continue
        problems = [p for p in verify_entry(e) if "sources missing" not in p]
        if problems:
            skipped.append({"uri": e.uri, "problems": problems})
            continue
        packed.append(e)
    if not packed:
        which = f" of variant(s) {', '.join(sorted(variants))}" if variants else ""
        raise FivarError(f"nothing to export: no valid fivar module{which} for arch {tc['arch']}, flashinfer "
                         f"{tc['flashinfer']}, nvcc {tc['nvcc']} in {jit_dir}")
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
            if e.gen_dir.is_dir():
                for p in sorted(e.gen_dir.iterdir()):
                    if p.is_file() and not p.name.startswith("."):
                        tar.add(p, f"generated/{e.uri}/{p.name}")
    replaced = Path(file).exists()
    os.replace(tmp, file)
    data = {"file": str(file), "replaced": replaced, "modules": [e.uri for e in packed], "skipped": skipped,
            "bytes": os.path.getsize(file), **{k: tc[k] for k in ("arch", "flashinfer", "nvcc")}}
    _out(as_json, data, lambda: console.print(
        f"exported {len(packed)} module(s) to {file}{' (replacing the file that was there)' if replaced else ''} "
        f"({human_size(data['bytes'])}; arch {tc['arch']}, flashinfer {tc['flashinfer']}, nvcc {tc['nvcc']})"
        + (f"; skipped {len(skipped)} invalid" if skipped else ""), highlight=False))


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


@cache.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def import_cmd(file, as_json):
    """Unpack an export into FlashInfer's JIT cache; refuses one built for another arch/FlashInfer/nvcc."""
    from filelock import FileLock

    from .jit.build import _sha256
    tc = current_toolchain()
    try:
        tar = tarfile.open(file, "r:gz")
        tar.getmembers()  # reads the whole archive: a truncated or corrupt one fails here, not midway
    except (tarfile.TarError, OSError, EOFError, zlib.error) as ex:
        raise FivarError(f"{file} is not a readable fivar cache export (a gzip tar archive): {ex or type(ex).__name__}")\
            from None
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
            members.setdefault(parts[1], []).append(mem)
        from flashinfer.jit import env as jit_env
        jit_dir, gen_root = jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR
        (jit_dir / "tmp").mkdir(parents=True, exist_ok=True)
        imported, present = [], []
        staged: list[tuple[str, Path, dict]] = []
        try:
            # every entry is unpacked and checked first (library hash, manifest), so a bad one leaves the cache
            # as it was instead of half imported
            for ent in meta.get("entries", []):
                uri = ent["uri"]
                staging = Path(tempfile.mkdtemp(prefix=f".import-{uri}-", dir=jit_dir))
                staged.append((uri, staging, {}))
                for mem in members.get(uri, []):
                    kind, _, name = mem.name.split("/")
                    dest = staging / kind / name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(mem) as src, open(dest, "wb") as out:
                        shutil.copyfileobj(src, out)
                so = staging / "cached_ops" / f"{uri}.so"
                if not so.exists() or (ent.get("so_sha256") and _sha256(so) != ent["so_sha256"]):
                    raise FivarError(f"{file}: the library of {uri} is missing or corrupt (sha256 mismatch); "
                                     "nothing was imported")
                try:
                    man = json.loads((staging / "cached_ops" / "fivar_manifest.json").read_text())
                except (OSError, ValueError):
                    man = None
                if not isinstance(man, dict) or man.get("uri") != uri:
                    raise FivarError(f"{file}: the manifest of {uri} is missing or unreadable; nothing was imported")
                staged[-1][2].update(man)
            for uri, staging, man in staged:
                with FileLock(str(jit_dir / "tmp" / f"{uri}.lock"), thread_local=False):
                    entry = Entry(uri, jit_dir / uri, gen_root / uri, jit_dir / "tmp" / f"{uri}.lock", None, 0)
                    try:
                        entry.manifest = json.loads((entry.build_dir / "fivar_manifest.json").read_text())
                    except (OSError, ValueError):
                        pass
                    if entry.manifest and not [p for p in verify_entry(entry) if "sources missing" not in p]:
                        present.append(uri)
                        continue
                    shutil.rmtree(entry.build_dir, ignore_errors=True)
                    os.replace(staging / "cached_ops", entry.build_dir)
                    if (staging / "generated").is_dir():
                        entry.gen_dir.mkdir(parents=True, exist_ok=True)
                        for p in (staging / "generated").iterdir():
                            os.replace(p, entry.gen_dir / p.name)
                    st = entry.library_path.stat()
                    man.update(so_size=st.st_size, so_mtime_ns=st.st_mtime_ns, imported_from=str(file),
                               imported=time.time())
                    (entry.build_dir / "fivar_manifest.json").write_text(json.dumps(man, indent=1))
                    imported.append(uri)
        finally:
            for _, staging, _ in staged:
                shutil.rmtree(staging, ignore_errors=True)
    data = {"file": str(file), "imported": imported, "already_present": present}
    _out(as_json, data, lambda: console.print(
        f"imported {len(imported)} module(s) into {jit_dir}" +
        (f"; {len(present)} already present" if present else ""), highlight=False))
