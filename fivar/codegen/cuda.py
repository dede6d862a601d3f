"""IR -> CUDA C++ (shared by the FA2 and FA3 variant structs, and by the host-compiled test harness).

Everything per-element reads only locals and members; the members (scalar params, hoisted invariants, the
query offset) are filled once per thread block in the variant's constructor. User names never appear as they
are: a param is `fvp_NAME`, a local `fvl_NAME` (fivar.spec.names.user_ident), fivar's own names are `fv_*`.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..spec import ir, positions
from ..spec.ir import BOOL, F32, I32
from ..spec.names import LOCAL, PARAM, check_rendered, comment_text, size_tag, stride_tag, user_ident
from ..spec.optimize import Lowered
from ..spec.params import Tensor

__all__ = ["CppEmitter", "Member", "additional_args", "additional_params", "comment_text"]

CTYPE = {F32: "float", I32: "int32_t", BOOL: "bool"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&&", "or": "||"}

#: How each index variable is computed from the FlashInfer hook arguments.
INDEX_INIT = {
    "batch": "int32_t(batch_idx)",
    "qo_head": "int32_t(qo_head_idx)",
    "kv_head": "int32_t(kv_head_idx)",
    "q_idx": "int32_t(qo_idx) + fv_q_offset",
    "kv_idx": "int32_t(kv_idx)",
}


def source_label(variant) -> str:
    """The file a generated struct's first comment names: the variant's, or what a shared kernel says instead."""
    return variant.__dict__.get("source_label") or os.path.basename(variant.source_file or "<unknown>")


def param_ident(name: str) -> str:
    """A param's name in FlashInfer's Params, the module's run functions and the variant struct."""
    return user_ident(PARAM, name)


def size_ident(name: str, dim: int) -> str:
    return user_ident(size_tag(dim), name)


def stride_ident(name: str, dim: int) -> str:
    return user_ident(stride_tag(dim), name)


def local_name(name: str) -> str:
    return user_ident(LOCAL, name)


def float_literal(v: float) -> str:
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    if math.isnan(v):
        return "NAN"
    text = repr(float(v))
    return (text if ("e" in text or "." in text) else text + ".0") + "f"


def _clamped_from_zero(i: ir.Expr) -> tuple[ir.Expr, ir.Expr] | None:
    """(x, hi) when `i` is minimum(maximum(x, 0), hi) of int32s (either argument order) with hi invariant."""
    def call(e, fn):
        return isinstance(e, ir.Call) and e.fn == fn and len(e.args) == 2
    if not (call(i, "minimum") and i.type == I32):
        return None
    for inner, hi in (i.args, i.args[::-1]):
        if call(inner, "maximum") and ir.is_invariant(hi) and hi.type == I32:
            for x, zero in (inner.args, inner.args[::-1]):
                if isinstance(zero, ir.Const) and zero.value == 0 and x.type == I32:
                    return x, hi
    return None


@dataclass
class Member:
    ctype: str
    name: str
    init: str


