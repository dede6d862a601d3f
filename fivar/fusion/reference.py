"""Torch reference for fusions: the unfused ops composed one after another, math in float32.

Used by the tests and `check_fusion`; also usable alone (`rms_norm`, `layer_norm`, `apply_rope`,
`quant_fp8`, `cos_sin_cache`). Never modifies its inputs.
"""
from __future__ import annotations

import math

import torch

from .args import arg_error, check_cos_sin_cache, check_qk, split_args

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
    rows = positions.long().to(cos_sin_cache.device).clamp(0, cos_sin_cache.shape[0] - 1)  # as the kernel does
    cs = cos_sin_cache.float()[rows].to(x.device)  # [T, rotary_dim]
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


def rope_inv_freq(rotary_dim: int, base: float = 10000.0, scaling: dict | None = None) -> torch.Tensor:
    """float32 [rotary_dim / 2] rotary frequencies, optionally scaled (the `inv_freq` of a fusion with
    `cos_sin="computed"`; `cos_sin_cache` tabulates the same frequencies).

    `scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position": 8192}`: Llama-3.1. `scaling={"type": "yarn", "factor": 4.0,
    "original_max_position": 32768, "beta_fast": 32, "beta_slow": 1}`: YaRN's blend of interpolated and
    extrapolated frequencies (its attention factor is `rope_attention_factor(scaling)`).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    kind = (scaling or {}).get("type")
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position"]
        wavelen = 2 * math.pi / inv_freq
        lo_wl, hi_wl = old / lo, old / hi
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > lo_wl, inv_freq / factor, inv_freq)
        mid = (wavelen <= lo_wl) & (wavelen >= hi_wl)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "yarn":
        factor, old = scaling["factor"], scaling["original_max_position"]

        def correction_dim(rotations):  # the dimension that turns `rotations` times over `old` positions
            return rotary_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(correction_dim(scaling.get("beta_fast", 32))), 0)
        high = min(math.ceil(correction_dim(scaling.get("beta_slow", 1))), rotary_dim - 1)
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by factor)
        inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    elif kind is not None:
        raise ValueError(f"unsupported rope scaling {kind!r} (have: llama3, yarn)")
    return inv_freq.float()


def rope_attention_factor(scaling: dict | None) -> float:
    """YaRN scales cos/sin by `0.1 * ln(factor) + 1` (or its `attention_factor`); 1 for everything else."""
    if not scaling or scaling.get("type") != "yarn":
        return 1.0
    if "attention_factor" in scaling:
        return float(scaling["attention_factor"])
    return 0.1 * math.log(scaling["factor"]) + 1.0 if scaling["factor"] > 1 else 1.0


def cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0, scaling: dict | None = None,
                  device="cpu") -> torch.Tensor:
    """float32 [max_pos, rotary_dim]: cos in the first half, sin in the second (FlashInfer/vLLM layout),
    for `rope_inv_freq(rotary_dim, base, scaling)`, times the scaling's attention factor."""
    return _cos_sin(torch.arange(max_pos), rope_inv_freq(rotary_dim, base, scaling),
                    rope_attention_factor(scaling)).to(device)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float) -> torch.Tensor:
    """[len(positions), rotary_dim] cos | sin rows, computed in float64."""
    freqs = positions.double().cpu()[:, None] * inv_freq.double().cpu()[None, :]
    return (torch.cat([freqs.cos(), freqs.sin()], -1) * attention_factor).float()


def _check_shapes(v, a) -> None:
    """The shapes a call takes (fivar.fusion.args checks those and more for the kernel), on any device and float
    dtype: a mismatch is an error naming the argument, not a broadcasting error from torch."""
    def need(name, shape=None, dims=None):
        t = a.get(name)
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            raise arg_error(v, name, f"must be a torch.Tensor, got {type(t).__name__}")
        if (shape is not None and tuple(t.shape) != tuple(shape)) or (dims is not None and t.dim() != dims):
            want = f"shape {tuple(shape)}" if shape is not None else f"{dims} dims"
            raise arg_error(v, name, f"must have {want}, got {tuple(t.shape)}")
        return t
    if not v.is_head:
        x = need("x", dims=2)
        for name in ("weight", "bias"):
            need(name, shape=x.shape[1:])
        need("residual", shape=x.shape)
        return
    q = need("q")
    check_qk(v, q, need("k"))
    for name in ("q_weight", "k_weight", "q_bias", "k_bias"):
        need(name, shape=(v.head_dim,))
    need("positions", shape=(q.shape[0],))
    need("inv_freq", shape=(v.rotary_dim // 2,) if v.rope else None)
    cs = need("cos_sin_cache")
    if cs is not None:
        check_cos_sin_cache(v, cs)


def reference(variant, **kwargs):
    """Same arguments as calling the fusion. Returns float32 results (fp8 tensors for fp8 fusions):

    per-row: `out`, or `(out, new_residual)` with a residual; per-head: `(q_out, k_out)`.
    """
    a = split_args(variant, kwargs, validate=False)
    _check_shapes(variant, a)
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
        if variant.rope and variant.cos_sin == "computed":  # each token's own row, computed here
            rows = _cos_sin(a["positions"], a["inv_freq"], float(a.get("attention_factor", 1.0)))
            t = apply_rope(t, torch.arange(t.shape[0]), rows, variant.rotary_dim, variant.rope)
        elif variant.rope:
            t = apply_rope(t, a["positions"], a["cos_sin_cache"], variant.rotary_dim, variant.rope)
        if variant.fp8:
            t = quant_fp8(t, a["scale"])
        outs.append(t)
    return tuple(outs)
