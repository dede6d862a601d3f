"""Checking a fusion's kernel against its torch reference (GPU), with fresh random inputs."""
from __future__ import annotations

import math

import torch

from ..testing import CheckResult, compare
from . import reference as R


def random_inputs(v, *, tokens: int, device="cuda", dtype=None, hidden: int = 1024, num_q_heads: int = 8,
                  num_kv_heads: int = 2, packed: bool = False, max_pos: int = 4096,
                  pos_dtype=torch.int64, generator: torch.Generator | None = None,
                  rope_scaling: dict | None = None) -> dict:
    """Keyword arguments for calling `v` (and v.reference): realistic random tensors on `device`."""
    dt = dtype or {"bf16": torch.bfloat16, "fp16": torch.float16}[v.dtype]
    g = generator

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(dt).to(device)

    def weights(n, prefix=""):
        out = {}
        if v.norm == "gemma":
            out[prefix + "weight"] = randn(n, scale=0.3)
        elif v.norm:
            out[prefix + "weight"] = randn(n, scale=0.3, shift=1.0)
        if v.norm == "layernorm":
            out[prefix + "bias"] = randn(n, scale=0.3)
        return out

    a: dict = {}
    if not v.is_head:
        a["x"] = randn(tokens, hidden, scale=2.0, shift=0.5)
        if v.residual:
            a["residual"] = randn(tokens, hidden)
        a.update(weights(hidden))
    else:
        d = v.head_dim
        if packed:
            a["qkv"] = randn(tokens, (num_q_heads + 2 * num_kv_heads) * d, scale=2.0, shift=0.5)
            a["num_q_heads"], a["num_kv_heads"] = num_q_heads, num_kv_heads
        else:
            a["q"] = randn(tokens, num_q_heads, d, scale=2.0, shift=0.5)
            a["k"] = randn(tokens, num_kv_heads, d, scale=2.0, shift=0.5)
        if v.rope:
            a["positions"] = torch.randint(0, max_pos, (tokens,), generator=g).to(pos_dtype).to(device)
            if v.cos_sin == "computed":
                a["inv_freq"] = R.rope_inv_freq(v.rotary_dim, scaling=rope_scaling).to(device)
                a["attention_factor"] = R.rope_attention_factor(rope_scaling)
            else:
                a["cos_sin_cache"] = R.cos_sin_cache(max_pos, v.rotary_dim, scaling=rope_scaling, device=device)
        if v.norm:
            a.update(weights(d, "q_"))
            a.update(weights(d, "k_"))
    if v.fp8:
        a["scale"] = torch.tensor([0.02], dtype=torch.float32, device=device)
    return a


def compare_fp8(name: str, case: str, out: torch.Tensor, ref: torch.Tensor, scale) -> CheckResult:
    """fp8 vs fp8: dequantized, each element within one e4m3 step of the reference's quantization."""
    a, b = R.dequant_fp8(out, scale).double(), R.dequant_fp8(ref.to(out.device), scale).double()
    if not torch.isfinite(a).all():
        return CheckResult(name, case, math.inf, math.inf, False)
    s = float(scale) if not isinstance(scale, torch.Tensor) else float(scale.reshape(()))
    diff = (a - b).abs()
    rel = float((a - b).norm() / b.norm().clamp_min(1e-12))
    ok = bool((diff <= 0.126 * b.abs() + 2 ** -9 * s).all()) and rel < 0.02
    return CheckResult(name, case, rel, float(diff.max()) if diff.numel() else 0.0, ok)


def check_fusion(v, *, tokens: int, packed: bool | None = None, dtype=None, device="cuda",
                 **kw) -> list[CheckResult]:
    """Run the kernel and the reference on the same fresh inputs; one CheckResult per output."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        from ..errors import FivarError
        raise FivarError(f"fusion '{v.name}': checking the kernel needs a CUDA GPU (none is visible); `pytest` on its "
                         "scaffolded test runs the reference on the CPU")
    a = random_inputs(v, tokens=tokens, device=device, dtype=dtype, packed=bool(packed), **kw)
    case = f"tokens={tokens}" + (" packed-qkv" if packed else "")
    ref = v.reference(**a)
    results = []
    if not v.is_head:
        out = v(**a)
        ref_out, ref_res = ref if v.residual else (ref, None)
        if v.residual:
            results.append(compare(v.name, case + " residual", a["residual"], ref_res, a["x"].dtype))
        outs = [("out", out, ref_out)]
    else:
        untouched = a["qkv"][:, (a["num_q_heads"] + a["num_kv_heads"]) * v.head_dim:].clone() if packed else None
        q_out, k_out = v(**a)
        outs = [("q", q_out, ref[0]), ("k", k_out, ref[1])]
        if packed:
            same = torch.equal(a["qkv"][:, (a["num_q_heads"] + a["num_kv_heads"]) * v.head_dim:], untouched)
            results.append(CheckResult(v.name, case + " v untouched", 0.0, 0.0, same))
    for label, o, r in outs:
        if v.fp8:
            results.append(compare_fp8(v.name, f"{case} {label}", o, r, a["scale"]))
        else:
            results.append(compare(v.name, f"{case} {label}", o, r, o.dtype))
    return results
