"""A small typed expression IR for attention variants.

A variant function becomes a `Program`: named let-bindings followed by one result expression. Every node
carries its type (`F32`, `I32` or `BOOL`), fixed by the parser, so the emitters never have to guess.
Code generators (CUDA, Triton, torch) walk the same tree; `rewrite` is the one traversal they share.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

F32, I32, BOOL = "f32", "i32", "bool"
NUMERIC = (F32, I32)

#: The index arguments of `logits`/`mask`, in signature order after `score`.
INDEX_VARS = ("batch", "qo_head", "kv_head", "q_idx", "kv_idx")

BINARY_OPS = ("add", "sub", "mul", "div", "floordiv", "mod")
COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGICAL_OPS = ("and", "or")
UNARY_FLOAT_FUNCS = ("tanh", "exp", "exp2", "log", "sigmoid", "sqrt", "floor")
NUMERIC_FUNCS = ("abs", "minimum", "maximum")


@dataclass(frozen=True)
class Expr:
    type: str

    def children(self) -> tuple["Expr", ...]:
        return ()


@dataclass(frozen=True)
class Const(Expr):
    value: float | int | bool
    #: (line, col) of the literal or name it came from, for the parser's range check
    at: tuple = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Score(Expr):
    """q.k multiplied by sm_scale (what the user's `score` argument is)."""


@dataclass(frozen=True)
class RawScore(Expr):
    """Plain q.k, before sm_scale. Only the optimizer introduces it."""


@dataclass(frozen=True)
class Index(Expr):
    name: str  # one of INDEX_VARS


@dataclass(frozen=True)
class ScalarParam(Expr):
    name: str


@dataclass(frozen=True)
class Hoisted(Expr):
    """A loop-invariant value computed once per thread block (in the variant's constructor)."""
    name: str


@dataclass(frozen=True)
class Local(Expr):
    name: str


@dataclass(frozen=True)
class Load(Expr):
    param: str
    indices: tuple[Expr, ...]

    def children(self):
        return self.indices


@dataclass(frozen=True)
class Unary(Expr):
    op: str  # "neg" | "not"
    x: Expr

    def children(self):
        return (self.x,)


@dataclass(frozen=True)
class Binary(Expr):
    op: str  # BINARY_OPS, COMPARE_OPS or LOGICAL_OPS
    a: Expr
    b: Expr
    # integer // and %: "file:line:col: variant 'name': `source`", for the reference's division-by-zero error
    where: str = field(default="", compare=False, repr=False)

    def children(self):
        return (self.a, self.b)


@dataclass(frozen=True)
class Select(Expr):
    cond: Expr
    a: Expr
    b: Expr

    def children(self):
        return (self.cond, self.a, self.b)


@dataclass(frozen=True)
class Call(Expr):
    fn: str  # UNARY_FLOAT_FUNCS or NUMERIC_FUNCS
    args: tuple[Expr, ...]

    def children(self):
        return self.args


@dataclass(frozen=True)
class Cast(Expr):
    x: Expr

    def children(self):
        return (self.x,)


@dataclass
class Program:
    """`lets` run in order, then `result` is the function's value."""
    lets: list[tuple[str, Expr]]
    result: Expr
    #: Hoisted name -> invariant expression (filled by the optimizer for targets that hoist).
    hoisted: dict[str, Expr] = field(default_factory=dict)

    def exprs(self) -> Iterator[Expr]:
        for _, e in self.lets:
            yield e
        yield self.result
        yield from self.hoisted.values()


def walk(e: Expr) -> Iterator[Expr]:
    yield e
    for c in e.children():
        yield from walk(c)


def rebuild(e: Expr, kids: tuple[Expr, ...]) -> Expr:
    if isinstance(e, Load):
        return replace(e, indices=kids)
    if isinstance(e, Unary):
        return replace(e, x=kids[0])
    if isinstance(e, Binary):
        return replace(e, a=kids[0], b=kids[1])
    if isinstance(e, Select):
        return replace(e, cond=kids[0], a=kids[1], b=kids[2])
    if isinstance(e, Call):
        return replace(e, args=kids)
    if isinstance(e, Cast):
        return replace(e, x=kids[0])
    return e


def substitute(e: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Top-down replacement: `fn(node)` first; a node it replaces is not visited further, `None` visits the
    node's children (and rebuilds it only where one changed)."""
    out = fn(e)
    if out is not None:
        return out
    kids = tuple(substitute(c, fn) for c in e.children())
    return rebuild(e, kids) if kids != e.children() else e


def rewrite(e: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Bottom-up rewrite: children first, then `fn(node)`; `None` keeps the node."""
    kids = tuple(rewrite(c, fn) for c in e.children())
    if kids != e.children():
        e = rebuild(e, kids)
    out = fn(e)
    return e if out is None else out


def uses(program: Program) -> set[str]:
    """What the program reads: 'score', index variables by name, params as 'params.NAME' (a param may be called
    `score` or `q_idx`)."""
    names: set[str] = set()
    for root in program.exprs():
        for e in walk(root):
            if isinstance(e, Index):
                names.add(e.name)
            elif isinstance(e, ScalarParam):
                names.add(f"params.{e.name}")
            elif isinstance(e, Load):
                names.add(f"params.{e.param}")
            elif isinstance(e, (Score, RawScore)):
                names.add("score")
    return names


def is_invariant(e: Expr) -> bool:
    """Depends only on scalar params and constants: the same for every element of a launch."""
    return all(isinstance(n, (Const, ScalarParam, Hoisted, Binary, Unary, Call, Cast, Select))
               for n in walk(e))


_SYM = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%", "lt": "<", "le": "<=",
        "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "and", "or": "or"}


def format_expr(e: Expr) -> str:
    """Python-like text of an expression, with every node's type made explicit where it matters."""
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Score):
        return "score"
    if isinstance(e, RawScore):
        return "qk"
    if isinstance(e, Index):
        return e.name
    if isinstance(e, ScalarParam):
        return f"params.{e.name}"
    if isinstance(e, (Hoisted, Local)):
        return e.name
    if isinstance(e, Load):
        return f"params.{e.param}[{', '.join(format_expr(i) for i in e.indices)}]"
    if isinstance(e, Unary):
        return f"(-{format_expr(e.x)})" if e.op == "neg" else f"(not {format_expr(e.x)})"
    if isinstance(e, Binary):
        return f"({format_expr(e.a)} {_SYM[e.op]} {format_expr(e.b)})"
    if isinstance(e, Select):
        return f"({format_expr(e.a)} if {format_expr(e.cond)} else {format_expr(e.b)})"
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(format_expr(a) for a in e.args)})"
    if isinstance(e, Cast):
        return f"{'float' if e.type == F32 else 'int'}({format_expr(e.x)})"
    return repr(e)


def format_program(p: Program, name: str) -> str:
    lines = [f"{name}:"]
    lines += [f"  {n}: {e.type} = {format_expr(e)}" for n, e in p.lets]
    lines.append(f"  return {format_expr(p.result)}  # {p.result.type}")
    return "\n".join(lines)
