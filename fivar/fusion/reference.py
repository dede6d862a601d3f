"""Torch reference for fusions: the unfused ops composed one after another, math in float32.

Used by the tests and `check_fusion`; also usable alone (`rms_norm`, `layer_norm`, `apply_rope`,
`quant_fp8`, `cos_sin_cache`). Never modifies its inputs.
"""
from __future__ import annotations

import math

import torch

FP8_MAX = 448.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    x = x.float()
    w = weight.float() + 1.0 if gemma else weight.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * weight.float() + bias.float()


def norm(kind: str, x, weight, bias, eps):
    if kind == "layernorm":
        return layer_norm(x, weight, bias, eps)
    return rms_norm(x, weight, eps, gemma=kind == "gemma")


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int,
               style: str) -> torch.Tensor:
    """x [T, H, D] (any float dtype) -> float32; rotates x[..., :rotary_dim], passes the rest through."""
    x = x.float().clone()
    cs = cos_sin_cache.float()[positions.long().to(cos_sin_cache.device)].to(x.device)  # [T, rotary_dim]
    half = rotary_dim // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:rotary_dim]
    rot = x[..., :rotary_dim]
    if style == "neox":
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    elif style == "gptj":
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    else:
        raise ValueError(f"unknown rope style {style!r}")
    x[..., :rotary_dim] = out
    return x


def quant_fp8(y: torch.Tensor, scale) -> torch.Tensor:
    s = float(scale) if not isinstance(scale, torch.Tensor) else scale.float().reshape(()).to(y.device)
    return (y.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequant_fp8(q: torch.Tensor, scale) -> torch.Tensor:
    s = float(scale) if not isinstance(scale, torch.Tensor) else scale.float().reshape(()).to(q.device)
    return q.float() * s


def cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0, scaling: dict | None = None,
                  device="cpu") -> torch.Tensor:
    """float32 [max_pos, rotary_dim]: cos in the first half, sin in the second (FlashInfer/vLLM layout).

    `scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position": 8192}` applies Llama-3.1's frequency scaling.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if scaling is not None:
        if scaling.get("type") != "llama3":
            raise ValueError(f"unsupported rope scaling {scaling.get('type')!r} (have: llama3)")
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position"]
        wavelen = 2 * math.pi / inv_freq
        lo_wl, hi_wl = old / lo, old / hi
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > lo_wl, inv_freq / factor, inv_freq)
        mid = (wavelen <= lo_wl) & (wavelen >= hi_wl)
        scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
        inv_freq = scaled
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], -1).float().to(device)


def reference(variant, **kwargs):
    """Same arguments as calling the fusion. Returns float32 results (fp8 tensors for fp8 fusions):

    per-row: `out`, or `(out, new_residual)` with a residual; per-head: `(q_out, k_out)`.
    """
    from .runtime import split_args
    a = split_args(variant, kwargs, validate=False)
    eps = a["eps"]
    if not variant.is_head:
        x = a["x"].float()
        new_res = None
        if variant.residual:
            x = x + a["residual"].float()
            new_res = x
        y = norm(variant.norm, x, a["weight"], a.get("bias"), eps)
        if variant.fp8:
            y = quant_fp8(y, a["scale"])
        return (y, new_res) if variant.residual else y
    outs = []
    for name in ("q", "k"):
        t = a[name].float()
        if variant.norm:
            t = norm(variant.norm, t, a[f"{name}_weight"], a.get(f"{name}_bias"), eps)
        if variant.rope:
            t = apply_rope(t, a["positions"], a["cos_sin_cache"], variant.rotary_dim, variant.rope)
        if variant.fp8:
            t = quant_fp8(t, a["scale"])
        outs.append(t)
    return tuple(outs)
