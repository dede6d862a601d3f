"""The q/k/v checks the torch reference (`fivar.codegen.torch_ref`) and the runtime (`fivar.runtime.attention`)
share. Imports torch and fivar.errors only, so the reference uses it without loading the runtime."""
from __future__ import annotations

import torch

from ..errors import FivarError

Q_LAYOUT = ("tokens", "num_qo_heads", "head_dim")
KV_LAYOUT = ("tokens", "num_kv_heads", "head_dim")
PAGED_KV_LAYOUT = ("num_pages", "page_size", "num_kv_heads", "head_dim")
PAGED_KV_NAMES = ("k_cache", "v_cache")


def check_qkv_layout(name: str, q, k, v, *, prefix: str = "", q_layout=Q_LAYOUT, kv_layout=KV_LAYOUT,
                     kv_names=("k", "v")) -> None:
    """q, k, v are tensors on one device, q [*q_layout], k and v [*kv_layout] of one shape (the last two dims
    num_kv_heads, head_dim), q's head_dim k's, num_qo_heads a multiple of num_kv_heads. A mismatch is a
    FivarError "variant '<name>': <prefix>..." naming the tensor and its shape. Dtypes, devices and sizes each
    caller supports are its own checks."""
    pre = f"variant '{name}': {prefix}"
    kn, vn = kv_names
    for t, tn in ((q, "q"), (k, kn), (v, vn)):
        if not isinstance(t, torch.Tensor):
            raise FivarError(f"{pre}{tn} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != len(q_layout):
        raise FivarError(f"{pre}q must be [{', '.join(q_layout)}], got shape {tuple(q.shape)}")
    if k.dim() != len(kv_layout) or k.shape != v.shape:
        raise FivarError(f"{pre}{kn} and {vn} must be [{', '.join(kv_layout)}] of one shape, got {kn} "
                         f"{tuple(k.shape)} and {vn} {tuple(v.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise FivarError(f"{pre}q {tuple(q.shape)} and {kn} {tuple(k.shape)} need the same head_dim, got "
                         f"{q.shape[-1]} and {k.shape[-1]}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv:
        raise FivarError(f"{pre}num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv}), got q "
                         f"{tuple(q.shape)} and {kn} {tuple(k.shape)}")
    if k.device != q.device or v.device != q.device:
        raise FivarError(f"{pre}q, {kn}, {vn} must be on one device, got {q.device}, {k.device}, {v.device}")
