"""Symbolic derivatives of a variant's logits program, as IR: what the backward kernels inline.

`derivative(program, wrt)` differentiates forward-mode through the lets: every let `x = e` gets a companion
`d_x = D(e)` and the result is `D(result)`, so the derivative program is the original lets, their derivative
lets, then one expression. `wrt` says which leaf varies:

* `WRT_QK`: the unscaled q.k (`RawScore`; a `Score` counts `sm_scale` per unit) -- the backward kernels
  work on the lowered programs, whose score is the raw q.k;
* `WRT_SCORE`: the scaled score, as the user writes it (`RawScore` counts `1 / sm_scale`);
* an `ir.Load` of a float tensor parameter: d(logit)/d(that element) (1 where the same load appears).

Non-smooth points take the subgradients torch's autograd takes, so the reference's autograd is the oracle:
floor and integer arithmetic have derivative 0, abs has sign(x) (0 at 0), minimum/maximum split a tie in
half, a select differentiates the branch it takes. Without softmax the logits program *is* the weight, so
the same derivative is the weight's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import ir
from .ir import BOOL, F32

SM_SCALE = ir.ScalarParam(F32, "sm_scale")
ZERO, ONE, HALF = ir.Const(F32, 0.0), ir.Const(F32, 1.0), ir.Const(F32, 0.5)


@dataclass(frozen=True)
class _Wrt:
    name: str


WRT_QK = _Wrt("qk")
WRT_SCORE = _Wrt("score")


# --- smart constructors: the derivatives stay small (most terms are 0 or 1) -----------------------------
def _is(e: ir.Expr, v: float) -> bool:
    return isinstance(e, ir.Const) and e.type == F32 and e.value == v


def add(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if _is(a, 0.0):
        return b
    if _is(b, 0.0):
        return a
    return ir.Binary(F32, "add", a, b)


def sub(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if _is(b, 0.0):
        return a
    if _is(a, 0.0):
        return neg(b)
    return ir.Binary(F32, "sub", a, b)


def mul(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if _is(a, 0.0) or _is(b, 0.0):
        return ZERO
    if _is(a, 1.0):
        return b
    if _is(b, 1.0):
        return a
    return ir.Binary(F32, "mul", a, b)


def div(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if _is(a, 0.0):
        return ZERO
    if _is(b, 1.0):
        return a
    return ir.Binary(F32, "div", a, b)


def neg(a: ir.Expr) -> ir.Expr:
    if _is(a, 0.0):
        return ZERO
    if isinstance(a, ir.Unary) and a.op == "neg":
        return a.x
    return ir.Unary(F32, "neg", a)


def select(cond: ir.Expr, a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if a == b:
        return a
    return ir.Select(F32, cond, a, b)


def call(fn: str, *args: ir.Expr) -> ir.Expr:
    return ir.Call(F32, fn, tuple(args))


def _sign(x: ir.Expr) -> ir.Expr:
    """sign(x) with sign(0) = 0, torch's derivative of abs."""
    return select(ir.Binary(BOOL, "gt", x, ZERO), ONE, select(ir.Binary(BOOL, "lt", x, ZERO), neg(ONE), ZERO))


def _tie_split(x: ir.Expr, y: ir.Expr, dx: ir.Expr, dy: ir.Expr, x_wins: str) -> ir.Expr:
    """minimum (x_wins="lt") / maximum ("gt"): the winner's derivative, a tie split in half (torch's rule)."""
    y_wins = "gt" if x_wins == "lt" else "lt"
    return select(ir.Binary(BOOL, x_wins, x, y), dx,
                  select(ir.Binary(BOOL, y_wins, x, y), dy, mul(HALF, add(dx, dy))))


#: fn -> (args, their derivatives) -> derivative of fn(args). A table so each rule is one line to read (and the
#: property test can swap one for a wrong one and see it caught).
CALL_RULES = {
    "tanh": lambda a, d: mul(sub(ONE, mul(call("tanh", a[0]), call("tanh", a[0]))), d[0]),
    "exp": lambda a, d: mul(call("exp", a[0]), d[0]),
    "exp2": lambda a, d: mul(mul(call("exp2", a[0]), ir.Const(F32, math.log(2.0))), d[0]),
    "log": lambda a, d: div(d[0], a[0]),
    "sigmoid": lambda a, d: mul(mul(call("sigmoid", a[0]), sub(ONE, call("sigmoid", a[0]))), d[0]),
    # sqrt(0) is finite with an infinite slope: where nothing upstream moves (d = 0) the derivative is 0, as
    # autograd's masked branches make it, not 0 / 0
    "sqrt": lambda a, d: select(ir.Binary(BOOL, "eq", d[0], ZERO), ZERO,
                                div(d[0], mul(ir.Const(F32, 2.0), call("sqrt", a[0])))),
    "floor": lambda a, d: ZERO,
    "abs": lambda a, d: mul(_sign(a[0]), d[0]),
    "minimum": lambda a, d: _tie_split(a[0], a[1], d[0], d[1], "lt"),
    "maximum": lambda a, d: _tie_split(a[0], a[1], d[0], d[1], "gt"),
}

