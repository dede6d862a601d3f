"""fivar: write an attention variant once in Python; get FlashInfer, Triton and torch kernels of it."""
from .errors import FivarBuildError, FivarError, FivarSpecError
from .lang import abs, clamp, exp, exp2, floor, log, maximum, minimum, sigmoid, sqrt, tanh, where
from .spec import AttentionVariant, Scalar, Tensor
from .runtime import methods as _methods  # noqa: F401 (adds AttentionVariant's calls: prefill, decode, ...)
from .fusion import FusionVariant
from .runtime.lse import merge_states
from .runtime.plan_cache import invalidate_plans

__version__ = "0.1.0"


def load(name: str) -> AttentionVariant:
    """The variant called `name`, from FIVAR_VARIANT_PATH, ./variants, or fivar's bundled variants."""
    from .registry import load_variant
    return load_variant(name)


__all__ = ["invalidate_plans", "AttentionVariant", "FusionVariant", "Scalar", "Tensor", "FivarError", "FivarSpecError", "FivarBuildError",
           "load", "tanh", "exp", "exp2", "log", "sigmoid", "sqrt", "abs", "floor", "minimum", "maximum",
           "clamp", "where", "merge_states"]
