"""The range of a logits transform over every score: `[lo, hi]` with constant ends, or None.

A softmax subtracts a per-row max from every logit before exp2, so that nothing overflows. FlashInfer's FA3
keeps it as a running max: a max reduction per KV tile and, whenever the max grows, a rescale of the row sum
and the output accumulator. A transform that cannot exceed `hi` makes `hi` a max that never moves, and both go
away (csrc/fivar_fa3_softmax.cuh). Soft-capping is the case that matters: once its cap is folded into the
softmax scale (fivar.spec.optimize.split_output_scale) the transform is `tanh(raw * K)`, in [-1, 1].

Interval arithmetic over the lowered program with constant ends only: anything that depends on a param, an
index, a load or the score itself is unbounded as far as this analysis is concerned. A mask's -inf is not
part of the range (it is an exp2 of zero whatever the max).
"""
from __future__ import annotations

import math

from . import ir

Range = tuple[float, float]
FULL: Range = (-math.inf, math.inf)

def _exp(x: float) -> float:
    return math.inf if x > 709.0 else math.exp(x)


_MONOTONE = {"tanh": math.tanh, "exp": _exp, "exp2": lambda x: math.inf if x > 1023.0 else 2.0 ** x,
             "floor": lambda x: float(math.floor(x)) if math.isfinite(x) else x,
             "sigmoid": lambda x: 1.0 / (1.0 + _exp(-x))}


def program_range(program: ir.Program) -> Range | None:
    """The range of `program.result` over every score, index and param value, or None if either end is
    unbounded."""
    env: dict[str, Range] = {}
    for name, e in program.lets:
        env[name] = _range(e, env)
    lo, hi = _range(program.result, env)
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None


def _range(e: ir.Expr, env: dict[str, Range]) -> Range:
    """Half-bounded ranges are kept (-inf or inf at one end), so that a clamp's two sides meet."""
    if isinstance(e, ir.Const) and not isinstance(e.value, bool):
        return float(e.value), float(e.value)
    if isinstance(e, ir.Local):
        return env.get(e.name, FULL)
    if isinstance(e, ir.Cast):
        lo, hi = _range(e.x, env)
        if e.type == ir.I32:  # int() truncates toward zero, which never decreases as its input grows
            return tuple(float(math.trunc(x)) if math.isfinite(x) else x for x in (lo, hi))
        return lo, hi
    if isinstance(e, ir.Unary) and e.op == "neg":
        lo, hi = _range(e.x, env)
        return -hi, -lo
    if isinstance(e, ir.Select):
        a, b = _range(e.a, env), _range(e.b, env)
        return min(a[0], b[0]), max(a[1], b[1])
    if isinstance(e, ir.Call):
        return _call_range(e.fn, [_range(a, env) for a in e.args])
    if isinstance(e, ir.Binary) and e.op in ("add", "sub", "mul", "div"):
        a, b = _range(e.a, env), _range(e.b, env)
        if e.op == "add":
            return a[0] + b[0], a[1] + b[1]
        if e.op == "sub":
            return a[0] - b[1], a[1] - b[0]
        if e.op == "div":
            if b[0] <= 0.0 <= b[1]:
                return FULL
            b = (1.0 / b[1], 1.0 / b[0])
        # 0 * inf has no value; the product of 0 and any (finite) operand is 0
        corners = [x * y for x in a for y in b if not ((x == 0.0 and math.isinf(y)) or (y == 0.0 and math.isinf(x)))]
        if any(0.0 in (x, y) for x in a for y in b):
            corners.append(0.0)
        return min(corners), max(corners)
    return FULL


def _call_range(fn: str, args: list[Range]) -> Range:
    lo, hi = args[0]
    if fn in _MONOTONE:
        return _MONOTONE[fn](lo), _MONOTONE[fn](hi)
    if fn == "abs":
        return (0.0 if lo <= 0.0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
    if fn in ("minimum", "maximum"):
        pick = min if fn == "minimum" else max
        return pick(args[0][0], args[1][0]), pick(args[0][1], args[1][1])
    if fn == "sqrt" and lo >= 0.0:
        return math.sqrt(lo), math.sqrt(hi)
    if fn == "log" and lo > 0.0:
        return math.log(lo), math.log(hi)
    return FULL
