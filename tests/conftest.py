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


def pytest_collection_modifyitems(config, items):
    # The files that run nvcc first (their order kept, and each file's): their minutes of compiles then overlap with
    # the rest, which fills in behind them in small pieces on whichever xdist worker is free.
    compiles = {item.path for item in items if "nvcc" in item.keywords}
    items.sort(key=lambda item: item.path not in compiles)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible); run on the GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
