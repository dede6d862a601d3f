"""Ring attention: each rank's key/value shard travels once around the ring (rank r sends to r+1 and receives from
r-1, by torch.distributed point-to-point ops, `batch_isend_irecv`). Every transfer is posted before the compute it
overlaps and waited for after it: step s posts shard s+1's send/recv, attends shard s, then waits (on GPUs NCCL runs
the transfer on its own stream; on gloo it is asynchronous). Memory: two shards at a time.

In the backward the shard travels again, and a float32 gradient buffer collects every rank's contribution to a
shard's dK/dV and arrives back at its owner after the last step. Step s's contributions go into a fresh buffer; the
buffer received from the previous rank (posted at the end of step s-1, so in flight during step s's compute) is
added to it after the compute, and the sum is posted on to the next rank, to be waited for after step s+1's
compute. Memory there: two shards, and three gradient buffers (this step's, the one arriving, the one leaving)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .core import Plan, Transport, padded, run


def _wait(requests) -> None:
    for req in requests:
        req.wait()


class RingTransport(Transport):
    def __init__(self, plan: Plan):
        self.plan = plan
        self.rows = plan.sharding.max_length
        world, rank, group = plan.world, plan.rank, plan.group
        self.next = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.prev = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
        self._dkv = None

    def _exchange(self, *sends: torch.Tensor):
        """Starts sending `sends` to the next rank and receiving the previous rank's alike; (requests, received)."""
        recvs = tuple(torch.empty_like(t) for t in sends)
        ops = [dist.P2POp(dist.isend, t, self.next, self.plan.group) for t in sends] + \
              [dist.P2POp(dist.irecv, t, self.prev, self.plan.group) for t in recvs]
        return dist.batch_isend_irecv(ops), recvs

    def _shards(self, k, v):
        """k and v as the ring sends them, [rows, Hkv, D] each: the caller's own where they are that long (no copy),
        else zero-padded (every transfer has one shape)."""
        if k.shape[0] == self.rows and k.is_contiguous() and v.is_contiguous():
            return k, v
        buf = padded(k, v, self.rows)
        return buf[0], buf[1]

    def forward(self, k, v):
        plan = self.plan
        buf = self._shards(k, v)
        for step in range(plan.world):
            owner = (plan.rank - step) % plan.world
            pending = self._exchange(*buf) if step < plan.world - 1 else None
            n = plan.sharding.length(owner)
            yield owner, buf[0][:n], buf[1][:n]
            if pending is not None:
                _wait(pending[0])
                buf = pending[1]

    def backward(self, k, v):
        plan = self.plan
        buf = self._shards(k, v)
        arriving = None  # (requests, buffer): the gradients of this step's shard so far, from the previous rank
        dkv = None
        for step in range(plan.world):
            owner = (plan.rank - step) % plan.world
            pending = self._exchange(*buf) if step < plan.world - 1 else None
            n = plan.sharding.length(owner)
            dkv = torch.zeros((2, *buf[0].shape), dtype=torch.float32, device=buf[0].device)
            yield owner, buf[0][:n], buf[1][:n], dkv
            if arriving is not None:  # in flight during this step's compute
                _wait(arriving[0])
                dkv += arriving[1][0]
            # the gradients follow their shard, overlapping the next step's compute; after the last step each is
            # back at its owner
            arriving = self._exchange(dkv) if plan.world > 1 else None
            if pending is not None:
                _wait(pending[0])
                buf = pending[1]
        if arriving is not None:
            _wait(arriving[0])
            dkv = arriving[1][0]
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
