"""What the strategies share: the call's checks, the (query run, key run) pairs to compute, one pair's attention on
global positions, and the autograd function that merges pairs by their LSEs and runs fivar's generated backward per
pair. A strategy (ring, all-gather) only says how the key/value shards reach each rank and how their gradients get
back (`Transport`)."""
from __future__ import annotations

import math
import weakref

import torch

from ..errors import FivarError
from ..runtime.lse import merge_into
from ..runtime.plan_cache import PlanCache
from ..spec.inputs import bind_params
from .positions import KERNEL_CAUSAL, MASK_CAUSAL, global_variant, pair_causality, shifts, sink_state
from .sharding import Sharding

BACKENDS = ("auto", "triton", "fa2", "fa3", "reference")
LN2 = math.log(2.0)
#: the query rows a pair's row range is trimmed by (fivar's classification over blocks of this many rows)
ROW_BLOCK = 512
#: likewise the keys a pair's key range, and so each transfer, is trimmed by
KEY_BLOCK = 512
#: blocks grow past ROW_BLOCK / KEY_BLOCK so that neither axis has more than this many: the classification of every
#: rank's rows against every rank's keys is quadratic in them (1024 x 1024 blocks: under a second on the host)
MAX_BLOCKS = 1024
#: another rank's keys travel in pieces: kept keys at least MIN_GAP keys apart go apart (a gap that long costs more
#: to send than one more kernel call over the later piece), at most MAX_PIECES per run of the sender's shard
MIN_GAP = 2048
MAX_PIECES = 4
#: Plan.table per call layout: the classification copies tensor params to the host and walks the mask's intervals,
#: which at 128k positions costs more than a shard's attention; keyed as one-shot plans are (tensors by identity and
#: version, so an in-place write classifies again; fivar.invalidate_plans clears it too)
_KEEPS = PlanCache(capacity=32)


