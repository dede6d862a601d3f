"""A serving engine's speculative verify batch: the custom mask of a draft tree per request, in the form
`v.batch_prefill_paged(..., packed_custom_mask=, mask_indptr=)` and FlashInfer's wrappers take (docs/serving.md).

Request i verifies n_i draft tokens over its prefix of p_i keys; the cache already holds the draft tokens after the
prefix, so kv_len_i = p_i + n_i and qo_len_i = n_i. Draft token j sees the whole prefix, itself and its ancestors in
the tree (`parents[i][j]`: the draft token it continues, -1 for one continuing the prefix). A chain is
parents = [-1, 0, 1, ...]: with causal=True it needs no custom mask at all.

A mixed step (`mixed_step`): prefill chunks and decodes of the same variant in one paged batch; with backend "auto"
its decodes run on FA2 and its chunks on FA3, in one plan (fivar.runtime.mixed).

A verify step replayed in a CUDA graph takes the same metadata and masks: `v.plan_paged(..., cuda_graph=True,
max_batch=, max_qo_len=, max_pages=)` once (`uniform_qo_len=True` where every request carries max_qo_len drafts),
then `plan.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, packed_custom_mask=, mask_indptr=)` before each
replay (fivar.runtime.graph_verify).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

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


class MixedStep(NamedTuple):
    """The paged metadata of one engine step (`mixed_step`): pass `*step` after q and the cache to
    `batch_prefill_paged`, or first to `plan_paged`."""
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def mixed_step(cached_lens, new_lens, page_table, page_size: int, *, device="cpu") -> MixedStep:
    """The metadata of a step mixing prefill chunks and decodes over one paged cache (docs/serving.md).

    Request i has `cached_lens[i]` keys in the cache from earlier steps and brings `new_lens[i]` query tokens this
    step (a prefill chunk: many; a decode: 1), whose keys the engine has already written after them, so it attends
    over kv_len_i = cached_i + new_i keys, its queries at their end. `page_table`: per request its pages in order,
    a list of lists or an int tensor [batch, max_pages] (a vLLM block table: the entries past a request's last page
    are never read); the first ceil(kv_len_i / page_size) pages of each are used."""
    def ints(name, xs):
        xs = xs.tolist() if isinstance(xs, torch.Tensor) else list(xs)
        if any(not isinstance(x, numbers.Integral) or isinstance(x, bool) for x in xs):
            raise FivarError(f"mixed_step: {name} must be integers, got {xs[:8]}")
        return xs
    cached = [int(x) for x in ints("cached_lens", cached_lens)]
    new = [int(x) for x in ints("new_lens", new_lens)]
    if len(cached) != len(new):
        raise FivarError(f"mixed_step: {len(cached)} cached lengths but {len(new)} new-token counts (one per request)")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise FivarError(f"mixed_step: page_size must be a positive int, got {page_size!r}")
    if any(c < 0 for c in cached) or any(n < 1 for n in new):
        raise FivarError(f"mixed_step: cached lengths must be >= 0 and new-token counts >= 1 (got cached {cached}, "
                         f"new {new})")
    rows = page_table.tolist() if isinstance(page_table, torch.Tensor) else [list(r) for r in page_table]
    if len(rows) != len(new):
        raise FivarError(f"mixed_step: the page table has {len(rows)} rows for {len(new)} requests")
    kv = [c + n for c, n in zip(cached, new)]
    pages = [-(-n // page_size) for n in kv]
    indices = []
    for i, (row, n) in enumerate(zip(rows, pages)):
        if len(row) < n:
            raise FivarError(f"mixed_step: request {i} holds {kv[i]} keys, {n} page(s) of {page_size}, but its page "
                             f"table row has {len(row)}")
        if any(not isinstance(p, numbers.Integral) or p < 0 for p in row[:n]):
            raise FivarError(f"mixed_step: request {i}'s pages must be ints >= 0, got {row[:n][:8]}")
        indices += [int(p) for p in row[:n]]

    def ind(xs):
        return torch.tensor([0] + xs, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return MixedStep(ind(new), ind(pages), torch.tensor(indices, dtype=torch.int32).to(device),
                     torch.tensor([n - (p - 1) * page_size for n, p in zip(kv, pages)], dtype=torch.int32).to(device))
