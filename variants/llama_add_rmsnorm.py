"""Llama decoder-layer boundary: residual add + RMSNorm (FlashInfer's fused_add_rmsnorm).

    out = v(x=x, residual=residual, weight=w)   # residual <- x + residual; out = rmsnorm(x + residual) * w
Pass out=x to write the normalised rows over x (FlashInfer's in-place convention).
"""
from fivar import FusionVariant

variant = FusionVariant(name="llama_add_rmsnorm", norm="rmsnorm", norm_scope="row", residual=True,
                        dtype="bf16", eps=1e-5)
