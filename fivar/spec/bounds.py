"""Which keys a mask can keep at all: a band `q_idx - left <= kv_idx <= q_idx + right` implied by it.

Kernels skip KV tiles outside the band instead of masking them element by element (FA3's sliding-window
schedule, the Triton twin's loop bounds). The band is only ever a consequence of the mask, never a
replacement: every target still applies the full mask, so a band that is looser than the mask costs
speed, never correctness.

The analysis is syntactic. With the lets inlined, the mask must be a conjunction (`&`/`and`) of terms;
each term that compares `q_idx - kv_idx` (or `kv_idx - q_idx`) against an expression of scalar params
and constants contributes a bound, other terms contribute nothing. `left`/`right` are invariant integer
IR expressions, evaluated per launch from the scalar params.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ir
from .ir import I32


@dataclass(frozen=True)
class KvBand:
    #: kv_idx >= q_idx - left for every kept pair (None: no such bound found).
    left: ir.Expr | None
    #: kv_idx <= q_idx + right for every kept pair (None: no such bound found).
    right: ir.Expr | None
    #: True when the mask is exactly the band (every term gave a bound): nothing inside it is masked.
    exact: bool = False

    @property
    def left_window(self) -> bool:
        """The mask is exactly `kv_idx >= q_idx - left`: a sliding window, which kernels apply as their own."""
        return self.exact and self.left is not None and self.right is None

    @property
    def causal_window(self) -> bool:
        """The mask is exactly `q_idx - left <= kv_idx <= q_idx` (a window that also states causality, as Mistral's
        is often written): the kernels' causal mode with their window computes it, however the call sets causal."""
        return (self.exact and self.left is not None and isinstance(self.right, ir.Const)
                and self.right.value == 0)

    @property
    def window(self) -> bool:
        """A sliding window the kernels apply as their own: left_window or causal_window."""
        return self.left_window or self.causal_window


def _inline(program: ir.Program) -> ir.Expr:
    env: dict[str, ir.Expr] = {}

    def sub(e):
        return env.get(e.name) if isinstance(e, ir.Local) else None

    for name, e in program.lets:
        env[name] = ir.rewrite(e, sub)
    return ir.rewrite(program.result, sub)


def _conjuncts(e: ir.Expr):
    if isinstance(e, ir.Binary) and e.op == "and":
        yield from _conjuncts(e.a)
        yield from _conjuncts(e.b)
    else:
        yield e


def _linear(e: ir.Expr, rest_ok=ir.is_invariant):
    """e as (coefficient of q_idx, coefficient of kv_idx, rest) or None, where `rest_ok(rest)` (an invariant by
    default). Integer terms only."""
    if e.type != I32:
        return None
    if isinstance(e, ir.Index) and e.name in ("q_idx", "kv_idx"):
        return (1, 0, ir.Const(I32, 0)) if e.name == "q_idx" else (0, 1, ir.Const(I32, 0))
    if rest_ok(e):
        return 0, 0, e
    if isinstance(e, ir.Unary) and e.op == "neg":
        x = _linear(e.x, rest_ok)
        return None if x is None else (-x[0], -x[1], ir.Unary(I32, "neg", x[2]))
    if isinstance(e, ir.Binary) and e.op in ("add", "sub"):
        a, b = _linear(e.a, rest_ok), _linear(e.b, rest_ok)
        if a is None or b is None:
            return None
        s = 1 if e.op == "add" else -1
        return a[0] + s * b[0], a[1] + s * b[1], ir.Binary(I32, e.op, a[2], b[2])
    return None


_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


