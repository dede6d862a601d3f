"""Norm / residual / RoPE / FP8 fusions: a parametric family of fused kernels built through FlashInfer's JIT."""
from .spec import FusionVariant

__all__ = ["FusionVariant"]
