"""IR -> torch tensors: evaluates a variant's programs on broadcast index tensors (the way FlexAttention defines a
score_mod), with the semantics every compiled target implements: Python's // and %, int() truncating toward zero,
tensor-parameter indices clamped to the tensor's bounds, 32-bit integers. The reference (fivar.codegen.torch_ref)
and the spec's own analyses (fivar.spec.sparsity's keep matrix) both evaluate with it, so it lives in the spec."""
from __future__ import annotations

import torch

from ..errors import FivarError
from . import ir
from .ir import BOOL, F32, I32

_UNARY = {"tanh": torch.tanh, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
          "sigmoid": torch.sigmoid, "sqrt": torch.sqrt, "floor": torch.floor, "abs": torch.abs}


#: Integers are 32-bit in every target (int32_t in the CUDA structs, tl.int32 in the Triton twin): the reference
#: computes in int32 as well, so an overflow wraps the same way everywhere and an int64 tensor param is read as its
#: low 32 bits, as the kernels read it.
INT = torch.int32


class TorchEvaluator:
    """`check_divisors`: track where an integer // or % divided by zero (the kernels leave the result undefined) and
    which values that reaches, through the branch a select takes and the operand `and`/`or` evaluates
    (`poison_of`); `zero_division_error` then names the spec's file:line when such a value is used. Off where the
    programs are traced (FlexAttention's score_mod/mask_mod), which cannot branch on data."""

    def __init__(self, env: dict, params: dict, float_dtype=torch.float32, device=None, hoisted=None,
                 check_divisors=False):
        self.env, self.params, self.fdt = env, params, float_dtype
        self.check_divisors = check_divisors
        self.hoisted = hoisted or {}  # lowered programs: per-block invariants by name
        self.device = device
        self.locals: dict[str, torch.Tensor] = {}
        self._poison: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(value) -> (value, where it is undefined)
        self.zero_divisions: list[tuple[str, torch.Tensor]] = []  # (where, divisor == 0) per division evaluated

    def tensor(self, value, t: str):
        dt = {F32: self.fdt, I32: INT, BOOL: torch.bool}[t]
        # torch.full, not torch.tensor: traced into a FlexAttention score_mod, a torch.tensor constant becomes a
        # lifted constant that Inductor's Flex lowering cannot take
        return torch.full((), value, dtype=dt, device=self.device)

    def run(self, program: ir.Program) -> torch.Tensor:
        self.locals = {}
        for name, e in program.lets:
            self.locals[name] = self.eval(e)
        return self.eval(program.result)

    def load_index(self, load: ir.Load, shape, values=None) -> list[torch.Tensor]:
        """A read's indices clamped to the table's dimensions, as the kernels clamp them (`values`: the indices
        already evaluated)."""
        values = [self.eval(i) for i in load.indices] if values is None else values
        return [x.clamp(0, shape[d] - 1) for d, x in enumerate(values)]

    def poison_of(self, value: torch.Tensor) -> torch.Tensor | None:
        hit = self._poison.get(id(value))
        return hit[1] if hit is not None and hit[0] is value else None

    def _with_poison(self, value: torch.Tensor, *masks) -> torch.Tensor:
        masks = [m for m in masks if m is not None]
        if masks:
            poison = masks[0]
            for m in masks[1:]:
                poison = poison | m
            self._poison[id(value)] = (value, poison)
        return value

    def zero_division_error(self, used: torch.Tensor, value: torch.Tensor) -> FivarError | None:
        """The error for a division by zero whose result reaches `value` where `used` holds, else None."""
        poison = self.poison_of(value)
        bad = None if poison is None else poison & used
        if bad is None or not bool(bad.any()):
            return None
        where = next((w for w, zero in self.zero_divisions if w and bool((zero & bad).any())), "an integer division")
        return FivarError(f"{where}: the divisor is 0 at positions whose result is used; "
                          "the kernels leave that undefined, so keep it non-zero there (e.g. maximum(d, 1), or "
                          "`... if d != 0 else ...`)")

    def eval(self, e: ir.Expr) -> torch.Tensor:
        P = self.poison_of if self.check_divisors else (lambda _: None)
        if isinstance(e, ir.Const):
            return self.tensor(e.value, e.type)
        if isinstance(e, ir.Score):
            return self.env["score"]
        if isinstance(e, ir.RawScore):
            return self.env["raw"]
        if isinstance(e, ir.Hoisted):
            return self.eval(self.hoisted[e.name])
        if isinstance(e, ir.Index):
            x = self.env[e.name]
            return x.to(INT) if isinstance(x, torch.Tensor) and not x.is_floating_point() else x
        if isinstance(e, ir.ScalarParam):
            v = self.env["sm_scale"] if e.name == "sm_scale" else self.params[e.name]
            return self.tensor(v, e.type)
        if isinstance(e, ir.Local):
            return self.locals[e.name]
        if isinstance(e, ir.Load):
            table = self.params[e.param]
            raw = [self.eval(i) for i in e.indices]
            out = table[tuple(torch.broadcast_tensors(*self.load_index(e, table.shape, raw)))]
            out = out.to({F32: self.fdt, I32: INT, BOOL: torch.bool}[e.type])
            return self._with_poison(out, *[P(x) for x in raw])
        if isinstance(e, ir.Unary):
            x = self.eval(e.x)
            return self._with_poison(-x if e.op == "neg" else ~x, P(x))
        if isinstance(e, ir.Binary):
            a, b = self.eval(e.a), self.eval(e.b)
            op = e.op
            pa, pb = P(a), P(b)
            if e.type == I32 and op in ("floordiv", "mod"):
                zero = None
                if self.check_divisors and bool((b == 0).any()):
                    zero = b == 0
                    self.zero_divisions.append((e.where, zero))
                    b = torch.where(zero, torch.ones_like(b), b)  # any value: the result is undefined there
                out = torch.div(a, b, rounding_mode="floor") if op == "floordiv" else torch.remainder(a, b)
                return self._with_poison(out, pa, pb, zero)
            if op in ("and", "or"):  # the compiled targets evaluate b only where a does not decide
                if pb is not None:
                    pb = pb & (a if op == "and" else ~a)
                return self._with_poison((a & b) if op == "and" else (a | b), pa, pb)
            if op == "add":
                out = a + b
            elif op == "sub":
                out = a - b
            elif op == "mul":
                out = a * b
            elif op == "div":
                out = a / b
            elif op == "floordiv":
                out = torch.floor(a / b)
            elif op == "mod":
                out = a - b * torch.floor(a / b)
            else:
                out = {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq,
                       "ne": torch.ne}[op](a, b)
            return self._with_poison(out, pa, pb)
        if isinstance(e, ir.Select):
            c, x, y = self.eval(e.cond), self.eval(e.a), self.eval(e.b)
            px, py = P(x), P(y)
            taken = None if px is None and py is None else torch.where(
                c, px if px is not None else torch.zeros((), dtype=torch.bool, device=c.device),
                py if py is not None else torch.zeros((), dtype=torch.bool, device=c.device))
            return self._with_poison(torch.where(c, x, y), P(c), taken)
        if isinstance(e, ir.Call):
            args = [self.eval(a) for a in e.args]
            if e.fn in _UNARY:
                out = _UNARY[e.fn](args[0])
            else:
                out = (torch.minimum if e.fn == "minimum" else torch.maximum)(*args)
            return self._with_poison(out, *(P(a) for a in args))
        if isinstance(e, ir.Cast):
            x = self.eval(e.x)
            if e.type == F32:
                out = x.to(self.fdt)
            else:
                out = torch.trunc(x).to(INT) if x.is_floating_point() else x.to(INT)
            return self._with_poison(out, P(x))
        raise TypeError(f"cannot evaluate {e!r}")


def eval_scalar(expr: ir.Expr, scalars: dict, sm_scale: float, hoisted: dict | None = None) -> float:
    """Value of an invariant expression (e.g. the folded output scale) for concrete scalar params; `hoisted`: the
    lowered programs' invariants by name, which such an expression may refer to."""
    ev = TorchEvaluator({"sm_scale": sm_scale}, scalars, torch.float64, "cpu", hoisted=hoisted)
    return float(ev.eval(expr))
