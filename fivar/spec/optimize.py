"""IR passes for the compiled targets (FA2/FA3 structs, Triton).

The kernels hand the variant the *unscaled* q.k and apply their own `exp2(x * sm_scale_log2)`.
Users write against the scaled `score`; these passes turn that into what stock kernels do by hand:

* `fold_score_scale`: `score * a / b` becomes `raw * K` with `K = sm_scale * a / b` computed once.
* `hoist_invariants`: anything that depends only on scalar params moves out of the per-element code.
* `split_output_scale`: a final `c * f(...)` (c invariant) drops `c` into the softmax exponent scale,
  e.g. soft-capping becomes `tanh(raw * K)` with `sm_scale_log2 = log2(e) * cap`, the stock kernel's form.
  Signs the spec fixes (`-score`, `-2 * tanh(...)`) stay in the logits; the runtime checks that what remains
  is > 0 for the params of a launch (a non-positive factor would flip the softmax max).
* `positions.tabulate` (first): a logits term of only the head and kv_idx - q_idx becomes a per-call table read.
* `training=True` adds what the generated backward inlines (`Lowered.gradients`): the derivatives of the logits per
  element (fivar.spec.grad), their position-only terms tabulated like the logits' (values only: no gradient passes
  through a table; the learnable reads are those of the logits per element).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import grad, ir, positions
from .ir import F32
from .params import Scalar

SM_SCALE = ir.ScalarParam(F32, "sm_scale")


def _scaled_factor(e: ir.Expr) -> ir.Expr | None:
    """If `e == raw_score * K` with K invariant, return K."""
    if isinstance(e, ir.Score):
        return SM_SCALE
    if isinstance(e, ir.Unary) and e.op == "neg":
        k = _scaled_factor(e.x)
        return None if k is None else ir.Unary(F32, "neg", k)
    if isinstance(e, ir.Binary) and e.op in ("mul", "div"):
        ka = _scaled_factor(e.a)
        if ka is not None and ir.is_invariant(e.b):
            return ir.Binary(F32, e.op, ka, e.b)
        if e.op == "mul":
            kb = _scaled_factor(e.b)
            if kb is not None and ir.is_invariant(e.a):
                return ir.Binary(F32, "mul", e.a, kb)
    return None


def fold_score_scale(e: ir.Expr) -> ir.Expr:
    def folded(n: ir.Expr) -> ir.Expr | None:
        k = _scaled_factor(n)
        return None if k is None else ir.Binary(F32, "mul", ir.RawScore(F32), k)
    return ir.substitute(e, folded)


def _pull_sign(e: ir.Expr) -> tuple[bool, ir.Expr]:
    """(negative, e without it) for a product/quotient of invariants: its negations and negative constants
    taken out, so that `-score` or `-2 * tanh(score)` folds a positive factor and keeps the sign per element."""
    if isinstance(e, ir.Unary) and e.op == "neg":
        negative, x = _pull_sign(e.x)
        return not negative, x
    if isinstance(e, ir.Const) and e.type != ir.BOOL and e.value < 0:
        return True, ir.Const(e.type, -e.value)
    if isinstance(e, ir.Binary) and e.op in ("mul", "div"):
        neg_a, a = _pull_sign(e.a)
        neg_b, b = _pull_sign(e.b)
        if neg_a or neg_b:
            return neg_a != neg_b, ir.Binary(e.type, e.op, a, b)
    return False, e


def _is_zero(e: ir.Expr) -> bool:
    if isinstance(e, ir.Const):
        return e.value == 0
    return isinstance(e, ir.Binary) and e.op in ("mul", "div") and (_is_zero(e.a) or (e.op == "mul" and _is_zero(e.b)))


def split_output_scale(result: ir.Expr) -> tuple[ir.Expr, ir.Expr | None]:
    """(per-element logits, invariant factor) of `result`; the factor's sign stays in the logits where the
    spec fixes it, and a zero constant is not split (it is no softmax scale)."""
    if isinstance(result, ir.Binary) and result.op == "mul" and result.type == F32:
        for x, c in ((result.b, result.a), (result.a, result.b)):
            if ir.is_invariant(c) and not ir.is_invariant(x):
                negative, c = _pull_sign(c)
                if _is_zero(c):
                    break
                return (ir.Unary(x.type, "neg", x) if negative else x), c
    return result, None


class _Hoister:
    def __init__(self, prefix: str):
        self.prefix, self.table, self.names = prefix, {}, {}

    def __call__(self, e: ir.Expr) -> ir.Expr:
        return ir.substitute(e, self._hoisted)

    def _hoisted(self, e: ir.Expr) -> ir.Expr | None:
        """A name for `e` where it is an invariant worth hoisting (the largest such subtree)."""
        if not ir.is_invariant(e) or isinstance(e, (ir.Const, ir.ScalarParam, ir.Hoisted)):
            return None
        if e not in self.names:
            name = f"{self.prefix}{len(self.names)}"
            self.names[e] = name
            self.table[name] = e
        return ir.Hoisted(e.type, self.names[e])


@dataclass
class Lowered:
    """A variant ready for a compiled target: per-element programs plus per-block invariants."""
    logits: ir.Program | None
    mask: ir.Program | None
    hoisted: dict[str, ir.Expr]
    #: Invariant factor folded out of the logits (None: the softmax scale is plain log2(e)).
    output_scale: ir.Expr | None
    #: Position-only terms the logits read from per-call tables (fivar.spec.positions), and the params they add.
    position_tables: tuple = ()
    params: dict = field(default_factory=dict)
    #: training only: the logits per element (launch constants written out where tables stand in the logits),
    #: which the learnable reads and derivatives come from
    gradient_logits: ir.Program | None = None
    #: training only: (function name, program) of d logits / d q.k (`fv_dlogits_dqk`) and per learnable read
    #: (`fv_dlogits_dload<i>`), and those reads (`learnable_loads`), in that order
    gradients: tuple = ()
    learnable_loads: tuple = ()


def lower(variant_ir, softmax: bool, position_tables: str = "off", param_names=(), learnable=None) -> Lowered:
    """`position_tables`: LoweringConfig's mode; `param_names`: the variant's own, which synthesized params avoid;
    `learnable` (training): the params whose reads get gradients, {name: declaration}."""
    if learnable is not None:
        return _with_gradients(variant_ir, softmax, position_tables, param_names, learnable)
    hoister = _Hoister("h")
    output_scale = None
    programs = []
    # A mask-only variant still has logits: the scaled score (the kernels hand over the unscaled q.k).
    logits = variant_ir.logits or ir.Program([], ir.Score(F32))
    logits, tables, offset = positions.tabulate(logits, position_tables, param_names)
    for prog, is_logits in ((logits, True), (variant_ir.mask, False)):
        if prog is None:
            programs.append(None)
            continue
        lets = [(n, fold_score_scale(e)) for n, e in prog.lets]
        result = fold_score_scale(prog.result)
        if is_logits and softmax:
            result, output_scale = split_output_scale(result)
        lets = [(n, hoister(e)) for n, e in lets]
        programs.append(ir.Program(lets, hoister(result)))
    if output_scale is not None:
        output_scale = hoister(output_scale)
    return Lowered(programs[0], programs[1], hoister.table, output_scale, tables,
                   positions.synthesized_params(tables, offset))


def _with_gradients(variant_ir, softmax: bool, mode: str, param_names, learnable: dict) -> Lowered:
    """The lowering plus the backward's derivative programs (Lowered.gradients); the mask's costly terms of the
    distance tabulated too (the backward evaluates the mask per pair on every cut tile: a table read there, not a
    modulo)."""
    base = lower(variant_ir, softmax, mode, param_names)
    tables = list(base.position_tables)
    offset = next((n for n, p in base.params.items() if isinstance(p, Scalar)), None)
    taken = set(param_names) | set(base.params)

    def tabulated(program: ir.Program, types=(F32,)) -> ir.Program | None:
        nonlocal offset
        program, made, offset_made = positions.tabulate(program, mode, taken, offset=offset, types=types,
                                                        reuse=tuple(tables))
        if not made:
            return None
        offset = offset_made
        new = [t for t in made if t not in tables]
        taken.update([offset_made] + [t.name for t in new])
        tables.extend(new)
        return program

    # the derivatives need the params' own reads: the logits with each table read replaced by the term it holds
    logits = _untabulated(base.logits, base.position_tables)
    mask = base.mask
    if mask is not None:  # evaluated per pair at every cut tile of the backward (launch constants written out)
        mask = tabulated(_inline_program(mask, base.hoisted), (F32, ir.BOOL)) or mask
    loads = grad.learnable_loads(logits, learnable)
    programs = [("fv_dlogits_dqk", _derivative(logits, grad.WRT_QK))]
    programs += [(f"fv_dlogits_dload{i}", _derivative(logits, load)) for i, load in enumerate(loads)]
    if tables:  # the derivatives' own terms of the distance, tabulated beside the logits' (one offset for all)
        programs = [(name, tabulated(_inline_program(program, base.hoisted)) or program)
                    for name, program in programs]
    params = positions.synthesized_params(tuple(tables), offset)
    return Lowered(base.logits, mask, base.hoisted, base.output_scale, tuple(tables), params, logits,
                   tuple(programs), tuple(loads))


def _untabulated(program: ir.Program, tables) -> ir.Program:
    """`program` with each read of one of `tables` replaced by the term the table holds: the term's lets come
    first, renamed after their table (their values are those of the program's lets of the same name, but the
    lowering may have dropped or rewritten those)."""
    by_name = {t.name: t for t in tables}
    lets, terms = [], {}

    def term(t) -> ir.Expr:
        if t.name not in terms:
            names = {n: f"{t.name}_{n}" for n, _ in t.term.lets}
            lets.extend((names[n], _renamed(e, names)) for n, e in t.term.lets)
            terms[t.name] = _renamed(t.term.result, names)
        return terms[t.name]

    def sub(e: ir.Expr) -> ir.Expr:
        return ir.substitute(e, lambda n: term(by_name[n.param]) if isinstance(n, ir.Load) and n.param in by_name
                             else None)
    body = [(n, sub(e)) for n, e in program.lets]
    result = sub(program.result)
    return ir.Program(lets + body, result, program.hoisted)


def _renamed(e: ir.Expr, names: dict) -> ir.Expr:
    return ir.substitute(e, lambda n: ir.Local(n.type, names[n.name]) if isinstance(n, ir.Local) and n.name in names
                         else None)


def _inline_program(program: ir.Program, hoisted: dict) -> ir.Program:
    """`program` with launch constants written out: a table's term is evaluated outside the kernels."""
    return ir.Program([(n, _inline(e, hoisted)) for n, e in program.lets], _inline(program.result, hoisted))


def _derivative(program: ir.Program, wrt) -> ir.Program:
    """grad.derivative with only the lets the derivative uses (a let it does not need may hold a gather)."""
    d = grad.derivative(program, wrt)
    return ir.Program(needed_lets(d.lets, [d.result]), d.result, d.hoisted)


def needed_lets(lets: list[tuple[str, ir.Expr]], roots) -> list[tuple[str, ir.Expr]]:
    """The lets `roots` use, directly or through other lets (an index's lets never need the score)."""
    need = {n.name for r in roots for n in ir.walk(r) if isinstance(n, ir.Local)}
    kept = []
    for name, e in reversed(lets):
        if name in need:
            kept.append((name, e))
            need |= {n.name for n in ir.walk(e) if isinstance(n, ir.Local)}
    return kept[::-1]


def _inline(e: ir.Expr, hoisted: dict) -> ir.Expr:
    """`e` with each hoisted name replaced by the expression it stands for."""
    return ir.substitute(e, lambda n: _inline(hoisted[n.name], hoisted) if isinstance(n, ir.Hoisted) else None)
