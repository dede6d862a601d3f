"""Decode over the pages that hold kept keys: each request's page list trimmed to at most two runs of pages.

A mask with a left band already reads only its window (window_left, fivar.runtime.attention). Other masks keep
keys the band cannot describe: a document mask keeps the query's own document, StreamingLLM keeps its sink tokens
and a window (two ranges). fivar.spec.sparsity.classify_decode finds, per request and page, whether the mask may
keep a key there; this module keeps the first run of such pages and the hull of the rest, and rebuilds kv_indptr /
kv_indices / kv_last_page_len for them on the device. A mask whose kept pages form more than two runs would read the
gaps after the first: where that is past HULL_SLACK times the keys of the tiles holding kept keys, the batch runs in
the tile-list form instead (fivar.runtime.fa3_tile_list), which reads only those tiles.

The kernel then sees shorter requests: the key-segments form of fivar's FA2 struct (fivar.codegen.fa2,
KV_SEGMENTS) maps each local key back to its kv_idx (one shift below the second run, another from it on) and the
query to its q_idx, so the mask and the logits see the positions they would have seen untrimmed. When every
request keeps one run of pages (a chunk, a document), the batch runs in kCausal mode, as stock decode runs a
window: the struct's full range (the keys from the run's first FULL page on, to the end) skips the mask, and its
per-request window_left makes the kernel evaluate the mask on the first KV tile, which must hold the keys before
that range (a partial first page), and on the last. Otherwise the mask applies to every key read (kCustom).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codegen.fa2 import NO_SECOND_RUN
from ..codegen.tile_list import TILE_WIDTH
from ..spec.sparsity import EMPTY, FULL

MIN_CTA_TILE_KV = 16  # FlashInfer's FA2 KV tile: NUM_MMA_KV x 16 keys
#: keys the hull may read per key of the tiles holding kept keys before decode leaves it for the tile list (the KV
#: bytes a mask's decode may read: 1.15x those of the tiles holding its kept keys)
HULL_SLACK = 1.15


@dataclass
class TrimmedPages:
    kv_indptr: torch.Tensor         # int32 [batch + 1]
    kv_indices: torch.Tensor        # int32 [pages kept]
    kv_last_page_len: torch.Tensor  # int32 [batch]
    segments: torch.Tensor          # int32 [batch, 9]: fivar.codegen.fa2.KV_SEGMENTS
    pages_read: int                 # kept pages, for the record
    pages_total: int
    causal: bool = False            # one run of pages a request: the kCausal launch (module docstring)
    keys_read: int = 0              # the keys of the pages kept
    tile_keys: int = 0              # the keys of the tiles holding a kept key, which the tile-list form reads

    def tile_list_reads_less(self) -> bool:
        """The hull reads more than HULL_SLACK times the keys of the tiles holding kept keys (the mask keeps more
        than two runs a request: global keys, a dilated or periodic pattern), so the tile-list form, which reads
        only those tiles, runs instead (fivar.runtime.plans)."""
        return self.keys_read > HULL_SLACK * self.tile_keys


def _kept_pages(kinds: torch.Tensor, kv_indptr: torch.Tensor):
    """(pages per request, page numbers [1, width], bool [batch, width]: the pages that may keep a key). A request
    that keeps no key still reads one page, masked in the kernel like any other (zeros out)."""
    n_pages = kv_indptr.long().diff()
    col = torch.arange(kinds.shape[1], device=kinds.device).view(1, -1)
    kept = (kinds != EMPTY) & (col < n_pages.view(-1, 1))
    kept[:, 0] |= ~kept.any(1) & (n_pages > 0)
    return n_pages, col, kept


def trim_pages(kinds: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
               kv_last_page_len: torch.Tensor, page_size: int) -> TrimmedPages:
    """The trimmed page lists of a decode batch from its page map (kinds [batch, max pages]); every page where
    none can be dropped (every page FULL, a prefix-LM's last query: in kCausal mode with no mask evaluated; else
    the mask on every key, as the plain kernel would: one module for decode). One device-to-host copy."""
    dev = kinds.device
    batch, width = kinds.shape
    indptr = kv_indptr.long()
    n_pages, col, kept = _kept_pages(kinds, kv_indptr)
    big = torch.full_like(col, width).expand(batch, width)
    a0 = torch.where(kept, col, big).amin(1)
    a1 = torch.where((col >= a0.view(-1, 1)) & ~kept, col, big).amin(1)  # the first run is [a0, a1)
    rest = kept & (col >= a1.view(-1, 1))
    has_b = rest.any(1)
    b0 = torch.where(rest, col, big).amin(1)
    b1 = torch.where(rest, col + 1, torch.zeros_like(col)).amax(1)
    sel = ((col >= a0.view(-1, 1)) & (col < a1.view(-1, 1))) | \
        (has_b.view(-1, 1) & (col >= b0.view(-1, 1)) & (col < b1.view(-1, 1)))
    new_n = sel.sum(1)
    not_full = sel & (kinds != FULL)
    per = max(1, TILE_WIDTH // page_size)  # pages of one tile of the tile-list form (tiles start at key 0)
    tiles = torch.nn.functional.pad(kept, (0, -width % per)).view(batch, -1, per).any(2)
    total_new, total, n_tiles = (int(x) for x in torch.stack([new_n.sum(), n_pages.sum(), tiles.sum()]).tolist())
    new_indptr = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), new_n.cumsum(0)])
    pos = (indptr[:-1].view(-1, 1) + col)[sel]  # row-major: each request's pages in order
    new_indices = kv_indices.long()[pos]
    last = kv_last_page_len.long()
    last_page_kept = sel.gather(1, (n_pages - 1).clamp(min=0).view(-1, 1)).view(-1) & (n_pages > 0)
    new_last = torch.where(last_page_kept, last, torch.full_like(last, page_size))
    new_last = torch.where(new_n > 0, new_last, torch.zeros_like(last))
    kv_len = (n_pages - 1).clamp(min=0) * page_size + torch.where(n_pages > 0, last, torch.zeros_like(last))
    local_len = (new_n - 1).clamp(min=0) * page_size + new_last
    first_len = (a1 - a0).clamp(min=0) * page_size
    seg = torch.where(has_b, first_len, torch.full_like(first_len, NO_SECOND_RUN))
    shift_a = torch.where(new_n > 0, a0 * page_size, torch.zeros_like(a0))
    shift_b = torch.where(has_b, b0 * page_size - first_len, torch.zeros_like(b0))
    zero = torch.zeros_like(seg)
    # the full range: local keys from the page after the run's last page that is not FULL, to the end
    f_lo = ((torch.where(not_full, col + 1, a0.view(-1, 1)).amax(1) - a0) * page_size).clamp(min=0)
    f_lo = torch.minimum(f_lo, local_len)
    # kCausal: with window_left = keys - 1 the kernel visits every key and evaluates the mask on its first KV tile
    # (at least MIN_CTA_TILE_KV keys) and its last; the keys before the full range must lie in that first tile
    causal = not bool(has_b.any()) and not bool((f_lo > MIN_CTA_TILE_KV).any())
    if causal:
        tail = [f_lo, local_len, zero, (local_len - 1).clamp(min=0)]
    else:  # no full range: the mask runs on every key read (kCustom); no skip; no window
        tail = [zero, zero, zero, zero - 1]
    segments = torch.stack([seg, shift_a, shift_b, kv_len - local_len, torch.arange(batch, device=dev), *tail],
                           1).to(torch.int32).contiguous()
    return TrimmedPages(new_indptr.to(torch.int32), new_indices.to(torch.int32), new_last.to(torch.int32),
                        segments, total_new, total, causal, total_new * page_size,
                        n_tiles * max(TILE_WIDTH, page_size))


def kept_page_list(kinds: torch.Tensor, kv_indptr: torch.Tensor, page_size: int):
    """(kept_indptr int32 [batch + 1], kept_pages int32: each request's numbers of its pages that may keep a key, in
    order, the most keys a request's kept pages hold): the Triton twin's decode reads only those, any number of runs
    (its kernel maps each local key back through the list). One device-to-host copy (the list's length and the
    longest)."""
    batch, width = kinds.shape
    _, _, kept = _kept_pages(kinds, kv_indptr)
    counts = kept.sum(1)
    total, longest = (int(x) for x in torch.stack([counts.sum(), counts.max()]).tolist()) if batch else (0, 0)
    pages = torch.nonzero_static(kept.view(-1), size=total).view(-1) % width  # row-major: each request's in order
    return (torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32), pages.to(torch.int32),
            longest * page_size)


def local_to_kv_idx(segments: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """kv_idx of local keys ([batch, n]), the mapping the key-segments struct applies (for checks)."""
    seg, shift_a, shift_b = (segments[:, i].long().view(-1, 1) for i in range(3))
    return torch.where(local < seg, local + shift_a, local + shift_b)
