"""What the strategies share: the call's checks, the (query run, key run) pairs to compute, one pair's attention on
global positions, and the autograd function that merges pairs by their LSEs and composes fivar's own backward per
pair. A strategy (ring, all-gather) only says how the key/value shards reach each rank and how their gradients get
back (`Transport`)."""
from __future__ import annotations

import math

import torch

from ..errors import FivarError
from ..runtime.lse import empty_lse, merge_states
from ..runtime.plan_cache import PlanCache
from ..spec.inputs import bind_params
from .positions import KERNEL_CAUSAL, MASK_CAUSAL, global_variant, pair_causality, shifts, sink_state
from .sharding import Sharding

BACKENDS = ("auto", "triton", "fa2", "fa3", "reference")
LN2 = math.log(2.0)
#: Plan.keep per call layout: the classification copies tensor params to the host and walks the mask's intervals,
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
        self.keep = _KEEPS.get(("keep", variant, self.causal, sharding.seq_len, sharding.runs, self.rank,
                                self.num_qo_heads, self.num_kv_heads, self.params), self._pairs_to_compute)

    def _pairs_to_compute(self) -> dict:
        """keep[(q run, owner, kv run)]: False where the mask (with causal) keeps no pair of positions, by fivar's
        interval classification (fivar.spec.sparsity), which never calls a block empty that keeps a pair."""
        from ..spec import ir
        from ..spec.sparsity import EMPTY, classify_bounds
        kv = [(o, j, s, e) for o in range(self.world) for j, (s, e) in enumerate(self.sharding.runs[o])]
        if not self.q_runs or not kv:
            return {}
        program = self.base.ir.mask
        if program is None and not self.causal:
            return {(i, o, j): True for i in range(len(self.q_runs)) for o, j, _, _ in kv}
        if program is None:
            program = ir.Program([], ir.Const(ir.BOOL, True))
        kinds = classify_bounds(
            program, torch.tensor([s for s, _, _ in self.q_runs]), torch.tensor([e - 1 for _, e, _ in self.q_runs]),
            torch.tensor([s for _, _, s, _ in kv]), torch.tensor([e - 1 for _, _, _, e in kv]),
            scalars=dict(self.bound.scalars), tensors={n: t.detach().cpu() for n, t in self.bound.tensors.items()},
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, causal=self.causal)
        return {(i, o, j): bool(kinds[i, c] != EMPTY) for i in range(len(self.q_runs))
                for c, (o, j, _, _) in enumerate(kv)}

    def kv_runs(self, owner: int):
        """(index, start, end, row offset in the owner's shard) of each run the owner holds."""
        at = 0
        for j, (s, e) in enumerate(self.sharding.runs[owner]):
            yield j, s, e, at
            at += e - s

    def pair(self, q, k, v, q_start, kv_start, params=None, grad=False):
        """(out, lse) of query rows at q_start.. over keys at kv_start.., on global positions."""
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
        call = derived.attention if grad else derived.prefill
        return call(q, k, v, causal=causal, sm_scale=self.sm_scale, backend=self.backend, return_lse=True, **p)

    def pairs_with(self, owner: int):
        """(q run index, q rows, q_start, kv rows slice, kv_start) of every kept pair with the owner's shard."""
        for i, (qs, qe, qat) in enumerate(self.q_runs):
            for j, ks, ke, kat in self.kv_runs(owner):
                if self.keep[(i, owner, j)]:
                    yield i, slice(qat, qat + qe - qs), qs, slice(kat, kat + ke - ks), ks


class Transport:
    """How key/value shards travel: `forward(k, v)` yields (owner, k, v) for every rank's shard; `backward(k, v)`
    yields (owner, k, v, dkv) where dkv [2, rows, Hkv, D] float32 takes the owner's gradient contributions, and
    after the loop `result()` is this rank's own dk/dv summed over all ranks."""


def padded(k, v, rows: int) -> torch.Tensor:
    """k and v stacked [2, rows, Hkv, D], zero rows after the shard's own: every transfer has one shape."""
    buf = k.new_zeros((2, rows, *k.shape[1:]))
    buf[0, :k.shape[0]], buf[1, :v.shape[0]] = k, v
    return buf


class ContextParallel(torch.autograd.Function):
    """(out, lse) of this rank's queries over every rank's keys (without the sink); backward composes the variant's
    own differentiable attention per pair, given the merged out and lse."""

    @staticmethod
    def forward(ctx, plan, transport, q, k, v, *learnable):
        states = [[] for _ in plan.q_runs]
        with torch.no_grad():
            for owner, ko, vo in transport.forward(k, v):
                for i, qrows, qs, kvrows, ks in plan.pairs_with(owner):
                    states[i].append(plan.pair(q[qrows], ko[kvrows], vo[kvrows], qs, ks))
            outs, lses = [], []
            for (qs, qe, _), st in zip(plan.q_runs, states):
                if st:
                    o, lse = merge_states([s[0] for s in st], [s[1].float() for s in st])
                else:  # the mask keeps no key of any shard for these rows
                    o = q.new_zeros(qe - qs, q.shape[1], v.shape[2])
                    lse = empty_lse(o)
                outs.append(o)
                lses.append(lse)
            out = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2])
            lse = torch.cat(lses) if lses else empty_lse(out)
        ctx.plan, ctx.transport = plan, transport
        ctx.save_for_backward(q, k, v, out, lse, *learnable)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        plan, transport = ctx.plan, ctx.transport
        q, k, v, out, lse, *learnable = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dparams = [torch.zeros_like(t, dtype=torch.float32) for t in learnable]
        dout = torch.zeros_like(out) if dout is None else dout
        dlse = torch.zeros_like(lse) if dlse is None else dlse
        for owner, ko, vo, dkv in transport.backward(k, v):
            for _, qrows, qs, kvrows, ks in plan.pairs_with(owner):
                leaves = [t.detach().requires_grad_() for t in learnable]
                params = {**plan.params, **dict(zip(plan.learnable, leaves))}
                qr, kr, vr = (x.detach().requires_grad_() for x in (q[qrows], ko[kvrows], vo[kvrows]))
                with torch.enable_grad():
                    o_c, l_c = plan.pair(qr, kr, vr, qs, ks, params=params, grad=True)
                total, do = lse[qrows], dout[qrows].float()
                # this pair's share of each row: 2^(lse_c - lse); out = sum_c share_c * out_c, lse = log2 sum 2^lse_c
                share = torch.where(torch.isfinite(l_c) & torch.isfinite(total), torch.exp2(l_c.float() - total),
                                    torch.zeros((), device=q.device))
                g_o = (share.unsqueeze(-1) * do).to(o_c.dtype)
                g_l = share * (LN2 * (do * (o_c.detach().float() - out[qrows].float())).sum(-1) + dlse[qrows].float())
                grads = torch.autograd.grad((o_c, l_c), [qr, kr, vr, *leaves], (g_o, g_l.to(l_c.dtype)),
                                            allow_unused=True)
                dq[qrows] += grads[0].float()
                if grads[1] is not None:
                    dkv[0, kvrows] += grads[1].float()
                if grads[2] is not None:
                    dkv[1, kvrows] += grads[2].float()
                for acc, g in zip(dparams, grads[3:]):
                    if g is not None:
                        acc += g.float()
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
