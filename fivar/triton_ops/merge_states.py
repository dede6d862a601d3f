"""
Merging attention states in Triton
==================================

Attention over keys K can be computed in chunks K = K_0 ∪ K_1 ∪ ... and put back together exactly. Each chunk j
gives its softmax-normalised output o_j and the log-sum-exp of its logits, lse_j (FlashInfer's kernels write it in
base 2). The whole row is then

    lse = log2(sum_j 2^lse_j),        o = sum_j 2^(lse_j - lse) * o_j

This is how split-KV kernels finish, and how fivar's FA3 single prefill fills the GPU's last wave
(`fivar.runtime.wave_split`): the last heads run as several shorter KV chunks, merged here.

* **one program per (row, head)**: it loads the chunks' lse, takes their max first (so 2^x never overflows; a
  chunk whose every key was masked has lse = -inf and weight 0), and accumulates the weighted outputs in float32;
* the chunks' outputs are stored in the output dtype (bf16/fp16) by the attention kernel, like FlashInfer's own
  split-KV partials, so the merge costs one read of each chunk and one write;
* `out` may be a strided view (the last heads of the full output) as long as its last dim is contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import FivarError


@triton.jit
def _reference_lse(top):
    """The largest lse of a row's states, the exponent every weight 2^(lse_j - top) is taken from (so none
    overflows); 0 when every state is empty (lse -inf): weights 0, output 0."""
    return tl.where(top == float("-inf"), 0.0, top)


@triton.jit
def _merge_states_kernel(O_PARTS, LSE_PARTS, OUT,
                         stride_pc, stride_pn, stride_ph, stride_lc, stride_ln, stride_lh, stride_on, stride_oh,
                         H, D, CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    n = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D

    chunks = tl.arange(0, CHUNKS)
    lse = tl.load(LSE_PARTS + chunks * stride_lc + n * stride_ln + h * stride_lh)
    top = _reference_lse(tl.max(lse, axis=0))
    total = tl.sum(tl.exp2(lse - top), axis=0)

    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(CHUNKS):
        lse_j = tl.load(LSE_PARTS + j * stride_lc + n * stride_ln + h * stride_lh)
        o_j = tl.load(O_PARTS + j * stride_pc + n * stride_pn + h * stride_ph + cols, mask=mask, other=0.0)
        acc += tl.exp2(lse_j - top) * o_j.to(tl.float32)
    acc = tl.where(total > 0, acc / total, 0.0)
    tl.store(OUT + n * stride_on + h * stride_oh + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def merge_states(o_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes the merge of `o_parts` [C, N, H, D] (their lse, base 2: `lse_parts` [C, N, H] float32) into
    `out` [N, H, D] and returns it. C must be a power of two."""
    if o_parts.dim() != 4:
        raise FivarError(f"merge_states: o_parts must be [C, N, H, D], got {list(o_parts.shape)}")
    chunks, n, h, d = o_parts.shape
    if chunks & (chunks - 1) or lse_parts.shape != (chunks, n, h) or out.shape != (n, h, d):
        raise FivarError(f"merge_states: o_parts {list(o_parts.shape)}, lse_parts {list(lse_parts.shape)}, out "
                         f"{list(out.shape)}: expected [C, N, H, D], [C, N, H], [N, H, D] with C a power of two")
    _check_parts("merge_states", o_parts, lse_parts, out)
    if o_parts.stride(-1) != 1 or out.stride(-1) != 1:
        raise FivarError("merge_states: the last dim of o_parts and out must be contiguous")
    if n * h == 0:
        return out
    block = triton.next_power_of_2(d)
    _merge_states_kernel[(n * h,)](
        o_parts, lse_parts, out,
        *o_parts.stride()[:3], *lse_parts.stride(), out.stride(0), out.stride(1),
        h, d, CHUNKS=chunks, BLOCK_D=block, num_warps=max(1, min(4, block // 64)))
    return out


def _check_parts(what: str, o, lse_parts, out, lse=None) -> None:
    """One device for every tensor, floating outputs, float32 lses (what the kernels load them as)."""
    tensors = {"o": o, "lse": lse_parts, "out": out, **({"out lse": lse} if lse is not None else {})}
    devices = {str(t.device) for t in tensors.values()}
    if len(devices) > 1:
        raise FivarError(f"{what}: every tensor must be on one device, got " +
                         ", ".join(f"{k} on {t.device}" for k, t in tensors.items()))
    if not (o.is_floating_point() and out.is_floating_point()):
        raise FivarError(f"{what}: the outputs must be floating point, got {o.dtype} and {out.dtype}")
    for k in ("lse", "out lse"):
        if k in tensors and tensors[k].dtype != torch.float32:
            raise FivarError(f"{what}: the {k} must be float32 (log2-sum-exps), got {tensors[k].dtype}")


@triton.jit
def _merge_into_kernel(O, LSE, O_NEW, LSE_NEW, stride_on, stride_oh, stride_ln, stride_lh, stride_pn, stride_ph,
                       stride_qn, stride_qh, N, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.program_id(1).to(tl.int64)
    keep_row = rows < N
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    keep = keep_row[:, None] & (cols < D)[None, :]

    lse_a = tl.load(LSE + rows * stride_ln + h * stride_lh, mask=keep_row, other=float("-inf"))
    lse_b = tl.load(LSE_NEW + rows * stride_qn + h * stride_qh, mask=keep_row, other=float("-inf"))
    top = _reference_lse(tl.maximum(lse_a, lse_b))
    w_a, w_b = tl.exp2(lse_a - top), tl.exp2(lse_b - top)
    total = w_a + w_b
    o_a = tl.load(O + rows[:, None] * stride_on + h * stride_oh + cols[None, :], mask=keep, other=0.0)
    o_b = tl.load(O_NEW + rows[:, None] * stride_pn + h * stride_ph + cols[None, :], mask=keep, other=0.0)
    acc = (w_a[:, None] * o_a.to(tl.float32) + w_b[:, None] * o_b.to(tl.float32)) / \
        tl.where(total > 0, total, 1.0)[:, None]
    tl.store(O + rows[:, None] * stride_on + h * stride_oh + cols[None, :], acc.to(O.dtype.element_ty), mask=keep)
    tl.store(LSE + rows * stride_ln + h * stride_lh, tl.where(total > 0, top + tl.log2(total), float("-inf")),
             mask=keep_row)


def merge_into(out: torch.Tensor, lse: torch.Tensor, o_new: torch.Tensor, lse_new: torch.Tensor) -> None:
    """out [N, H, D] and lse [N, H] (float32, base 2) become the merge of themselves with (o_new, lse_new), in place:
    one read of each and one write, a block of rows per program (the running merge of states arriving one by one,
    as context parallelism has them)."""
    n, h, d = out.shape
    if o_new.shape != out.shape or lse.shape != (n, h) or lse_new.shape != (n, h):
        raise FivarError(f"merge_into: out {list(out.shape)}, lse {list(lse.shape)}, o_new {list(o_new.shape)}, "
                         f"lse_new {list(lse_new.shape)}: expected [N, H, D] twice and [N, H] twice")
    _check_parts("merge_into", o_new, lse_new, out, lse)
    if o_new.stride(-1) != 1 or out.stride(-1) != 1:
        raise FivarError("merge_into: the last dim of out and o_new must be contiguous")
    if n * h == 0:
        return
    block_n, block_d = 16, triton.next_power_of_2(d)
    _merge_into_kernel[(triton.cdiv(n, block_n), h)](
        out, lse, o_new, lse_new, out.stride(0), out.stride(1), *lse.stride(), o_new.stride(0), o_new.stride(1),
        *lse_new.stride(), n, d, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4)
