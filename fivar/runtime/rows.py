"""Index arithmetic the block lowerings (fivar.runtime.fa2_blocks, fivar.runtime.fa3_tile_list) share: indptrs from
counts, the rows of a selection of blocks, and a second launch's rows written over the first's output."""
from __future__ import annotations

import torch


def indptr(counts: torch.Tensor) -> torch.Tensor:
    """int32 [n + 1]: 0 and the running sums of `counts`."""
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.long().cumsum(0)]).to(torch.int32)


def concat_ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """int64: start_i, start_i + 1, ..., start_i + count_i - 1 for every i, in order."""
    starts, counts = starts.long(), counts.long()
    before = counts.cumsum(0) - counts
    return torch.repeat_interleave(starts - before, counts) + torch.arange(int(counts.sum()))


def write_rows(result, rows: torch.Tensor, rest, return_lse: bool):
    """`result` (an output, or (output, lse)) with `rest`, computed over q's `rows`, written over those rows."""
    out, lse = result if return_lse else (result, None)
    rest_out, rest_lse = rest if return_lse else (rest, None)
    out.index_copy_(0, rows, rest_out)
    if return_lse:
        lse.index_copy_(0, rows, rest_lse)
    return result
