"""Front end: a variant's Python functions -> type-checked `ir.Program`s.

Only a small, explicit subset of Python is accepted (see ALLOWED). Everything else is rejected with a
`FivarSpecError` that points at file:line:column of the offending construct.
"""
from __future__ import annotations

import ast
import difflib
import math
import builtins
import dataclasses
import textwrap
from dataclasses import dataclass, field

from .. import lang
from ..errors import FivarSpecError
from . import constants, ir, power
from .ir import BOOL, F32, I32, NUMERIC
from .params import Tensor, out_of_range
from .source import function_source, sink_lambda

ALLOWED = ("arithmetic (+ - * / // %), comparisons, and/or/not, `a if c else b`, local assignments, "
           "numbers, params.NAME, params.TABLE[i, ...], and the functions "
           "tanh exp exp2 log sigmoid sqrt abs floor minimum maximum clamp where float int "
           "(from fivar; math.* and torch.* spellings of the same functions are accepted too)")

#: How deep an expression may nest, counting through the locals it reads: far beyond any real variant, and shallow
#: enough for every recursive pass over the IR (and the compilers' expression parsers) to handle.
MAX_DEPTH = 100

LOGITS_ARGS = ("score",) + ir.INDEX_VARS + ("params",)
MASK_ARGS = ir.INDEX_VARS + ("params",)
#: A sink is one logit per (request, query head): the full form, and the per-head shorthand.
SINK_ARGS = ("batch", "qo_head", "params")
SINK_HEAD_ARGS = ("qo_head", "params")

_BINOPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.FloorDiv: "floordiv",
           ast.Mod: "mod"}
_SYMBOLS = {"div": "/", "floordiv": "//", "mod": "%"}
_CMPOPS = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}
_MODULE_FUNCS = {  # functions reachable as module.attr, mapped to fivar's names
    "math": {"tanh": "tanh", "exp": "exp", "log": "log", "sqrt": "sqrt", "floor": "floor",
             "fabs": "abs"},
    "torch": {n: n for n in ("tanh", "exp", "exp2", "log", "sigmoid", "sqrt", "abs", "floor",
                             "minimum", "maximum", "clamp", "where")},
}
_BUILTIN_FUNCS = {"abs": "abs", "min": "minimum", "max": "maximum", "float": "float", "int": "int"}


@dataclass
class VariantIR:
    logits: ir.Program | None
    mask: ir.Program | None
    divisor_scalars: dict[str, str] = field(default_factory=dict)  # int Scalar param -> where it divides
    #: The attention sink: a float of `batch` and `qo_head` only (no score, no query or key position).
    sink: ir.Program | None = None


def parse_variant(variant) -> VariantIR:
    sink = getattr(variant, "sink", None)
    parsers = {role: _FunctionParser(variant, fn, role) for role, fn in (("logits", variant.logits),
                                                                          ("mask", variant.mask),
                                                                          ("sink", sink)) if fn}
    programs = {role: p.parse() for role, p in parsers.items()}
    divisors = {name: where for p in parsers.values() for name, where in p.divisor_scalars.items()}
    return VariantIR(programs.get("logits"), programs.get("mask"), divisors, programs.get("sink"))


def _node_name(node: ast.AST) -> str:
    return {ast.If: "`if` statement", ast.For: "`for` loop", ast.While: "`while` loop",
            ast.Lambda: "lambda", ast.ListComp: "list comprehension", ast.Pow: "`**`",
            ast.BitAnd: "`&`", ast.BitOr: "`|`", ast.BitXor: "`^`", ast.LShift: "`<<`",
            ast.RShift: "`>>`", ast.Invert: "`~`", ast.MatMult: "`@`", ast.Is: "`is`",
            ast.In: "`in`", ast.NotIn: "`not in`", ast.IsNot: "`is not`"}.get(
        type(node), f"`{type(node).__name__}`")


