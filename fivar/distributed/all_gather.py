"""All-gather attention: every rank gathers every key/value shard at once (one all_gather), then attends them
locally; the backward sends each shard's gradient back to its owner with one reduce per rank. Fewer, larger
messages than the ring; memory: the whole sequence's keys and values on every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .core import Plan, Transport, padded, run


class AllGatherTransport(Transport):
    def __init__(self, plan: Plan):
        self.plan = plan
        self.rows = plan.sharding.max_length
        self._mine = None

    def _gathered(self, k, v):
        buf = padded(k, v, self.rows)
        parts = [torch.empty_like(buf) for _ in range(self.plan.world)]
        dist.all_gather(parts, buf, group=self.plan.group)
        return parts

    def forward(self, k, v):
        for owner, buf in enumerate(self._gathered(k, v)):
            n = self.plan.sharding.length(owner)
            yield owner, buf[0, :n], buf[1, :n]

    def backward(self, k, v):
        plan = self.plan
        grads = []
        for owner, buf in enumerate(self._gathered(k, v)):
            n = plan.sharding.length(owner)
            dkv = torch.zeros(buf.shape, dtype=torch.float32, device=buf.device)
            yield owner, buf[0, :n], buf[1, :n], dkv
            grads.append(dkv)
        for owner, dkv in enumerate(grads):  # each owner receives the sum of every rank's contribution
            dst = dist.get_global_rank(plan.group, owner) if plan.group is not None else owner
            dist.reduce(dkv, dst=dst, group=plan.group)
        self._mine = grads[plan.rank]

    def result(self):
        n = self.plan.sharding.length(self.plan.rank)
        return self._mine[0, :n], self._mine[1, :n]


def all_gather_attention(variant, q, k, v, sharding, *, causal: bool = False, sm_scale: float | None = None,
                         backend: str = "auto", group=None, return_lse: bool = False, **params):
    """As `ring_attention` (same arguments and results), with the key/value shards gathered by one all_gather."""
    plan = Plan(variant, q, k, v, sharding, causal=causal, sm_scale=sm_scale, backend=backend, group=group,
                params=params, strategy="all_gather_attention")
    return run(plan, AllGatherTransport(plan), q, k, v, return_lse)
