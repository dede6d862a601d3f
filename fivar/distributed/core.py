"""What the strategies share: the call's checks, the (query run, key run) pairs to compute, one pair's attention on
global positions, and the autograd function that merges pairs by their LSEs and runs fivar's generated backward per
pair. A strategy (ring, all-gather) only says how the key/value shards reach each rank and how their gradients get
back (`Transport`)."""
from __future__ import annotations

import math

import torch

from ..errors import FivarError
from ..runtime.lse import merge_states
from ..runtime.plan_cache import PlanCache
from ..spec.inputs import bind_params
from .positions import KERNEL_CAUSAL, MASK_CAUSAL, global_variant, pair_causality, shifts, sink_state
from .sharding import Sharding

BACKENDS = ("auto", "triton", "fa2", "fa3", "reference")
LN2 = math.log(2.0)
#: the query rows a pair's row range is trimmed by (fivar's classification over blocks of this many rows)
ROW_BLOCK = 512
#: Plan.rows per call layout: the classification copies tensor params to the host and walks the mask's intervals,
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
        self.rows = _KEEPS.get(("rows", variant, self.causal, sharding.seq_len, sharding.runs, self.rank,
                                self.num_qo_heads, self.num_kv_heads, self.params), self._pairs_to_compute)
        #: keep[(q run, owner, kv run)]: whether the pair is computed at all
        self.keep = {pair: rows is not None for pair, rows in self.rows.items()}

    def _pairs_to_compute(self) -> dict:
        """rows[(q run, owner, kv run)]: the query rows (lo, hi) within the run that keep any key of the kv run
        (by fivar's interval classification, fivar.spec.sparsity, which never calls a block empty that keeps a
        pair, over blocks of ROW_BLOCK rows), None where none does. Only whole blocks are trimmed, and a pair's rows
        keep the run's last row where the pair is causal (its rows and keys then still end together:
        pair_causality)."""
        from ..spec import ir
        from ..spec.sparsity import EMPTY, classify_bounds
        kv = [(o, j, s, e) for o in range(self.world) for j, (s, e) in enumerate(self.sharding.runs[o])]
        if not self.q_runs or not kv:
            return {}
        program = self.base.ir.mask
        if program is None and not self.causal:
            return {(i, o, j): (0, qe - qs) for i, (qs, qe, _) in enumerate(self.q_runs) for o, j, _, _ in kv}
        if program is None:
            program = ir.Program([], ir.Const(ir.BOOL, True))
        blocks = [(i, b, min(b + ROW_BLOCK, qe - qs)) for i, (qs, qe, _) in enumerate(self.q_runs)
                  for b in range(0, qe - qs, ROW_BLOCK)]
        kinds = classify_bounds(
            program, torch.tensor([self.q_runs[i][0] + lo for i, lo, _ in blocks]),
            torch.tensor([self.q_runs[i][0] + hi - 1 for i, _, hi in blocks]),
            torch.tensor([s for _, _, s, _ in kv]), torch.tensor([e - 1 for _, _, _, e in kv]),
            scalars=dict(self.bound.scalars), tensors={n: t.detach().cpu() for n, t in self.bound.tensors.items()},
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, causal=self.causal)
        rows = {}
        for c, (o, j, ks, ke) in enumerate(kv):
            for i, (qs, qe, _) in enumerate(self.q_runs):
                kept = [(lo, hi) for b, (bi, lo, hi) in enumerate(blocks) if bi == i and kinds[b, c] != EMPTY]
                if not kept:
                    rows[(i, o, j)] = None
                    continue
                lo, hi = kept[0][0], kept[-1][1]
                if pair_causality(self.causal, qs, qe - qs, ks, ke - ks) == KERNEL_CAUSAL:
                    hi = qe - qs
                rows[(i, o, j)] = (lo, hi)
        return rows

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
        g_l = share * (LN2 * (do * (o_c.detach().float() - out.float())).sum(-1) + (0 if dlse is None else dlse.float()))
        grads = torch.autograd.grad((o_c, l_c), [qr, kr, vr, *leaves.values()], (g_o, g_l.to(l_c.dtype)),
                                    allow_unused=True)
        return (*grads[:3], dict(zip(leaves, grads[3:])))

    def pairs_with(self, owner: int):
        """(q run index, q rows slice, q_start, kv rows slice, kv_start) of every kept pair with the owner's shard: the
        run's rows that keep any of the pair's keys, q_start the global position of the first."""
        for i, (qs, qe, qat) in enumerate(self.q_runs):
            for j, ks, ke, kat in self.kv_runs(owner):
                rows = self.rows[(i, owner, j)]
                if rows is not None:
                    yield i, slice(qat + rows[0], qat + rows[1]), qs + rows[0], slice(kat, kat + ke - ks), ks


class Transport:
    """How key/value shards travel: `forward(k, v)` yields (owner, k, v) for every rank's shard; `backward(k, v)`
    yields (owner, k, v, dkv) where dkv [2, rows, Hkv, D] float32 takes the owner's gradient contributions, and
    after the loop `result()` is this rank's own dk/dv summed over all ranks."""


def padded(k, v, rows: int) -> torch.Tensor:
    """k and v stacked [2, rows, Hkv, D], zero rows after the shard's own: every transfer has one shape."""
    buf = k.new_zeros((2, rows, *k.shape[1:]))
    buf[0, :k.shape[0]], buf[1, :v.shape[0]] = k, v
    return buf


def _merge_into(out, lse, o_new, lse_new) -> None:
    """(out, lse) <- their merge with (o_new, lse_new), in place (fivar.triton_ops.merge_states on GPUs)."""
    if out.is_cuda:
        from ..triton_ops.merge_states import merge_into
        merge_into(out, lse, o_new, lse_new)
        return
    o, s = merge_states([out, o_new.to(out.dtype)], [lse, lse_new])
    out.copy_(o)
    lse.copy_(s)


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
                        _merge_into(out[qrows], lse[qrows], o_c, lse_c.float())
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
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dparams = [torch.zeros_like(t, dtype=torch.float32) for t in learnable]
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dlse = None if dlse is None else dlse.contiguous()  # None: the loss does not read the lse
        for owner, ko, vo, dkv in transport.backward(k, v):
            for _, qrows, qs, kvrows, ks in plan.pairs_with(owner):
                grads = plan.pair_grads(q[qrows], ko[kvrows], vo[kvrows], qs, ks, out[qrows], lse[qrows],
                                        dout[qrows], None if dlse is None else dlse[qrows])
                dq[qrows] += grads[0].float()
                if grads[1] is not None:
                    dkv[0, kvrows] += grads[1].float()
                if grads[2] is not None:
                    dkv[1, kvrows] += grads[2].float()
                for name, acc in zip(plan.learnable, dparams):
                    if grads[3].get(name) is not None:
                        acc += grads[3][name].float()
        dk, dv = transport.result()
        return (None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                *(g.to(t.dtype) for g, t in zip(dparams, learnable)))


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