class CppEmitter:
    """Renders expressions. `param_ref(name)` is how a params field is spelled on this target."""

    def __init__(self, variant, param_ref=lambda n: f"params.{n}", index_init=None):
        self.variant, self.param_ref = variant, param_ref
        self.index_init = {**INDEX_INIT, **(index_init or {})}
        self.user_idents: set[str] = set()  # every identifier derived from a user name, checked as it is made

    def ident(self, name: str) -> str:
        """A derived identifier, held against the reserved C++/CUDA names (fivar.spec.names.check_rendered)."""
        if name not in self.user_idents:
            check_rendered("cuda", [name], self.variant.name)
            self.user_idents.add(name)
        return name

    def member(self, name: str) -> str:
        """The struct member holding a scalar param (or fivar's own sm_scale) for the block."""
        return "fv_sm_scale" if name == "sm_scale" else self.ident(param_ident(name))

    def expr(self, e: ir.Expr) -> str:
        if isinstance(e, ir.Const):
            if e.type == BOOL:
                return "true" if e.value else "false"
            if e.type == F32:
                return float_literal(e.value)
            return f"int32_t({int(e.value)})" if e.value < 0 else str(int(e.value))
        if isinstance(e, ir.RawScore):
            return "float(logits)"
        if isinstance(e, ir.Score):
            return "(float(logits) * fv_sm_scale)"
        if isinstance(e, ir.Index):
            return f"fv_{e.name}"
        if isinstance(e, ir.ScalarParam):
            return self.member(e.name)
        if isinstance(e, ir.Hoisted):
            return f"fv_{e.name}"
        if isinstance(e, ir.Local):
            return self.ident(local_name(e.name))
        if isinstance(e, ir.Load):
            p = self.variant.compiled_params[e.param]
            # a position table holds every distance a kernel reads (positions.TABLE_PAD): unclamped, its read is
            # one load at an immediate offset from a per-tile base, not two min/max and an address per score
            unchecked = positions.is_table(e.param)
            size = lambda d: self.param_ref(self.ident(size_ident(e.param, d)))  # noqa: E731
            offset = " + ".join(
                (self.expr(i) if unchecked else self.clamped_index(i, size(d)))
                + (f" * {self.param_ref(self.ident(stride_ident(e.param, d)))}" if d < p.ndim - 1 else "")
                for d, i in enumerate(e.indices))
            return f"{CTYPE[e.type]}({self.param_ref(self.ident(param_ident(e.param)))}[{offset}])"
        if isinstance(e, ir.Unary):
            return f"(-{self.expr(e.x)})" if e.op == "neg" else f"(!{self.expr(e.x)})"
        if isinstance(e, ir.Binary):
            if e.op in ("floordiv", "mod"):
                return f"fivar::{e.op}({self.expr(e.a)}, {self.expr(e.b)})"
            return f"({self.expr(e.a)} {_INFIX[e.op]} {self.expr(e.b)})"
        if isinstance(e, ir.Select):
            return f"({self.expr(e.cond)} ? {self.expr(e.a)} : {self.expr(e.b)})"
        if isinstance(e, ir.Call):
            return f"fivar::{e.fn}({', '.join(self.expr(a) for a in e.args)})"
        if isinstance(e, ir.Cast):
            return f"{CTYPE[e.type]}({self.expr(e.x)})"
        raise TypeError(f"no C++ for {e!r}")  # an IR node the parser cannot produce

    def clamped_index(self, i: ir.Expr, size: str) -> str:
        """An index clamped to its dimension [0, size). An index the variant itself clamps to [0, hi] with hi the same
        for the whole launch (a learned table at `clamp(q_idx - kv_idx, 0, max_distance)`) gets one clamp, to
        [0, min(hi, size - 1)], whose bound the compiler hoists: two int32 ops a score instead of four and a
        64-bit select."""
        from_zero = _clamped_from_zero(i)
        if from_zero is None:
            return f"fivar::clamp_index({self.expr(i)}, {size})"
        x, hi = (self.expr(t) for t in from_zero)
        bound = f"fivar::maximum(static_cast<int32_t>({size} - 1 < {hi} ? {size} - 1 : int64_t({hi})), 0)"
        return f"static_cast<int64_t>(fivar::minimum(fivar::maximum({x}, 0), {bound}))"

    def prologue(self, *programs: ir.Program) -> list[str]:
        """Declarations of the index variables the programs use."""
        used = set().union(*(_used_indices(p) for p in programs if p))
        return [f"const int32_t fv_{n} = {self.index_init[n]};" for n in ir.INDEX_VARS if n in used]

    def statements(self, program: ir.Program) -> tuple[list[str], str]:
        """The program's let-bindings as C++ statements, and the expression of its result."""
        lines = [f"const {CTYPE[e.type]} {self.ident(local_name(n))} = {self.expr(e)};" for n, e in program.lets]
        return lines, self.expr(program.result)

    def body(self, program: ir.Program, indent: str = "    ", guard: str | None = None) -> str:
        """Statements computing the program, ending in `return` (of `guard && result` if a guard is given)."""
        lines, result = self.statements(program)
        lines = self.prologue(program) + lines
        lines.append(f"return {guard} && {result};" if guard else f"return {result};")
        return ("\n" + indent).join(lines)

    def sink_lines(self, program: ir.Program, out: str = "fv_log2_sink") -> list[str]:
        """Statements setting `out` (a float declared by the caller) to the sink logit in the kernels' softmax
        domain: log2, like the running max m (the logits' own factor is in sm_scale_log2, not in the sink)."""
        lines, result = self.statements(program)
        return self.prologue(program) + lines + [f"{out} = float({result}) * flashinfer::math::log2e;"]

    def members(self, lowered: Lowered, extra_exprs=()) -> list[Member]:
        """Per-block members: scalar params read per element, hoisted invariants, the query offset."""
        roots = [e for p in (lowered.logits, lowered.mask) if p for e in p.exprs()]
        roots += list(lowered.hoisted.values()) + list(extra_exprs)
        scalars, q_offset = [], False
        for root in roots:
            for n in ir.walk(root):
                if isinstance(n, (ir.ScalarParam,)) and n.name not in scalars:
                    scalars.append(n.name)
                if isinstance(n, ir.Score) and "sm_scale" not in scalars:
                    scalars.append("sm_scale")
                if isinstance(n, ir.Index) and n.name == "q_idx":
                    q_offset = True
        out = []
        if q_offset:
            out.append(Member("int32_t", "fv_q_offset", "int32_t(kv_len) - int32_t(qo_len)"))
        for name in scalars:
            t = F32 if name == "sm_scale" else self.variant.compiled_params[name].ir_type
            field = "sm_scale" if name == "sm_scale" else param_ident(name)
            out.append(Member(CTYPE[t], self.member(name), f"{CTYPE[t]}({self.param_ref(field)})"))
        for name, e in lowered.hoisted.items():
            out.append(Member(CTYPE[e.type], f"fv_{name}", self.expr(e)))
        return out


