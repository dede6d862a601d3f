import os
import shutil
import tempfile

import pytest
import torch

_MADE: list[str] = []  # the directories this run creates, removed when it finishes
os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
# Default calls run the modules they are testing, never the Triton twin while those build (fivar.runtime.cold_start;
# its own tests turn it on).
os.environ.setdefault("FIVAR_COLD_START", "wait")
if not torch.cuda.is_available():
    # No GPU to detect an arch from: compile for Hopper, which is what fivar's kernels target.
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    # Triton kernels run in its interpreter. Triton fixes interpreted-vs-compiled when it is first
    # imported/when a kernel is defined, and other tests (FlexAttention) import it early: set it here.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist workers inherit the controller's environment, these directories included: one FlashInfer workspace
# and fivar cache for the whole run, so each module compiles once whichever worker needs it first (fivar and
# FlashInfer build a module under a file lock of its own); the controller, which made them, removes them.
_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if _XDIST_WORKER:
    # xdist's workers run with COLUMNS=80; the CLI tests read its output as a pipe gets it (fivar.console)
    os.environ.pop("COLUMNS", None)
    # nvcc jobs per worker: the cores shared among the workers (ninja's default, cores + 2 jobs in each worker, ran 8
    # nvcc processes of up to several GiB each at once on a 2-core box)
    if "MAX_JOBS" not in os.environ:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        os.environ["MAX_JOBS"] = str(max(1, (os.cpu_count() or 1) // workers))
if os.environ.get("FIVAR_TEST_FRESH_JIT_CACHE", "1") == "1" and not _XDIST_WORKER:
    # A fresh FlashInfer cache per test run, so the build tests really run nvcc (FlashInfer fixes
    # its cache directory at import, which happens after this).
    os.environ["FLASHINFER_WORKSPACE_BASE"] = tempfile.mkdtemp(prefix="fivar-test-jit-")
    _MADE.append(os.environ["FLASHINFER_WORKSPACE_BASE"])
if "FIVAR_CACHE_DIR" not in os.environ:
    os.environ["FIVAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fivar-test-cache-")
    _MADE.append(os.environ["FIVAR_CACHE_DIR"])


def pytest_unconfigure(config):
    """The test run's own directories go with it (a directory set from outside is the caller's)."""
    for d in _MADE:
        shutil.rmtree(d, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "nvcc: runs nvcc (minutes on a small machine); the fast path is -m 'not nvcc'")
    # Before xdist starts its workers, which inherit the environment: torch's (and numpy's, which the Triton
    # interpreter runs on) threads a worker are its share of the cores. Each worker otherwise starts as many threads
    # as there are cores, and on 2 cores the interpreter tests ran 11% slower.
    workers = getattr(config.option, "numprocesses", None)
    if not _XDIST_WORKER and isinstance(workers, int) and workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


# Each test file's seconds in the last run that ran it (pytest's cache, written by the run's controller), so the next
# run starts the longest files first. Without a record (a fresh clone, CI): these, measured on 2 cores.
_FILE_SECONDS = "fivar/file_seconds"
_MEASURED = {"test_build.py": 1207, "test_fa3_tile_list.py": 285, "test_triton_backward.py": 219,
             "test_sccache.py": 179, "test_cache_races.py": 163, "test_fa2_tile_list.py": 149,
             "test_triton_attention.py": 123, "test_cache_reliability.py": 117, "test_fa2_block_form.py": 105,
             "test_sinks.py": 85, "test_bench_context_parallel.py": 74, "test_distributed.py": 74,
             "test_fusion_build.py": 73, "test_position_tables.py": 61, "test_fuzz_spec.py": 59,
             "test_fp8_kv.py": 44, "test_cli.py": 43, "test_serving.py": 39, "test_triton_ops.py": 31,
             "test_block_map.py": 30, "test_mask_ranges.py": 29, "test_flashinfer_compat.py": 28,
             "test_training_lowering.py": 27, "test_cache_environments.py": 24, "test_fusion_spec.py": 21,
             "test_wave_split.py": 21}
_seconds_run: dict[str, float] = {}


def _file_key(path) -> str:
    return os.path.relpath(path, os.path.dirname(os.path.dirname(__file__)))


def pytest_collection_modifyitems(config, items):
    # The files that run nvcc first (their order kept, and each file's): their minutes of compiles then overlap with
    # the rest, which fills in behind them in small pieces on whichever xdist worker is free. Then the rest, longest
    # file first, so that no long file starts last (pyproject's --no-loadscope-reorder keeps this order in xdist).
    compiles = {item.path for item in items if "nvcc" in item.keywords}
    cache = getattr(config, "cache", None)
    last = (cache.get(_FILE_SECONDS, None) if cache is not None else None) or {}
    cost = {p: last.get(_file_key(p), _MEASURED.get(p.name, 0)) for p in {item.path for item in items}}
    items.sort(key=lambda item: (item.path not in compiles, -cost[item.path]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible); run on the GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _seconds_run[path] = _seconds_run.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    """The controller (or a run without xdist) records each file's seconds for the next run's order."""
    cache = getattr(session.config, "cache", None)
    if cache is None or _XDIST_WORKER or not _seconds_run:
        return
    cache.set(_FILE_SECONDS, {**(cache.get(_FILE_SECONDS, None) or {}), **_seconds_run})
