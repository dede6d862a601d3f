"""Ring attention: each rank sends each other rank the slices of its key/value shard that the other's query rows
keep (`Plan.slices`, sized by the mask's classification: nothing where a pair keeps no key), directly, by
torch.distributed point-to-point ops (`batch_isend_irecv`), in W - 1 steps: at step s rank r sends to r+s and
receives from r-s, so every copy arrives from its owner and none is forwarded. Every transfer is posted before the
compute it overlaps and waited for after it: step s posts step s+1's send/recv, attends the keys of step s, then
waits (on GPUs NCCL runs the transfer on its own stream; on gloo it is asynchronous). Memory: the own shard and two
received copies.

In the backward the slices travel again, and each step's float32 dK/dV of the copy it attended goes straight back
to its owner, which adds it into the rows it sent: posted after the step's compute and waited for after the next
step's, so it overlaps that compute too. Memory there: the copies, the own shard's gradient, and two gradient
buffers in flight (the one leaving, the one arriving)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .core import KeyGrads, Plan, Transport, add_returned, p2p_ready, run


def _wait(requests) -> None:
    for req in requests:
        req.wait()


class RingTransport(Transport):
    def __init__(self, plan: Plan):
        self.plan = plan
        self._dkv = None

    def _peer(self, offset: int) -> int:
        """The global rank `offset` places after this one in the group."""
        plan = self.plan
        r = (plan.rank + offset) % plan.world
        return dist.get_global_rank(plan.group, r) if plan.group is not None else r

    def _post(self, sends, recvs):
        """Starts the point-to-point ops [(tensor, peer)]; their requests (none where nothing travels)."""
        ops = [dist.P2POp(dist.isend, t, peer, self.plan.group) for t, peer in sends] + \
              [dist.P2POp(dist.irecv, t, peer, self.plan.group) for t, peer in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    def _keys(self, k, v, step: int):
        """Starts step `step`'s exchange: this rank's slices for rank r+step, rank r-step's for this one;
        (requests, k, v) of what arrives (empty where this rank keeps none of that rank's keys)."""
        plan = self.plan
        to, frm = (plan.rank + step) % plan.world, (plan.rank - step) % plan.world
        sends = [(x[a:b], self._peer(step)) for a, b in plan.transfer(to, plan.rank) for x in (k, v)]
        rows = plan.transfer(plan.rank, frm)
        buf = k.new_empty((2, sum(b - a for a, b in rows), *k.shape[1:]))
        recvs, at = [], 0
        for a, b in rows:  # one message each for k and v per slice, in the order the owner sends them
            recvs += [(buf[0, at:at + b - a], self._peer(-step)), (buf[1, at:at + b - a], self._peer(-step))]
            at += b - a
        return self._post(sends, recvs), buf[0], buf[1]

    def _grads(self, dkv, step: int):
        """Starts sending step `step`'s gradients back to their owner (rank r-step) and receiving those of rank
        r+step for the slices this rank sent it; (requests, buffer)."""
        plan = self.plan
        n = sum(b - a for a, b in plan.transfer((plan.rank + step) % plan.world, plan.rank))
        back = dkv.new_empty((2, n, *dkv.shape[2:]))
        sends = [(dkv, self._peer(-step))] if dkv.shape[1] else []
        return self._post(sends, [(back, self._peer(step))] if n else []), back

    def forward(self, k, v):
        plan = self.plan
        k, v = k.contiguous(), v.contiguous()
        p2p_ready(plan.group, k.device)
        held = (k, v)
        for step in range(plan.world):
            pending = self._keys(k, v, step + 1) if step < plan.world - 1 else None
            yield (plan.rank - step) % plan.world, *held
            if pending is not None:
                _wait(pending[0])
                held = pending[1:]

    def backward(self, k, v):
        plan = self.plan
        k, v = k.contiguous(), v.contiguous()
        p2p_ready(plan.group, k.device)
        mine = self._dkv = KeyGrads(plan, k)
        held, returning = (k, v), None  # returning: (requests, buffer, step) of the gradients coming back
        for step in range(plan.world):
            pending = self._keys(k, v, step + 1) if step < plan.world - 1 else None
            dkv = mine if step == 0 else torch.zeros((2, *held[0].shape), dtype=torch.float32, device=k.device)
            yield (plan.rank - step) % plan.world, *held, dkv
            if returning is not None:  # in flight during this step's compute
                self._add(*returning)
            returning = (*self._grads(dkv, step), step) if step else None
            if pending is not None:
                _wait(pending[0])
                held = pending[1:]
        if returning is not None:
            self._add(*returning)

    def _add(self, requests, back, step: int) -> None:
        plan = self.plan
        _wait(requests)
        add_returned(self._dkv, back, plan.transfer((plan.rank + step) % plan.world, plan.rank))

    def result(self):
        return self._dkv.result()


def ring_attention(variant, q, k, v, sharding, *, causal: bool = False, sm_scale: float | None = None,
                   backend: str = "auto", group=None, return_lse: bool = False, **params):
    """Context-parallel prefill of `variant` over the ranks of `group`: q/k/v are this rank's rows of one sequence
    (`sharding` says which positions), positions are global, each rank gets only the keys its rows keep (pairs
    the mask empties are skipped). Returns this
    rank's out [rows, Hq, D] (and lse [rows, Hq], log2, with return_lse). Differentiable in q, k, v and the
    learnable tensor params (their gradient is this rank's share: sum it over the group, as for any replicated
    weight)."""
    plan = Plan(variant, q, k, v, sharding, causal=causal, sm_scale=sm_scale, backend=backend, group=group,
                params=params, strategy="ring_attention")
    return run(plan, RingTransport(plan), q, k, v, return_lse)
