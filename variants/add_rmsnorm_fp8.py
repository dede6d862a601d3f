"""Residual add + RMSNorm + FP8 e4m3 quantisation with a per-tensor scale (input to an FP8 GEMM).

    out_fp8 = v(x=x, residual=residual, weight=w, scale=s)   # out = clamp(rmsnorm(x + residual) * w / s)
"""
from fivar import FusionVariant

variant = FusionVariant(name="add_rmsnorm_fp8", norm="rmsnorm", norm_scope="row", residual=True,
                        out_dtype="fp8_e4m3", dtype="bf16", eps=1e-5)