class _FunctionParser:
    def __init__(self, variant, fn, role: str):
        self.variant, self.fn, self.role = variant, fn, role
        self.source, self.first_line, self.col_offset = function_source(variant, fn, role)  # checks fn is a def
        self.filename = fn.__code__.co_filename
        self.lambda_node: ast.Lambda | None = None
        if fn.__name__ == "<lambda>" and role == "sink":
            self.lambda_node, self.source = sink_lambda(variant, fn)
            self.first_line, self.col_offset = 1, 0
        self.env: dict[str, ir.Expr] = {}  # python name -> expr (args) or Local
        self.lets: list[tuple[str, ir.Expr]] = []
        self.let_values: dict[str, int | float | None] = {}  # a local's value where constants alone give it
        self.let_names: set[str] = set()
        self.let_depth: dict[str, int] = {}  # local -> how deep its expression nests, through the locals it reads
        self.nesting = 0  # of the expression being parsed
        self.divisor_scalars: dict[str, str] = {}  # Scalar param -> where it divides (a 0 is refused per call)
        self.guards = 0  # > 0 while parsing what a condition guards: a branch, or `and`/`or` after its first operand

    # --- errors --------------------------------------------------------------------------------
    def location(self, node: ast.AST | None) -> tuple[int, int]:
        """(line, col) of a node in the variant's file."""
        if node is None:
            return self.first_line, 0
        return self.first_line + getattr(node, "lineno", 1) - 1, getattr(node, "col_offset", 0) + self.col_offset

    def error(self, node: ast.AST | None, message: str, construct: str | None = None, allowed=None):
        line, col = self.location(node)
        return FivarSpecError(f"in `{self.role}`: {message}", variant=self.variant.name,
                              filename=self.filename, line=line, col=col, construct=construct,
                              allowed=allowed)

    def unsupported(self, node: ast.AST, what: str | None = None):
        what = what or _node_name(node)
        return self.error(node, f"{what} is not supported in a variant function", construct=what,
                          allowed=ALLOWED)

    # --- entry ---------------------------------------------------------------------------------
    def parse(self) -> ir.Program:
        if self.lambda_node is not None:
            fdef = self.lambda_node
        else:
            try:
                tree = ast.parse(textwrap.dedent(self.source))
            except (RecursionError, MemoryError, SyntaxError) as e:  # nesting beyond what Python's parser takes
                raise self.error(None, f"cannot parse `{self.role}` ({type(e).__name__}: {e})",
                                 "unparsable source") from None
            fdef = tree.body[0]
        if not isinstance(fdef, (ast.FunctionDef, ast.Lambda)) or (isinstance(fdef, ast.Lambda)
                                                                    and self.role != "sink"):
            raise self.error(fdef, f"`{self.role}` must be defined with `def`, not a lambda", "lambda",
                             "def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params): ...")
        a = fdef.args
        if self.role == "sink":
            expected = SINK_HEAD_ARGS if len(a.args) == len(SINK_HEAD_ARGS) else SINK_ARGS
        else:
            expected = LOGITS_ARGS if self.role == "logits" else MASK_ARGS
        if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults \
                or len(a.args) != len(expected):
            forms = f"({', '.join(expected)})" + (f" or ({', '.join(SINK_HEAD_ARGS)})" if self.role == "sink" else "")
            raise self.error(fdef, f"`{self.role}` must take exactly {len(expected)} positional "
                             f"arguments {forms}; got {len(a.args)}",
                             "signature", f"def {self.role}({', '.join(expected)})")
        for arg, role in zip(a.args, expected):
            if role == "score":
                self.env[arg.arg] = ir.Score(F32)
            elif role == "params":
                self.env[arg.arg] = _PARAMS
            else:
                self.env[arg.arg] = ir.Index(I32, role)
        if isinstance(fdef, ast.Lambda):  # one expression: the sink
            body = [ast.Return(value=fdef.body, lineno=fdef.body.lineno, col_offset=fdef.body.col_offset)]
        else:
            body = list(fdef.body)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # docstring
        result = None
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.Return):
                if i != len(body) - 1:
                    raise self.error(body[i + 1], "code after `return` is not allowed", "unreachable code")
                if stmt.value is None:
                    raise self.error(stmt, "`return` needs a value")
                result = self.expr(stmt.value)
                self.check_depth(result, stmt)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if len(targets) != 1 or not isinstance(targets[0], ast.Name) or stmt.value is None:
                    raise self.unsupported(stmt, "this assignment form (only `name = expr` and `name op= expr`)")
                value = stmt.value
                if isinstance(stmt, ast.AugAssign):  # `x += e` is `x = x + e`
                    read = ast.copy_location(ast.Name(id=targets[0].id, ctx=ast.Load()), stmt.target)
                    value = ast.copy_location(ast.BinOp(left=read, op=stmt.op, right=stmt.value), stmt)
                self.bind(targets[0].id, self.expr(value), stmt)
            elif isinstance(stmt, ast.Pass):
                continue
            else:
                raise self.unsupported(stmt)
        if result is None:
            raise self.error(fdef, f"`{self.role}` must end with a `return`", "missing return")
        if self.role in ("logits", "sink"):
            if result.type == BOOL:
                raise self.error(body[-1], f"`{self.role}` must return a number"
                                 + (", but this returns a bool (a condition belongs in a `mask` function)"
                                    if self.role == "logits" else " (a logit), but this returns a bool"), "bool result")
            if result.type == I32:
                result = ir.Cast(F32, result)
        elif result.type != BOOL:
            raise self.error(body[-1], f"`mask` must return a bool (a comparison), but this returns "
                             f"{'a float' if result.type == F32 else 'an int'}", "non-bool mask")
        program = ir.Program(self.lets, result)
        self.check_constants(program)
        return program

    def check_constants(self, program: ir.Program):
        """Every constant fits the type it lowered to (int32, float32): beyond it the targets would disagree."""
        for root in program.exprs():
            for e in ir.walk(root):
                if isinstance(e, ir.Const) and e.type != BOOL:
                    why = out_of_range(e.value, e.type)
                    if why:
                        raise self.const_error(e, why)

    def const_error(self, c: ir.Const, why: str):
        line, col = c.at or (self.first_line, 0)
        return FivarSpecError(f"in `{self.role}`: constant {why}", variant=self.variant.name, filename=self.filename,
                              line=line, col=col, construct="constant out of range")

    def depth(self, e: ir.Expr) -> int:
        """How deep `e` nests, a local counting as deep as the expression it names. Without recursion: 2,000 terms
        of `and` (or a chained comparison) are flat in Python's syntax and a 2,000-deep tree here."""
        memo: dict[int, int] = {}
        stack = [(e, False)]
        while stack:
            x, ready = stack.pop()
            if isinstance(x, ir.Local):
                memo[id(x)] = self.let_depth.get(x.name, 1)
            elif ready:
                memo[id(x)] = 1 + max((memo[id(c)] for c in x.children()), default=0)
            else:
                stack.append((x, True))
                stack.extend((c, False) for c in x.children() if id(c) not in memo)
        return memo[id(e)]

    def check_depth(self, value: ir.Expr, node):
        d = self.depth(value)
        if d > MAX_DEPTH:
            raise self.too_deep(node, f"{d} levels, counting the locals it reads")
        return d

    def too_deep(self, node, how: str):
        return self.error(node, f"expression nests deeper than {MAX_DEPTH} levels ({how}); split it into local "
                          "assignments of a few terms each", "expression too deep")

    def bind(self, name: str, value: ir.Expr, node):
        if self.env.get(name) is _PARAMS or isinstance(self.env.get(name), (ir.Score, ir.Index)):
            raise self.error(node, f"cannot assign to argument `{name}`", "argument reassignment")
        if value is _PARAMS:
            raise self.error(node, "`params` itself cannot be assigned; use params.NAME", "params alias")
        cname, n = name, 2  # a reassigned name is a new local (the targets spell it as their own identifier)
        while cname in self.let_names:
            cname, n = f"{name}_{n}", n + 1
        self.let_depth[cname] = self.check_depth(value, node)
        self.let_names.add(cname)
        self.lets.append((cname, value))
        self.let_values[cname] = constants.value(value, self.let_values)
        self.env[name] = ir.Local(value.type, cname)

    # --- expressions ---------------------------------------------------------------------------
    def expr(self, node: ast.AST) -> ir.Expr:
        method = getattr(self, "expr_" + type(node).__name__, None)
        if method is None:
            raise self.unsupported(node)
        if self.nesting >= MAX_DEPTH:
            raise self.too_deep(node, "of calls, operators or parentheses")
        self.nesting += 1
        try:
            out = method(node)
        finally:
            self.nesting -= 1
        if out is _PARAMS:
            raise self.error(node, "`params` must be used as params.NAME", "bare params")
        return out

    def expr_Constant(self, node):
        if isinstance(node.value, float) and math.isinf(node.value):  # only a literal past float64 parses as inf
            raise self.const_error(ir.Const(F32, node.value, self.location(node)), "literal is past float64's "
                                   "range (Python reads it as inf), far outside the kernels' 32-bit floats; for an "
                                   "infinity, name one outside the function (INF = float('inf'))")
        c = self.const(node.value, node)
        if c is None:
            raise self.unsupported(node, f"constant {node.value!r}")
        return c

    def const(self, v, node) -> ir.Const | None:
        """The constant for a Python number (None if `v` is none), remembering where it was written."""
        at = self.location(node)
        if isinstance(v, bool):
            return ir.Const(BOOL, v, at)
        if isinstance(v, int):
            return ir.Const(I32, v, at)
        if isinstance(v, float):
            return ir.Const(F32, v, at)
        return None

    def expr_Name(self, node):
        if node.id in self.env:
            return self.env[node.id]
        g = self.lookup_global(node.id, node)
        c = self.const(g, node) if isinstance(g, (int, float)) else None
        if c is not None:
            return c
        raise self.error(node, f"`{node.id}` is a {type(g).__name__}; only numbers can be used from "
                         "outside the function", "non-numeric global", ALLOWED)

    def lookup_global(self, name: str, node):
        fn = self.fn
        if fn.__closure__:
            for var, cell in zip(fn.__code__.co_freevars, fn.__closure__):
                if var == name:
                    return cell.cell_contents
        if name in fn.__globals__:
            return fn.__globals__[name]
        if hasattr(builtins, name):
            return getattr(builtins, name)
        raise self.error(node, f"name `{name}` is not defined", "undefined name", self.allowed_names())

    def allowed_names(self) -> str:
        args = [n for n, e in self.env.items() if not isinstance(e, ir.Local)]
        local = [n for n, e in self.env.items() if isinstance(e, ir.Local)]
        return (f"the arguments ({', '.join(args)}), locals assigned above ({', '.join(local) or 'none yet'}), "
                "numbers defined outside the function, and the functions "
                f"{' '.join(dict.fromkeys([*lang.FUNCTIONS, 'abs', 'min', 'max', 'float', 'int']))}")

    def unknown_param(self, node, name: str):
        """`params.NAME` of a name not declared (read or indexed): the declared names, the closest first."""
        close = difflib.get_close_matches(name, list(self.variant.params), n=1)
        known = ", ".join(self.variant.params) or "none declared"
        hint = f"did you mean `{close[0]}`? " if close else ""
        return self.error(node, f"unknown parameter `{name}` ({hint}declared: {known})", "unknown parameter")

    def expr_Attribute(self, node):
        base = node.value
        if isinstance(base, ast.Name) and self.env.get(base.id) is _PARAMS:
            p = self.variant.params.get(node.attr)
            if p is None:
                raise self.unknown_param(node, node.attr)
            if isinstance(p, Tensor):
                raise self.error(node, f"tensor parameter `{node.attr}` must be indexed, e.g. "
                                 f"params.{node.attr}[{', '.join(p.dims)}]", "unindexed tensor")
            return ir.ScalarParam(p.ir_type, node.attr)
        raise self.unsupported(node, "attribute access other than params.NAME")

    def expr_Subscript(self, node):
        base = node.value
        if not (isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
                and self.env.get(base.value.id) is _PARAMS):
            raise self.unsupported(node, "indexing anything but a tensor parameter")
        p = self.variant.params.get(base.attr)
        if p is None:
            raise self.unknown_param(base, base.attr)
        if not isinstance(p, Tensor):
            raise self.error(node, f"`{base.attr}` is not a tensor parameter, it cannot be indexed",
                             "indexing a scalar")
        sl = node.slice
        items = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        if any(isinstance(i, ast.Slice) for i in items):
            raise self.unsupported(node, "slicing")
        if len(items) != p.ndim:
            raise self.error(node, f"params.{base.attr} has {p.ndim} dimension(s) {p.dims}, "
                             f"indexed with {len(items)}", "wrong index count")
        idx = []
        for item in items:
            e = self.expr(item)
            if e.type != I32:
                raise self.error(item, f"index into params.{base.attr} must be an int, got "
                                 f"{'a float' if e.type == F32 else 'a bool'} (use int(...))",
                                 "non-int index")
            idx.append(e)
        return ir.Load(p.ir_type, base.attr, tuple(idx))

    def expr_BinOp(self, node):
        if isinstance(node.op, ast.Pow):
            return self.power(node, self.expr(node.left), self.expr(node.right))
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise self.unsupported(node.op if hasattr(node.op, "lineno") else node, _node_name(node.op))
        a, b = self.expr(node.left), self.expr(node.right)
        for x, n in ((a, node.left), (b, node.right)):
            if x.type == BOOL:
                raise self.error(n, "arithmetic on a bool; use `a if cond else b` to turn a condition "
                                 "into a number", "bool arithmetic")
        if op == "div" or a.type == F32 or b.type == F32:
            if op in ("div", "floordiv", "mod") and self.zero(b):  # written in the spec: Python would raise here
                raise self.error(node.right, f"`{ast.unparse(node)}`: `{_SYMBOLS[op]}` by zero", "division by zero")
            return ir.Binary(F32, op, self.to_f32(a), self.to_f32(b))
        self.check_int_arithmetic(op, a, b, node)
        if op in ("floordiv", "mod"):
            return ir.Binary(I32, op, a, self.integer_divisor(b, node), where=self.where(node))
        return ir.Binary(I32, op, a, b)

    def check_int_arithmetic(self, op: str, a: ir.Expr, b: ir.Expr, node) -> None:
        """Integer arithmetic on constants alone past int32 (`65536 * 65536`) is refused where it is written, as a
        literal that large is: an int is int32 in every target and the reference, where it would wrap (to 0 here)."""
        x = constants.value(a, self.let_values)
        y = None if x is None else constants.value(b, self.let_values)
        if y is None or (y == 0 and op in ("floordiv", "mod")):
            return
        why = out_of_range(constants.OPS[op](x, y), I32)
        if why:
            raise self.error(node, f"`{ast.unparse(node)}` = {why}", "constant out of range")

    def power(self, node, x: ir.Expr, y: ir.Expr) -> ir.Expr:
        for v, n in ((x, node.left), (y, node.right)):
            if v.type == BOOL:
                raise self.error(n, "`**` on a bool; use `a if cond else b` to turn a condition into a number",
                                 "bool arithmetic")
        if isinstance(x, ir.Const) and isinstance(y, ir.Const):  # folded as Python would, then range-checked
            return self.folded_power(node, x, y)
        if x.type == I32 and y.type == I32 and not (isinstance(y, ir.Const) and abs(y.value) <= power.PRODUCT_MAX):
            raise self.error(node, f"`{ast.unparse(node)}`: an int to an int power known only at run time has no "
                             "exact form here; write float(...) ** ... for a float power, or a literal exponent",
                             "int power")
        return power.lower(x, y, self.to_f32)

    def folded_power(self, node, x: ir.Const, y: ir.Const) -> ir.Const:
        at = self.location(node)
        if x.type == I32 and y.type == I32 and y.value >= 0:
            # past 64 bits it is out of int32's range whatever it is: no need to compute a huge int
            value = x.value ** y.value if abs(x.value) < 2 or y.value < 64 else 2 ** 64
            why = out_of_range(value, I32)  # as a literal that large is: an int here is int32 in every target
            if why:
                raise self.const_error(ir.Const(I32, value, at), f"`{ast.unparse(node)}` = {why}")
            return ir.Const(I32, value, at)
        try:
            value = float(x.value) ** float(y.value)
        except OverflowError:
            value = math.inf
        except ZeroDivisionError:
            raise self.error(node, f"`{ast.unparse(node)}`: 0 to a negative power", "division by zero") from None
        if isinstance(value, complex):
            raise self.error(node, f"`{ast.unparse(node)}` is not a real number", "complex power")
        if math.isinf(value):
            raise self.const_error(ir.Const(F32, value, at), f"`{ast.unparse(node)}` is past float64's range, far "
                                   "outside the kernels' 32-bit floats")
        return ir.Const(F32, value, at)

    def where(self, node) -> str:
        line, col = self.location(node)
        return f"{self.filename}:{line}:{col + 1}: variant '{self.variant.name}': `{ast.unparse(node)}`"

    def integer_divisor(self, b: ir.Expr, node) -> ir.Expr:
        """A literal zero is refused here, an unguarded Scalar divisor on every call (`divisor_scalars`: under a
        condition, `q_idx % params.w if params.w > 0 else 0`, a 0 can be what the spec means); any other divisor
        is the spec's promise, which the reference checks where the result is used (fivar.codegen.torch_ref)."""
        value = self.resolved(b)
        if self.zero(b):
            raise self.error(node.right, f"integer `{'//' if isinstance(node.op, ast.FloorDiv) else '%'}` by zero",
                             "division by zero")
        if isinstance(value, ir.ScalarParam) and not self.guards:
            if self.variant.params[value.name].default == 0:
                raise self.error(node.right, f"params.{value.name} divides (`{ast.unparse(node)}`) but its "
                                 "default is 0 (under a condition that excludes 0 it may be)", "division by zero")
            self.divisor_scalars.setdefault(value.name, self.where(node))
        return b

    def resolved(self, b: ir.Expr) -> ir.Expr:
        """`b`, or the expression a local `b` holds (through locals holding locals)."""
        while isinstance(b, ir.Local):
            b = next(v for n, v in reversed(self.lets) if n == b.name)
        return b

    def zero(self, b: ir.Expr) -> bool:
        """Whether divisor `b` is a zero written in the spec: a literal, a module constant, a local holding one, or
        arithmetic on those (`3 - 3`, `W // 8` with W = 4), which the parser keeps as written."""
        return constants.value(b, self.let_values) == 0

    def expr_UnaryOp(self, node):
        x = self.expr(node.operand)
        if isinstance(node.op, ast.Not):
            if x.type != BOOL:
                raise self.error(node, "`not` needs a bool operand", "not on a number")
            return ir.Unary(BOOL, "not", x)
        if isinstance(node.op, ast.USub):
            if x.type == BOOL:
                raise self.error(node, "cannot negate a bool", "bool arithmetic")
            if isinstance(x, ir.Const):
                return dataclasses.replace(x, value=-x.value)
            return ir.Unary(x.type, "neg", x)
        if isinstance(node.op, ast.UAdd):
            return x
        raise self.unsupported(node, _node_name(node.op))

    def expr_BoolOp(self, node):
        op = "and" if isinstance(node.op, ast.And) else "or"
        vals = [self.expr(node.values[0])] + [self.guarded(v) for v in node.values[1:]]
        for v, n in zip(vals, node.values):
            if v.type != BOOL:
                raise self.error(n, f"`{op}` needs bool operands (comparisons), got a number",
                                 f"`{op}` on a number")
        out = vals[0]
        for v in vals[1:]:
            out = ir.Binary(BOOL, op, out, v)
        return out

    def expr_Compare(self, node):
        out, left = None, self.expr(node.left)
        for op_node, right_node in zip(node.ops, node.comparators):
            op = _CMPOPS.get(type(op_node))
            if op is None:
                raise self.unsupported(node, _node_name(op_node))
            right = self.expr(right_node)
            if (left.type == BOOL) != (right.type == BOOL) or (left.type == BOOL and op not in ("eq", "ne")):
                raise self.error(node, "cannot compare a bool with a number", "bool comparison")
            a, b = self.promote(left, right)
            cmp = ir.Binary(BOOL, op, a, b)
            out = cmp if out is None else ir.Binary(BOOL, "and", out, cmp)
            left = right
        return out

    def expr_IfExp(self, node):
        return self.select(node, self.expr(node.test), self.guarded(node.body), self.guarded(node.orelse))

    def guarded(self, node) -> ir.Expr:
        self.guards += 1
        try:
            return self.expr(node)
        finally:
            self.guards -= 1

    def select(self, node, cond, a, b):
        if cond.type != BOOL:
            raise self.error(node, "the condition of `a if cond else b` / where() must be a bool",
                             "non-bool condition")
        if (a.type == BOOL) != (b.type == BOOL):
            raise self.error(node, "both branches must be numbers, or both bools", "mixed branches")
        a, b = self.promote(a, b)
        return ir.Select(a.type, cond, a, b)

    def expr_Call(self, node):
        if node.keywords:
            raise self.unsupported(node, "keyword arguments in a call")
        name = self.resolve_function(node.func)
        args = [self.expr(a) if i == 0 or name != "where" else self.guarded(a) for i, a in enumerate(node.args)]
        arity = {"float": 1, "int": 1, **{k: v[0] for k, v in lang.FUNCTIONS.items()}}[name]
        if len(args) != arity:
            raise self.error(node, f"{name}() takes {arity} argument(s), got {len(args)}", "arity")
        if name == "where":
            return self.select(node, *args)
        if name in ("float", "int"):
            x = args[0]
            if name == "int" and isinstance(c := constants.value(x, self.let_values), float) and not math.isfinite(c):
                raise self.error(node, f"`{ast.unparse(node)}`: int() of {c} (no integer; kernels and reference "
                                 "would each pick their own)", "non-finite int")
            want = F32 if name == "float" else I32
            return x if x.type == want else ir.Cast(want, x)
        for a, n in zip(args, node.args):
            if a.type == BOOL:
                raise self.error(n, f"{name}() needs a number, got a bool", "bool argument")
        if name in ir.UNARY_FLOAT_FUNCS:
            return ir.Call(F32, name, (self.to_f32(args[0]),))
        if name == "abs":
            return ir.Call(args[0].type, "abs", (args[0],))
        if name == "clamp":
            x, lo, hi = args
            x, lo = self.promote(x, lo)
            inner = ir.Call(x.type, "maximum", (x, lo))
            inner, hi = self.promote(inner, hi)
            return ir.Call(inner.type, "minimum", (inner, hi))
        a, b = self.promote(*args)
        return ir.Call(a.type, name, (a, b))

    def resolve_function(self, func: ast.AST) -> str:
        if isinstance(func, ast.Name):
            if func.id in self.env:  # Python would call the argument or local, which holds a number
                raise self.error(func, f"`{func.id}` is an argument or local of `{self.role}` here, not a function; "
                                 "rename it", "call of a number", ALLOWED)
            obj = self.lookup_global(func.id, func)
            for fname in lang.FUNCTIONS:
                if obj is getattr(lang, fname):
                    return fname
            if obj is getattr(builtins, func.id, None) and func.id in _BUILTIN_FUNCS:
                return _BUILTIN_FUNCS[func.id]
            raise self.error(func, f"`{func.id}` is not a function fivar can compile", "unknown function",
                             ALLOWED)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id in self.env:
                raise self.error(func, f"`{func.value.id}` is an argument or local of `{self.role}` here, not a "
                                 "module; rename it", "call of a number", ALLOWED)
            mod = self.lookup_global(func.value.id, func)
            modname = getattr(mod, "__name__", "")
            if modname in ("fivar", "fivar.lang") and func.attr in lang.FUNCTIONS:
                return func.attr
            table = _MODULE_FUNCS.get(modname, {})
            if func.attr in table:
                return table[func.attr]
            raise self.error(func, f"`{func.value.id}.{func.attr}` is not a function fivar can compile",
                             "unknown function", ALLOWED)
        raise self.unsupported(func, "this kind of call")

    # --- typing helpers ------------------------------------------------------------------------
    def to_f32(self, x: ir.Expr) -> ir.Expr:
        if x.type == F32:
            return x
        if isinstance(x, ir.Const):
            why = out_of_range(x.value, F32)
            if why:
                raise self.const_error(x, why)
            return ir.Const(F32, float(x.value), x.at)
        return ir.Cast(F32, x)

    def promote(self, a: ir.Expr, b: ir.Expr):
        if a.type in NUMERIC and b.type in NUMERIC and a.type != b.type:
            return self.to_f32(a), self.to_f32(b)
        return a, b


class _ParamsMarker:
    """Stands for the `params` argument while parsing; only `params.NAME` may be used."""


_PARAMS = _ParamsMarker()
