"""What a build says while it runs, and what each module's compile cost, read from ninja's log.

A batch (`build_many`, `fivar build --prewarm`) runs one ninja over many modules. fivar runs that ninja itself
(`run_ninja_batch`) rather than through FlashInfer's `build_jit_specs`, for two reasons:

- FlashInfer's runner keeps ninja's output until ninja exits; fivar reads its status lines as edges finish
  (NINJA_STATUS gives the running count for the heartbeat).
- ninja (1.12 and later) runs the ready edge with the longest chain after it first; a module's link ends its
  chain, so every link waits until no compile unit is left to start: one ninja over 74 modules linked all of
  them in its last seconds. fivar's top-level ninja file adds a chain of no-op edges after the libraries
  (`order_edges`), which puts each module's link ahead of the next modules' units, so a module is linked (and
  usable, and reported) seconds after its last unit, and an interrupted prewarm keeps what it finished.

A module's compile seconds (its manifest and its build record) are the sum of the durations of its own ninja
edges in this run, its nvcc units and its link, from ninja's log (`module_times`): what the module cost,
whatever else ran beside it and however ninja ordered the batch. Its units may run side by side, so a module
built alone on idle cores takes less wall time than that: about its longest unit plus the link.
"""
from __future__ import annotations

import collections
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: the longest a batch goes without a line when nothing finishes
HEARTBEAT_S = 30.0
#: how often the batch's watcher reads ninja's log
POLL_S = 0.25
#: ninja's status prefix in a batch: edges finished, edges in all, edges running
STATUS_FORMAT = "[fivar %f/%t %r] "
_STATUS = re.compile(r"\[fivar (\d+)/(\d+) (\d+)\] ")
LOG_NAME = ".ninja_log"


def parse_ninja_log(text: str) -> dict[str, tuple[int, int, int]]:
    """output -> (start ms, end ms, mtime) of its latest entry in a .ninja_log (v5-v7: start, end, mtime, output,
    command hash, tab-separated; the header and malformed lines skipped). Later entries replace earlier ones."""
    latest: dict[str, tuple[int, int, int]] = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 4 and parts[0].isdigit() and parts[1].isdigit() and parts[2].isdigit():
            latest[parts[3]] = (int(parts[0]), int(parts[1]), int(parts[2]))
    return latest


def read_ninja_log(path) -> dict[str, tuple[int, int, int]]:
    try:
        return parse_ninja_log(Path(path).read_text(errors="replace"))
    except OSError:
        return {}


@dataclass
class ModuleTime:
    units: int = 0         # compile edges (objects) finished in this run
    seconds: float = 0.0   # the sum of this run's edges of the module: its units and its link
    linked: bool = False   # its library's link finished in this run


def module_times(entries: dict[str, tuple[int, int, int]], build_dirs: dict[str, Path],
                 before: dict[str, tuple[int, int, int]] | None = None) -> dict[str, ModuleTime]:
    """uri -> ModuleTime for the modules (uri -> build folder) with an edge in `entries` (parse_ninja_log) that is
    not in `before` (the log as it was when the run began): an output ninja built again gets a new entry, one it
    did not build keeps the old one. Outputs map to modules by folder (FlashInfer writes a module's objects and
    library into its build folder), so a log shared with other builds costs one dict lookup per line."""
    dirs: dict[str, str] = {}
    for uri, d in build_dirs.items():
        dirs[str(d)] = uri
        dirs[os.path.realpath(d)] = uri
    out: dict[str, ModuleTime] = {}
    for path, entry in entries.items():
        uri = dirs.get(os.path.dirname(path))
        if uri is None or (before is not None and before.get(path) == entry):
            continue
        t = out.setdefault(uri, ModuleTime())
        t.seconds += max(0, entry[1] - entry[0]) / 1000.0
        if os.path.basename(path) == f"{uri}.so":
            t.linked = True
        else:
            t.units += 1
    return out


