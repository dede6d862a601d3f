"""Norm / residual / RoPE / FP8 fusions: a parametric family of fused kernels built through FlashInfer's JIT.

Layers, each importing only those before it: spec (the declaration) -> args (call arguments) -> reference
(torch) and build (JIT module) -> runtime (launch) -> variant (`FusionVariant`: the declaration with its
calls) -> check (kernel against reference).
"""
from .reference import cos_sin_cache, rope_attention_factor, rope_inv_freq
from .spec import FusionSpec
from .variant import FusionVariant

__all__ = ["FusionSpec", "FusionVariant", "cos_sin_cache", "rope_attention_factor", "rope_inv_freq"]