#: op -> (a, b, da, db) -> derivative of `a op b` (float operands).
BINARY_RULES = {
    "add": lambda a, b, da, db: add(da, db),
    "sub": lambda a, b, da, db: sub(da, db),
    "mul": lambda a, b, da, db: add(mul(da, b), mul(a, db)),
    "div": lambda a, b, da, db: sub(div(da, b), div(mul(a, db), mul(b, b))),
    "floordiv": lambda a, b, da, db: ZERO,  # floor(a / b): piecewise constant
    "mod": lambda a, b, da, db: sub(da, mul(db, call("floor", div(a, b)))),  # a - b * floor(a / b)
}


class _Differentiator:
    def __init__(self, wrt, lets: list[tuple[str, ir.Expr]]):
        self.wrt = wrt
        self.dlocal: dict[str, ir.Expr] = {}  # let name -> its derivative (a Local, or a constant 0 / 1)
        taken = {n for n, _ in lets}
        self.lets: list[tuple[str, ir.Expr]] = []
        for name, e in lets:
            d = self.d(e)
            if isinstance(d, ir.Const) or e.type != F32:
                self.dlocal[name] = d if e.type == F32 else ZERO
                continue
            dname = f"fv_d_{name}"
            while dname in taken:
                dname += "_"
            taken.add(dname)
            self.lets.append((dname, d))
            self.dlocal[name] = ir.Local(F32, dname)

    def d(self, e: ir.Expr) -> ir.Expr:
        if e.type != F32:
            return ZERO  # ints and bools: piecewise constant
        if isinstance(e, ir.RawScore):
            return ONE if self.wrt is WRT_QK else div(ONE, SM_SCALE) if self.wrt is WRT_SCORE else ZERO
        if isinstance(e, ir.Score):
            return SM_SCALE if self.wrt is WRT_QK else ONE if self.wrt is WRT_SCORE else ZERO
        if isinstance(e, ir.Load):
            return ONE if e == self.wrt else ZERO
        if isinstance(e, ir.Local):
            return self.dlocal[e.name]
        if isinstance(e, (ir.Const, ir.ScalarParam, ir.Hoisted, ir.Index, ir.Cast)):
            return ZERO  # a cast to float is of an int: constant
        if isinstance(e, ir.Unary):
            return neg(self.d(e.x))
        if isinstance(e, ir.Binary):
            return BINARY_RULES[e.op](e.a, e.b, self.d(e.a), self.d(e.b))
        if isinstance(e, ir.Select):
            return select(e.cond, self.d(e.a), self.d(e.b))
        if isinstance(e, ir.Call):
            ds = [self.d(a) for a in e.args]
            if all(_is(x, 0.0) for x in ds):
                return ZERO
            return CALL_RULES[e.fn](e.args, ds)
        raise TypeError(f"no derivative for {e!r}")  # an IR node the parser cannot produce


def derivative(program: ir.Program, wrt) -> ir.Program:
    """d(program's result)/d(wrt) as a program: the original lets, their derivative lets, the derivative."""
    diff = _Differentiator(wrt, program.lets)
    return ir.Program(list(program.lets) + diff.lets, diff.d(program.result), dict(program.hoisted))


def is_zero(program: ir.Program) -> bool:
    return _is(program.result, 0.0)


def learnable_loads(program: ir.Program | None, params: dict, names=None) -> list[ir.Load]:
    """The distinct float tensor-param reads of `program` whose parameter is learnable (or in `names`), in
    the order they first appear: each gets its own derivative and its own scatter into the gradient."""
    from .params import Tensor
    if program is None:
        return []
    found: list[ir.Load] = []
    for root in program.exprs():
        for e in ir.walk(root):
            p = params.get(e.param) if isinstance(e, ir.Load) else None
            if (isinstance(p, Tensor) and e.type == F32 and e not in found
                    and (p.learnable if names is None else e.param in names)):
                found.append(e)
    return found