def _used_indices(program: ir.Program) -> set[str]:
    return {n.name for root in program.exprs() for n in ir.walk(root) if isinstance(n, ir.Index)}


@dataclass(frozen=True)
class AdditionalArg:
    """One FlashInfer `additional` argument of a module: its C++ name and type, and what the runtime passes
    (`source`: "sm_scale", "causal", "table" (fivar's own int32 tensor `param`), "tensor", "scalar", "size" or
    "stride" of the variant's param `param`, dimension `dim`)."""
    name: str
    ctype: str
    source: str
    param: str | None = None
    dim: int = 0


def additional_args(variant, with_causal_flag: bool, extra_tensors=()) -> list[AdditionalArg]:
    """FlashInfer's `additional_*` arguments in declaration order: tensors (fivar's `extra_tensors` tables first,
    FA3's tile-list form), then scalars (sm_scale first). Names derived from params are user_ident's, so none is
    `maybe*` (FlashInfer's optional tensors) or any other name FlashInfer gives a meaning."""
    tensors = [AdditionalArg(t, "int32_t", "table", t) for t in extra_tensors]
    scalars = [AdditionalArg("sm_scale", "double", "sm_scale")]
    params = variant.compiled_params  # the variant's own, then the lowering's (position tables)
    for name, p in params.items():
        if isinstance(p, Tensor):
            tensors.append(AdditionalArg(param_ident(name), p.cpp_type, "tensor", name))
            for d in range(p.ndim):
                scalars.append(AdditionalArg(size_ident(name, d), "int64_t", "size", name, d))
                if d < p.ndim - 1:
                    scalars.append(AdditionalArg(stride_ident(name, d), "int64_t", "stride", name, d))
    for name, p in params.items():
        if isinstance(p, Tensor):
            continue
        scalars.append(AdditionalArg(param_ident(name), "double" if p.ir_type == F32 else "int64_t", "scalar", name))
    if with_causal_flag:
        scalars.append(AdditionalArg("fv_causal", "int64_t", "causal"))
    check_rendered("cuda", [a.name for a in tensors + scalars if a.param is not None and a.source != "table"],
                   variant.name)
    return tensors + scalars


def additional_params(variant, with_causal_flag: bool, extra_tensors=()):
    """additional_args as FlashInfer's lists: (tensor_names, tensor_ctypes, scalar_names, scalar_ctypes)."""
    args = additional_args(variant, with_causal_flag, extra_tensors)
    tensors = [a for a in args if a.source in ("table", "tensor")]
    scalars = [a for a in args if a not in tensors]
    return ([a.name for a in tensors], [a.ctype for a in tensors], [a.name for a in scalars],
            [a.ctype for a in scalars])
