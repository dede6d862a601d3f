"""Ring attention: each rank's key/value shard travels once around the ring (rank r sends to r+1 and receives from
r-1, by torch.distributed point-to-point ops); while one shard is attended the next is in flight. Memory: two
shards at a time. In the backward the shard travels again, with a float32 gradient buffer that collects every
rank's contribution and arrives back at its owner after the last step."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .core import Plan, Transport, padded, run


class RingTransport(Transport):
    def __init__(self, plan: Plan):
        self.plan = plan
        self.rows = plan.sharding.max_length
        world, rank, group = plan.world, plan.rank, plan.group
        self.next = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.prev = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
        self._dkv = None

    def _exchange(self, send: torch.Tensor):
        """Starts sending `send` to the next rank and receiving the previous rank's buffer; (requests, buffer)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.plan.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.plan.group)]
        return dist.batch_isend_irecv(ops), recv

    def forward(self, k, v):
        plan = self.plan
        buf = padded(k, v, self.rows)
        for step in range(plan.world):
            owner = (plan.rank - step) % plan.world
            pending = self._exchange(buf) if step < plan.world - 1 else None
            n = plan.sharding.length(owner)
            yield owner, buf[0, :n], buf[1, :n]
            if pending is not None:
                for req in pending[0]:
                    req.wait()
                buf = pending[1]

    def backward(self, k, v):
        plan = self.plan
        buf = padded(k, v, self.rows)
        dkv = torch.zeros(buf.shape, dtype=torch.float32, device=buf.device)
        for step in range(plan.world):
            owner = (plan.rank - step) % plan.world
            pending = self._exchange(buf) if step < plan.world - 1 else None
            n = plan.sharding.length(owner)
            yield owner, buf[0, :n], buf[1, :n], dkv
            if plan.world > 1:  # the gradients follow their shard; after the last step each is back at its owner
                reqs, dkv = self._exchange(dkv)
                for req in reqs:
                    req.wait()
            if pending is not None:
                for req in pending[0]:
                    req.wait()
                buf = pending[1]
        self._dkv = dkv

    def result(self):
        n = self.plan.sharding.length(self.plan.rank)
        return self._dkv[0, :n], self._dkv[1, :n]


def ring_attention(variant, q, k, v, sharding, *, causal: bool = False, sm_scale: float | None = None,
                   backend: str = "auto", group=None, return_lse: bool = False, **params):
    """Context-parallel prefill of `variant` over the ranks of `group`: q/k/v are this rank's rows of one sequence
    (`sharding` says which positions), positions are global, shards the mask empties are skipped. Returns this
    rank's out [rows, Hq, D] (and lse [rows, Hq], log2, with return_lse). Differentiable in q, k, v and the
    learnable tensor params (their gradient is this rank's share: sum it over the group, as for any replicated
    weight)."""
    plan = Plan(variant, q, k, v, sharding, causal=causal, sm_scale=sm_scale, backend=backend, group=group,
                params=params, strategy="ring_attention")
    return run(plan, RingTransport(plan), q, k, v, return_lse)