def _term_bound(e: ir.Expr, rest_ok=ir.is_invariant):
    """('left'|'right', expr) for a term `q_idx - kv_idx (op) c`, after normalising; else None."""
    if not (isinstance(e, ir.Binary) and e.op in _FLIP):
        return None
    a, b = _linear(e.a, rest_ok), _linear(e.b, rest_ok)
    if a is None or b is None:
        return None
    cq, ckv, op = a[0] - b[0], a[1] - b[1], e.op
    rest = ir.Binary(I32, "sub", b[2], a[2])  # cq*q + ckv*kv (op) rest
    if (cq, ckv) == (-1, 1):  # kv - q (op) rest  <=>  q - kv (flipped op) -rest
        cq, ckv, op, rest = 1, -1, _FLIP[op], ir.Unary(I32, "neg", rest)
    if (cq, ckv) != (1, -1):
        return None
    one = ir.Const(I32, 1)
    if op == "lt":  # q - kv < r  <=>  kv >= q - (r - 1)
        return "left", ir.Binary(I32, "sub", rest, one)
    if op == "le":
        return "left", rest
    if op == "gt":  # q - kv > r  <=>  kv <= q - (r + 1)
        return "right", ir.Unary(I32, "neg", ir.Binary(I32, "add", rest, one))
    return "right", ir.Unary(I32, "neg", rest)


def _chunk_width(e: ir.Expr) -> ir.Expr | None:
    """`abs(C) - 1` for a term `q_idx // C == kv_idx // C` (a chunked mask, C invariant): two positions in one
    chunk of C are at most |C| - 1 apart. None for any other term."""
    if not (isinstance(e, ir.Binary) and e.op == "eq"):
        return None
    sides = []
    for x in (e.a, e.b):
        if not (isinstance(x, ir.Binary) and x.op == "floordiv" and isinstance(x.a, ir.Index)
                and ir.is_invariant(x.b) and x.b.type == I32):
            return None
        sides.append((x.a.name, x.b))
    if {sides[0][0], sides[1][0]} != {"q_idx", "kv_idx"} or sides[0][1] != sides[1][1]:
        return None
    return ir.Binary(I32, "sub", ir.Call(I32, "abs", (sides[0][1],)), ir.Const(I32, 1))


def kv_band(mask: ir.Program | None) -> KvBand:
    if mask is None:
        return KvBand(None, None)
    found: dict[str, ir.Expr] = {}
    exact = True
    for term in _conjuncts(_inline(mask)):
        chunk = _chunk_width(term)
        if chunk is not None:  # implies |q_idx - kv_idx| <= width, both sides; the chunk edges stay in the mask
            bounds, exact = [("left", chunk), ("right", chunk)], False
        else:
            bound = _term_bound(term)
            if bound is None:
                exact = False
                continue
            bounds = [bound]
        for side, e in bounds:
            e = _simplify(e)
            found[side] = e if side not in found else ir.Call(I32, "minimum", (found[side], e))
    return KvBand(found.get("left"), found.get("right"), exact and bool(found))


def _simplify(e: ir.Expr) -> ir.Expr:
    """Fold the integer constants the normalisation introduced, so generated code stays readable."""
    def fold(n):
        if isinstance(n, ir.Call) and n.fn == "abs" and isinstance(n.args[0], ir.Const):
            return ir.Const(I32, abs(n.args[0].value))
        if isinstance(n, ir.Unary) and n.op == "neg":
            if isinstance(n.x, ir.Const):
                return ir.Const(I32, -n.x.value)
            if isinstance(n.x, ir.Unary) and n.x.op == "neg":
                return n.x.x
        if isinstance(n, ir.Binary) and n.op in ("add", "sub"):
            a, b = n.a, n.b
            if isinstance(a, ir.Const) and isinstance(b, ir.Const) and a.type == b.type == I32:
                return ir.Const(I32, a.value + b.value if n.op == "add" else a.value - b.value)
            if isinstance(b, ir.Const) and b.value == 0:
                return a
            if isinstance(a, ir.Const) and a.value == 0:
                return b if n.op == "add" else again(ir.Unary(I32, "neg", b))
        return None

    def again(n):  # a node a fold made is folded too (`0 - (-w)` is `w`, not `-(-w)`)
        return fold(n) or n
    return ir.rewrite(e, fold)