class LogWatch:
    """The per-module times of one ninja run, re-read from its log only when the file changed."""

    def __init__(self, log_path, build_dirs: dict[str, Path]):
        self.path, self.build_dirs = Path(log_path), build_dirs
        self.before = read_ninja_log(self.path)
        self._key: tuple | None = None
        self._times: dict[str, ModuleTime] = {}

    def poll(self) -> dict[str, ModuleTime]:
        try:
            st = self.path.stat()
            key = (st.st_size, st.st_mtime_ns, st.st_ino)
        except OSError:
            key = None
        if key != self._key:
            self._key = key
            self._times = module_times(read_ninja_log(self.path), self.build_dirs, self.before)
        return self._times


def _ninja_path(path) -> str:
    """A path as a ninja file holds it ($, space and : escaped)."""
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def order_edges(libraries: list) -> list[str]:
    """Top-level ninja lines that make each library's link run as soon as its units are done (module docstring).

    ninja weighs each edge by the longest chain of edges from it to the end and starts the heaviest ready one.
    Library k feeds no-op edge 2k of a chain of 2n; its link then weighs 2(n-k)+1 and the units of any later module
    j at most 2(n-j)+2 < that, while module k's units still come before module k+1's. The no-op edges write no
    file; ninja logs them under `.fivar_order_<i>` (a fixed set of names, so the log does not grow run by run)."""
    n = 2 * len(libraries)
    if not n:
        return []
    lines = ["rule fivar_order", "  command = :"]
    for i in range(n):
        deps = ([_ninja_path(libraries[i // 2])] if i % 2 == 0 else []) + ([f".fivar_order_{i - 1}"] if i else [])
        lines.append(f"build .fivar_order_{i}: fivar_order {' '.join(deps)}")
    lines.append(f"default .fivar_order_{n - 1}")
    return lines


def run_ninja_batch(ninja_files: list, libraries: list, workdir, batch_file, jobs: int | None = None,
                    ninja: str = "ninja", on_status=None) -> None:
    """One ninja over the modules' ninja files (`subninja`), with `order_edges` after their libraries, run in
    `workdir`. `on_status(finished, total, running)` is called as ninja reports each finished edge. Raises
    RuntimeError (with the end of ninja's output) when ninja fails."""
    text = "\n".join(["ninja_required_version = 1.3", *(f"subninja {_ninja_path(p)}" for p in ninja_files),
                      *order_edges(libraries), ""])
    batch_file = Path(batch_file)
    batch_file.parent.mkdir(parents=True, exist_ok=True)
    if not batch_file.exists() or batch_file.read_text() != text:
        tmp = batch_file.with_name(f".{batch_file.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, batch_file)
    cmd = [ninja, "-C", str(workdir), "-f", str(batch_file.resolve())] + (["-j", str(jobs)] if jobs else [])
    tail: collections.deque = collections.deque(maxlen=200)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            cwd=str(workdir), env={**os.environ, "NINJA_STATUS": STATUS_FORMAT})
    try:
        for line in proc.stdout:
            tail.append(line)
            m = _STATUS.match(line)
            if m and on_status is not None:
                on_status(int(m.group(1)), int(m.group(2)), int(m.group(3)))
        rc = proc.wait()
    except BaseException:  # interrupted: stop ninja, which stops its compilers on SIGTERM, before leaving
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    finally:
        proc.stdout.close()
    if rc:
        raise RuntimeError(f"Ninja build failed (exit {rc}). Ninja output:\n" + "".join(tail))


class BatchProgress:
    """The lines a build of several modules prints: one per module as it is ready (with its own compile seconds),
    a heartbeat when nothing finished for `heartbeat_s`, and a summary. Thread-safe (the batch's watcher thread
    reports). `write(line)` prints a line; `on_change(self)` (a live bar) is called after each update; `heartbeat`
    False leaves the heartbeat to such a bar."""

    def __init__(self, modules, write, heartbeat_s: float = HEARTBEAT_S, clock=time.monotonic, on_change=None,
                 heartbeat: bool = True):
        self.uris = {m.uri for m in modules}  # the modules to build; others (already up to date) are not counted
        self.total = len(self.uris)
        self.write, self.heartbeat_s, self.clock, self.on_change = write, heartbeat_s, clock, on_change
        self.heartbeat = heartbeat
        self.done = self.units_done = self.units_total = self.compiled = 0
        self.running: int | None = None
        self.t0 = self.last_line = clock()
        self.cpu0 = children_cpu_seconds()
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def _say(self, line: str) -> None:
        self.last_line = self.clock()
        self.write(line)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def batch_started(self, units_total: int) -> None:
        with self._lock:
            self.units_total += units_total
        self._changed()

    def units(self, done: int, running: int | None = None) -> None:
        with self._lock:
            self.units_done, self.running = max(self.units_done, done), running
        self._changed()

    def module_done(self, m, kind: str, seconds: float | None, announce: bool = True) -> None:
        """`announce` False: counted, but the line was printed elsewhere (a module built on its own says so on
        stderr, fivar.jit.build)."""
        with self._lock:
            if m.uri in self._seen or m.uri not in self.uris:
                return
            self._seen.add(m.uri)
            self.done += 1
            self.compiled += kind == "cold"
            if announce:
                what = (f"built {m.uri}, {seconds:.1f} s of compile" if kind == "cold" and seconds is not None else
                        f"{m.uri}: built by another process" if kind == "disk" else f"{m.uri}: {kind}")
                self._say(f"{what} ({self.done}/{self.total}, {self.clock() - self.t0:.0f} s elapsed)")
        self._changed()

    def tick(self) -> None:
        """A heartbeat line if nothing was printed for heartbeat_s."""
        with self._lock:
            now = self.clock()
            if not self.heartbeat or now - self.last_line < self.heartbeat_s:
                return
            units = f"{self.units_done}/{self.units_total} units done" if self.units_total else ""
            running = f"{self.running} compiling" if self.running is not None else ""
            self._say(f"... {self.done}/{self.total} modules done, "
                      + ", ".join(x for x in (units, running) if x) + (", " if units or running else "")
                      + f"{now - self.t0:.0f} s")

    def summary(self) -> str:
        cpu0, cpu = self.cpu0, children_cpu_seconds()
        cpu_text = f", {cpu - cpu0:.0f} CPU-seconds" if cpu is not None and cpu0 is not None else ""
        return (f"{self.done}/{self.total} module(s) ready, {self.compiled} compiled, in "
                f"{self.clock() - self.t0:.1f} s wall{cpu_text}")


def children_cpu_seconds() -> float | None:
    """User + system CPU seconds of this process's finished children (ninja, and through it every compiler)."""
    try:
        import resource
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime
    except (ImportError, OSError):
        return None


# ------------------------------------------------------------------------------------- a module built on its own

def expected_text(m) -> str:
    """What records say similar modules (same op and target) took: the median of their recent compile seconds."""
    from . import records
    found = records.compile_seconds_of(m.op, m.target)
    if not found:
        return f"no earlier {m.target} {m.op} build recorded to estimate from"
    return (f"expected about {statistics.median(found):.0f} s of compile (median of {len(found)} recorded "
            f"{m.target} {m.op} build(s))")


class SingleBuild:
    """The two stderr lines of a module built on its own (a first use inside a call, or `fivar build NAME`): what,
    why and the expected time before ninja starts, and its time when done, with its own compile seconds read from
    the module's ninja log (FlashInfer runs a lone module's ninja in its build folder)."""

    def __init__(self, m, why: str, stream=None):
        self.m, self.stream = m, stream
        self.watch = LogWatch(Path(m.build_dir) / LOG_NAME, {m.uri: Path(m.build_dir)})
        self.t0 = time.perf_counter()
        variant = getattr(m.variant, "name", "?")
        self._print(f"fivar: compiling {m.uri} (variant '{variant}', {why}); {expected_text(m)}")

    def _print(self, line: str) -> None:
        stream = self.stream or sys.stderr
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not fail the build
            pass

    def finished(self) -> float:
        """Print the done line; returns the module's compile seconds (the wall time if ninja's log has none)."""
        wall = time.perf_counter() - self.t0
        own = self.watch.poll().get(self.m.uri)
        secs = own.seconds if own is not None and own.linked and own.seconds > 0 else wall
        self._print(f"fivar: compiled {self.m.uri} in {wall:.1f} s"
                    + (f" ({secs:.1f} s of compile over its {own.units} unit(s) and link)"
                       if own is not None and own.linked and own.seconds > 0 else ""))
        return secs
