"""The per-call tables of position-only logits terms (fivar.spec.positions): evaluated once per call, or per plan,
on the call's device, then passed to the kernels like any tensor param.

Table t holds t.term at [head, d + offset] for every distance d = kv_idx - q_idx in [-(L - 1 + P), L - 1 + P], L
the longest query or key run of the call (a query's q_idx lies in [kv_len - qo_len, kv_len - 1], so every pair's
distance is in [-(L - 1), L - 1]) and P = fivar.spec.positions.TABLE_PAD the distances a kernel's tile padding
reaches past them (the CUDA structs read the table unclamped). The torch evaluator computes it with q_idx = 0 and
kv_idx = d: the term reads the two only through their difference.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..codegen.torch_ref import TorchEvaluator
from ..errors import FivarError
from ..spec.positions import table_offset


def max_lengths(qo_indptr, kv_indptr, kv_last_page_len=None, page_size: int = 1) -> tuple[int, int]:
    """(longest query run, longest key run) of a batch given by its indptrs (paged: pages and last-page lengths)."""
    qo = qo_indptr.long().cpu().diff() if qo_indptr is not None else torch.ones(1, dtype=torch.long)
    pages = kv_indptr.long().cpu().diff()
    if kv_last_page_len is None:
        kv = pages
    else:
        kv = (pages - 1).clamp(min=0) * page_size + torch.where(pages > 0, kv_last_page_len.long().cpu(), 0)
    return int(qo.max()) if qo.numel() else 0, int(kv.max()) if kv.numel() else 0


def table_values(variant, table, bound, length: int, sm_scale: float = 1.0) -> torch.Tensor:
    """float32 [heads or 1, 2 * (length + TABLE_PAD) - 1]: `table`'s term at every head and distance in
    [-(length - 1 + TABLE_PAD), length - 1 + TABLE_PAD], distance 0 at column table_offset(length)."""
    reach = table_offset(length)
    device = bound.device if bound.device is not None else "cpu"
    heads = bound.num_qo_heads if table.per_head else 1
    group = max(bound.num_qo_heads // max(bound.num_kv_heads, 1), 1)
    i32 = dict(dtype=torch.int32, device=device)
    qo_head = torch.arange(heads, **i32)[:, None]
    env = {"qo_head": qo_head, "kv_head": qo_head // group, "q_idx": torch.zeros(1, 1, **i32),
           "kv_idx": torch.arange(-reach, reach + 1, **i32)[None, :], "sm_scale": sm_scale}
    ev = TorchEvaluator(env, {**bound.scalars, **bound.tensors}, torch.float32, device)
    out = ev.run(table.term).to(torch.float32)
    return out.expand(heads, 2 * reach + 1).contiguous()


def bind(variant, bound, lengths) -> object:
    """`bound` with the lowering's tables and offset added, for a call whose longest runs are `lengths` ((qo, kv), or
    a function returning them: only called when the variant has tables, so other variants sync nothing)."""
    lowered = variant.lowered
    if not lowered.position_tables or all(t.name in bound.tensors for t in lowered.position_tables):
        return bound
    if lengths is None:
        raise FivarError(f"variant '{variant.name}': its position tables need the call's lengths, which this entry "
                         "point does not pass (a fivar bug)")
    qo_len, kv_len = lengths() if callable(lengths) else lengths
    length = max(int(qo_len), int(kv_len), 1)
    tensors = dict(bound.tensors)
    for t in lowered.position_tables:
        tensors[t.name] = table_values(variant, t, bound, length)
    offset = next(n for n in lowered.params if n not in tensors)
    return replace(bound, tensors=tensors, scalars={**bound.scalars, offset: table_offset(length)})
