"""FP8 KV caches (e4m3, one k and one v scale per tensor) on FA2's paged kernels (decode and paged prefill).

A cache holds k / k_scale and v / v_scale in float8_e4m3fn; the kernels read it and upcast, and the scales are
applied outside the variant, exactly: k_scale joins sm_scale (a variant sees sm_scale only through its `score`,
fivar.spec.optimize, so q.k8 * (sm_scale * k_scale) is the score of the dequantized keys), v_scale multiplies the
output (attention is linear in V; the LSE does not depend on it). FA3's and the Triton twin's kernels read 16-bit
caches only, so those refuse an FP8 cache.
"""
from __future__ import annotations

import math

import torch

from ..errors import FivarError
from ..jit.build import KV_DTYPES, kv_dtype_name
from ..jit.targets import named

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_q_dtype(variant, q) -> None:
    if isinstance(q, torch.Tensor) and q.dtype in FP8_DTYPES:
        raise FivarError(f"variant '{variant.name}': q is {q.dtype}: FP8 queries are not supported (an FP8 KV cache "
                         "is read with float16/bfloat16 queries)")


def kv_dtype_of(variant, q_dtype, k_cache, v_cache) -> str | None:
    """gen_module's kv_dtype for this cache (None: q's dtype); a cache of another dtype is an error."""
    if k_cache.dtype != v_cache.dtype:
        raise FivarError(f"variant '{variant.name}': k_cache and v_cache must have one dtype, got {k_cache.dtype} "
                         f"and {v_cache.dtype}")
    if k_cache.dtype not in KV_DTYPES.values():
        return None
    return kv_dtype_name(k_cache.dtype, q_dtype)


def plan_kv_dtype(variant, q_dtype, kv_dtype) -> str | None:
    """A plan's `kv_dtype=` (a torch dtype or None): gen_module's name for it (None: q's dtype)."""
    if kv_dtype is None or kv_dtype == q_dtype:
        return None
    try:
        return kv_dtype_name(kv_dtype, q_dtype)
    except FivarError as e:
        raise FivarError(f"variant '{variant.name}': {e}") from None


def fp8_backend(variant, backend: str, kv_dtype: str | None) -> str:
    """The backend that runs an FP8 cache: FA2 (auto picks it), else a clear refusal."""
    if kv_dtype is None:
        return backend
    t = named(backend)  # None: auto, which picks FA2 here, or a name the caller's checks report
    if t is not None and not t.reads_fp8_kv:
        raise FivarError(f"variant '{variant.name}': an FP8 KV cache runs on FA2's paged kernels only; backend "
                         f"'{backend}' reads float16/bfloat16 caches (use backend='fa2' or 'auto')")
    return "fa2"


def check_scale(variant, name: str, value) -> float:
    if value is None:
        return 1.0
    try:
        value = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise FivarError(f"variant '{variant.name}': {name} must be a positive finite float, got {value!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise FivarError(f"variant '{variant.name}': {name} must be a positive finite float, got {value!r}")
    return value


def scaled_output(result, v_scale: float, return_lse: bool):
    """`result` (out, or (out, lse)) with out multiplied by v_scale in place."""
    if v_scale != 1.0:
        (result[0] if return_lse else result).mul_(v_scale)
    return result


class ScaledArgs:
    """A plan's kernel arguments per k_scale (k_scale folded into sm_scale): made once per distinct scale, so the
    layers of a model, each with its own scale, share one plan."""

    def __init__(self, make, sm_scale: float):
        self._make, self._sm_scale = make, sm_scale
        self._by_scale = {1.0: make(sm_scale)}

    def __call__(self, k_scale: float) -> list:
        args = self._by_scale.get(k_scale)
        if args is None:
            if len(self._by_scale) > 256:
                self._by_scale = {1.0: self._by_scale[1.0]}
            args = self._by_scale[k_scale] = self._make(self._sm_scale * k_scale)
        return args
