"""IR -> CUDA C++ (shared by the FA2 and FA3 variant structs, and by the host-compiled test harness).

Everything per-element reads only locals and `fv_*` members; the members (scalar params, hoisted
invariants, the query offset) are filled once per thread block in the variant's constructor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..spec import ir
from ..spec.ir import BOOL, F32, I32
from ..spec.optimize import Lowered

CTYPE = {F32: "float", I32: "int32_t", BOOL: "bool"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&&", "or": "||"}
_CPP_KEYWORDS = {"auto", "bool", "break", "case", "char", "class", "const", "default", "delete",
                 "do", "double", "enum", "explicit", "extern", "float", "friend", "goto", "inline",
                 "int", "long", "mutable", "namespace", "new", "operator", "private", "protected",
                 "public", "register", "short", "signed", "sizeof", "static", "struct", "switch",
                 "template", "this", "throw", "typedef", "typename", "union", "unsigned", "using",
                 "virtual", "void", "volatile", "logits", "params", "output", "batch_idx", "qo_idx",
                 "kv_idx", "qo_head_idx", "kv_head_idx", "signed", "half", "int32_t", "int64_t"}

#: How each index variable is computed from the FlashInfer hook arguments.
INDEX_INIT = {
    "batch": "int32_t(batch_idx)",
    "qo_head": "int32_t(qo_head_idx)",
    "kv_head": "int32_t(kv_head_idx)",
    "q_idx": "int32_t(qo_idx) + fv_q_offset",
    "kv_idx": "int32_t(kv_idx)",
}


def local_name(name: str) -> str:
    return name + "_" if name in _CPP_KEYWORDS else name


def float_literal(v: float) -> str:
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    if math.isnan(v):
        return "NAN"
    text = repr(float(v))
    return (text if ("e" in text or "." in text) else text + ".0") + "f"


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
        if isinstance(e, (ir.ScalarParam, ir.Hoisted)):
            return f"fv_{e.name}"
        if isinstance(e, ir.Local):
            return local_name(e.name)
        if isinstance(e, ir.Load):
            p = self.variant.params[e.param]
            offset = " + ".join(
                f"fivar::clamp_index({self.expr(i)}, {self.param_ref(f'{e.param}_size{d}')})"
                + (f" * {self.param_ref(f'{e.param}_stride{d}')}" if d < p.ndim - 1 else "")
                for d, i in enumerate(e.indices))
            return f"{CTYPE[e.type]}({self.param_ref(e.param)}[{offset}])"
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

    def prologue(self, *programs: ir.Program) -> list[str]:
        """Declarations of the index variables the programs use."""
        used = set().union(*(_used_indices(p) for p in programs if p))
        return [f"const int32_t fv_{n} = {self.index_init[n]};" for n in ir.INDEX_VARS if n in used]

    def statements(self, program: ir.Program) -> tuple[list[str], str]:
        """The program's let-bindings as C++ statements, and the expression of its result."""
        lines = [f"const {CTYPE[e.type]} {local_name(n)} = {self.expr(e)};" for n, e in program.lets]
        return lines, self.expr(program.result)

    def body(self, program: ir.Program, indent: str = "    ", guard: str | None = None) -> str:
        """Statements computing the program, ending in `return` (of `guard && result` if a guard is given)."""
        lines, result = self.statements(program)
        lines = self.prologue(program) + lines
        lines.append(f"return {guard} && {result};" if guard else f"return {result};")
        return ("\n" + indent).join(lines)

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
            t = F32 if name == "sm_scale" else self.variant.params[name].ir_type
            out.append(Member(CTYPE[t], f"fv_{name}", f"{CTYPE[t]}({self.param_ref(name)})"))
        for name, e in lowered.hoisted.items():
            out.append(Member(CTYPE[e.type], f"fv_{name}", self.expr(e)))
        return out


def _used_indices(program: ir.Program) -> set[str]:
    return {n.name for root in program.exprs() for n in ir.walk(root) if isinstance(n, ir.Index)}


def additional_params(variant, with_causal_flag: bool, extra_tensors=()):
    """FlashInfer `additional_*` lists: tensors, then scalars (sm_scale first), all fivar-owned names.
    `extra_tensors` are fivar's own int32 tables (FA3's KV-range form), before the variant's tensors.

    Returns (tensor_names, tensor_ctypes, scalar_names, scalar_ctypes).
    """
    t_names, t_types, s_names, s_types = list(extra_tensors), ["int32_t"] * len(extra_tensors), ["sm_scale"], ["double"]
    for name, p in variant.tensor_params.items():
        t_names.append(name)
        t_types.append(p.cpp_type)
        for d in range(p.ndim):
            s_names.append(f"{name}_size{d}")
            s_types.append("int64_t")
            if d < p.ndim - 1:
                s_names.append(f"{name}_stride{d}")
                s_types.append("int64_t")
    for name, p in variant.scalar_params.items():
        s_names.append(name)
        s_types.append("double" if p.ir_type == F32 else "int64_t")
    if with_causal_flag:
        s_names.append("fv_causal")
        s_types.append("int64_t")
    return t_names, t_types, s_names, s_types
