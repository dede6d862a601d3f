"""Run the GPU test files on a GPU host: one file per pytest process, in lanes that share one JIT cache.

    python3 benchmarks/tools/gpu_suite.py --logs /tmp/gl --lanes 3 [FILE_STEM ...]   (default: every tests/test_gpu_*.py)

Files are dealt to the lanes roughly longest first (ORDER); each lane runs its files one after another, so a module
the lanes share compiles once (FlashInfer's and fivar's file locks) and the GPU is shared. Each file's pytest output
goes to LOGS/<stem>.log, ending with its exit status; LOGS/summary.txt has a line per file, and LOGS/all.done
appears when every lane is done, so a detached run (`setsid nohup ... &`) can be polled. The exit status is 1 if
any file failed. The pyproject's xdist options are dropped (one process per file; a GPU host need not have
pytest-xdist).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: roughly slowest first on an H200 with a cold JIT cache (zoo about 14 minutes, index_layouts under one)
ORDER = ["zoo", "sparsity", "kernels", "backward", "serving", "mask_battery", "index_tensors", "sinks", "engine",
         "fusions", "mixed_batches", "tables", "triton", "fp8", "index_layouts"]


def run_lane(files: list[str], logs: Path, env: dict, timeout_s: int, status: dict) -> None:
    for stem in files:
        with open(logs / f"{stem}.log", "w") as out:
            # a session of its own, so a file past its time is stopped with the compilers it started
            p = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-o", "addopts=", "-p", "no:cacheprovider",
                                  "-rfE", f"tests/test_gpu_{stem}.py"], cwd=ROOT, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = "timeout"
            out.write(f"\nrc={rc}\n")
        status[stem] = rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="test file stems (test_gpu_<stem>.py); default: all")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/gpu-suite"))
    ap.add_argument("--lanes", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=None, help="nvcc jobs per lane (default: cores / lanes)")
    ap.add_argument("--timeout-s", type=int, default=3600, help="per file")
    args = ap.parse_args(argv)
    if args.lanes < 1:
        ap.error("--lanes must be at least 1")
    args.logs = args.logs.resolve()  # the children run in the repository root
    every = sorted(p.stem[len("test_gpu_"):] for p in (ROOT / "tests").glob("test_gpu_*.py"))
    files = args.files or every
    unknown = sorted(set(files) - set(every))
    if unknown:
        ap.error(f"no tests/test_gpu_<stem>.py for: {', '.join(unknown)}")
    files.sort(key=lambda s: ORDER.index(s) if s in ORDER else len(ORDER))
    args.logs.mkdir(parents=True, exist_ok=True)
    (args.logs / "all.done").unlink(missing_ok=True)
    lanes = [files[i::args.lanes] for i in range(args.lanes)]
    jobs = args.jobs or max(1, (os.cpu_count() or 1) // args.lanes)
    # one JIT cache for every lane (the tests' conftest would give each process a fresh one)
    env = {**os.environ, "FIVAR_TEST_FRESH_JIT_CACHE": "0", "MAX_JOBS": str(jobs),
           "FLASHINFER_WORKSPACE_BASE": os.environ.get("FLASHINFER_WORKSPACE_BASE", str(args.logs / "jit")),
           "FIVAR_CACHE_DIR": os.environ.get("FIVAR_CACHE_DIR", str(args.logs / "fivar-cache"))}
    status: dict = {}
    threads = [threading.Thread(target=run_lane, args=(lane, args.logs, env, args.timeout_s, status))
               for lane in lanes if lane]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (args.logs / "summary.txt").write_text("".join(f"{stem} rc={status[stem]}\n" for stem in files))
    (args.logs / "all.done").touch()
    return 0 if all(rc == 0 for rc in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
