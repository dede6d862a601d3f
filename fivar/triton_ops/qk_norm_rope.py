"""
Per-head q/k RMSNorm + RoPE in Triton, in place on packed QKV
=============================================================

Qwen3, Gemma 3, OLMo 2 and friends normalise every query and key head on its own (RMSNorm over the head
dim, with one weight vector for q and another for k) and then apply rotary embeddings:

    q[t, h] <- rope(rmsnorm(q[t, h]) * q_weight, positions[t])
    k[t, h] <- rope(rmsnorm(k[t, h]) * k_weight, positions[t])

Unfused that is three kernels and three round trips through HBM for q and k (`rmsnorm(q)`,
`rmsnorm(k)`, `rope(q, k)`); here it is one read and one write of each element. The structure is the
RoPE kernel's (rope.py), with the norm in front:

* **one program per token**, which loads the position and the cos/sin row once and walks over the q
  heads, then the k heads, a chunk of `BLOCK_H` heads at a time (q and k in separate programs measured
  62% of copy on an H200 against 78% for this);
* each head is loaded **in the pieces RoPE needs**, so the rotation partners already sit in the same
  thread's registers after the norm: NeoX loads the two halves of the rotated part as two
  `[BLOCK_H, half]` tiles; GPT-J loads the rotated run contiguously and de-interleaves it in registers
  (see rope.py); the pass-through tail (`rotary_dim < head_dim`) is a third
  tile. The norm's sum of squares is over the distinct pieces; the weight is loaded in the same pieces;
* **float32 math**; normalised values are rotated in float32 and rounded to the storage dtype once;
* q `[T, Hq, D]` / k `[T, Hk, D]` may be strided views into a packed QKV buffer; only the head dim
  must be contiguous. The V part of the buffer is never touched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rope import _load_pairs, _store_pairs, _style_is_neox, _token_cos_sin, block_heads, check_rope_args

#: Elements of q/k per chunk of heads. Measured on an H200 (65536 tokens, 32/8 heads, hd128, NeoX): 1024
#: (8 heads, 2 warps) 95.5% of copy bandwidth, 2048 87.4%, 4096 77.7%, 8192 77.7%: the norm's reduction
#: wants small programs, many of them resident per SM.
TILE = 1024


@triton.jit
def _norm_rope_heads(base, stride_h, H, W, cos, sin, eps,
                     D: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr, GEMMA: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    """RMSNorm (weight W [D]) then RoPE of the H heads at `base`, in place."""
    ROT: tl.constexpr = 2 * HALF
    HAS_TAIL: tl.constexpr = D > ROT
    c, s = cos[None, :], sin[None, :]
    # The weights of the rotated part in the same pieces as the activations, then the pass-through tail.
    w1, w2, _, _ = _load_pairs(W[None], tl.full([1], True, tl.int1), HALF, IS_NEOX, BLOCK_HALF)
    tail = ROT + tl.arange(0, BLOCK_TAIL)
    tail_mask = tail < D
    w_tail = tl.load(W + tail, mask=tail_mask & HAS_TAIL, other=0.0).to(tl.float32)
    if GEMMA:
        w1 += 1.0
        w2 += 1.0
        w_tail += 1.0

    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        h_mask = heads < H
        rows = base + heads.to(tl.int64)[:, None] * stride_h
        x1, x2, offs, mask = _load_pairs(rows, h_mask, HALF, IS_NEOX, BLOCK_HALF)
        sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if HAS_TAIL:
            t_ptrs = rows + tail[None, :]
            t_mask = h_mask[:, None] & tail_mask[None, :]
            xt = tl.load(t_ptrs, mask=t_mask, other=0.0).to(tl.float32)
            sum_sq += tl.sum(xt * xt, axis=1)
        rstd = tl.rsqrt(sum_sq / D + eps)[:, None]
        # Norm, then rotate the normalised (float32) values.
        y1 = x1 * rstd * w1
        y2 = x2 * rstd * w2
        _store_pairs(rows, y1 * c - y2 * s, y2 * c + y1 * s, offs, mask, HALF, IS_NEOX)
        if HAS_TAIL:
            tl.store(t_ptrs, (xt * rstd * w_tail[None, :]).to(base.dtype.element_ty), mask=t_mask)


@triton.jit
def _qk_norm_rope_kernel(Q, K, QW, KW, POS, CS,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                         HQ, HK, eps,
                         D: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr, GEMMA: tl.constexpr,
                         BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         BLOCK_TAIL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _token_cos_sin(POS, CS, t, stride_cs, HALF, BLOCK_HALF)
    _norm_rope_heads(Q + t * stride_qt, stride_qh, HQ, QW, cos, sin, eps,
                     D, HALF, IS_NEOX, GEMMA, BLOCK_HQ, BLOCK_HALF, BLOCK_TAIL)
    _norm_rope_heads(K + t * stride_kt, stride_kh, HK, KW, cos, sin, eps,
                     D, HALF, IS_NEOX, GEMMA, BLOCK_HK, BLOCK_HALF, BLOCK_TAIL)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int, eps: float = 1e-6,
                 style: str = "neox", gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: every head of q [T, Hq, D] is RMS-normalised with q_weight [D] (k: k_weight [D]), then
    its first `rotary_dim` features are rotated at `positions` [T] with `cos_sin_cache`
    [max_pos, rotary_dim] (cos first half, sin second). `gemma=True` scales by 1 + weight. Returns (q, k).
    """
    is_neox = _style_is_neox(style)
    t, hq, hk, d = check_rope_args(q, k, positions, cos_sin_cache, rotary_dim)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (d,) or w.stride(0) != 1 or w.device != q.device:
            raise ValueError(f"{name} must be a contiguous [{d}] tensor on {q.device}, got "
                             f"{tuple(w.shape)} on {w.device}")
    if t == 0:
        return q, k
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    block_tail = triton.next_power_of_2(max(d - rotary_dim, 1))
    per_head = 2 * block_half + (block_tail if d > rotary_dim else 0)
    bq, bk = block_heads(hq, per_head, TILE), block_heads(hk, per_head, TILE)
    tile = max(bq, bk) * per_head
    _qk_norm_rope_kernel[(t,)](
        q, k, q_weight, k_weight, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        hq, hk, float(eps),
        D=d, HALF=half, IS_NEOX=is_neox, GEMMA=bool(gemma),
        BLOCK_HQ=bq, BLOCK_HK=bk, BLOCK_HALF=block_half, BLOCK_TAIL=block_tail,
        num_warps=min(max(tile // 512, 1), 8))
    return q, k
