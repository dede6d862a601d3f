import os

import pytest
import torch

os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible); run on the GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
