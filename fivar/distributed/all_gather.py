"""All-gather attention: every rank gets every other rank's keys and values at once, then attends them locally;
the backward sends each copy's gradient back to its owner at once. Each rank gets only the slices of each shard that
its query rows keep (`Plan.slices`: the mask's classification sizes every transfer), so the gather is one
`all_to_all_single` of those slices (the whole shards, as an all-gather moves them, where the mask keeps everything),
and the gradients return by one more. The own shard is attended while the exchange is in flight. Fewer, larger
messages than the ring; memory: every slice this rank keeps at once."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .core import KeyGrads, Plan, Transport, add_returned, run


class AllGatherTransport(Transport):
    def __init__(self, plan: Plan):
        self.plan = plan
        self._mine = None

    def _counts(self):
        """(sent, received): rows this rank sends each rank and receives from each (0 with itself)."""
        plan = self.plan
        rows = lambda r, o: 0 if r == o else sum(b - a for a, b in plan.transfer(r, o))  # noqa: E731
        return ([rows(p, plan.rank) for p in range(plan.world)], [rows(plan.rank, p) for p in range(plan.world)])

    def _exchange(self, send, counts_in, counts_out, unit: int):
        """Starts one all_to_all_single of `send` (flat, counts_out[p] rows of `unit` elements for rank p);
        (work or None, flat buffer receiving counts_in[p] rows from rank p alike). Every rank knows every count,
        so where nothing travels at all no rank calls it."""
        plan = self.plan
        recv = send.new_empty(sum(counts_in) * unit)
        if not any(plan.slices.values()):
            return None, recv
        work = dist.all_to_all_single(recv, send, [n * unit for n in counts_in], [n * unit for n in counts_out],
                                      group=plan.group, async_op=True)
        return work, recv

    @staticmethod
    def _parts(flat, counts, like):
        """flat cut into [2, counts[p], Hkv, D] per rank p (k's rows before v's)."""
        parts, at = [], 0
        for n in counts:
            size = 2 * n * like.shape[1] * like.shape[2]
            parts.append(flat[at:at + size].view(2, n, *like.shape[1:]))
            at += size
        return parts

    def _gathered(self, k, v):
        """Yields (owner, k, v) of the own shard at once, then every other rank's slices once they arrive."""
        plan = self.plan
        sent, received = self._counts()
        send = k.new_empty(2 * sum(sent) * k.shape[1] * k.shape[2])
        for p, part in enumerate(self._parts(send, sent, k)):
            at = 0
            for a, b in plan.transfer(p, plan.rank) if p != plan.rank else ():
                part[0, at:at + b - a], part[1, at:at + b - a] = k[a:b], v[a:b]
                at += b - a
        work, recv = self._exchange(send, received, sent, 2 * k.shape[1] * k.shape[2])
        yield plan.rank, k, v
        if work is not None:
            work.wait()
        for owner, part in enumerate(self._parts(recv, received, k)):
            if owner != plan.rank:
                yield owner, part[0], part[1]

    def forward(self, k, v):
        yield from self._gathered(k, v)

    def backward(self, k, v):
        plan = self.plan
        sent, received = self._counts()
        self._mine = KeyGrads(plan, k)
        # every copy's gradients side by side, as the return exchange sends them
        grads = torch.zeros(2 * sum(received) * k.shape[1] * k.shape[2], dtype=torch.float32, device=k.device)
        parts = self._parts(grads, received, k)
        for owner, ko, vo in self._gathered(k, v):
            yield owner, ko, vo, self._mine if owner == plan.rank else parts[owner]
        work, back = self._exchange(grads, sent, received, 2 * k.shape[1] * k.shape[2])
        if work is not None:
            work.wait()
        for p, part in enumerate(self._parts(back, sent, k)):
            if p != plan.rank:
                add_returned(self._mine, part, plan.transfer(p, plan.rank))

    def result(self):
        return self._mine.result()


def all_gather_attention(variant, q, k, v, sharding, *, causal: bool = False, sm_scale: float | None = None,
                         backend: str = "auto", group=None, return_lse: bool = False, **params):
    """As `ring_attention` (same arguments and results), with the key/value slices each rank keeps moved at once
    (one all_to_all_single; the gradients back by one more)."""
    plan = Plan(variant, q, k, v, sharding, causal=causal, sm_scale=sm_scale, backend=backend, group=group,
                params=params, strategy="all_gather_attention")
    return run(plan, AllGatherTransport(plan), q, k, v, return_lse)
