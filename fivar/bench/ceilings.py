"""The two ceilings every result is judged against, measured on this GPU and cached per GPU name."""
from __future__ import annotations

import json

import torch

from ..cache import cache_dir


def measure(device="cuda") -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and dense bf16 matmul rate, on random data."""
    from triton.testing import do_bench
    n = 1 << 28  # 512 MiB of bf16: far past L2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    copy_tbps = 2 * src.numel() * 2 / ms / 1e9
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median")
    return {"gpu": torch.cuda.get_device_name(device), "copy_tb_per_s": copy_tbps,
            "bf16_matmul_tflops": 2 * 8192 ** 3 / ms / 1e9}


def get(device="cuda", refresh: bool = False) -> dict:
    path = cache_dir() / "ceilings.json"
    try:
        table = json.loads(path.read_text()) if path.exists() else {}
    except (ValueError, RecursionError):  # a cache: unreadable (or nested too deep to read) means measure again
        table = {}
    if not isinstance(table, dict):
        table = {}
    name = torch.cuda.get_device_name(device)
    if refresh or name not in table:
        table[name] = measure(device)
        path.write_text(json.dumps(table, indent=1))
    return table[name]
