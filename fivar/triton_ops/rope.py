"""
Rotary position embedding (RoPE) in Triton, in place
====================================================

RoPE rotates pairs of features of every query and key head by an angle that depends on the token's
position `p` and the pair's index `i`:

    (x1, x2) <- (x1 * cos(p * f_i) - x2 * sin(p * f_i),  x2 * cos(p * f_i) + x1 * sin(p * f_i))

Two conventions choose *which* features pair up:

* **NeoX** (`style="neox"`, Llama/Qwen/most HF models): feature `i` pairs with `i + rotary_dim / 2`
  (the two halves of the rotated part);
* **GPT-J** (`style="gptj"`): feature `2i` pairs with `2i + 1` (interleaved).

With **partial rotary** (`rotary_dim < head_dim`, e.g. GPT-J, Phi, ChatGLM) only the first `rotary_dim`
features rotate; the rest pass through untouched, so an in-place kernel simply never loads them.

The angles come precomputed in FlashInfer's/vLLM's `cos_sin_cache` `[max_pos, rotary_dim]` (float32):
row `p` holds `cos(p * f_i)` for `i < rotary_dim / 2` in its first half and `sin(p * f_i)` in its second
(`fivar.fusion.reference.cos_sin_cache` builds one).

The kernel is memory bound (read and write each rotated element once, plus one cache row per token):

* **one program per token**: it loads the token's position and its cos/sin row once, then walks over
  the query heads and then the key heads in chunks of `BLOCK_H` heads. NeoX: each chunk is a
  `[BLOCK_H, half]` tile per half (two contiguous half-rows, the partners in the same thread). GPT-J:
  one contiguous `[BLOCK_H, rotary_dim]` load, de-interleaved in registers (`tl.reshape` + `tl.split`)
  and re-interleaved the same way before one contiguous store. (Measured on an H200, GPT-J rot 64 of 128:
  a `[BLOCK_H, half, 2]` pointer tile 12.6% of copy bandwidth, a second load at the partner index
  `i ^ 1` 24.9%: both defeat vectorised access.) `_load_pairs`/`_store_pairs` are shared with the
  QK-norm+RoPE kernel.
* **float32 math**, results rounded once to the storage dtype;
* q `[T, Hq, D]` and k `[T, Hk, D]` may be **strided views** into a packed QKV buffer
  (`qkv[:, :Hq*D].view(T, Hq, D)`): the token and head strides are kernel arguments, only the last dim
  must be contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements of q/k per chunk of heads (both halves): ~16 fp32 registers a thread at 8 warps


@triton.jit
def _rope_heads(base, stride_h, H, cos, sin,
                HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotates x[:, :2*HALF] of the H heads at `base` (head stride `stride_h`), in place."""
    c, s = cos[None, :], sin[None, :]
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        rows = base + heads.to(tl.int64)[:, None] * stride_h
        x1, x2, offs, mask = _load_pairs(rows, heads < H, HALF, IS_NEOX, BLOCK_HALF)
        _store_pairs(rows, x1 * c - x2 * s, x2 * c + x1 * s, offs, mask, HALF, IS_NEOX)


@triton.jit
def _token_cos_sin(POS, CS, t, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """cos and sin (fp32, BLOCK_HALF wide) of token t's position, from FlashInfer's cos_sin_cache layout."""
    pos = tl.load(POS + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    cos = tl.load(CS + pos * stride_cs + i, mask=i_mask, other=0.0).to(tl.float32)
    sin = tl.load(CS + pos * stride_cs + HALF + i, mask=i_mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _load_pairs(rows, mask_h, HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The rotated features of a [BLOCK_H] chunk of heads as rotation partners (x1, x2), each
    [BLOCK_H, BLOCK_HALF] fp32, plus what `_store_pairs` needs to write them back."""
    if IS_NEOX:  # two contiguous half-rows
        i = tl.arange(0, BLOCK_HALF)
        offs = i[None, :]
        mask = mask_h[:, None] & (i < HALF)[None, :]
        x1 = tl.load(rows + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(rows + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    else:  # one contiguous run, de-interleaved in registers
        r = tl.arange(0, 2 * BLOCK_HALF)
        offs = r[None, :]
        mask = mask_h[:, None] & (r < 2 * HALF)[None, :]
        x = tl.load(rows + offs, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [x.shape[0], BLOCK_HALF, 2]))
    return x1, x2, offs, mask


@triton.jit
def _store_pairs(rows, y1, y2, offs, mask, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    if IS_NEOX:
        tl.store(rows + offs, y1.to(rows.dtype.element_ty), mask=mask)
        tl.store(rows + offs + HALF, y2.to(rows.dtype.element_ty), mask=mask)
    else:
        y = tl.reshape(tl.join(y1, y2), [y1.shape[0], 2 * y1.shape[1]])
        tl.store(rows + offs, y.to(rows.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, POS, CS,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                 HQ, HK,
                 HALF: tl.constexpr, IS_NEOX: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _token_cos_sin(POS, CS, t, stride_cs, HALF, BLOCK_HALF)
    _rope_heads(Q + t * stride_qt, stride_qh, HQ, cos, sin, HALF, IS_NEOX, BLOCK_HQ, BLOCK_HALF)
    _rope_heads(K + t * stride_kt, stride_kh, HK, cos, sin, HALF, IS_NEOX, BLOCK_HK, BLOCK_HALF)


def _style_is_neox(style: str) -> bool:
    if style not in ("neox", "gptj"):
        raise ValueError(f"style must be 'neox' or 'gptj', got {style!r}")
    return style == "neox"


def check_rope_args(q, k, positions, cos_sin_cache, rotary_dim):
    """Shape/dtype/device checks shared with qk_norm_rope. Returns (T, Hq, Hk, D)."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens or head dim")
    for name, x in (("q", q), ("k", k)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous (stride {x.stride(-1)})")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {x.dtype}")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{t}], got {positions.dtype} {tuple(positions.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= d:
        raise ValueError(f"rotary_dim must be even and in (0, {d}], got {rotary_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, {rotary_dim}] with a contiguous last dim, got "
                         f"{tuple(cos_sin_cache.shape)}")
    for name, x in (("k", k), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    return t, hq, k.shape[1], d


def block_heads(h: int, elems_per_head: int, tile: int | None = None) -> int:
    """Heads per chunk: all of them if they fit in `tile` (default TILE) elements, else as many as do (a
    power of 2)."""
    return max(1, min(triton.next_power_of_2(max(h, 1)), (tile or TILE) // elems_per_head))


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               rotary_dim: int, style: str = "neox") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place (the first `rotary_dim` features of each head) at
    `positions` [T], with `cos_sin_cache` [max_pos, rotary_dim] (cos first half, sin second). Returns
    (q, k). Like `flashinfer.apply_rope_with_cos_sin_cache_inplace`, positions are not bounds-checked."""
    is_neox = _style_is_neox(style)
    t, hq, hk, _ = check_rope_args(q, k, positions, cos_sin_cache, rotary_dim)
    if t == 0:
        return q, k
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    bq, bk = block_heads(hq, 2 * block_half), block_heads(hk, 2 * block_half)
    tile = max(bq, bk) * 2 * block_half
    _rope_kernel[(t,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        hq, hk,
        HALF=half, IS_NEOX=is_neox, BLOCK_HQ=bq, BLOCK_HK=bk, BLOCK_HALF=block_half,
        num_warps=min(max(tile // 512, 1), 8))
    return q, k
