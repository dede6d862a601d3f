"""Which global sequence positions each rank of a context-parallel group holds.

A rank's shard is a list of contiguous runs [start, end) of the sequence; its q, k and v rows are those runs'
rows, back to back in run order. `zigzag` balances causal work: with R ranks the sequence is cut into 2R chunks
and rank r holds chunks r and 2R-1-r, so every rank has as many early (cheap) as late (costly) query rows.
`balanced` does the same for any mask: its 2R pieces hold equal attention work (the tiles the mask keeps, by fivar's
interval classification) rather than equal lengths, so packed documents of uneven lengths, a window or a prefix
split as evenly as causal does under zigzag; and where the work stays by the diagonal (a window), R contiguous
pieces of equal work, one run a rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FivarError

#: `balanced` leaves zigzag's equal rows for equal-work pieces only when that lowers the busiest rank's work by more
#: than this: uneven rows cost memory and uneven transfers (the longest shard's ranks send the most)
BALANCE_GAIN = 0.02


@dataclass(frozen=True)
class Sharding:
    """runs[r]: the (start, end) runs of global positions rank r holds, in the order its rows are stored."""
    seq_len: int
    runs: tuple[tuple[tuple[int, int], ...], ...]

    def __post_init__(self):
        # a rank's runs that follow each other in position as in storage are one run (one kernel call a pair, not
        # two: zigzag's middle chunks on 2 ranks)
        object.__setattr__(self, "runs", tuple(_joined(runs) for runs in self.runs))
        seen = torch.zeros(self.seq_len, dtype=torch.int32)
        for r, runs in enumerate(self.runs):
            for s, e in runs:
                if not (isinstance(s, int) and isinstance(e, int) and 0 <= s < e <= self.seq_len):
                    raise FivarError(f"sharding: rank {r}'s run ({s}, {e}) is not a non-empty range inside "
                                     f"[0, {self.seq_len})")
                seen[s:e] += 1
        if self.seq_len and not bool((seen == 1).all()):
            pos = int(torch.nonzero(seen != 1)[0])
            raise FivarError(f"sharding: position {pos} is held by {int(seen[pos])} ranks; every position of the "
                             f"{self.seq_len} must be held by exactly one")

    @property
    def world_size(self) -> int:
        return len(self.runs)

    def length(self, rank: int) -> int:
        """How many rows rank `rank` holds."""
        return sum(e - s for s, e in self.runs[rank])

    @property
    def max_length(self) -> int:
        return max((self.length(r) for r in range(self.world_size)), default=0)

    @staticmethod
    def of_lengths(lengths) -> "Sharding":
        """Contiguous shards of the given lengths (a length may be 0: a rank with no rows)."""
        runs, at = [], 0
        for n in lengths:
            n = int(n)
            if n < 0:
                raise FivarError(f"sharding: shard lengths must be >= 0, got {list(lengths)}")
            runs.append(((at, at + n),) if n else ())
            at += n
        return Sharding(at, tuple(runs))

    @staticmethod
    def contiguous(seq_len: int, world_size: int) -> "Sharding":
        """Rank r holds the r-th of `world_size` near-equal contiguous pieces."""
        _check_split(seq_len, world_size)
        bounds = [seq_len * r // world_size for r in range(world_size + 1)]
        return Sharding.of_lengths([bounds[r + 1] - bounds[r] for r in range(world_size)])

    @staticmethod
    def zigzag(seq_len: int, world_size: int) -> "Sharding":
        """2 * world_size near-equal chunks; rank r holds chunk r and chunk 2R-1-r (balanced causal work)."""
        _check_split(seq_len, world_size)
        n = 2 * world_size
        bounds = [seq_len * c // n for c in range(n + 1)]
        chunk = [(bounds[c], bounds[c + 1]) for c in range(n)]
        return Sharding(seq_len, tuple(tuple(run for run in (chunk[r], chunk[n - 1 - r]) if run[1] > run[0])
                                       for r in range(world_size)))

    @staticmethod
    def balanced(variant, seq_len: int, world_size: int, *, causal: bool = False, num_qo_heads: int = 1,
                 num_kv_heads: int = 1, blocks: int = 256, **params) -> "Sharding":
        """A sharding whose ranks get near-equal attention work under the variant's mask: `zigzag` (equal rows),
        unless zigzag over pieces of equal work (2R pieces cut at block edges, each holding 1/2R of the tiles the
        mask keeps with `causal`; rank r holds pieces r and 2R-1-r) lowers the busiest rank's work by more than
        BALANCE_GAIN; and R contiguous pieces of equal work (one run a rank: one kernel call a pair, transfers only
        where the mask crosses a boundary) where they cost no more than that choice by BALANCE_GAIN, both by the
        busiest rank's work and by the ring in lockstep (`ring_cost`): a window or short documents, whose work stays
        near the diagonal, not causal attention. The work is counted over `blocks` x `blocks` tiles by fivar's
        interval classification; `params` are the variant's, as the call gets them (tensor params read on the host
        once)."""
        zig = Sharding.zigzag(seq_len, world_size)
        if seq_len == 0:
            return zig
        edges, weights = block_weights(variant, seq_len, blocks, causal=causal, num_qo_heads=num_qo_heads,
                                       num_kv_heads=num_kv_heads, params=params)
        cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(weights.sum(1), 0)])
        if float(cum[-1]) == 0:
            return zig

        def pieces(n):  # n pieces of equal work: cut at the first block edge where the work so far reaches c/n
            cuts = [0]
            for c in range(1, n):
                at = int(torch.searchsorted(cum, float(cum[-1]) * c / n))
                cuts.append(max(cuts[-1], int(edges[min(at, edges.numel() - 1)])))
            return [(a, b) for a, b in zip(cuts, cuts[1:] + [seq_len])]
        n = 2 * world_size
        chunk = pieces(n)
        even = Sharding(seq_len, tuple(tuple(run for run in (chunk[r], chunk[n - 1 - r]) if run[1] > run[0])
                                       for r in range(world_size)))
        contiguous = Sharding(seq_len, tuple((run,) if run[1] > run[0] else () for run in pieces(world_size)))
        busiest = lambda sh: max(float(_cover(edges, runs) @ weights.sum(1)) for runs in sh.runs)  # noqa: E731
        lockstep = lambda sh: ring_cost(sh, edges, weights)  # noqa: E731
        chosen = even if busiest(even) < (1 - BALANCE_GAIN) * busiest(zig) else zig
        # one run a rank where that costs no more by either bound of the ring's time: the busiest rank's work (ranks
        # never wait for each other) and the sum of each step's busiest pair (ranks in lockstep)
        if all(cost(contiguous) <= (1 + BALANCE_GAIN) * cost(chosen) for cost in (busiest, lockstep)):
            return contiguous
        return chosen

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s rows of a full-sequence tensor (dim 0 is the position)."""
        self._check_full(x)
        return torch.cat([x[s:e] for s, e in self.runs[rank]] or [x[:0]])

    def unshard(self, parts) -> torch.Tensor:
        """The full-sequence tensor from every rank's rows (parts[r] as `shard` gives it)."""
        parts = list(parts)
        if len(parts) != self.world_size:
            raise FivarError(f"sharding: unshard needs {self.world_size} parts, got {len(parts)}")
        pieces = []
        for r, p in enumerate(parts):
            if p.shape[0] != self.length(r):
                raise FivarError(f"sharding: part {r} has {p.shape[0]} rows, rank {r} holds {self.length(r)}")
            at = 0
            for s, e in self.runs[r]:
                pieces.append((s, p[at:at + e - s]))
                at += e - s
        pieces.sort(key=lambda sp: sp[0])
        return torch.cat([p for _, p in pieces]) if pieces else parts[0][:0]

    def _check_full(self, x: torch.Tensor):
        if x.shape[0] != self.seq_len:
            raise FivarError(f"sharding: the tensor has {x.shape[0]} positions, the sharding covers {self.seq_len}")