class Plan:
    """One call's fixed facts: who holds what, which pairs are computed, and how one pair is run."""

    def __init__(self, variant, q, k, v, sharding, *, causal, sm_scale, backend, group, params, strategy):
        import torch.distributed as dist
        name = variant.name
        if not isinstance(sharding, Sharding):
            raise FivarError(f"variant '{name}': {strategy}: sharding must be a fivar.distributed.Sharding, got "
                             f"{type(sharding).__name__}")
        if sharding.seq_len == 0:
            raise FivarError(f"variant '{name}': {strategy}: the sharding covers no positions")
        if not variant.softmax:
            raise FivarError(f"variant '{name}': {strategy} merges partial results by their LSEs, and this variant "
                             "has softmax=False (no normaliser to merge by)")
        if backend not in BACKENDS:
            raise FivarError(f"variant '{name}': {strategy}: backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if not dist.is_available() or not dist.is_initialized():
            raise FivarError(f"variant '{name}': {strategy} needs torch.distributed initialised "
                             "(torch.distributed.init_process_group)")
        self.group, self.world = group, dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if sharding.world_size != self.world:
            raise FivarError(f"variant '{name}': {strategy}: the sharding has {sharding.world_size} ranks, the "
                             f"process group {self.world}")
        for t, tn in ((q, "q"), (k, "k"), (v, "v")):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise FivarError(f"variant '{name}': {strategy}: {tn} must be a 3-D tensor [rows, heads, head_dim]")
            if t.shape[0] != sharding.length(self.rank):
                raise FivarError(f"variant '{name}': {strategy}: {tn} has {t.shape[0]} rows, rank {self.rank}'s "
                                 f"shard holds {sharding.length(self.rank)}")
        if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
            raise FivarError(f"variant '{name}': {strategy}: q {list(q.shape)}, k {list(k.shape)}, v "
                             f"{list(v.shape)} do not fit (k and v alike, one head_dim, qo heads a multiple of kv "
                             "heads)")
        self.base, self.causal, self.sm_scale, self.backend = variant, bool(causal), sm_scale, backend
        self.sharding, self.params = sharding, dict(params)
        self.num_qo_heads, self.num_kv_heads = q.shape[1], k.shape[1]
        self.bound = bind_params(variant, self.params, num_qo_heads=q.shape[1], num_kv_heads=k.shape[1],
                                 batch_size=1, device=q.device)
        self.learnable = [n for n, p in variant.tensor_params.items() if p.learnable
                          and isinstance(self.params.get(n), torch.Tensor) and self.params[n].requires_grad]
        # this rank's query runs, each with where its rows start in q
        self.q_runs, at = [], 0
        for s, e in sharding.runs[self.rank]:
            self.q_runs.append((s, e, at))
            at += e - s
        # every rank classifies every rank's pairs alike: a sender sizes each transfer as its receiver does
        self.table, self.slices = _KEEPS.get(("pairs", variant, self.causal, sharding.seq_len, sharding.runs,
                                              self.num_qo_heads, self.num_kv_heads, self.params,
                                              (ROW_BLOCK, KEY_BLOCK, MIN_GAP, MAX_PIECES)), self._classify)
        #: pieces[(q run, owner, kv run)]: ((lo, hi), (start, end)) per kernel call of the pair: its query rows
        #: within the run and its keys in global positions; empty where the pair keeps nothing
        self.pieces = {(i, o, j): p or () for (r, i, o, j), p in self.table.items() if r == self.rank}
        #: rows[...]: the query rows (lo, hi) within the run that keep any of the pair's keys, None where none does;
        #: keys[...]: the pair's key range (start, end) in global positions, every piece's keys within it
        self.rows = {pair: (min(r[0] for r, _ in p), max(r[1] for r, _ in p)) if p else None
                     for pair, p in self.pieces.items()}
        self.keys = {pair: (min(k[0] for _, k in p), max(k[1] for _, k in p)) if p else None
                     for pair, p in self.pieces.items()}
        #: keep[(q run, owner, kv run)]: whether the pair is computed at all
        self.keep = {pair: rows is not None for pair, rows in self.rows.items()}
        self._starts = [[at for _, _, _, at in self.kv_runs(o)] for o in range(self.world)]

    def _classify(self) -> tuple[dict, dict]:
        """(table, slices) for every rank's pairs, by fivar's interval classification (fivar.spec.sparsity, which
        never calls a block empty that keeps a pair) of every rank's query blocks against every rank's key blocks.

        table[(rank, q run, owner, kv run)]: the pair's pieces, each ((lo, hi) the run's rows from the first to the
        last block keeping any of the piece's keys, (start, end) global keys from a kept block to a kept block),
        None where no block keeps any. Another rank's keys come in pieces (`split`: kept blocks MIN_GAP keys apart
        go apart); the own shard's in one, and where that pair is the kernels' causal square (a run with itself,
        pair_causality) its rows and keys keep ending together, and its keys start no later than its rows, so it
        stays that square. slices[(receiver, owner)], receiver != owner: (j, start, end) per piece of every kv run
        j of the owner that the receiver keeps any key of: its pairs' pieces with run j, split alike, which is what
        the owner sends it."""
        from ..spec import ir
        from ..spec.sparsity import EMPTY, classify_bounds
        runs, n = self.sharding.runs, self.sharding.seq_len
        flat = [(r, i, s, e) for r in range(self.world) for i, (s, e) in enumerate(runs[r])]
        if not flat:
            return {}, {}
        program = self.base.ir.mask
        if program is None and not self.causal:
            table = {(r, i, o, j): (((0, qe - qs), (ks, ke)),) for r, i, qs, qe in flat for o, j, ks, ke in flat}
        else:
            if program is None:
                program = ir.Program([], ir.Const(ir.BOOL, True))

            def blocks(size):  # (first block, end block) per run, and every block's global (lo, hi) inclusive
                size = max(size, -(-n // MAX_BLOCKS))
                spans, lo, hi = [], [], []
                for _, _, s, e in flat:
                    starts = range(s, e, size)
                    spans.append((len(lo), len(lo) + len(starts)))
                    lo += starts
                    hi += [min(b + size, e) - 1 for b in starts]
                return spans, torch.tensor(lo), torch.tensor(hi)
            (qspans, q_lo, q_hi), (kspans, k_lo, k_hi) = blocks(ROW_BLOCK), blocks(KEY_BLOCK)
            kept = classify_bounds(
                program, q_lo, q_hi, k_lo, k_hi, scalars=dict(self.bound.scalars),
                tensors={name: t.detach().cpu() for name, t in self.bound.tensors.items()},
                num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, causal=self.causal) != EMPTY
            table = {}
            for (r, i, qs, qe), (qa, qb) in zip(flat, qspans):
                for (o, j, ks, ke), (ka, kb) in zip(flat, kspans):
                    sub, starts, ends = kept[qa:qb, ka:kb], k_lo[ka:kb], k_hi[ka:kb] + 1
                    cols = sub.any(0).nonzero().view(-1).tolist()
                    if not cols:
                        table[(r, i, o, j)] = None
                        continue
                    if r == o:
                        ranges = [(int(starts[cols[0]]), int(ends[cols[-1]]))]
                    else:
                        ranges = split([(int(starts[c]), int(ends[c])) for c in cols])
                    got = []
                    for a, b in ranges:
                        rows = sub[:, (starts >= a) & (ends <= b)].any(1).nonzero().view(-1)
                        lo, hi = int(q_lo[qa + rows[0]]) - qs, int(q_hi[qa + rows[-1]]) + 1 - qs
                        if pair_causality(self.causal, qs, qe - qs, ks, ke - ks) == KERNEL_CAUSAL:
                            hi, b, a = qe - qs, ke, min(a, qs + lo)
                        got.append(((lo, hi), (a, b)))
                    table[(r, i, o, j)] = tuple(got)
        keys = {}  # (receiver, owner, kv run) -> its pairs' pieces' keys
        for (r, _, o, j), p in table.items():
            if p is not None and r != o:
                keys.setdefault((r, o, j), []).extend(k for _, k in p)
        slices = {(r, o): tuple((j, a, b) for j in range(len(runs[o])) for a, b in split(keys.get((r, o, j), ())))
                  for r in range(self.world) for o in range(self.world) if r != o}
        return table, slices

    def kv_runs(self, owner: int):
        """(index, start, end, row offset in the owner's shard) of each run the owner holds."""
        at = 0
        for j, (s, e) in enumerate(self.sharding.runs[owner]):
            yield j, s, e, at
            at += e - s

    def pair(self, q, k, v, q_start, kv_start, params=None, grad=False, out=None):
        """(out, lse) of query rows at q_start.. over keys at kv_start.., on global positions (written into `out`
        where the backend takes it)."""
        p = {**(self.params if params is None else params), **shifts(q_start, q.shape[0], kv_start, k.shape[0])}
        how = pair_causality(self.causal, q_start, q.shape[0], kv_start, k.shape[0])
        derived = global_variant(self.base, how == MASK_CAUSAL)
        causal = how == KERNEL_CAUSAL
        if self.backend == "reference":
            from ..codegen.torch_ref import reference_attention
            fdt = torch.float64 if q.dtype == torch.float64 else torch.float32
            o, lse = reference_attention(derived, q, k, v, causal=causal, sm_scale=self.sm_scale, params=p,
                                         return_lse=True, float_dtype=fdt)
            return o.to(q.dtype), lse
        if grad:
            return derived.attention(q, k, v, causal=causal, sm_scale=self.sm_scale, backend=self.backend,
                                     return_lse=True, **p)
        return derived.prefill(q, k, v, causal=causal, sm_scale=self.sm_scale, backend=self.backend, out=out,
                               return_lse=True, **p)

    def pair_grads(self, q, k, v, q_start, kv_start, out, lse, dout, dlse):
        """(dq, dk, dv, {learnable param: gradient}) of one pair, given its query rows' merged out and lse (over every
        kept pair) and their gradients. The generated backward takes them as they are: with the merged lse each
        key's probability is its share of the whole row, so no pair's forward runs again. The reference backend
        composes autograd instead: the pair's own (out, lse) again, weighted by its share of each row."""
        if self.backend != "reference":
            from ..runtime.autograd import attention_grads
            p = {**self.params, **shifts(q_start, q.shape[0], kv_start, k.shape[0])}
            how = pair_causality(self.causal, q_start, q.shape[0], kv_start, k.shape[0])
            return attention_grads(global_variant(self.base, how == MASK_CAUSAL), q, k, v, out, lse, dout, dlse,
                                   causal=how == KERNEL_CAUSAL, sm_scale=self.sm_scale, params=p)
        leaves = {n: self.params[n].detach().requires_grad_() for n in self.learnable}
        qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
        with torch.enable_grad():
            o_c, l_c = self.pair(qr, kr, vr, q_start, kv_start, params={**self.params, **leaves}, grad=True)
        # this pair's share of each row: 2^(lse_c - lse); out = sum_c share_c * out_c, lse = log2 sum 2^lse_c
        share = torch.where(torch.isfinite(l_c) & torch.isfinite(lse), torch.exp2(l_c.float() - lse),
                            torch.zeros((), device=q.device))
        do = dout.float()
        g_o = (share.unsqueeze(-1) * do).to(o_c.dtype)
        g_l = share * (LN2 * (do * (o_c.detach().float() - out.float())).sum(-1)
                       + (0 if dlse is None else dlse.float()))
        grads = torch.autograd.grad((o_c, l_c), [qr, kr, vr, *leaves.values()], (g_o, g_l.to(l_c.dtype)),
                                    allow_unused=True)
        return (*grads[:3], dict(zip(leaves, grads[3:])))

    def held(self, owner: int) -> dict:
        """This rank's copy of the owner's keys, as a strategy yields it: {kv run: [(start, end, row in the copy)]}
        of the global keys it holds. The own shard whole; another rank's, the slices it sends this rank (`slices`)
        back to back."""
        if owner == self.rank:
            return {j: [(s, e, at)] for j, s, e, at in self.kv_runs(owner)}
        held, at = {}, 0
        for j, s, e in self.slices[(self.rank, owner)]:
            held.setdefault(j, []).append((s, e, at))
            at += e - s
        return held

    def transfer(self, receiver: int, owner: int) -> list[tuple[int, int]]:
        """The rows (a, b) of the owner's shard it sends the receiver, slices adjacent in the shard merged (one
        message each for k and v); what the receiver gets is them back to back."""
        out = []
        for j, s, e in self.slices[(receiver, owner)]:
            a = self._starts[owner][j] + s - self.sharding.runs[owner][j][0]
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], a + e - s)
            else:
                out.append((a, a + e - s))
        return out

    def pairs_with(self, owner: int):
        """(q run index, q rows slice, q_start, kv rows slice, kv_start) of every piece of every kept pair with the
        owner's keys: the run's rows that keep any of the piece's keys, q_start the global position of the first;
        the piece's keys as rows of this rank's copy of them (`held`), kv_start the global position of the first."""
        held = self.held(owner)
        for i, (qs, qe, qat) in enumerate(self.q_runs):
            for j in range(len(self.sharding.runs[owner])):
                for (lo, hi), (a, b) in self.pieces[(i, owner, j)]:
                    s, _, at = next(h for h in held[j] if h[0] <= a and b <= h[1])
                    yield i, slice(qat + lo, qat + hi), qs + lo, slice(at + a - s, at + b - s), a


def split(ranges) -> list[tuple[int, int]]:
    """Key ranges (start, end) as pieces: sorted, merged where they overlap, touch or lie less than MIN_GAP keys
    apart, then the nearest neighbours merged until at most MAX_PIECES remain."""
    out = []
    for s, e in sorted(ranges):
        if out and s - out[-1][1] < max(MIN_GAP, 1):
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    while len(out) > MAX_PIECES:
        g = min(range(len(out) - 1), key=lambda x: out[x + 1][0] - out[x][1])
        out[g:g + 2] = [(out[g][0], out[g + 1][1])]
    return out


class Transport:
    """How key/value shards travel: `forward(k, v)` yields (owner, k, v) for every rank, k and v this rank's copy of
    the owner's keys (`Plan.held`: its own shard, another's the slices this rank's rows keep); `backward(k, v)`
    yields (owner, k, v, dkv) where dkv takes the gradient contributions to them (`add_kv`: the own shard's
    KeyGrads, another's [2, rows of that copy, Hkv, D] float32, sent back), and after the loop `result()` is this
    rank's own dk/dv summed over all ranks, in k's dtype."""


def add_returned(acc, back: torch.Tensor, rows) -> None:
    """The own shard's KeyGrads take the gradients `back` [2, n, ...] of the shard rows a receiver was sent (`rows`,
    Plan.transfer, back to back in `back`)."""
    at = 0
    for a, b in rows:
        for which in (0, 1):
            acc.add(which, slice(a, b), back[which, at:at + b - a])
        at += b - a


_READY = weakref.WeakSet()


def p2p_ready(group, device) -> None:
    """NCCL creates a group's communicator at its first collective, with every rank taking part; a batch of
    point-to-point ops that only some ranks post (a pair keeping no keys sends nothing) must not be that first one."""
    import torch.distributed as dist
    g = group if group is not None else dist.group.WORLD
    if g in _READY:
        return
    if torch.device(device).type == "cuda" and "nccl" in str(dist.get_backend(g)):
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    _READY.add(g)


class ContextParallel(torch.autograd.Function):
    """(out, lse) of this rank's queries over every rank's keys (without the sink); the backward runs each pair's
    gradients from the merged out and lse (Plan.pair_grads)."""

    @staticmethod
    def forward(ctx, plan, transport, q, k, v, *learnable):
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        runs = [slice(at, at + qe - qs) for qs, qe, at in plan.q_runs]
        started = [False] * len(runs)
        with torch.no_grad():
            for owner, ko, vo in transport.forward(k, v):
                for i, qrows, qs, kvrows, ks in plan.pairs_with(owner):
                    if not started[i] and qrows == runs[i]:  # a run's first state over all its rows: in place
                        o_c, lse_c = plan.pair(q[qrows], ko[kvrows], vo[kvrows], qs, ks, out=out[qrows])
                        if o_c.data_ptr() != out[qrows].data_ptr():  # a backend that does not write into `out`
                            out[qrows] = o_c
                        lse[qrows] = lse_c
                    else:
                        if not started[i]:  # the rows this pair leaves out keep nothing so far
                            out[runs[i]] = 0
                            lse[runs[i]] = -math.inf
                        o_c, lse_c = plan.pair(q[qrows], ko[kvrows], vo[kvrows], qs, ks)
                        merge_into(out[qrows], lse[qrows], o_c, lse_c.float())
                    started[i] = True
            for rows, done in zip(runs, started):
                if not done:  # the mask keeps no key of any shard for these rows
                    out[rows] = 0
                    lse[rows] = -math.inf
        ctx.plan, ctx.transport = plan, transport
        ctx.save_for_backward(q, k, v, out, lse, *learnable)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        plan, transport = ctx.plan, ctx.transport
        q, k, v, out, lse, *learnable = ctx.saved_tensors
        dq = query_grads(plan, q)
        dparams = [torch.zeros_like(t, dtype=torch.float32) for t in learnable]
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dlse = None if dlse is None else dlse.contiguous()  # None: the loss does not read the lse
        for owner, ko, vo, dkv in transport.backward(k, v):
            for _, qrows, qs, kvrows, ks in plan.pairs_with(owner):
                grads = plan.pair_grads(q[qrows], ko[kvrows], vo[kvrows], qs, ks, out[qrows], lse[qrows],
                                        dout[qrows], None if dlse is None else dlse[qrows])
                dq.add(qrows, grads[0])
                for which, g in ((0, grads[1]), (1, grads[2])):
                    if g is not None:
                        add_kv(dkv, which, kvrows, g)
                for name, acc in zip(plan.learnable, dparams):
                    if grads[3].get(name) is not None:
                        acc += grads[3][name]
        dk, dv = transport.result()
        return (None, None, dq.result(), dk, dv,
                *(g.to(t.dtype) for g, t in zip(dparams, learnable)))


class SpanSum:
    """A gradient over the rows (dim 0) of `like` that several contributions write. A row one contribution covers
    takes it as given, in like's dtype, as one GPU's backward would: no float32 buffer to fill, add into and cast
    back, each a pass over every row. The rows that two or more share sum in float32, over the span from a
    segment's first such row to its last; rows none covers are zero. `segments`: the (start, stop) row ranges no
    contribution crosses (a rank's runs); `spans`: the (start, stop) of every contribution to come."""

    def __init__(self, like: torch.Tensor, segments, spans):
        self.out = torch.empty_like(like)
        self.shared = []  # (first shared row, float32 sum over the shared span), one at most a segment
        for lo, hi in segments:
            count = torch.zeros(hi - lo + 1, dtype=torch.int32)  # how many contributions cover each row
            for a, b in spans:
                if lo <= a < hi:
                    count[a - lo] += 1
                    count[b - lo] -= 1
            count = count.cumsum(0)[:-1]
            none = torch.cat([torch.zeros(1, dtype=torch.int32), (count == 0).int(), torch.zeros(1, dtype=torch.int32)])
            edges = torch.nonzero(none.diff()).flatten().tolist()  # host side: slices, no device sync
            for a, b in zip(edges[::2], edges[1::2]):
                self.out[lo + a:lo + b] = 0
            both = torch.nonzero(count >= 2).flatten()
            if both.numel():
                at = lo + int(both[0])
                self.shared.append((at, torch.zeros((int(both[-1]) + 1 - int(both[0]), *like.shape[1:]),
                                                    dtype=torch.float32, device=like.device)))

    def add(self, rows: slice, g: torch.Tensor) -> None:
        for at, acc in self.shared:
            lo, hi = max(rows.start, at), min(rows.stop, at + acc.shape[0])
            if lo < hi:
                acc[lo - at:hi - at] += g[lo - rows.start:hi - rows.start]
                if rows.start < lo:
                    self.out[rows.start:lo] = g[:lo - rows.start]
                if hi < rows.stop:
                    self.out[hi:rows.stop] = g[hi - rows.start:]
                return
        self.out[rows] = g

    def result(self) -> torch.Tensor:
        for at, acc in self.shared:
            self.out[at:at + acc.shape[0]] = acc
        return self.out


def query_grads(plan, q) -> SpanSum:
    """dq of this rank's query runs: each pair's rows (`Plan.pairs_with`) are a contribution."""
    spans = [(r.start, r.stop) for owner in range(plan.world) for _, r, *_ in plan.pairs_with(owner)]
    return SpanSum(q, [(at, at + qe - qs) for qs, qe, at in plan.q_runs], spans)


class KeyGrads:
    """dK and dV of this rank's own shard: its own pairs' key rows and the slices it sends others (their gradients
    come back) are the contributions, so a key only this rank's rows keep costs no float32 pass."""

    def __init__(self, plan, k):
        spans = [(r.start, r.stop) for *_, r, _ in plan.pairs_with(plan.rank)]
        spans += [ab for p in range(plan.world) if p != plan.rank for ab in plan.transfer(p, plan.rank)]
        whole = [(0, k.shape[0])]  # one segment: a transfer joins slices adjacent in the shard across its runs
        self.parts = (SpanSum(k, whole, spans), SpanSum(k, whole, spans))

    def add(self, which: int, rows: slice, g: torch.Tensor) -> None:
        self.parts[which].add(rows, g)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parts[0].result(), self.parts[1].result()


def add_kv(dkv, which: int, rows: slice, g: torch.Tensor) -> None:
    """A pair's dK (which 0) or dV (1) into the buffer a transport gave for those keys: the own shard's KeyGrads,
    or a received copy's float32 buffer, which goes back to its owner (an in-place add casts as it reads)."""
    if isinstance(dkv, KeyGrads):
        dkv.add(which, rows, g)
    else:
        dkv[which, rows] += g


def run(plan: Plan, transport, q, k, v, return_lse: bool):
    """The strategies' common tail: the pairs through ContextParallel, then the sink merged once per row."""
    learnable = [plan.params[n] for n in plan.learnable]
    out, lse = ContextParallel.apply(plan, transport, q, k, v, *learnable)
    values = {**plan.bound.scalars, **plan.bound.tensors}
    sink = sink_state(plan.base, values, q.shape[0], plan.num_qo_heads, plan.num_kv_heads, out)
    if sink is not None:  # exp(sink) joins each row's denominator once: 2^lse' = 2^lse + 2^sink_lse
        total = torch.logaddexp2(lse, sink[1])
        out = (out.float() * torch.exp2(lse - total).unsqueeze(-1)).to(out.dtype)
        lse = total
    return (out, lse) if return_lse else out
