"""Norm / residual / RoPE / FP8 fusions: a parametric family of fused kernels built through FlashInfer's JIT."""
from .reference import cos_sin_cache, rope_attention_factor, rope_inv_freq
from .spec import FusionVariant

__all__ = ["FusionVariant", "cos_sin_cache", "rope_attention_factor", "rope_inv_freq"]
