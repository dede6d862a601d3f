"""Position-only logits terms become per-call tables (an IR pass of the compiled targets).

A term that reads only the head and the distance `kv_idx - q_idx` (T5's log buckets, a learned relative table, any
function of the distance) has at most heads x (2 * max_len - 1) distinct values, while the kernels evaluate it for
every (query, key) pair. `tabulate` replaces each maximal such term that is costly enough (LoweringConfig's
`position_tables`) by a read of a float32 table fivar synthesizes, `TABLE[qo_head, (kv_idx - q_idx) + OFFSET]`
(padded by TABLE_PAD distances, so the CUDA structs read it unclamped); the runtime evaluates the original term once
per call, or per plan, over every head and distance with the torch evaluator (fivar.runtime.position_tables) and
passes the table like any tensor param. The reference never runs this pass: it evaluates the user's expression,
which is what checks the tables.

The distance is recognised syntactically, after the lets it goes through are followed: every read of `q_idx` and
`kv_idx` in the term must be one side of `kv_idx - q_idx` or `q_idx - kv_idx` (so `clamp(q_idx - kv_idx, 0, r)` and
`float(kv_idx - q_idx)` qualify, `q_idx // 64` does not).
"""
from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace as _replace

from . import ir
from .ir import BOOL, F32, I32
from .params import Scalar, Tensor

TABLE_PREFIX, OFFSET_NAME = "fv_pos_table", "fv_pos_offset"
#: Distances each table holds past the call's own on either side: the kernels evaluate the term on their tiles'
#: padding rows and keys too (at most one tile past a run), and the CUDA structs read the table unclamped.
TABLE_PAD = 512


def is_table(param: str) -> bool:
    """A param `tabulate` synthesized: a table sized so that every distance a kernel reads is inside it."""
    return param.startswith(TABLE_PREFIX)


def table_offset(length: int) -> int:
    """The column of distance 0 in a table for runs of up to `length` (fivar.runtime.position_tables)."""
    return length - 1 + TABLE_PAD


def table_offset_param(load: ir.Load) -> ir.ScalarParam:
    """The offset scalar a table read adds to the distance (its column index is `distance_index`'s form): the
    column of distance 0, so that twice it is the table's last column."""
    column = load.indices[-1]
    assert isinstance(column, ir.Binary) and column.op == "add" and isinstance(column.b, ir.ScalarParam), column
    return column.b


HEADS = ("qo_head", "kv_head")
COSTLY_FUNCS = ("tanh", "exp", "exp2", "log", "sigmoid", "sqrt", "floor")


@dataclass(frozen=True)
class PositionTable:
    """One synthesized table: its param name, the term it holds (a program: the lets it needs, then the term) and
    whether it varies by head (else it has one row)."""
    name: str
    term: ir.Program
    per_head: bool


def is_distance(e: ir.Expr) -> bool:
    """`kv_idx - q_idx` or `q_idx - kv_idx`."""
    return (isinstance(e, ir.Binary) and e.op == "sub" and isinstance(e.a, ir.Index) and isinstance(e.b, ir.Index)
            and {e.a.name, e.b.name} == {"kv_idx", "q_idx"})


class Analysis:
    """Per-node facts, following Locals into the let they name (memoised per let, so shared lets cost once)."""

    def __init__(self, lets: dict[str, ir.Expr]):
        self.lets = lets
        self._memo: dict[tuple[str, str], object] = {}

    def _local(self, kind: str, name: str, fn):
        key = (kind, name)
        if key not in self._memo:
            self._memo[key] = fn(self.lets[name])
        return self._memo[key]

    def position_only(self, e: ir.Expr) -> bool:
        if is_distance(e):
            return True
        if isinstance(e, ir.Index):
            return e.name in HEADS
        if isinstance(e, (ir.Score, ir.RawScore)):
            return False
        if isinstance(e, ir.ScalarParam) and e.name == "sm_scale":  # a call's, not the table's (tables are per plan)
            return False
        if isinstance(e, ir.Local):
            return self._local("pos", e.name, self.position_only)
        return all(self.position_only(c) for c in e.children())

    def reads_distance(self, e: ir.Expr) -> bool:
        if is_distance(e):
            return True
        if isinstance(e, ir.Local):
            return self._local("dist", e.name, self.reads_distance)
        return any(self.reads_distance(c) for c in e.children())

    def reads_head(self, e: ir.Expr) -> bool:
        if isinstance(e, ir.Index):
            return e.name in HEADS
        if isinstance(e, ir.Local):
            return self._local("head", e.name, self.reads_head)
        return any(self.reads_head(c) for c in e.children())

    def costly(self, e: ir.Expr) -> bool:
        """A transcendental, a floor or float->int conversion, a float division by a variable, an integer // or %,
        or a gather whose index is costly or itself gathered: what a table read beats (a division is a reciprocal
        on the same unit as the softmax's exponential, and its refinement)."""
        if isinstance(e, ir.Call) and e.fn in COSTLY_FUNCS:
            return True
        if isinstance(e, ir.Binary) and e.op == "div" and e.type == F32 and not isinstance(e.b, ir.Const):
            return True
        if isinstance(e, ir.Cast) and e.type == I32 and e.x.type == F32:
            return True
        if isinstance(e, ir.Binary) and e.op in ("floordiv", "mod"):
            return True
        if isinstance(e, ir.Load) and any(self.gathers(i) for i in e.indices):
            return True
        if isinstance(e, ir.Local):
            return self._local("cost", e.name, self.costly)
        return any(self.costly(c) for c in e.children())

    def divides_by_distance(self, e: ir.Expr) -> bool:
        """An integer // or % whose divisor reads the distance: the table evaluates every distance, 0 too, while
        the kernels evaluate it only where the user's `or`/`where` guards it."""
        if isinstance(e, ir.Binary) and e.op in ("floordiv", "mod") and self.reads_distance(e.b):
            return True
        if isinstance(e, ir.Local):
            return self._local("div", e.name, self.divides_by_distance)
        return any(self.divides_by_distance(c) for c in e.children())

    def gathers(self, e: ir.Expr) -> bool:
        if isinstance(e, ir.Load):
            return True
        if isinstance(e, ir.Local):
            return self._local("gather", e.name, self.gathers)
        return any(self.gathers(c) for c in e.children())

    def needed_lets(self, e: ir.Expr, order: list[str]) -> list[str]:
        """The lets `e` reads, directly or through other lets, in program order."""
        seen: set[str] = set()
        stack = [e]
        while stack:
            for n in ir.walk(stack.pop()):
                if isinstance(n, ir.Local) and n.name not in seen:
                    seen.add(n.name)
                    stack.append(self.lets[n.name])
        return [n for n in order if n in seen]


