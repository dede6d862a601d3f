"""Which (query block, KV block) pairs a mask empties, keeps whole, or cuts: the block map every path skips by.

A kernel that tiles attention only needs three answers per tile: no pair is kept (skip the tile), every pair is
kept (run it without evaluating the mask), or some are (evaluate the mask per element). `classify` reads them off
the mask by interval arithmetic: each index variable ranges over its block (`q_idx` over the block's rows,
`kv_idx` over its keys, `qo_head` over every head), each subexpression becomes an interval that holds every value
it takes there, and each boolean becomes the pair (must be true, may be true). A tile is

* empty when the mask may be true nowhere in it, for no head;
* full when the mask must be true everywhere in it, for every head;
* partial otherwise, which is always safe: the kernel then evaluates the mask per element.

The arithmetic is exact for the shapes masks are built from: bands (`q_idx - kv_idx < w`), causal terms, chunks
(`q_idx // C == kv_idx // C`: a floor division of a block is the interval of its ends' quotients), per-request
tensors (a load over a block is the min/max of the tensor over the indices the block reaches: document ids,
prefix lengths), and `&`/`|`/`not` of these. A disjunction is not exact (a tile kept whole only by the union of
two terms is called partial); float arithmetic is not analysed (its comparisons are "may be either"). Both only
cost speed.

`brute_force` is the definition (every pair evaluated by the torch reference's evaluator); `violations` compares a
map against it. `BlockRanges` is the form the runtime uses: per query block, the KV blocks it must visit and the
run of them it may visit without the mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ir
from .bounds import _conjuncts, _inline, _term_bound
from .ir import BOOL, F32, I32

EMPTY, PARTIAL, FULL = 0, 1, 2
KIND_NAMES = {EMPTY: "empty", PARTIAL: "partial", FULL: "full"}
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass(frozen=True)
class _Iv:
    """An integer interval [lo, hi] (int64 tensors, broadcast over [heads, q blocks, kv blocks]); for a boolean,
    lo = must be true, hi = may be true."""
    lo: torch.Tensor
    hi: torch.Tensor
    type: str


def _wrap(lo, hi) -> _Iv:
    # int32 in every target: a value that may leave the range may wrap to anything
    bad = (lo < _I32_MIN) | (hi > _I32_MAX)
    if bool(bad.any()):
        lo, hi = torch.where(bad, _I32_MIN, lo), torch.where(bad, _I32_MAX, hi)
    return _Iv(lo, hi, I32)


def _point(value, like: torch.Tensor, t: str = I32) -> _Iv:
    x = torch.tensor(value, dtype=torch.bool if t == BOOL else torch.int64, device=like.device)
    return _Iv(x, x, t)


def _unknown(t: str, like: torch.Tensor) -> _Iv | None:
    if t == BOOL:
        return _Iv(torch.zeros((), dtype=torch.bool, device=like.device),
                   torch.ones((), dtype=torch.bool, device=like.device), BOOL)
    if t == I32:
        return _Iv(torch.tensor(_I32_MIN, device=like.device), torch.tensor(_I32_MAX, device=like.device), I32)
    return None  # floats: not analysed


def _as_int(v: _Iv) -> _Iv:
    return v if v.type != BOOL else _Iv(v.lo.long(), v.hi.long(), I32)


def _range_min_max(table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, point_index: tuple):
    """min and max of `table[*point_index, lo..hi]` (the last dim ranged), with a doubling table per level."""
    n = table.shape[-1]
    mins, maxs = [table], [table]
    step = 1
    while 2 * step <= n:
        a, b = mins[-1], maxs[-1]
        pad = lambda x, fill: torch.nn.functional.pad(x[..., step:], (0, step), value=fill)  # noqa: E731
        mins.append(torch.minimum(a, pad(a, _I32_MAX)))
        maxs.append(torch.maximum(b, pad(b, _I32_MIN)))
        step *= 2
    mins, maxs = torch.stack(mins), torch.stack(maxs)
    length = (hi - lo + 1).clamp(min=1)
    level = torch.floor(torch.log2(length.double())).long()
    # log2 of an exact power of two can round below: correct the level against the window it covers
    level = torch.where((1 << (level + 1)) <= length, level + 1, level)
    level = torch.where((1 << level) > length, level - 1, level)
    right = hi - (1 << level) + 1
    idx_lo = (level, *point_index, lo)
    idx_hi = (level, *point_index, right)
    return torch.minimum(mins[idx_lo], mins[idx_hi]), torch.maximum(maxs[idx_lo], maxs[idx_hi])


class _Interpreter:
    def __init__(self, env: dict[str, _Iv], scalars: dict, tensors: dict):
        self.env, self.scalars, self.tensors = env, scalars, tensors
        self.locals: dict[str, _Iv | None] = {}
        self.like = next(iter(env.values())).lo

    def run(self, program: ir.Program) -> _Iv:
        # lets inlined and negated comparisons flipped: a conjunction's band terms must be visible as such
        out = self.eval(ir.rewrite(_inline(program), _push_not))
        return out if out is not None else _unknown(BOOL, self.like)

    def _conjunction(self, e: ir.Binary) -> _Iv:
        """`a & b & ...`: each term's interval, and the band terms (`q_idx - kv_idx` against an invariant) taken
        together: in a block, q_idx - kv_idx takes every value of [q_lo - kv_hi, q_hi - kv_lo], so the pair of
        bounds may hold only where that interval meets the band. Exact for bands and causal terms."""
        terms = list(_conjuncts(e))
        must = may = None
        d_lo, d_hi = None, None  # the band on d = q_idx - kv_idx
        for term in terms:
            v = self.eval(term)
            v = v if v is not None else _unknown(BOOL, self.like)
            must = v.lo if must is None else must & v.lo
            may = v.hi if may is None else may & v.hi
            bound = _term_bound(term, _free_of_positions)  # the rest may depend on the head (a per-head window)
            if bound is None:
                continue
            side, rest = bound
            r = self.eval(rest)
            if r is None:
                continue
            known = r.lo == r.hi  # a bound is used where the rest is one value
            if side == "left":  # kv >= q - rest  <=>  d <= rest
                bound_hi = torch.where(known, r.lo, _I32_MAX * 4)
                d_hi = bound_hi if d_hi is None else torch.minimum(d_hi, bound_hi)
            else:  # kv <= q + rest  <=>  d >= -rest
                bound_lo = torch.where(known, -r.lo, -_I32_MAX * 4)
                d_lo = bound_lo if d_lo is None else torch.maximum(d_lo, bound_lo)
        if d_lo is not None or d_hi is not None:
            q, kv = self.env["q_idx"], self.env["kv_idx"]
            blk_lo, blk_hi = q.lo - kv.hi, q.hi - kv.lo
            lo = blk_lo if d_lo is None else torch.maximum(blk_lo, d_lo)
            hi = blk_hi if d_hi is None else torch.minimum(blk_hi, d_hi)
            may = may & (lo <= hi)
        return _Iv(must, may, BOOL)

    def eval(self, e: ir.Expr) -> _Iv | None:  # noqa: C901 (one case per node kind)
        if e.type == F32:
            return None
        if isinstance(e, ir.Const):
            return _point(e.value, self.like, e.type)
        if isinstance(e, ir.Index):
            return self.env[e.name]
        if isinstance(e, ir.ScalarParam):
            value = self.scalars.get(e.name)
            return _unknown(e.type, self.like) if value is None else _point(int(value), self.like, e.type)
        if isinstance(e, ir.Local):
            return self.locals.get(e.name)
        if isinstance(e, ir.Load):
            return self._load(e)
        if isinstance(e, ir.Unary):
            x = self.eval(e.x)
            if x is None:
                return _unknown(e.type, self.like)
            if e.op == "not":
                return _Iv(~x.hi, ~x.lo, BOOL)
            return _wrap(-x.hi, -x.lo)
        if isinstance(e, ir.Binary):
            return self._binary(e)
        if isinstance(e, ir.Select):
            c, a, b = self.eval(e.cond), self.eval(e.a), self.eval(e.b)
            if a is None or b is None or c is None:
                return _unknown(e.type, self.like)
            if a.type == BOOL:
                a, b = _as_int(a), _as_int(b)
            lo = torch.where(c.lo, a.lo, torch.where(~c.hi, b.lo, torch.minimum(a.lo, b.lo)))
            hi = torch.where(c.lo, a.hi, torch.where(~c.hi, b.hi, torch.maximum(a.hi, b.hi)))
            return _Iv(lo.bool(), hi.bool(), BOOL) if e.type == BOOL else _Iv(lo, hi, I32)
        if isinstance(e, ir.Call):
            args = [self.eval(a) for a in e.args]
            if any(a is None for a in args) or e.fn not in ("abs", "minimum", "maximum"):
                return _unknown(e.type, self.like)
            if e.fn == "abs":
                (x,) = args
                lo = torch.where(x.lo > 0, x.lo, torch.where(x.hi < 0, -x.hi, torch.zeros_like(x.lo)))
                return _wrap(lo, torch.maximum(x.lo.abs(), x.hi.abs()))
            pick = torch.minimum if e.fn == "minimum" else torch.maximum
            return _Iv(pick(args[0].lo, args[1].lo), pick(args[0].hi, args[1].hi), I32)
        if isinstance(e, ir.Cast):
            x = self.eval(e.x)
            return _unknown(e.type, self.like) if x is None else _as_int(x)
        return _unknown(e.type, self.like)

    def _binary(self, e: ir.Binary) -> _Iv | None:
        if e.op == "and":
            return self._conjunction(e)
        if e.op == "or":
            a, b = self.eval(e.a), self.eval(e.b)
            a = a if a is not None else _unknown(BOOL, self.like)
            b = b if b is not None else _unknown(BOOL, self.like)
            if e.op == "and":
                return _Iv(a.lo & b.lo, a.hi & b.hi, BOOL)
            return _Iv(a.lo | b.lo, a.hi | b.hi, BOOL)
        a, b = self.eval(e.a), self.eval(e.b)
        if a is None or b is None:
            return _unknown(e.type, self.like)
        a, b = _as_int(a), _as_int(b)
        op = e.op
        if op == "lt":
            return _Iv(a.hi < b.lo, a.lo < b.hi, BOOL)
        if op == "le":
            return _Iv(a.hi <= b.lo, a.lo <= b.hi, BOOL)
        if op == "gt":
            return _Iv(a.lo > b.hi, a.hi > b.lo, BOOL)
        if op == "ge":
            return _Iv(a.lo >= b.hi, a.hi >= b.lo, BOOL)
        if op in ("eq", "ne"):
            must = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
            may = (a.lo <= b.hi) & (b.lo <= a.hi)
            return _Iv(must, may, BOOL) if op == "eq" else _Iv(~may, ~must, BOOL)
        if op == "add":
            return _wrap(a.lo + b.lo, a.hi + b.hi)
        if op == "sub":
            return _wrap(a.lo - b.hi, a.hi - b.lo)
        if op == "mul":
            corners = torch.stack(torch.broadcast_tensors(a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi))
            return _wrap(corners.amin(0), corners.amax(0))
        if op == "floordiv":
            # floor(a / b) is monotone in a and in b on either side of b = 0: its extremes are at the corners
            sign_ok = (b.lo > 0) | (b.hi < 0)
            one = torch.ones_like(b.lo)
            blo, bhi = torch.where(sign_ok, b.lo, one), torch.where(sign_ok, b.hi, one)
            corners = torch.stack(torch.broadcast_tensors(
                torch.div(a.lo, blo, rounding_mode="floor"), torch.div(a.lo, bhi, rounding_mode="floor"),
                torch.div(a.hi, blo, rounding_mode="floor"), torch.div(a.hi, bhi, rounding_mode="floor")))
            lo, hi = corners.amin(0), corners.amax(0)
            return _wrap(torch.where(sign_ok, lo, _I32_MIN), torch.where(sign_ok, hi, _I32_MAX))
        if op == "mod":
            # Python's %: in [0, b) for b > 0, (b, 0] for b < 0; exact within one period of a constant b
            const_b = b.lo == b.hi
            safe_b = torch.where(b.lo == 0, torch.ones_like(b.lo), b.lo)
            same_period = const_b & (torch.div(a.lo, safe_b, rounding_mode="floor")
                                     == torch.div(a.hi, safe_b, rounding_mode="floor"))
            lo = torch.where(b.lo > 0, torch.zeros_like(b.lo), torch.where(b.hi < 0, b.lo + 1, _I32_MIN))
            hi = torch.where(b.lo > 0, b.hi - 1, torch.where(b.hi < 0, torch.zeros_like(b.hi), _I32_MAX))
            lo = torch.where(same_period & (b.lo != 0), torch.remainder(a.lo, safe_b), lo)
            hi = torch.where(same_period & (b.lo != 0), torch.remainder(a.hi, safe_b), hi)
            return _Iv(lo, hi, I32)
        return _unknown(e.type, self.like)

    def _load(self, e: ir.Load) -> _Iv | None:
        table = self.tensors.get(e.param)
        if table is None or e.type == F32:
            return _unknown(e.type, self.like)
        idx = [self.eval(i) for i in e.indices]
        if any(i is None for i in idx):
            return _unknown(e.type, self.like)
        # the kernels read an int64 tensor as its low 32 bits, and clamp every index to the tensor
        t = table.to(torch.int32).to(torch.int64) if table.dtype != torch.bool else table.to(torch.int64)
        t = t.to(self.like.device)
        los = [i.lo.clamp(0, t.shape[d] - 1) for d, i in enumerate(idx)]
        his = [i.hi.clamp(0, t.shape[d] - 1) for d, i in enumerate(idx)]
        ranged = [d for d in range(t.dim()) if not bool((los[d] == his[d]).all())]
        tmin = tmax = t
        for d in ranged[:-1]:  # all but one ranged dim: the whole dim's min/max (looser, still sound)
            tmin, tmax = tmin.amin(d, keepdim=True), tmax.amax(d, keepdim=True)
            los[d] = his[d] = torch.zeros_like(los[d])
        if not ranged:
            lo = hi = t[tuple(los)]
        else:
            r = ranged[-1]
            order = [d for d in range(t.dim()) if d != r] + [r]
            point = tuple(los[d] for d in order[:-1])
            lo, _ = _range_min_max(tmin.permute(order), los[r], his[r], point)
            _, hi = _range_min_max(tmax.permute(order), los[r], his[r], point)
        if e.type == BOOL:
            return _Iv(lo.bool(), hi.bool(), BOOL)
        return _Iv(lo, hi, I32)


def _free_of_positions(e: ir.Expr) -> bool:
    return not any(isinstance(n, ir.Index) and n.name in ("q_idx", "kv_idx") for n in ir.walk(e))


_COMPLEMENT = {"lt": "ge", "ge": "lt", "le": "gt", "gt": "le", "eq": "ne", "ne": "eq"}


def _push_not(e: ir.Expr) -> ir.Expr | None:
    """`not (a < b)` is `a >= b` (integers: no NaN)."""
    if isinstance(e, ir.Unary) and e.op == "not" and isinstance(e.x, ir.Binary) and e.x.op in _COMPLEMENT \
            and e.x.a.type != F32 and e.x.b.type != F32:
        return ir.Binary(BOOL, _COMPLEMENT[e.x.op], e.x.a, e.x.b)
    return None


@dataclass(frozen=True)
class BlockMap:
    """kinds[i, j]: EMPTY, PARTIAL or FULL for query block i (rows i*q_block...) and KV block j."""
    kinds: torch.Tensor  # int8 [ceil(qo_len / q_block), ceil(kv_len / kv_block)]
    q_block: int
    kv_block: int
    qo_len: int
    kv_len: int

    def ranges(self) -> "BlockRanges":
        return BlockRanges.of(self.kinds)

    def counts(self) -> dict[str, int]:
        return {KIND_NAMES[k]: int((self.kinds == k).sum()) for k in KIND_NAMES}


@dataclass(frozen=True)
class BlockRanges:
    """Per query block: [kept_lo, kept_hi) the KV blocks to visit (every non-empty one lies inside), and
    [full_lo, full_hi) the longest run of FULL blocks inside it (full_lo == full_hi: none)."""
    kept_lo: torch.Tensor
    kept_hi: torch.Tensor
    full_lo: torch.Tensor
    full_hi: torch.Tensor

    @staticmethod
    def of(kinds: torch.Tensor) -> "BlockRanges":
        nq, nk = kinds.shape
        col = torch.arange(nk).expand(nq, nk)
        kept = kinds != EMPTY
        any_kept = kept.any(1)
        kept_lo = torch.where(any_kept, torch.where(kept, col, nk).amin(1), 0)
        kept_hi = torch.where(any_kept, torch.where(kept, col + 1, 0).amax(1), 0)
        # longest run of FULL: run length ending at each column
        full = (kinds == FULL).long()
        run = torch.zeros_like(full)
        for j in range(nk):
            run[:, j] = full[:, j] * ((run[:, j - 1] if j else 0) + 1)
        best = run.amax(1)
        end = torch.where(best > 0, (run == best[:, None]).long().argmax(1) + 1, 0)
        return BlockRanges(kept_lo, kept_hi, end - best, end)

    def segments(self, kinds: torch.Tensor, row: int) -> list[tuple[int, int, int]]:
        """(start, end, kind) runs of one query block's non-empty KV blocks, in order."""
        out: list[tuple[int, int, int]] = []
        for j, k in enumerate(kinds[row].tolist()):
            if k == EMPTY:
                continue
            if out and out[-1][1] == j and out[-1][2] == k:
                out[-1] = (out[-1][0], j + 1, k)
            else:
                out.append((j, j + 1, k))
        return out


