"""
Moving rows in Triton
=====================

fivar's head-requests form (`fivar.runtime.kv_ranges`) runs a request per (head, request), over q and k/v read a
head a row: each launch gathers its rows (one token of one head: head_dim contiguous values) from q viewed as
[tokens * heads, head_dim], and writes its output rows back to the same places. torch's index_select and
index_copy_ move such 256-byte rows at about half the device's copy bandwidth (H200); here each program moves
BLOCK_R rows with whole-row vector loads and stores.

* `gather_rows(src, index)`: out[i] = src[index[i]];
* `scatter_rows(dst, index, src)`: dst[index[i]] = src[i] (indices distinct);
* rows are the last dim of 2-D contiguous tensors; other layouts (and CPU tensors outside the interpreter) take
  torch's ops.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_R = 32  # rows per program: 8 KB of bf16 rows of 128 in flight


@triton.jit
def _move_rows_kernel(SRC, DST, INDEX, n, W, GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_W)
    ok = rows < n
    at = tl.load(INDEX + rows, mask=ok, other=0).to(tl.int64)
    mask = ok[:, None] & (cols[None, :] < W)
    here = rows.to(tl.int64)[:, None] * W + cols[None, :]
    there = at[:, None] * W + cols[None, :]
    if GATHER:
        tl.store(DST + here, tl.load(SRC + there, mask=mask), mask=mask)
    else:
        tl.store(DST + there, tl.load(SRC + here, mask=mask), mask=mask)


def _triton_ok(*tensors) -> bool:
    on_gpu = all(t.is_cuda for t in tensors)
    return (on_gpu or os.environ.get("TRITON_INTERPRET") == "1") and all(
        t.is_contiguous() for t in tensors if t.dim() == 2)


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src [N, W] contiguous, index int [n] -> [n, W]: src's rows at `index`."""
    if not _triton_ok(src, index):
        return src.index_select(0, index)
    out = src.new_empty((index.numel(), src.shape[1]))
    if index.numel():
        _move_rows_kernel[(triton.cdiv(index.numel(), BLOCK_R),)](
            src, out, index, index.numel(), src.shape[1], GATHER=True, BLOCK_R=BLOCK_R,
            BLOCK_W=triton.next_power_of_2(src.shape[1]))
    return out


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst [N, W] contiguous, src [n, W], index int [n] of distinct rows: dst[index] = src, in place."""
    if not _triton_ok(dst, src, index):
        return dst.index_copy_(0, index, src)
    if index.numel():
        _move_rows_kernel[(triton.cdiv(index.numel(), BLOCK_R),)](
            src.contiguous(), dst, index, index.numel(), dst.shape[1], GATHER=False, BLOCK_R=BLOCK_R,
            BLOCK_W=triton.next_power_of_2(dst.shape[1]))
    return dst
