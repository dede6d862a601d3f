"""IR -> Triton backward: the variant's training module, the forward twin plus FlashAttention-2 backward kernels.

The backward kernels inline the same lowered programs as the forward (through the same `TritonEmitter`), plus
the training lowering's derivatives (fivar.spec.optimize with fivar.spec.grad): `fv_dlogits_dqk` (d logits /
d unscaled q.k) and, per read of a learnable tensor parameter, `fv_dlogits_dload<i>` with `fv_grad_offset<i>`, the
clamped element the read came from, where its gradient is scattered. The module is the forward module's text followed by the
backward's, so both share the variant functions and helpers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import override
from ..spec import ir, positions
from ..spec.ir import I32
from ..spec.optimize import needed_lets
from .fa2 import render
from .cuda import size_ident
from .triton import TritonEmitter, read_without, render_attention


@dataclass(frozen=True)
class _GradOffset(ir.Expr):
    """Where a tensor-parameter read lands: its clamped element offset (only the backward emits this)."""
    load: ir.Load = None


@dataclass(frozen=True)
class _TileElement(ir.Expr):
    """For a read indexed by both q_idx and kv_idx: the one element the whole tile reads when its clamped index
    cannot vary over the tile's query and key ranges (a relative offset clamped far from the diagonal), else -1."""
    load: ir.Load = None


@dataclass
class LearnableRead:
    """One read of a learnable tensor parameter in the logits: how the backward accumulates its gradient."""
    index: int
    param: str
    #: "program": the same element for the whole program (per head, say) -- one sum, one atomic add;
    #: "row": one element per query row -- summed over the keys, one atomic add per row;
    #: "element": any element per (query, key) -- atomic adds per tile (one when the tile maps to one element).
    kind: str
    text: str
    #: element reads: whether `fv_grad_tile<index>` tells a tile that reads one element from its index ranges
    #: (else the kernel finds that out by reducing the tile's offsets)
    tile_test: bool = False
    #: element reads of the head and `kv_idx - q_idx` only (a relative-position table): summed along the tile's
    #: diagonals, one atomic add per diagonal
    diagonal: bool = False


class _BackwardEmitter(TritonEmitter):
    def expr(self, e: ir.Expr) -> str:
        if isinstance(e, _GradOffset):
            return self.clamped_offset(e.load.param, [self.expr(i) for i in e.load.indices])
        if isinstance(e, _TileElement):
            ranges = self.tile_ranges(e.load)
            clamp = lambda d, x: f"tl.minimum(tl.maximum({x}, 0), {size_ident(e.load.param, d)} - 1)"  # noqa: E731
            uniform = " & ".join(f"({clamp(d, lo)} == {clamp(d, hi)})" for d, (lo, hi) in ranges.items())
            at_lo = self.clamped_offset(e.load.param, [ranges[d][0] if d in ranges else self.expr(i)
                                                       for d, i in enumerate(e.load.indices)])
            return f"tl.where({uniform}, {at_lo}, -1)"
        return super().expr(e)

    def read_kind(self, load: ir.Load) -> str:
        nodes = [n for i in load.indices for n in self.walk_lets(i)]
        if any(isinstance(n, (ir.Score, ir.RawScore)) for n in nodes):
            return "element"
        used = {n.name for n in nodes if isinstance(n, ir.Index)}
        return "element" if "kv_idx" in used else "row" if "q_idx" in used else "program"


class _GluonEmitter(_BackwardEmitter):
    """The variant functions as the Gluon dK/dV and dQ kernels call them (Triton's functions compile inside a Gluon
    kernel, all but a zeros_like, which there needs a layout).

    Reads of the key alone (`doc_ids[batch, kv_idx]`: `col_loads`) are passed in as `fv_col<i>`, each function
    taking those it uses (`function_cols`): the dK/dV kernel, whose program owns one key block, reads them once
    before its loop (the same key columns for every query tile); the dQ kernel per tile. Read inside the functions,
    ptxas kept a 64-bit address per key column live across dK/dV's loop and spilled them (sm_90a, a document mask:
    308 bytes a thread)."""
    zeros_like = "gl.zeros_like"

    def __init__(self, variant):
        super().__init__(variant)
        self.col_loads = self._col_loads()
        self.function_cols: dict[str, list[str]] = {}
        self._used_cols: dict[str, None] = {}

    def _col_loads(self) -> dict[ir.Load, str]:
        """Tensor-param reads of the key alone (not the query, its head, the score or a let), as the functions use
        them: a read inside another such read is one only where it also stands alone."""
        found: dict[ir.Load, str] = {}

        def visit(e: ir.Expr) -> None:
            if isinstance(e, ir.Load) and e not in self.row_loads and read_without(e, ("q_idx", "qo_head")):
                found.setdefault(e, f"fv_col{len(found)}")
                return
            for c in e.children():
                visit(c)
        for program in (self.lowered.logits, self.lowered.mask):
            for root in (program.exprs() if program else ()):
                visit(root)
        return found

    def expr(self, e: ir.Expr) -> str:
        if isinstance(e, ir.Load) and e in self.col_loads and not self.in_prologue:
            self._used_cols[self.col_loads[e]] = None
            return self.col_loads[e]
        return super().expr(e)

    def function(self, program: ir.Program, name: str, first_args: tuple[str, ...]) -> str:
        self._used_cols = {}
        text = super().function(program, name, first_args)
        self.function_cols[name] = list(self._used_cols)
        return text

    def function_args(self) -> list[str]:
        return list(self._used_cols)


