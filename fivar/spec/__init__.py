from .params import Scalar, Tensor
from .variant import AttentionVariant

__all__ = ["AttentionVariant", "Scalar", "Tensor"]
