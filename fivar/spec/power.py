"""`x ** y` in a variant function, lowered to what every target has (products, exp, log, selects), so the kernels,
the Triton twin, the reference and the backward's derivatives all compute the same function."""
from __future__ import annotations

import math

from . import ir
from .ir import BOOL, F32, I32

#: `x ** n` for a literal integer |n| up to this is products of x (exact for an int, any sign of x), at most
#: 2 log2 |n| of them; past it a float power (an int base to such a power is past int32 whatever it is)
PRODUCT_MAX = 1 << 16


def lower(x: ir.Expr, y: ir.Expr, to_f32) -> ir.Expr:
    """Products for a literal integer exponent (an int to a non-negative int power stays an int, as in Python, and
    wraps in 32 bits as every int does; a negative one is 1 / x**n in float), else exp(y * log(|x|)) with
    torch.pow's values at the edges: 0, 1 or inf at x == 0, the sign of an odd integer y for x < 0, NaN for a
    fractional one. Gradients: torch.pow's, but where it is infinite or NaN (the base's at x == 0 for 0 < y < 1,
    the exponent's for x < 0) it is 0 and that of +-|x| ** y. An int to an exponent known only at run time is the
    parser's to refuse (a float power is not exact). `to_f32`: the parser's conversion (it range-checks literals)."""
    if isinstance(y, ir.Const) and float(y.value).is_integer() and abs(y.value) <= PRODUCT_MAX:
        n = int(y.value)
        return _products(x if x.type == I32 and y.type == I32 and n >= 0 else to_f32(x), n)
    x, y = to_f32(x), to_f32(y)
    if isinstance(y, ir.Const) and y.value == 0.5:
        return ir.Call(F32, "sqrt", (x,))
    zero, one, inf = ir.Const(F32, 0.0), ir.Const(F32, 1.0), ir.Const(F32, math.inf)
    # x == 0 is a branch of its own and the others never take log(0): a gradient through a branch not taken is still
    # computed (0 * -inf would be NaN where torch's is 0)
    is_zero = ir.Binary(BOOL, "eq", x, zero)

    def exp_log(base):
        safe = ir.Select(F32, is_zero, one, base)
        return ir.Call(F32, "exp", (ir.Binary(F32, "mul", y, ir.Call(F32, "log", (safe,))),))
    if isinstance(y, ir.Const) and not float(y.value).is_integer():  # a fractional literal: log's NaN below 0
        return ir.Select(F32, is_zero, zero if y.value > 0 else inf, exp_log(x))
    # 0 ** y: 0, 1 or inf by the sign of y, and the base's gradient y * 0 ** (y - 1) where it is finite and not 0
    # (y == 1); elsewhere y == 0 gives exp(0) = 1 with the exponent's gradient log|x|, as torch's
    at_zero = ir.Binary(F32, "add", ir.Select(F32, ir.Binary(BOOL, "gt", y, zero), zero,
                                              ir.Select(F32, ir.Binary(BOOL, "eq", y, zero), one, inf)),
                        ir.Binary(F32, "mul", x, ir.Select(F32, ir.Binary(BOOL, "eq", y, one), one, zero)))
    if non_negative(x):  # a distance, an abs(): no branch for a negative base
        rest = exp_log(x)
    else:
        magnitude = exp_log(ir.Call(F32, "abs", (x,)))
        integer = ir.Binary(BOOL, "eq", ir.Call(F32, "floor", (y,)), y)
        half = ir.Binary(F32, "mul", y, ir.Const(F32, 0.5))
        odd = ir.Binary(BOOL, "ne", ir.Call(F32, "floor", (half,)), half)
        below = ir.Select(F32, integer, ir.Select(F32, odd, ir.Unary(F32, "neg", magnitude), magnitude),
                          ir.Call(F32, "log", (ir.Select(F32, is_zero, one, x),)))  # log of a negative: NaN
        rest = ir.Select(F32, ir.Binary(BOOL, "lt", x, zero), below, magnitude)
    return ir.Select(F32, is_zero, at_zero, rest)


def _products(base: ir.Expr, n: int) -> ir.Expr:
    """base ** n by square-and-multiply (a float base where n < 0)."""
    out, square, k = None, base, abs(n)
    while k:
        if k & 1:
            out = square if out is None else ir.Binary(base.type, "mul", out, square)
        k >>= 1
        if k:
            square = ir.Binary(base.type, "mul", square, square)
    out = out if out is not None else ir.Const(base.type, 1 if base.type == I32 else 1.0)
    return ir.Binary(F32, "div", ir.Const(F32, 1.0), out) if n < 0 else out


def non_negative(e: ir.Expr) -> bool:
    """Whether `e` is >= 0 by its form (an abs, exp, sqrt, sigmoid, a non-negative literal, a cast of one)."""
    if isinstance(e, ir.Cast):
        return non_negative(e.x)
    if isinstance(e, ir.Const):
        return e.value >= 0
    return isinstance(e, ir.Call) and e.fn in ("abs", "exp", "exp2", "sqrt", "sigmoid")
