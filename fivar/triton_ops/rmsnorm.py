"""
RMSNorm (and residual-add + RMSNorm) in Triton
==============================================

RMSNorm rescales every row of `x` by the reciprocal of its root mean square and multiplies by a learned
weight:

    y = x / sqrt(mean(x ** 2) + eps) * w          (Gemma: * (1 + w))

It is a *memory-bound* op: per element it reads two bytes, writes two bytes, and does a handful of
FLOPs. The only thing that matters for speed is to touch HBM exactly once per element, so the kernel
follows Triton's layer-norm tutorial:

* **one program per row**, with a block (`BLOCK`, the next power of two of the hidden size) that covers
  the whole row, so the row is loaded into registers once, reduced, scaled and stored, with no second
  pass over memory;
* **float32 math** whatever the storage dtype (fp16/bf16/fp32): the sum of squares of 4096 bf16 values
  would lose most of its bits otherwise;
* **num_warps grows with the row**: one warp per 256 elements (8 bytes of bf16 per thread per load, so
  16-byte vectorised accesses once the block is big), between 1 and 16 warps.

`fused_add_rmsnorm` is the pre-norm transformer's "add the sub-layer output to the residual stream, then
normalise" step, done in place like `flashinfer.fused_add_rmsnorm`:

    residual <- x + residual
    x        <- rmsnorm(residual) * w

The sum is kept in float32 and normalised from there (the stored `residual` is rounded to its dtype),
which is what FlashInfer does too. Reads x, residual; writes residual, x: 4 bytes-per-element trips
instead of the 6 of the unfused pair.

Rows may be strided: `x` may be `[T, N]` or `[T, H, N]` with any strides on the leading dims (per-head
norms over the heads of a packed QKV buffer) as long as the last dim is contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 65536  # one row in registers; beyond this a row would spill


@triton.jit
def _rmsnorm_kernel(X, Y, R, W,
                    stride_xt, stride_xh, stride_yt, stride_yh, stride_rt, stride_rh,
                    H, N, eps,
                    ADD_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    # Row `pid` is (token t, head h) of a [T, H, N] view (H == 1 for a plain [T, N] matrix). The
    # token index goes to int64 before it meets a stride: T * stride overflows int32 past 2 GiB.
    pid = tl.program_id(0)
    t = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N

    x = tl.load(X + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        # residual += x, kept in float32 for the norm; the stored copy is rounded to R's dtype.
        r_ptrs = R + t * stride_rt + h * stride_rh + cols
        x += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_ptrs, x.to(R.dtype.element_ty), mask=mask)

    # Masked lanes hold 0, so they add nothing to the sum of squares; divide by the true N.
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w += 1.0
    tl.store(Y + t * stride_yt + h * stride_yh + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def _rows3(t: torch.Tensor, name: str) -> torch.Tensor:
    """A [T, H, N] view of `t` (no copy), with a contiguous last dim."""
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dim")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride {t.stride(-1)})")
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    try:
        return t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"{name}: cannot view {tuple(t.shape)} with strides {t.stride()} as [rows, H, N] "
                         "without a copy") from e


def _check_weight(weight: torch.Tensor, n: int, device) -> None:
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    if weight.device != device:
        raise ValueError(f"weight is on {weight.device}, x on {device}")


def _launch(x3, y3, r3, weight, eps, gemma, add_residual):
    t, h, n = x3.shape
    block = triton.next_power_of_2(n)
    if block > MAX_BLOCK:
        raise ValueError(f"hidden size {n} > {MAX_BLOCK}: one row no longer fits one program's registers")
    if t * h == 0:
        return
    r3 = r3 if r3 is not None else x3  # unused when not ADD_RESIDUAL, but needs to be a pointer
    _rmsnorm_kernel[(t * h,)](
        x3, y3, r3, weight,
        x3.stride(0), x3.stride(1), y3.stride(0), y3.stride(1), r3.stride(0), r3.stride(1),
        h, n, float(eps),
        ADD_RESIDUAL=add_residual, GEMMA=bool(gemma), BLOCK=block, num_warps=_num_warps(block))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, gemma: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of `x` ([..., N], last dim contiguous). Returns `out` (a new tensor of
    x's shape and dtype unless given; `out=x` normalises in place). `gemma=True` scales by 1 + weight."""
    x3 = _rows3(x, "x")
    _check_weight(weight, x.shape[-1], x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.device != x.device:
        raise ValueError(f"out must be {tuple(x.shape)} on {x.device}, got {tuple(out.shape)} on {out.device}")
    _launch(x3, _rows3(out, "out"), None, weight, eps, gemma, add_residual=False)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      gemma: bool = False) -> None:
    """In place, like `flashinfer.fused_add_rmsnorm`: residual <- x + residual; x <- rmsnorm(residual).

    The norm is taken of the float32 sum (before `residual` is rounded to its dtype)."""
    if residual.shape != x.shape or residual.device != x.device:
        raise ValueError(f"residual must be {tuple(x.shape)} on {x.device}, got {tuple(residual.shape)} "
                         f"on {residual.device}")
    x3, r3 = _rows3(x, "x"), _rows3(residual, "residual")
    _check_weight(weight, x.shape[-1], x.device)
    _launch(x3, x3, r3, weight, eps, gemma, add_residual=True)
