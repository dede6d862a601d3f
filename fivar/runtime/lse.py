"""Log-sum-exp outputs and merging attention over split KV.

fivar's convention, the same on every backend (fa2, fa3, triton) and in the reference, and FlashInfer's own
default (`lse_base="log2"`): for query row i and query head h,

    lse[i, h] = log2( sum_j exp(logits[i, h, j]) )      over the keys j the mask (and causal) keeps,

a float32 tensor shaped like the output without its last dim ([tokens, num_qo_heads]); -inf where a row keeps
no key (its output is zeros). `logits` are the variant's (score = q.k * sm_scale, then the logits transform), in
natural units: lse / log2(e) is the usual natural-log LSE.

Attention over keys K = K_0 ∪ K_1 ∪ ... (disjoint) is then exactly

    lse = log2( sum_c 2^lse_c ),        out = sum_c 2^(lse_c - lse) * out_c,

which `merge_states` computes: cascade attention (a shared prefix plus per-request suffixes), context
parallelism, and chunked prefill merge partial results this way. A variant with a `sink` adds exp(sink) to every
call's denominator, so each part's lse counts it and a merge of parts counts it once per part: its parts must be
computed without the sink and the sink's own state (zeros, sink * log2(e)) merged once, as fivar.distributed does
(fivar.distributed.positions.sink_state). Only a softmax makes outputs mergeable: a
variant with `softmax=False` has no normaliser, and asking it for an LSE is an error (fivar.spec.inputs.check_lse,
which the reference shares, as it does LOG2E).
"""
from __future__ import annotations

import math

import torch

from ..errors import FivarError


def empty_lse(q: torch.Tensor) -> torch.Tensor:
    """The LSE of rows that see no key: -inf, [tokens, num_qo_heads] float32."""
    return torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)


def merge_states(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """Combines attention computed over disjoint parts of the keys into attention over all of them.

    outs: a sequence of C outputs [*, H, D] (or one tensor [C, *, H, D]); lses: their log2-sum-exps [*, H] (or
    [C, *, H]), as `return_lse=True` gives them. Returns (out, lse): out in the outputs' dtype, lse float32.
    Rows that no part kept a key for stay zeros with lse -inf. Plain torch (float32 math), so it runs on any
    device and inside `torch.compile`.
    """
    o, s = _stacked(outs, "outputs"), _stacked(lses, "lses")
    if o.dim() < 3 or s.shape != o.shape[:-1]:
        raise FivarError(f"merge_states: outputs {list(o.shape)} and lses {list(s.shape)} do not match: expected "
                         "C outputs [*, H, D] and C lses [*, H] (as return_lse=True returns them)")
    if s.device != o.device:
        raise FivarError(f"merge_states: the outputs are on {o.device} and the lses on {s.device}; pass them on one "
                         "device")
    s = s.float()
    top = s.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all parts empty: weights 0
    weight = torch.exp2(s - top)  # [C, *, H]
    total = weight.sum(0)
    merged = (weight.unsqueeze(-1) * o.float()).sum(0) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    lse = torch.where(total > 0, top + torch.log2(total), torch.full_like(total, -math.inf))
    return merged.to(o.dtype), lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, o_new: torch.Tensor, lse_new: torch.Tensor) -> None:
    """(out, lse) <- their merge with (o_new, lse_new), in place: one fused pass on a GPU
    (fivar.triton_ops.merge_states), merge_states elsewhere."""
    if out.is_cuda:
        from ..triton_ops.merge_states import merge_into as fused
        fused(out, lse, o_new, lse_new)
        return
    o, s = merge_states([out, o_new.to(out.dtype)], [lse, lse_new])
    out.copy_(o)
    lse.copy_(s)


def _stacked(parts, what: str) -> torch.Tensor:
    """The C parts (a sequence of tensors, or one tensor [C, ...]) as one tensor, every part of one shape, floating
    dtype and device, else one line naming the part that differs (torch.stack would promote mixed dtypes)."""
    if isinstance(parts, torch.Tensor):
        if not parts.is_floating_point():
            raise FivarError(f"merge_states: the {what} must be floating point, got {parts.dtype}")
        return parts
    try:
        parts = list(parts)
    except TypeError:
        raise FivarError(f"merge_states: the {what} must be a sequence of tensors or one tensor, got "
                         f"{type(parts).__name__}") from None
    if not parts:
        raise FivarError(f"merge_states: no {what} to merge")
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            raise FivarError(f"merge_states: {what}[{i}] is a {type(p).__name__}, not a tensor")
        if not p.is_floating_point():
            raise FivarError(f"merge_states: {what}[{i}] must be floating point, got {p.dtype}")
        first = parts[0]
        if (p.shape, p.dtype, p.device) != (first.shape, first.dtype, first.device):
            raise FivarError(f"merge_states: {what}[{i}] is {list(p.shape)} {p.dtype} on {p.device} but {what}[0] is "
                             f"{list(first.shape)} {first.dtype} on {first.device}; every part must match")
    return torch.stack(parts)
