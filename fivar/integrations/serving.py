"""A serving engine's speculative verify batch: the custom mask of a draft tree per request, in the form
`v.batch_prefill_paged(..., packed_custom_mask=, mask_indptr=)` and FlashInfer's wrappers take (docs/serving.md).

Request i verifies n_i draft tokens over its prefix of p_i keys; the cache already holds the draft tokens after the
prefix, so kv_len_i = p_i + n_i and qo_len_i = n_i. Draft token j sees the whole prefix, itself and its ancestors in
the tree (`parents[i][j]`: the draft token it continues, -1 for one continuing the prefix). A chain is
parents = [-1, 0, 1, ...]: with causal=True it needs no custom mask at all.
"""
from __future__ import annotations

import torch

from ..errors import FivarError
from ..runtime.custom_mask import pack


def chain_parents(n: int) -> list[int]:
    """A chain of n draft tokens: each continues the one before."""
    return list(range(-1, n - 1))


def tree_rows(parents) -> torch.Tensor:
    """bool [n, n]: row j keeps draft token j and its ancestors. `parents[j]` < j (a tree listed parents first)."""
    parents = [int(p) for p in (parents.tolist() if isinstance(parents, torch.Tensor) else parents)]
    n = len(parents)
    rows = torch.eye(n, dtype=torch.bool)
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise FivarError(f"tree mask: parents[{j}] = {p}; a draft token's parent must be -1 (the prefix) or an "
                             f"earlier draft token (0..{j - 1})")
        if p >= 0:
            rows[j] |= rows[p]
    return rows


def tree_mask(prefix_lens, parents, *, device="cpu", packed: bool = True):
    """The verify batch's custom mask: per request [n_i, p_i + n_i] (the prefix all ones, then tree_rows).
    packed: (packed_custom_mask uint8, mask_indptr int32), bits little-endian from a byte per request (FlashInfer's
    segment_packbits(bitorder="little") layout); else the flat bool custom_mask."""
    prefix_lens = [int(p) for p in (prefix_lens.tolist() if isinstance(prefix_lens, torch.Tensor) else prefix_lens)]
    if len(prefix_lens) != len(parents):
        raise FivarError(f"tree mask: {len(prefix_lens)} prefix lengths but {len(parents)} parent lists (one per "
                         "request)")
    if any(p < 0 for p in prefix_lens):
        raise FivarError(f"tree mask: prefix lengths must be >= 0, got {prefix_lens}")
    blocks = []
    for p, par in zip(prefix_lens, parents):
        rows = tree_rows(par)
        blocks.append(torch.cat([torch.ones(rows.shape[0], p, dtype=torch.bool), rows], 1).view(-1))
    flat = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
    flat = flat.to(device)
    if not packed:
        return flat
    n = torch.tensor([len(par) for par in parents], dtype=torch.long)
    mask = pack(flat, n, n + torch.tensor(prefix_lens, dtype=torch.long))
    return mask.packed, mask.indptr