def _blocks(n: int, size: int, offset: int = 0):
    start = torch.arange(0, max(n, 1), size, dtype=torch.int64)
    return start + offset, torch.clamp(start + size, max=n) - 1 + offset


def classify_bounds(program: ir.Program, q_lo, q_hi, kv_lo, kv_hi, *, scalars: dict, tensors: dict,
                    num_qo_heads: int = 1, num_kv_heads: int = 1, batch_idx: int = 0,
                    causal: bool = False, pairs: bool = False) -> torch.Tensor:
    """kinds [len(q_lo), len(kv_lo)] for query blocks [q_lo[i], q_hi[i]] (q_idx, inclusive) and KV blocks
    [kv_lo[j], kv_hi[j]]: the interval analysis itself, on explicit block bounds. `pairs`: kinds [n] of the n
    pairs (query block i, KV block i) only (linear, where the matrix's diagonal would be quadratic)."""
    heads = torch.arange(num_qo_heads, dtype=torch.int64).view(-1, 1, 1)
    group = max(1, num_qo_heads // max(1, num_kv_heads))
    q = _Iv(q_lo.view(1, -1, 1), q_hi.view(1, -1, 1), I32)
    kv = (_Iv(kv_lo.view(1, -1, 1), kv_hi.view(1, -1, 1), I32) if pairs else
          _Iv(kv_lo.view(1, 1, -1), kv_hi.view(1, 1, -1), I32))
    b = torch.tensor(batch_idx, dtype=torch.int64)
    env = {"q_idx": q, "kv_idx": kv, "qo_head": _Iv(heads, heads, I32),
           "kv_head": _Iv(heads // group, heads // group, I32), "batch": _Iv(b, b, I32)}
    if causal:  # kv_idx <= q_idx, applied in addition to the mask (a band term like any other)
        causal_term = ir.Binary(BOOL, "le", ir.Index(I32, "kv_idx"), ir.Index(I32, "q_idx"))
        program = ir.Program(program.lets, ir.Binary(BOOL, "and", program.result, causal_term))
    keep = _Interpreter(env, scalars, tensors).run(program)
    must, may = keep.lo, keep.hi
    shape = (num_qo_heads, q_lo.numel(), 1 if pairs else kv_lo.numel())
    must, may = must.expand(shape).all(0), may.expand(shape).any(0)
    kinds = torch.full(shape[1:], PARTIAL, dtype=torch.int8)
    kinds[must] = FULL
    kinds[~may] = EMPTY
    return kinds[:, 0] if pairs else kinds


def classify_decode(program: ir.Program | None, kv_lens: torch.Tensor, *, page_size: int, scalars: dict | None = None,
                    tensors: dict | None = None, num_qo_heads: int = 1, num_kv_heads: int = 1) -> torch.Tensor:
    """kinds [batch, max pages] of a decode batch (request b's one query at q_idx kv_lens[b] - 1) over its pages
    of `page_size` keys, all requests at once on kv_lens' device; pages past a request's keys are EMPTY."""
    dev = kv_lens.device
    lens = kv_lens.long().view(-1, 1, 1, 1)  # [batch, heads, q, pages]
    pages = max(1, -(-int(kv_lens.max()) // page_size)) if kv_lens.numel() else 1
    kv_lo = (torch.arange(pages, device=dev, dtype=torch.int64) * page_size).view(1, 1, 1, -1)
    kv_hi = torch.minimum(kv_lo + page_size - 1, lens - 1)
    q = lens - 1
    heads = torch.arange(num_qo_heads, device=dev, dtype=torch.int64).view(1, -1, 1, 1)
    group = max(1, num_qo_heads // max(1, num_kv_heads))
    batch = torch.arange(kv_lens.numel(), device=dev, dtype=torch.int64).view(-1, 1, 1, 1)
    env = {"q_idx": _Iv(q, q, I32), "kv_idx": _Iv(kv_lo, kv_hi, I32), "qo_head": _Iv(heads, heads, I32),
           "kv_head": _Iv(heads // group, heads // group, I32), "batch": _Iv(batch, batch, I32)}
    if program is None:
        program = ir.Program([], ir.Const(BOOL, True))
    tensors = {n: t.to(dev) for n, t in (tensors or {}).items()}
    keep = _Interpreter(env, scalars or {}, tensors).run(program)
    shape = (kv_lens.numel(), num_qo_heads, 1, pages)
    must, may = keep.lo.expand(shape).all(1)[:, 0], keep.hi.expand(shape).any(1)[:, 0]
    kinds = torch.full(must.shape, PARTIAL, dtype=torch.int8, device=dev)
    kinds[must] = FULL
    kinds[~may | (kv_lo.view(1, -1) >= kv_lens.long().view(-1, 1))] = EMPTY
    return kinds


def classify(program: ir.Program | None, *, qo_len: int, kv_len: int, q_block: int, kv_block: int,
             scalars: dict | None = None, tensors: dict | None = None, num_qo_heads: int = 1,
             num_kv_heads: int = 1, batch_idx: int = 0, causal: bool = False) -> BlockMap:
    """The block map of one request. `program`: the variant's mask (`variant.ir.mask`; None keeps every pair);
    q_idx of row r is r + kv_len - qo_len (bottom-right aligned, as everywhere in fivar)."""
    q_lo, q_hi = _blocks(qo_len, q_block, kv_len - qo_len)
    kv_lo, kv_hi = _blocks(kv_len, kv_block)
    if program is None:
        program = ir.Program([], ir.Const(BOOL, True))
    kinds = classify_bounds(program, q_lo, q_hi, kv_lo, kv_hi, scalars=scalars or {}, tensors=tensors or {},
                            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, batch_idx=batch_idx,
                            causal=causal)
    return BlockMap(kinds, q_block, kv_block, qo_len, kv_len)


def keep_matrix(program: ir.Program | None, *, qo_len: int, kv_len: int, scalars: dict | None = None,
                tensors: dict | None = None, num_qo_heads: int = 1, num_kv_heads: int = 1, batch_idx: int = 0,
                causal: bool = False) -> torch.Tensor:
    """Every pair, evaluated by the torch reference's evaluator: bool [heads, qo_len, kv_len]."""
    from .evaluate import TorchEvaluator
    group = max(1, num_qo_heads // max(1, num_kv_heads))
    head = torch.arange(num_qo_heads).view(-1, 1, 1)
    q_idx = torch.arange(qo_len).view(1, -1, 1) + (kv_len - qo_len)
    kv_idx = torch.arange(kv_len).view(1, 1, -1)
    keep = torch.ones(num_qo_heads, qo_len, kv_len, dtype=torch.bool)
    if program is not None:
        env = {"batch": torch.tensor(batch_idx), "qo_head": head, "kv_head": head // group, "q_idx": q_idx,
               "kv_idx": kv_idx, "sm_scale": 1.0}
        keep = keep & TorchEvaluator(env, {**(scalars or {}), **(tensors or {})}).run(program).bool()
    if causal:
        keep = keep & (kv_idx <= q_idx)
    return keep


def brute_force(keep: torch.Tensor, q_block: int, kv_block: int) -> torch.Tensor:
    """The true kinds of a keep matrix ([heads, qo_len, kv_len]) cut into blocks."""
    h, nq, nk = keep.shape
    pq, pk = -nq % q_block, -nk % kv_block
    # padding rows/keys count as neither kept nor dropped: pad with True for "all", False for "any"
    all_k = torch.nn.functional.pad(keep, (0, pk, 0, pq), value=True)
    any_k = torch.nn.functional.pad(keep, (0, pk, 0, pq), value=False)
    shape = (h, (nq + pq) // q_block, q_block, (nk + pk) // kv_block, kv_block)
    full = all_k.view(shape).all(4).all(2).all(0)
    some = any_k.view(shape).any(4).any(2).any(0)
    kinds = torch.full(full.shape, PARTIAL, dtype=torch.int8)
    kinds[full] = FULL
    kinds[~some] = EMPTY
    return kinds


def violations(claimed: torch.Tensor, truth: torch.Tensor) -> list[str]:
    """Where a claimed map is wrong: a block claimed full that drops a pair, or claimed empty that keeps one.
    (Claiming partial is never wrong, only slower.)"""
    out = []
    for kind, bad in ((FULL, (claimed == FULL) & (truth != FULL)), (EMPTY, (claimed == EMPTY) & (truth != EMPTY))):
        for i, j in bad.nonzero().tolist()[:4]:
            out.append(f"block ({i}, {j}) claimed {KIND_NAMES[kind]}, is {KIND_NAMES[int(truth[i, j])]}")
    return out
