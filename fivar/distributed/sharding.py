"""Which global sequence positions each rank of a context-parallel group holds.

A rank's shard is a list of contiguous runs [start, end) of the sequence; its q, k and v rows are those runs'
rows, back to back in run order. `zigzag` balances causal work: with R ranks the sequence is cut into 2R chunks
and rank r holds chunks r and 2R-1-r, so every rank has as many early (cheap) as late (costly) query rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FivarError


@dataclass(frozen=True)
class Sharding:
    """runs[r]: the (start, end) runs of global positions rank r holds, in the order its rows are stored."""
    seq_len: int
    runs: tuple[tuple[tuple[int, int], ...], ...]

    def __post_init__(self):
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


def _check_split(seq_len, world_size):
    if not (isinstance(seq_len, int) and seq_len >= 0 and isinstance(world_size, int) and world_size >= 1):
        raise FivarError(f"sharding: seq_len must be an int >= 0 and world_size an int >= 1, got {seq_len!r} and "
                         f"{world_size!r}")