def _gluon_functions(variant, derivatives: list[tuple[str, ir.Program, tuple]], logits: ir.Program | None = None
                     ) -> tuple[list[str], _GluonEmitter]:
    """The functions the Gluon kernels call, prefixed gl_: the logits, the mask (if any) and `derivatives` (name,
    program, arguments: the backward's own functions, derived from `logits`, by default the lowered ones); and
    their emitter (col_loads, function_cols)."""
    emit = _GluonEmitter(variant)
    emit.table_tile_test = False
    fns = [emit.function(emit.lowered.logits, "gl_variant_logits", ("qk",) + ir.INDEX_VARS)]
    if emit.lowered.mask:
        fns.append(emit.function(emit.lowered.mask, "gl_variant_mask", ir.INDEX_VARS))
    emit.table_tile_test = True
    for name, program, args in derivatives:
        emit.let_exprs = dict((logits or emit.lowered.logits).lets)
        fns.append(emit.function(program, "gl_" + name, args))
    return fns, emit


def learnable_params(variant) -> list[str]:
    """The variant's tensor parameters that get gradients: float tensors declared `learnable=True`."""
    return list(variant.learnable_params)


def render_training(variant) -> str:
    """The forward twin's module followed by the backward kernels and their launcher, from the training lowering
    (fivar.spec.optimize: the derivative programs, their terms of the distance read from position tables like the
    logits'; the learnable reads and every derivative are those of the logits per element)."""
    with override(training=True):
        return _render_training(variant)


def _render_training(variant) -> str:
    emit = _BackwardEmitter(variant)
    lowered = emit.lowered
    logits = lowered.gradient_logits
    derivatives = [(name, program, ("qk",) + ir.INDEX_VARS) for name, program in lowered.gradients]
    prologue, row_prologue = emit.prologue(), emit.row_prologue()
    tile_fns, tile_tests, reads = [], [], []
    for i, load in enumerate(lowered.learnable_loads):
        emit.let_exprs = dict(logits.lets)  # read_kind and tile_ranges follow the index through the lets
        kind = emit.read_kind(load)
        tile_test = kind == "element" and emit.tile_ranges(load) is not None
        by_distance = positions.Analysis(dict(logits.lets))
        diagonal = kind == "element" and all(by_distance.position_only(i) for i in load.indices)
        reads.append(LearnableRead(i, load.param, kind, ir.format_expr(load), tile_test, diagonal))
        index_lets = needed_lets(logits.lets, load.indices)
        # an element read's index may depend on the score (then its offset function takes the tile's q.k)
        offset_args = ir.INDEX_VARS + (("qk",) if kind == "element" else ())  # not first: no tile broadcast
        derivatives.append((f"fv_grad_offset{i}", ir.Program(index_lets, _GradOffset(I32, load)), offset_args))
        if tile_test:
            tile_program = ir.Program(index_lets, _TileElement(I32, load))
            tile_fns.append(emit.function(tile_program, f"fv_grad_tile{i}", ir.INDEX_VARS))
            tile_tests.append((f"fv_grad_tile{i}", tile_program, ir.INDEX_VARS))
    fns = []
    for name, program, args in derivatives:  # then the Gluon kernels' copies of the same (_gluon_functions)
        emit.let_exprs = dict(logits.lets)
        fns.append(emit.function(program, name, args))
    fns += tile_fns
    gluon_fns, gluon = _gluon_functions(variant, derivatives + tile_tests, logits)
    # the module's helper functions (_py_mod & co.) are the forward's: it defines those the derivatives use too
    forward = render_attention(variant, extra_helpers=emit.helpers | gluon.helpers)
    band = variant.kv_band
    backward = render("triton/attention_bwd.py.jinja", name=variant.name, softmax=variant.softmax,
                      functions=fns, prologue=prologue, row_prologue=row_prologue,
                      kernel_args=[a.name for a in emit.args], variant_args=emit.variant_args(),
                      unspecialized=emit.unspecialized(), reads=reads,
                      band_left=band.left is not None, band_right=band.right is not None, band_exact=band.exact,
                      tile_lists=variant.scans_mask,
                      has_mask=emit.lowered.mask is not None, gluon_functions=gluon_fns,
                      col_prologue=gluon.read_lines(gluon.col_loads), gl_cols=gluon.function_cols)
    # the template's parts are included whole, each followed by blank lines: at most two between definitions
    return forward + "\n\n" + re.sub(r"\n{4,}", "\n\n\n", backward)
