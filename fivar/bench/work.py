"""Counting the work a kernel must do: useful FLOPs (masked-out pairs excluded) and minimal bytes."""
from __future__ import annotations

import torch

from .timing import attention_flops, decode_kv_bytes  # noqa: F401  (re-exported: one place for counting)


def attention_bytes(qo_len: int, kv_len: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                    elem_bytes: int = 2, batch: int = 1) -> float:
    """Each input read once, the output written once: q, k, v, o."""
    return float(elem_bytes * head_dim * batch * (2 * qo_len * num_qo_heads + 2 * kv_len * num_kv_heads))


def kept_fraction(variant, params: dict, *, qo_len: int, kv_len: int, num_qo_heads: int, num_kv_heads: int,
                  causal: bool, device="cpu", sample_rows: int = 512, batch_size: int = 1) -> float:
    """Fraction of (query, key) pairs the variant's mask (and causal) keeps, relative to the causal-or-full
    count that `attention_flops` already assumes. 1.0 for variants without a mask."""
    if variant.mask is None:
        return 1.0
    from ..codegen.torch_ref import TorchEvaluator
    from ..runtime.params import bind_params
    b = bind_params(variant, params, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                    batch_size=batch_size, device=device)
    n = min(sample_rows, qo_len)
    rows = torch.linspace(0, qo_len - 1, n, device=device).round().long().view(1, n, 1) + (kv_len - qo_len)
    kv = torch.arange(kv_len, device=device).view(1, 1, kv_len)
    heads = torch.arange(num_qo_heads, device=device).view(-1, 1, 1)
    env = {"batch": torch.tensor(0, device=device), "qo_head": heads,
           "kv_head": heads // (num_qo_heads // num_kv_heads), "q_idx": rows, "kv_idx": kv}
    keep = TorchEvaluator(env, {**b.scalars, **b.tensors}, torch.float32, device).run(variant.ir.mask)
    keep = keep.expand(num_qo_heads, n, kv_len)
    if causal:
        visible = (kv <= rows).expand_as(keep)
        return float((keep & visible).sum()) / max(1.0, float(visible.sum()))
    return float(keep.float().mean())
