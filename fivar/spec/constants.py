"""The value of an expression built from constants alone, for what the parser decides where a spec is written: a
divisor that is zero (`3 - 3`, `W // 8`), int arithmetic past int32 (`65536 * 65536`)."""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping

from . import ir
from .ir import F32

#: Python's arithmetic, as the reference's
OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
       "floordiv": operator.floordiv, "mod": operator.mod}
_CALLS = {"minimum": min, "maximum": max, "abs": abs}


def value(e: ir.Expr, local_values: Mapping[str, int | float | None]):
    """`e`'s value, or None where it is not known from constants alone. A local's is looked up in `local_values` (the
    parser fills it as each local is bound, so a chain of locals is walked once). An int past int32 (which every
    target wraps and Python does not), a float past float64, NaN, int() of a computed float (rounded differently in
    float32), or an error Python raises gives None."""
    if isinstance(e, ir.Local):
        return local_values.get(e.name)
    if isinstance(e, ir.Const):
        return int(e.value) if isinstance(e.value, bool) else e.value
    try:
        if isinstance(e, ir.Cast):
            x = value(e.x, local_values)
            if e.type != F32 and isinstance(x, float) and not isinstance(e.x, ir.Const):
                return None  # float64 here, float32 in the kernels: int(1.0 - 1e-16) is 0 here and 1 there
            out = None if x is None else (float(x) if e.type == F32 else int(x))
        elif isinstance(e, ir.Unary) and e.op == "neg":
            x = value(e.x, local_values)
            out = None if x is None else -x
        elif isinstance(e, ir.Call) and e.fn in _CALLS:
            xs = [value(a, local_values) for a in e.args]
            out = None if None in xs else _CALLS[e.fn](*xs)
        elif isinstance(e, ir.Binary) and e.op in OPS:
            a = value(e.a, local_values)
            b = None if a is None else value(e.b, local_values)
            out = None if b is None or (b == 0 and e.op in ("div", "floordiv", "mod")) else OPS[e.op](a, b)
        else:
            return None
    except (OverflowError, ValueError, ZeroDivisionError):
        return None
    if isinstance(out, int) and not -2 ** 31 <= out < 2 ** 31:
        return None
    if isinstance(out, float) and not math.isfinite(out):
        return None
    return out
