"""Typed variant parameters: runtime scalars and small tensors (tables indexed inside the kernel)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .ir import BOOL, F32, I32

#: The ranges of the kernels' number types: every int is an int32_t / tl.int32, every float a float32.
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38


def out_of_range(value, ir_type: str) -> str | None:
    """Why a constant or Scalar value does not fit the kernels' `ir_type` (F32 or I32), or None when it does.
    Infinities and NaN are float32 values (a constant may say -inf on purpose); a finite float beyond float32 is
    not: it would be inf in the kernels, and a finite float64 in the reference."""
    if ir_type == I32 and not INT32_MIN <= value <= INT32_MAX:
        return f"{shown(value)} does not fit the kernels' 32-bit ints [-2**31, 2**31 - 1]"
    if ir_type == F32 and isinstance(value, (int, float)) and value == value and abs(value) != float("inf"):
        try:
            big = abs(float(value)) > FLOAT32_MAX
        except OverflowError:  # an int too large for any float
            big = True
        if big:
            return f"{shown(value)} does not fit the kernels' 32-bit floats (|x| <= {FLOAT32_MAX!r})"
    return None


def shown(value) -> str:
    """A number as an error message shows it: an integer of hundreds of digits by its size."""
    text = repr(value)
    if len(text) <= 40 or not isinstance(value, int):
        return text
    return f"{'a negative' if value < 0 else 'an'} integer of {len(str(abs(value)))} digits"


#: Dimension names whose size fivar knows at call time and therefore checks.
KNOWN_DIMS = ("qo_head", "kv_head", "batch")

#: tensor dtype name -> (IR type of an element, C++ storage type)
TENSOR_DTYPES = {
    "float32": (F32, "float"),
    "float16": (F32, "half"),
    "bfloat16": (F32, "nv_bfloat16"),
    "int32": (I32, "int32_t"),
    "int64": (I32, "int64_t"),
    "bool": (BOOL, "bool"),
}


def call_site(depth: int) -> dict:
    """{filename, line, col} of the frame `depth` levels above the caller: where a declaration was written."""
    frame = sys._getframe(depth + 1)
    return {"filename": frame.f_code.co_filename, "line": frame.f_lineno, "col": 0}


@dataclass(frozen=True)
class _Declared:
    """A parameter declaration that remembers where it was written, so errors about it name that line."""
    where: dict = field(default_factory=dict, compare=False, repr=False, kw_only=True)

    def __post_init__(self):
        if not self.where:  # the caller of the dataclass __init__ that called this
            object.__setattr__(self, "where", call_site(2))


@dataclass(frozen=True)
class Scalar(_Declared):
    """A runtime scalar, passed by keyword at call time (e.g. `softcap=30.0`)."""
    dtype: type = float
    default: float | int | None = None
    doc: str = ""

    @property
    def ir_type(self) -> str:
        return I32 if self.dtype is int else F32


@dataclass(frozen=True)
class Tensor(_Declared):
    """A tensor read inside the kernel, e.g. per-head ALiBi slopes: `Tensor("float32", ("qo_head",))`.

    `dims` names each dimension; `qo_head`, `kv_head` and `batch` are checked against the call's shapes,
    any other name is free. Indices are clamped to the tensor's bounds on every target, so an index
    expression can never read outside the tensor. `learnable=True` (float dtypes): `v.attention` returns
    its gradient when the tensor passed requires grad (a learned bias table, ALiBi-like slopes).
    """
    dtype: str = "float32"
    dims: tuple[str, ...] = ("n",)
    doc: str = ""
    learnable: bool = False

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def ir_type(self) -> str:
        return TENSOR_DTYPES[self.dtype][0]

    @property
    def cpp_type(self) -> str:
        return TENSOR_DTYPES[self.dtype][1]