def tabulable(e: ir.Expr, analysis: Analysis, mode: str, types=(F32,)) -> bool:
    """Whether `e` is a term to replace by a table read under `mode` ("costly", "all" or "off"); `types`: the terms'
    types that may be (a mask's booleans are held as 1.0 and 0.0)."""
    if mode == "off" or e.type not in types or isinstance(e, (ir.Const, ir.ScalarParam)):
        return False
    if isinstance(e, ir.Cast) and is_distance(e.x):  # float(kv_idx - q_idx): a subtraction beats any read
        return False
    if not (analysis.position_only(e) and analysis.reads_distance(e)) or analysis.divides_by_distance(e):
        return False
    return mode == "all" or analysis.costly(e)


def distance_index(offset: str = OFFSET_NAME) -> ir.Expr:
    """The table column of the pair's distance: (kv_idx - q_idx) + offset."""
    dist = ir.Binary(I32, "sub", ir.Index(I32, "kv_idx"), ir.Index(I32, "q_idx"))
    return ir.Binary(I32, "add", dist, ir.ScalarParam(I32, offset))


def _fresh(prefix: str, taken: set[str]) -> str:
    i = 0
    while f"{prefix}{i}" in taken:
        i += 1
    return f"{prefix}{i}"


def tabulate(program: ir.Program | None, mode: str, taken=(), offset: str | None = None, types=(F32,), reuse=()
             ) -> tuple[ir.Program | None, tuple[PositionTable, ...], str | None]:
    """(program with its maximal tabulable terms replaced, the tables it reads, the offset param's name or None).
    `taken`: the param names the synthesized ones avoid (the variant's own); `offset`: an offset param already made
    (the backward's derivative tables share the logits'); `types`: tabulable's (BOOL too for a mask: the table holds
    1.0 where the term is true, read back as `!= 0`); `reuse`: tables already made, read again where a term is one
    of theirs."""
    if program is None or mode == "off":
        return program, (), None
    taken = set(taken)
    if offset is None:
        offset = OFFSET_NAME if OFFSET_NAME not in taken else _fresh(OFFSET_NAME, taken)
    taken.add(offset)
    order = [n for n, _ in program.lets]
    analysis = Analysis(dict(program.lets))
    tables: dict[ir.Expr, PositionTable] = {}

    def read(e: ir.Expr) -> ir.Expr | None:
        """A read of the table holding `e`, where `e` is a term to tabulate."""
        if tabulable(e, analysis, mode, types):
            if e not in tables:
                lets = [(n, analysis.lets[n]) for n in analysis.needed_lets(e, order)]
                made = PositionTable("", ir.Program(lets, e), analysis.reads_head(e))
                same = [t for t in reuse if (t.term, t.per_head) == (made.term, made.per_head)]
                name = same[0].name if same else _fresh(TABLE_PREFIX, taken)
                taken.add(name)
                tables[e] = _replace(made, name=name)
            t = tables[e]
            head = ir.Index(I32, "qo_head") if t.per_head else ir.Const(I32, 0)
            value = ir.Load(F32, t.name, (head, distance_index(offset)))
            return value if e.type == F32 else ir.Binary(BOOL, "ne", value, ir.Const(F32, 0.0))
        return None

    def replace(e: ir.Expr) -> ir.Expr:
        return ir.substitute(e, read)

    # from the result back: a let only a table's term read is dropped, not rewritten (no table of its own)
    result = replace(program.result)
    live = _locals(result)
    lets = []
    for name, e in reversed(program.lets):
        if name in live:
            e = replace(e)
            lets.append((name, e))
            live |= _locals(e)
    if not tables:
        return program, (), None
    return ir.Program(lets[::-1], result), tuple(tables.values()), offset


def has_position_term(program: ir.Program | None) -> bool:
    """Whether a term of `program` reads only the head and `kv_idx - q_idx` (one `tabulate` would table in "all"
    mode: ALiBi's slope times the distance, a learned table at the distance, T5's buckets)."""
    return bool(tabulate(program, "all")[1])


def _locals(e: ir.Expr) -> set[str]:
    return {n.name for n in ir.walk(e) if isinstance(n, ir.Local)}


def synthesized_params(tables: tuple[PositionTable, ...], offset: str | None) -> dict[str, Scalar | Tensor]:
    """Declarations of the tables and the offset, as the code generators read a variant's params."""
    if not tables:
        return {}
    decls: dict[str, Scalar | Tensor] = {t.name: Tensor("float32", ("qo_head" if t.per_head else "one", "distance"),
                                                       where={"filename": "<fivar>", "line": 0}) for t in tables}
    decls[offset] = Scalar(int, where={"filename": "<fivar>", "line": 0})
    return decls