def _joined(runs) -> tuple:
    """`runs` with each run that starts where the one before it ends joined to it."""
    pair = lambda r: isinstance(r, (tuple, list)) and len(r) == 2 and all(isinstance(x, int) for x in r)  # noqa: E731
    out = []
    for run in runs:
        if out and pair(run) and pair(out[-1]) and out[-1][1] == run[0]:
            out[-1] = (out[-1][0], run[1])
        else:
            out.append(tuple(run) if pair(run) else run)
    return tuple(out)


def _check_split(seq_len, world_size):
    if not (isinstance(seq_len, int) and seq_len >= 0 and isinstance(world_size, int) and world_size >= 1):
        raise FivarError(f"sharding: seq_len must be an int >= 0 and world_size an int >= 1, got {seq_len!r} and "
                         f"{world_size!r}")


def block_weights(variant, seq_len: int, blocks: int, *, causal: bool, num_qo_heads: int, num_kv_heads: int,
                  params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(edges [m+1], weights [m, m]): the sequence cut into m <= `blocks` equal blocks, and per (query block, key
    block) the mask's (with causal) keep by fivar's interval classification (fivar.spec.sparsity): FULL 1, PARTIAL
    1/2 (a block much larger than a kernel's tile is about half kept tiles there: a diagonal, a document's edge)."""
    from ..spec import ir
    from ..spec.inputs import bind_params
    from ..spec.sparsity import FULL, PARTIAL, classify_bounds
    m = max(1, min(blocks, seq_len))
    edges = torch.tensor([seq_len * b // m for b in range(m + 1)], dtype=torch.int64)
    edges = torch.unique_consecutive(edges)
    lo, hi = edges[:-1], edges[1:] - 1
    program = variant.ir.mask
    if program is None:
        if not causal:
            return edges, torch.ones(lo.numel(), lo.numel(), dtype=torch.float64)
        program = ir.Program([], ir.Const(ir.BOOL, True))
    host = {k: t.detach().cpu() if isinstance(t, torch.Tensor) else t for k, t in params.items()}
    bound = bind_params(variant, host, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, batch_size=1,
                        device="cpu")
    kinds = classify_bounds(program, lo, hi, lo, hi, scalars=dict(bound.scalars),
                            tensors={k: t.detach().cpu() for k, t in bound.tensors.items()},
                            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, causal=causal)
    return edges, (kinds == FULL).double() + 0.5 * (kinds == PARTIAL).double()


def _cover(edges: torch.Tensor, runs) -> torch.Tensor:
    """float64 [m]: the share of each block's rows the runs hold."""
    lo, hi = edges[:-1].double(), edges[1:].double()
    share = torch.zeros(lo.numel(), dtype=torch.float64)
    for s, e in runs:
        share += ((hi.clamp(max=e) - lo.clamp(min=s)).clamp(min=0)) / (hi - lo)
    return share


def ring_cost(sharding: "Sharding", edges: torch.Tensor, weights: torch.Tensor) -> float:
    """The ring's work along its critical path: at step k rank r computes its rows against rank (r - k) mod R's
    keys, and a step lasts as long as its busiest rank's pair; a pair's work is the block weights its rows and keys
    cover (fractions of a block at a run's ends)."""
    cover = [_cover(edges, runs) for runs in sharding.runs]
    world = len(cover)
    pair = [[float(cover[r] @ weights @ cover[o]) for o in range(world)] for r in range(world)]
    return sum(max(pair[r][(r - k) % world] for r in range(world)) for k in range(world))
