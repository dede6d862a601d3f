import os
import tempfile

import pytest
import torch

os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
if not torch.cuda.is_available():
    # No GPU to detect an arch from: compile for Hopper, which is what fivar's kernels target.
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    # Triton kernels run in its interpreter. Triton fixes interpreted-vs-compiled when it is first
    # imported/when a kernel is defined, and other tests (FlexAttention) import it early: set it here.
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("FIVAR_TEST_FRESH_JIT_CACHE", "1") == "1":
    # A fresh FlashInfer cache per test session, so the build tests really run nvcc (FlashInfer fixes
    # its cache directory at import, which happens after this).
    os.environ["FLASHINFER_WORKSPACE_BASE"] = tempfile.mkdtemp(prefix="fivar-test-jit-")
os.environ.setdefault("FIVAR_CACHE_DIR", tempfile.mkdtemp(prefix="fivar-test-cache-"))


def pytest_configure(config):
    config.addinivalue_line("markers", "nvcc: runs nvcc (minutes on a small machine); the fast path is -m 'not nvcc'")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible); run on the GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
