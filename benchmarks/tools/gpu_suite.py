"""Run the GPU test files on a GPU host: one file per pytest process, in lanes that share one JIT cache.

    python3 benchmarks/tools/gpu_suite.py --logs /tmp/gl --lanes 3 [FILE_STEM[:SHARDS] ...]   (default: every file)

Files are taken roughly longest first (ORDER) by the lanes, each lane taking the next file when its last one ends,
so a module the lanes share compiles once (FlashInfer's and fivar's file locks) and the GPU is shared. `kernels:4`
splits a file's tests into 4 contiguous shards, one process each: one pytest process compiles one module at a time,
so a long file on a cold cache is bound by its modules' chain, not by the host's cores; `--max-tests 80` shards
every file of more tests than that; `-k EXPR` selects tests in every file (a file left with none passes). Each
process's output goes to LOGS/<stem>.log (LOGS/<stem>.<k>.log for a shard), ending with its exit status;
LOGS/summary.txt has a line per process, and LOGS/all.done appears when every lane is done, so a detached run
(`setsid nohup ... &`) can be polled. The exit status is 1 if any process failed. The pyproject's xdist options are
dropped (a GPU host need not have pytest-xdist).
"""
from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: roughly slowest first on an H200 with a cold JIT cache (zoo about 14 minutes, index_layouts under one)
ORDER = ["zoo", "sparsity", "kernels", "backward", "serving", "mask_battery", "index_tensors", "sinks", "engine",
         "fusions", "mixed_batches", "tables", "triton", "fp8", "index_layouts"]


def collect(stems: list[str], env: dict, keyword: list[str]) -> dict[str, list[str]]:
    """Each file's test ids (those `keyword`, ["-k", EXPR] or [], selects), in order, from one collecting process."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p",
                          "no:cacheprovider", *keyword, *(f"tests/test_gpu_{s}.py" for s in stems)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    ids: dict[str, list[str]] = {s: [] for s in stems}
    for line in out.stdout.splitlines():
        stem = line.partition("::")[0].removeprefix("tests/test_gpu_").removesuffix(".py")
        if "::" in line and stem in ids:
            ids[stem].append(line)
    return ids


def plan_jobs(specs: list[str], env: dict, max_tests: int | None = None,
              keyword: list[str] = ()) -> list[tuple[str, list[str]]]:
    """(log name, pytest arguments) per process: a whole file, or one contiguous shard of its tests (FILE:N, or as
    many shards as keep each within max_tests)."""
    wanted = {stem: int(n or 1) for stem, _, n in (spec.partition(":") for spec in specs)}
    ids = collect([s for s, n in wanted.items() if n > 1 or max_tests], env, list(keyword)) if max_tests or any(
        n > 1 for n in wanted.values()) else {}
    jobs = []
    for stem, n in wanted.items():
        if max_tests and stem in ids and n == 1:
            n = max(1, -(-len(ids[stem]) // max_tests))
        if n == 1 or not ids.get(stem):  # whole: also a file whose tests did not collect (its error then shows)
            jobs.append((stem, [*keyword, f"tests/test_gpu_{stem}.py"]))
            continue
        size = -(-len(ids[stem]) // n)
        jobs += [(f"{stem}.{k}", ids[stem][k * size:(k + 1) * size]) for k in range(n)
                 if ids[stem][k * size:(k + 1) * size]]
    return jobs


def run_lane(todo: queue.Queue, logs: Path, env: dict, timeout_s: int, status: dict) -> None:
    while True:
        try:
            name, targets = todo.get_nowait()
        except queue.Empty:
            return
        with open(logs / f"{name}.log", "w") as out:
            # a session of its own, so a process past its time is stopped with the compilers it started
            p = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-o", "addopts=", "-p", "no:cacheprovider",
                                  "-rfE", *targets], cwd=ROOT, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = "timeout"
            out.write(f"\nrc={rc}\n")
        status[name] = rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="test file stems (test_gpu_<stem>.py), each with an optional :SHARDS; "
                    "default: every file, whole")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/gpu-suite"))
    ap.add_argument("--lanes", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=None, help="nvcc jobs per lane (default: cores / lanes)")
    ap.add_argument("--timeout-s", type=int, default=3600, help="per process")
    ap.add_argument("-k", dest="keyword", default=None, help="pytest's -k expression, for every file")
    ap.add_argument("--max-tests", type=int, default=None,
                    help="split every file of more tests than this into shards of at most this many")
    args = ap.parse_args(argv)
    if args.lanes < 1 or (args.max_tests is not None and args.max_tests < 1):
        ap.error("--lanes and --max-tests must be at least 1")
    args.logs = args.logs.resolve()  # the children run in the repository root
    every = sorted(p.stem[len("test_gpu_"):] for p in (ROOT / "tests").glob("test_gpu_*.py"))
    files = args.files or every
    unknown = sorted({f.partition(":")[0] for f in files} - set(every))
    if unknown:
        ap.error(f"no tests/test_gpu_<stem>.py for: {', '.join(unknown)}")
    bad = [f for f in files if ":" in f and not (f.partition(":")[2].isdigit() and int(f.partition(":")[2]) > 0)]
    if bad:
        ap.error(f"a shard count is a positive integer: {', '.join(bad)}")
    files.sort(key=lambda f: ORDER.index(f.partition(":")[0]) if f.partition(":")[0] in ORDER else len(ORDER))
    args.logs.mkdir(parents=True, exist_ok=True)
    (args.logs / "all.done").unlink(missing_ok=True)
    jobs = args.jobs or max(1, (os.cpu_count() or 1) // args.lanes)
    # one JIT cache for every lane (the tests' conftest would give each process a fresh one)
    env = {**os.environ, "FIVAR_TEST_FRESH_JIT_CACHE": "0", "MAX_JOBS": str(jobs),
           "FLASHINFER_WORKSPACE_BASE": os.environ.get("FLASHINFER_WORKSPACE_BASE", str(args.logs / "jit")),
           "FIVAR_CACHE_DIR": os.environ.get("FIVAR_CACHE_DIR", str(args.logs / "fivar-cache"))}
    todo: queue.Queue = queue.Queue()
    planned = plan_jobs(files, env, args.max_tests, ["-k", args.keyword] if args.keyword else [])
    for job in planned:
        todo.put(job)
    status: dict = {}
    threads = [threading.Thread(target=run_lane, args=(todo, args.logs, env, args.timeout_s, status))
               for _ in range(min(args.lanes, len(planned)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (args.logs / "summary.txt").write_text("".join(f"{name} rc={status[name]}\n" for name, _ in planned))
    (args.logs / "all.done").touch()
    # pytest's 5: no test selected, which -k may rightly do to a file
    return 0 if planned and all(rc == 0 or (rc == 5 and args.keyword) for rc in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
