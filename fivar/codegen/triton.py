"""IR -> Triton: the variant as two small `@triton.jit` functions, inlined into a FlashAttention-2 kernel.

The same lowered programs as the CUDA structs (`fivar.spec.optimize.lower`): `qk` is the unscaled q.k,
invariants are computed once per program in the kernel prologue, and a folded output factor goes into
the exp2 scale. Inside a tile, `q_idx` is a column [BLOCK_M, 1], `kv_idx` a row [1, BLOCK_N] and the
heads/batch are scalars (decode: `qo_head` is a column of the group's heads), so every expression simply
broadcasts. Semantics follow the torch reference: Python's // and % (Triton's integer ops truncate, the
helpers below fix that up), int() truncates toward zero, tensor-parameter indices are clamped.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch

from ..spec import ir, positions
from ..spec.ir import BOOL, F32, I32
from ..spec.names import check_rendered
from ..spec.params import Tensor
from .cuda import local_name, param_ident, size_ident, stride_ident
from .fa2 import render

_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&", "or": "|"}
_CALLS = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "sqrt": "tl.sqrt", "floor": "tl.floor",
          "abs": "tl.abs", "minimum": "tl.minimum", "maximum": "tl.maximum", "sigmoid": "tl.sigmoid",
          "tanh": "_tanh"}
_TL_TYPE = {F32: "tl.float32", I32: "tl.int32"}
#: functions that never decrease: an interval's image is the interval of its ends' images
MONOTONE_FUNCS = ("exp", "exp2", "log", "sqrt", "floor")
#: After the index variables, every variant function takes the tile's query and key index ranges.
TILE_RANGE_ARGS = ("fv_q_lo", "fv_q_hi", "fv_kv_lo", "fv_kv_hi")


def float_literal(v: float) -> str:
    if v != v:
        return 'float("nan")'
    if v in (float("inf"), float("-inf")):
        return f'float("{"-" if v < 0 else ""}inf")'
    return repr(float(v))


def _constant(e: ir.Expr, const_locals: dict) -> bool:
    return all(isinstance(n, ir.Const) or (isinstance(n, ir.Local) and n.name in const_locals)
               or (n.children() and not isinstance(n, ir.Load)) for n in ir.walk(e))


@dataclass
class KernelArg:
    """One variant argument of the kernels: its name in the module and how the runtime fills it."""
    name: str
    source: str  # "sm_scale", "scalar", "tensor", "size", "stride"
    param: str | None = None
    dim: int = 0
    specialize: bool = False  # ints only: let Triton specialise on the value (strides)


def read_without(e: ir.Expr, indices: tuple[str, ...]) -> bool:
    """Whether `e` reads none of `indices`, the score or a let (which may hold either): the same for every value of
    those indices, so a kernel can read it once outside a loop over them."""
    return not any(isinstance(n, (ir.Score, ir.RawScore, ir.Local)) or (isinstance(n, ir.Index) and n.name in indices)
                   for n in ir.walk(e))


class TritonEmitter:
    #: a zero tile shaped like another (Gluon's needs the other's layout, which gl.zeros_like takes from it)
    zeros_like = "tl.zeros_like"
    #: whether a position table's gather sits behind the tile test like other tile gathers, though a table never
    #: passes it (it holds every distance a tile reads): the branch keeps Triton's pipeliner from staging the gather
    #: through shared memory (the Triton forward, T5's table at 128 x 64: 135 -> 197 KB and spills, +16% on an
    #: H200) and ptxas from hoisting the learnable reads' gathers into spills (the Gluon dQ kernel); the Gluon
    #: kernels' logits and mask read tables without it (their dK/dV kernel 14% faster, dQ no slower)
    table_tile_test = True

    def __init__(self, variant):
        self.variant = variant
        self.lowered = variant.lowered
        # user names as the CUDA structs spell them (fivar.spec.names.user_ident): never a Python keyword or
        # builtin, a name of the module's own, or a launch option such as num_warps
        self.param_names = {name: param_ident(name) for name in variant.compiled_params}
        self.hoisted_names = {h: f"fv_{h}" for h in self.lowered.hoisted}
        self.row_loads = self._row_loads()
        self.args = self._kernel_args()
        check_rendered("triton", [a.name for a in self.args if a.param is not None], variant.name)
        self.helpers: set[str] = set()
        self.local_names: dict[str, str] = {}
        self.const_locals: dict[str, ir.Expr] = {}
        self.let_exprs: dict[str, ir.Expr] = {}
        self.in_prologue = False
        self.statements: list[str] | None = None  # where a tile-uniform load emits its if/else
        self.tile_loads = 0

    # --- arguments -------------------------------------------------------------------------------
    def _kernel_args(self) -> list[KernelArg]:
        args = [KernelArg("sm_scale", "sm_scale")]
        params = self.variant.compiled_params  # the variant's own, then the lowering's (position tables)
        for name, p in ((n, p) for n, p in params.items() if isinstance(p, Tensor)):
            pname = self.param_names[name]
            args.append(KernelArg(pname, "tensor", name))
            for d in range(p.ndim):
                args.append(KernelArg(size_ident(name, d), "size", name, d))
                if d < p.ndim - 1:
                    args.append(KernelArg(stride_ident(name, d), "stride", name, d, specialize=True))
        for name in (n for n, p in params.items() if not isinstance(p, Tensor)):
            args.append(KernelArg(self.param_names[name], "scalar", name))
        return args

    def _row_loads(self) -> dict[ir.Load, str]:
        """Tensor-param reads that do not depend on the key (say `doc_ids[batch, q_idx]`): the same for every
        KV tile, so each kernel reads them once before its KV loop instead of once per tile."""
        loads: dict[ir.Load, str] = {}
        for program in (self.lowered.logits, self.lowered.mask):
            for root in (program.exprs() if program else ()):
                for e in ir.walk(root):
                    if isinstance(e, ir.Load) and e not in loads and read_without(e, ("kv_idx",)):
                        loads[e] = f"fv_row{len(loads)}"
        return loads

    def variant_args(self) -> list[str]:
        """What the logits/mask functions take after the index variables: kernel args, then invariants
        (per launch, then per query row)."""
        return [a.name for a in self.args] + list(self.hoisted_names.values()) + list(self.row_loads.values())

    def unspecialized(self) -> list[str]:
        return [a.name for a in self.args if a.source in ("scalar", "size")]

    # --- expressions -----------------------------------------------------------------------------
    def expr(self, e: ir.Expr) -> str:
        if not isinstance(e, ir.Const) and _constant(e, self.const_locals):
            return self.literal(self.fold(e), e.type)
        if isinstance(e, ir.Const):
            return self.literal(e.value, e.type)
        if isinstance(e, ir.RawScore):
            return "qk"
        if isinstance(e, ir.Score):
            return "(qk * sm_scale)"
        if isinstance(e, ir.Index):
            return e.name
        if isinstance(e, ir.ScalarParam):
            return "sm_scale" if e.name == "sm_scale" else self.param_names[e.name]
        if isinstance(e, ir.Hoisted):
            return self.hoisted_names[e.name]
        if isinstance(e, ir.Local):
            return self.local_names[e.name]
        if isinstance(e, ir.Load):
            return self.row_loads[e] if e in self.row_loads and not self.in_prologue else self.load(e)
        if isinstance(e, ir.Unary):
            return f"(-{self.expr(e.x)})" if e.op == "neg" else f"(~{self.expr(e.x)})"
        if isinstance(e, ir.Binary):
            a, b = self.expr(e.a), self.expr(e.b)
            if e.op in ("floordiv", "mod"):
                if e.type == F32:
                    return f"tl.floor({a} / {b})" if e.op == "floordiv" else f"({a} - {b} * tl.floor({a} / {b}))"
                self.helpers.add(e.op)
                return f"_py_{e.op}({a}, {b})"
            if e.op in ("and", "or") and self._per_program(e.a) != self._per_program(e.b):
                # Triton 3.9's interpreter broadcasts a loaded per-program bool into float data in `|`/`&` (which
                # then fail), not as a select's condition; compiled, the select is the same instruction
                u, t = (a, b) if self._per_program(e.a) else (b, a)
                return f"tl.where({u}, True, {t})" if e.op == "or" else f"tl.where({u}, {t}, False)"
            return f"({a} {_INFIX[e.op]} {b})"
        if isinstance(e, ir.Select):
            return f"tl.where({self.expr(e.cond)}, {self.expr(e.a)}, {self.expr(e.b)})"
        if isinstance(e, ir.Call):
            if e.fn == "tanh":
                self.helpers.add("tanh")
            return f"{_CALLS[e.fn]}({', '.join(self.expr(a) for a in e.args)})"
        if isinstance(e, ir.Cast):  # tl.cast: the interpreter passes scalar args as Python numbers (no .to)
            return f"tl.cast({self.expr(e.x)}, {_TL_TYPE[e.type]})"
        raise TypeError(f"no Triton for {e!r}")  # an IR node the parser cannot produce

    def _per_program(self, e: ir.Expr) -> bool:
        """Whether `e` is one value per program (no query or key index in it, through locals too)."""
        for n in ir.walk(e):
            if isinstance(n, (ir.Score, ir.RawScore)) or (isinstance(n, ir.Index) and n.name in ("q_idx", "kv_idx")):
                return False
            if isinstance(n, ir.Local) and n.name in self.let_exprs and not self._per_program(self.let_exprs[n.name]):
                return False
        return True

    def clamped_offset(self, param: str, indices: list[str], load: ir.Load | None = None) -> str:
        """The element offset of `param[indices]`, each index clamped to its dimension (also where the
        backward scatters a tensor parameter's gradient). A position table's distance (`load` given) is clamped
        to the table's width written as twice its offset scalar (fivar.spec.positions.table_offset), the same
        expression for every table: the compiler computes it once for all a tile reads."""
        ndim = self.variant.compiled_params[param].ndim
        highs = self.last_indices(param, load)
        return " + ".join(f"tl.minimum(tl.maximum({i}, 0), {highs[d]})"
                          + (f" * {stride_ident(param, d)}" if d < ndim - 1 else "") for d, i in enumerate(indices))

    def last_indices(self, param: str, load: ir.Load | None = None) -> list[str]:
        """Each dimension's last index of `param`; for a position table read (`load`), its distance column's as
        twice the offset scalar."""
        highs = [f"{size_ident(param, d)} - 1" for d in range(self.variant.compiled_params[param].ndim)]
        if load is not None and positions.is_table(param):
            highs[1] = f"2 * {self.expr(positions.table_offset_param(load))}"
        return highs

    def load(self, e: ir.Load) -> str:
        name = self.param_names[e.param]
        last = self.last_indices(e.param, e)

        def offset(indices: list[str]) -> str:
            return self.clamped_offset(e.param, indices, e)

        def typed(value: str) -> str:
            return f"({value} != 0)" if e.type == BOOL else f"{value}.to({_TL_TYPE[e.type]})"

        full = offset([self.expr(i) for i in e.indices])
        plain = positions.is_table(e.param) and not self.table_tile_test
        ranges = self.tile_ranges(e) if self.statements is not None and not plain else None
        if ranges is None:
            return typed(f"tl.load({name} + {full})")
        # A gather over a whole (query, key) tile whose index often does not vary across the tile (a clamped
        # offset far from the diagonal): test that from the tile's index ranges and read one value instead.
        n = self.tile_loads
        self.tile_loads += 1
        uniform = " & ".join(f"({lo} == {hi})" for lo, hi in (
            (f"tl.minimum(tl.maximum({lo}, 0), {last[d]})",
             f"tl.minimum(tl.maximum({hi}, 0), {last[d]})") for d, (lo, hi) in ranges.items()))
        at_lo = offset([ranges[d][0] if d in ranges else self.expr(i) for d, i in enumerate(e.indices)])
        self.statements += [f"fv_offset{n} = {full}",
                            f"if {uniform}:",
                            f"    fv_gather{n} = {self.zeros_like}(fv_offset{n}).to({name}.dtype.element_ty) + "
                            f"tl.load({name} + {at_lo})",
                            "else:",
                            f"    fv_gather{n} = tl.load({name} + fv_offset{n})"]
        return typed(f"fv_gather{n}")

    def tile_ranges(self, e: ir.Load) -> dict[int, tuple[str, str]] | None:
        """For a load indexed by both q_idx and kv_idx: each such index's [lo, hi] over the tile, as scalar
        expressions of the tile's query and key ranges (fv_q_lo.., fv_kv_lo..). None if not such a load or
        an index is not a monotone expression fivar can bound."""
        deps = [self.index_vars(i) for i in e.indices]
        if not ({"q_idx", "kv_idx"} <= set().union(*deps)):
            return None
        ranges = {}
        for d, (index, used) in enumerate(zip(e.indices, deps)):
            if used & {"q_idx", "kv_idx"}:
                bounds = self.interval(index)
                if bounds is None:
                    return None
                ranges[d] = bounds
        return ranges

    def walk_lets(self, e: ir.Expr):
        """Every node of `e`, and of the lets its locals name."""
        for n in ir.walk(e):
            yield n
            if isinstance(n, ir.Local) and n.name in self.let_exprs:
                yield from self.walk_lets(self.let_exprs[n.name])

    def index_vars(self, e: ir.Expr) -> set[str]:
        return {n.name for n in self.walk_lets(e) if isinstance(n, ir.Index)}

    def interval(self, e: ir.Expr) -> tuple[str, str] | None:
        """[lo, hi] of an integer/float expression over the tile, by interval arithmetic; None if an
        operation is not supported (the load then stays a plain gather)."""
        if isinstance(e, ir.Index):
            return {"q_idx": ("fv_q_lo", "fv_q_hi"), "kv_idx": ("fv_kv_lo", "fv_kv_hi")}.get(e.name)
        if isinstance(e, (ir.Const, ir.ScalarParam, ir.Hoisted)):
            x = self.expr(e)
            return x, x
        if isinstance(e, ir.Local):
            if e.name in self.const_locals:
                x = self.expr(e)
                return x, x
            return self.interval(self.let_exprs[e.name]) if e.name in self.let_exprs else None
        if isinstance(e, ir.Cast) and e.type == I32 and e.x.type == I32:
            return self.interval(e.x)
        if isinstance(e, ir.Cast):  # int <-> float: monotone (the truncation to int too)
            b = self.interval(e.x)
            return None if b is None else tuple(f"tl.cast({x}, {_TL_TYPE[e.type]})" for x in b)
        if isinstance(e, ir.Unary) and e.op == "neg":
            b = self.interval(e.x)
            return None if b is None else (f"(-{b[1]})", f"(-{b[0]})")
        if isinstance(e, ir.Select):  # the branch the condition takes over the whole tile, else both's hull
            a, b, decided = self.interval(e.a), self.interval(e.b), self.decided(e.cond)
            if a is None or b is None:
                return None
            lo, hi = f"tl.minimum({a[0]}, {b[0]})", f"tl.maximum({a[1]}, {b[1]})"
            if decided is None:
                return lo, hi
            always, never = decided
            return (f"tl.where({always}, {a[0]}, tl.where({never}, {b[0]}, {lo}))",
                    f"tl.where({always}, {a[1]}, tl.where({never}, {b[1]}, {hi}))")
        if isinstance(e, ir.Call) and e.fn in MONOTONE_FUNCS:
            b = self.interval(e.args[0])
            if b is None:
                return None
            f = _CALLS[e.fn]
            self.helpers.add("nan_to")
            # a bound outside the function's domain (NaN) widens to the infinite one: never one element
            return (f"_fv_nan_to({f}({b[0]}), float('-inf'))", f"_fv_nan_to({f}({b[1]}), float('inf'))")
        if isinstance(e, ir.Binary) and e.op == "div" and e.type == F32 and isinstance(
                e.b, (ir.Const, ir.ScalarParam, ir.Hoisted, ir.Local)):
            a, b = self.interval(e.a), self.interval(e.b)
            if a is None or b is None or b[0] != b[1]:  # a divisor that is one value over the tile
                return None
            self.helpers.add("nan_to")  # a zero divisor: NaN bounds, widened to infinite ones
            x, y = f"({a[0]} / {b[0]})", f"({a[1]} / {b[0]})"
            return (f"_fv_nan_to(tl.minimum({x}, {y}), float('-inf'))", f"_fv_nan_to(tl.maximum({x}, {y}), float('inf'))")
        if isinstance(e, ir.Binary) and e.op == "floordiv" and e.type == I32:  # monotone in a, given one b
            a, b = self.interval(e.a), self.interval(e.b)
            if a is None or b is None or b[0] != b[1]:
                return None
            self.helpers.add("floordiv")
            x, y = f"_py_floordiv({a[0]}, {b[0]})", f"_py_floordiv({a[1]}, {b[0]})"
            return f"tl.minimum({x}, {y})", f"tl.maximum({x}, {y})"
        kids = [self.interval(c) for c in e.children()]
        if None in kids or not kids:
            return None
        if isinstance(e, ir.Binary) and e.op == "add":
            (alo, ahi), (blo, bhi) = kids
            return f"({alo} + {blo})", f"({ahi} + {bhi})"
        if isinstance(e, ir.Binary) and e.op == "sub":
            (alo, ahi), (blo, bhi) = kids
            return f"({alo} - {bhi})", f"({ahi} - {blo})"
        if isinstance(e, ir.Binary) and e.op == "mul":
            (alo, ahi), (blo, bhi) = kids
            corners = [f"{a} * {b}" for a in (alo, ahi) for b in (blo, bhi)]
            lo, hi = corners[0], corners[0]
            for c in corners[1:]:
                lo, hi = f"tl.minimum({lo}, {c})", f"tl.maximum({hi}, {c})"
            return lo, hi
        if isinstance(e, ir.Call) and e.fn in ("minimum", "maximum"):
            (alo, ahi), (blo, bhi) = kids
            f = f"tl.{e.fn}"
            return f"{f}({alo}, {blo})", f"{f}({ahi}, {bhi})"
        if isinstance(e, ir.Call) and e.fn == "abs":
            ((lo, hi),) = kids
            return (f"tl.where({lo} >= 0, {lo}, tl.where({hi} <= 0, -({hi}), 0))",
                    f"tl.maximum(tl.abs({lo}), tl.abs({hi}))")
        return None

    def decided(self, cond: ir.Expr) -> tuple[str, str] | None:
        """For a comparison of two bounded expressions: (holds for the whole tile, fails for the whole tile) as
        scalar expressions; None for another condition."""
        if isinstance(cond, ir.Local) and cond.name in self.let_exprs:
            return self.decided(self.let_exprs[cond.name])
        if not (isinstance(cond, ir.Binary) and cond.op in ("lt", "le", "gt", "ge")):
            return None
        a, b = self.interval(cond.a), self.interval(cond.b)
        if a is None or b is None:
            return None
        (alo, ahi), (blo, bhi) = a, b
        return {"lt": (f"({ahi} < {blo})", f"({alo} >= {bhi})"), "le": (f"({ahi} <= {blo})", f"({alo} > {bhi})"),
                "gt": (f"({alo} > {bhi})", f"({ahi} <= {blo})"), "ge": (f"({alo} >= {bhi})", f"({ahi} < {blo})")}[cond.op]

    def fold(self, e: ir.Expr):
        """Constant subtrees are computed here (float32, the reference's semantics): Triton would
        otherwise evaluate them as Python constexprs, with Python's float64 and no tensor methods."""
        from ..spec.evaluate import TorchEvaluator
        ev = TorchEvaluator({}, {}, torch.float32, "cpu")
        for name, value in self.const_locals.items():
            ev.locals[name] = ev.eval(value)
        return ev.eval(e).item()

    @staticmethod
    def literal(value, t: str) -> str:
        if t == BOOL:
            return "True" if value else "False"
        if t == F32:
            return float_literal(float(value))
        return str(int(value))

    # --- functions -------------------------------------------------------------------------------
    def function(self, program: ir.Program, name: str, first_args: tuple[str, ...]) -> str:
        """A `@triton.jit` function computing the program (lets as statements, then the return)."""
        self.local_names, self.const_locals = {}, {}
        self.let_exprs = dict(program.lets)
        lines = self.statements = []
        for lname, e in program.lets:
            if _constant(e, self.const_locals):
                self.const_locals[lname] = e  # folded wherever it is used
                continue
            self.local_names[lname] = local_name(lname)
            check_rendered("triton", [self.local_names[lname]], self.variant.name)
            lines.append(f"{self.local_names[lname]} = {self.expr(e)}")
        weight = program.result
        if (first_args[0] == "qk" and not self.variant.softmax and isinstance(weight, ir.Call)
                and weight.fn == "sigmoid"):
            # the weight itself, rounded to bf16/fp16 for P.V next: tanh.approx's error does not show there
            # (it would inside log(sigmoid(x)) or as a small factor, so only this position gets it)
            self.helpers.update({"tanh", "sigmoid"})
            result = f"_sigmoid({self.expr(weight.args[0])})"
        else:
            result = self.expr(weight)
        self.statements = None
        if first_args[0] == "qk" and "score" not in ir.uses(program):
            result = f"{self.zeros_like}(qk) + {result}"  # logits that ignore the score: still a full tile
        lines.append(f"return {result}")
        args = ", ".join(list(first_args) + list(TILE_RANGE_ARGS) + self.variant_args() + self.function_args())
        body = "\n".join("    " + line for line in lines)
        return f"@triton.jit\ndef {name}({args}):\n{body}\n"

    def function_args(self) -> list[str]:
        """Arguments of the function just emitted beyond variant_args (none here)."""
        return []

    def sink_function(self, program: ir.Program) -> str:
        """`variant_sink(batch, qo_head, <kernel args>)`: the sink logit of one (request, query head), from the
        parsed program (nothing in it is per element, so it is not lowered); its tensor reads are plain loads."""
        self.local_names, self.const_locals = {}, {}
        self.let_exprs = dict(program.lets)
        self.statements = None
        self.in_prologue = True  # a load the logits also read per row is not a row load here
        try:
            lines = []
            for lname, e in program.lets:
                if _constant(e, self.const_locals):
                    self.const_locals[lname] = e
                    continue
                self.local_names[lname] = local_name(lname)
                check_rendered("triton", [self.local_names[lname]], self.variant.name)
                lines.append(f"{self.local_names[lname]} = {self.expr(e)}")
            lines.append(f"return tl.cast({self.expr(program.result)}, tl.float32)")
        finally:
            self.in_prologue = False
        args = ", ".join(["batch", "qo_head"] + [a.name for a in self.args])
        body = "\n".join("    " + line for line in lines)
        return f"@triton.jit\ndef variant_sink({args}):\n{body}\n"

    def prologue(self) -> list[str]:
        """Kernel statements computing the per-program invariants and the exp2 scale of the softmax."""
        self.local_names, self.const_locals = {}, {}
        lines = [f"{self.hoisted_names[h]} = {self.expr(e)}" for h, e in self.lowered.hoisted.items()]
        band = self.variant.kv_band
        for side, e in (("left", band.left), ("right", band.right)):
            if e is not None:
                lines.append(f"fv_band_{side} = {self.expr(e)}")
        if self.variant.softmax:
            scale = self.lowered.output_scale
            lines.append("qk_scale = LOG2E" if scale is None else f"qk_scale = LOG2E * {self.expr(scale)}")
        return lines


    def read_plan(self) -> list[tuple[str, str]]:
        """(tensor read, how the twin does it) for every tensor-param read in the lowered logits and mask."""
        plan: dict[ir.Load, str] = {}
        for program in (self.lowered.logits, self.lowered.mask):
            if program is None:
                continue
            self.let_exprs = dict(program.lets)
            for root in program.exprs():
                for e in ir.walk(root):
                    if not isinstance(e, ir.Load) or e in plan:
                        continue
                    by_key_only = "q_idx" not in self.index_vars(e) and not any(
                        isinstance(n, (ir.Score, ir.RawScore)) for n in self.walk_lets(e))
                    plan[e] = ("once per program (does not depend on the key)" if e in self.row_loads else
                               "one value per tile where its clamped index cannot vary, else a gather"
                               if self.tile_ranges(e) is not None else
                               "once per key (a row of values per tile)" if by_key_only else
                               "a gather per element")
        return [(ir.format_expr(e), how) for e, how in plan.items()]

    def mask_element_cost(self) -> int:
        """About how many instructions the lowered mask costs per (row, key) pair on a tile: a read of the key alone
        1 (a row of values, broadcast), a gather by both indices 4, an integer // or % 4, any other operation 1;
        per-row reads and per-launch invariants nothing."""
        mask = self.lowered.mask
        if mask is None:
            return 0
        self.let_exprs = dict(mask.lets)
        cost = 0
        for root in [e for _, e in mask.lets] + [mask.result]:
            for e in ir.walk(root):
                if isinstance(e, ir.Load):
                    cost += 0 if e in self.row_loads else 4 if "q_idx" in self.index_vars(e) else 1
                elif isinstance(e, ir.Binary):
                    cost += 4 if e.op in ("floordiv", "mod") else 1
                elif isinstance(e, (ir.Unary, ir.Select, ir.Call, ir.Cast)):
                    cost += 1
        return cost

    def row_prologue(self) -> list[str]:
        """Kernel statements reading the per-row values (`row_loads`), once the index variables exist."""
        return self.read_lines(self.row_loads)

    def read_lines(self, loads: dict[ir.Load, str]) -> list[str]:
        """`name = <the read>` for each of `loads`, read in full (not by the name it stands for)."""
        self.local_names, self.const_locals = {}, {}
        self.in_prologue = True
        try:
            return [f"{name} = {self.expr(e)}" for e, name in loads.items()]
        finally:
            self.in_prologue = False


#: A cut tile's precomputed bits cost about this much per pair (a shift, an and, a compare; one load a row): a mask
#: costing more (fivar.codegen.triton.TritonEmitter.mask_element_cost) reads bits on cut tiles instead.
MASK_BITS_COST = 4


def reads_mask_bits(variant) -> bool:
    """Whether the Triton twin reads the block map's bits on cut tiles rather than evaluating the mask there."""
    return variant.scans_mask and TritonEmitter(variant).mask_element_cost() > MASK_BITS_COST


def render_attention(variant, extra_helpers=()) -> str:
    """The whole Python module of the variant's Triton twin (prefill and decode kernels, launchers).
    `extra_helpers`: helper functions to define beyond the forward's own (the training module's backward uses them)."""
    emit = TritonEmitter(variant)
    logits = emit.lowered.logits
    logits_fn = emit.function(logits, "variant_logits", ("qk",) + ir.INDEX_VARS)
    mask_fn = emit.function(emit.lowered.mask, "variant_mask", ir.INDEX_VARS) if emit.lowered.mask else None
    sink_fn = emit.sink_function(variant.ir.sink) if variant.ir.sink is not None else None
    prologue = emit.prologue()
    row_prologue = emit.row_prologue()  # before `helpers` is read: a row read's index may need _py_mod & co.
    band = variant.kv_band
    source = os.path.basename(variant.source_file or "<unknown>")
    return render("triton/attention.py.jinja", name=variant.name, source=source, doc=variant.doc.strip(),
                  softmax=variant.softmax, logits_fn=logits_fn, mask_fn=mask_fn, sink_fn=sink_fn,
                  helpers=sorted(emit.helpers | set(extra_helpers)),
                  prologue=prologue, row_prologue=row_prologue, kernel_args=[a.name for a in emit.args],
                  band_left=band.left and ir.format_expr(band.left),
                  band_right=band.right and ir.format_expr(band.right),
                  band_exact=band.exact,
                  prescan=variant.scans_mask,
                  block_map=variant.scans_mask,
                  map_bits=reads_mask_bits(variant),
                  range_per_head=bool({"qo_head", "kv_head"} & ir.uses(emit.lowered.mask)) if emit.lowered.mask
                  else False,
                  variant_args=emit.variant_args(), unspecialized=emit.unspecialized(),
                  logits_text=ir.format_program(variant.ir.logits, "logits") if variant.ir.logits else None,
                  mask_text=ir.format_program(variant.ir.mask, "mask") if variant.ir.mask else None,
                  sink_text=ir.format_program(variant.ir.sink, "sink") if variant.ir.sink else None)


_kernel_args: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kernel_arg_values(variant, bound, sm_scale: float) -> dict:
    """The variant's kernel arguments by name, from params checked by `bind_params`."""
    lowered = variant.lowered
    args = _kernel_args.get(variant)
    if args is None or args[0] is not lowered:  # another lowering config: other arguments
        args = _kernel_args[variant] = (lowered, TritonEmitter(variant).args)
    values = {}
    for a in args[1]:
        if a.source == "sm_scale":
            values[a.name] = float(sm_scale)
        elif a.source == "scalar":
            p = variant.compiled_params[a.param]
            values[a.name] = float(bound.scalars[a.param]) if p.dtype is float else int(bound.scalars[a.param])
        elif a.source == "tensor":
            values[a.name] = bound.tensors[a.param]
        elif a.source == "size":
            values[a.name] = int(bound.tensors[a.param].shape[a.dim])
        else:
            values[a.name] = int(bound.tensors[a.param].stride(a.dim))
    return values
