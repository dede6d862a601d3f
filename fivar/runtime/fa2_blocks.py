"""FA2 prefill of a mask that is more than a band: each query block attends over the keys its mask may keep.

FlashInfer's FA2 kernels take no per-block KV ranges, and a mask that is more than a band runs in kCustom mode
on every tile (causal included: kCustom skips nothing right of the diagonal). The same lowering as FA3's
(fivar.runtime.kv_ranges), on FA2's paged kernel: each request is cut into query blocks, and each block becomes a
request of its own over the pages that hold the keys fivar.spec.sparsity's block map says it may keep (the hull of
its non-empty KV blocks, or its two runs of them: a sink and a window). Requests over overlapping keys are just page lists that share pages; ragged K/V is read
as pages of one key. The key-segments form of the struct (fivar.codegen.fa2.KV_SEGMENTS) maps each block's local
rows and keys back to their q_idx and kv_idx, applies causal on those, and applies the mask to every pair outside
the block's run of FULL KV blocks (inside it the mask keeps every pair: causal is the only check there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec.sparsity import BlockRanges, classify

#: Query rows per block: FA2's largest query tile (a block smaller than a tile wastes rows of it).
BLOCK_ROWS = 128
#: KV block of the analysis for ragged K/V (read as pages of one key): finer finds more empty keys, costs more
#: planning.
RAGGED_KV_BLOCK = 64
_NO_SECOND_RUN = 1 << 30


@dataclass
class BlockLayout:
    qo_indptr: torch.Tensor         # int32 [R + 1]: the blocks' rows (a refinement of the batch's)
    kv_indptr: torch.Tensor         # int32 [R + 1]: pages per block
    kv_indices: torch.Tensor        # int32: the blocks' page lists
    kv_last_page_len: torch.Tensor  # int32 [R]
    segments: torch.Tensor          # int32 [R, 7]: fivar.codegen.fa2.KV_SEGMENTS
    keys_read: int                  # keys the blocks read, and what every block reading its request's keys would
    keys_total: int


def _page_runs(ranges: BlockRanges, kinds: torch.Tensor, i: int, per: int, n_pages: int) -> list[tuple[int, int]]:
    """Query block i's pages to read, [lo, hi) page ranges: its non-empty KV blocks as two runs when they form
    exactly two with a page or more between them (a sink and a window), else their hull (one page if none)."""
    lo, hi = int(ranges.kept_lo[i]) * per, min(int(ranges.kept_hi[i]) * per, n_pages)
    if hi <= lo:  # no key kept: one page, masked in the kernel like any other (zeros out)
        return [(0, 1)]
    spans = []
    for start, end, _ in ranges.segments(kinds, i):  # runs of one kind: merge the adjacent ones
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    if len(spans) == 2:
        a = (spans[0][0] * per, min(spans[0][1] * per, n_pages))
        b = (spans[1][0] * per, min(spans[1][1] * per, n_pages))
        if a[1] < b[0]:
            return [a, b]
    return [(lo, hi)]


def block_layout(mask, qo_indptr: torch.Tensor, kv_lens: torch.Tensor, pages: list[torch.Tensor],
                 last_page_len: torch.Tensor, page_size: int, *, scalars: dict, tensors: dict, num_qo_heads: int,
                 num_kv_heads: int, causal: bool, kv_block: int | None = None, rows: int = BLOCK_ROWS) -> BlockLayout:
    """Host tensors in, host tensors out. `pages[b]`: request b's page ids in order (for ragged K/V read as pages of
    one key, its token indices); `kv_lens`/`last_page_len` per request."""
    kv_block = kv_block or page_size
    if kv_block % page_size:
        raise ValueError(f"kv_block {kv_block} must be a multiple of the page size {page_size}")
    tensors = {n: t.cpu() for n, t in tensors.items()}
    qo_h = qo_indptr.long().cpu()
    q_rows, kv_counts, indices, lasts, segs = [], [], [], [], []
    read = total = 0
    for b in range(qo_h.numel() - 1):
        qo_len, kv_len = int(qo_h[b + 1] - qo_h[b]), int(kv_lens[b])
        if qo_len == 0:
            continue
        n_pages = pages[b].numel()
        if kv_len == 0:  # nothing to attend: one block per tile of rows over no keys
            for r0 in range(0, qo_len, rows):
                q_rows.append(int(qo_h[b]) + r0)
                kv_counts.append(0)
                lasts.append(0)
                segs.append((_NO_SECOND_RUN, 0, 0, 0, b, 0, 0))
            continue
        kinds = classify(mask, qo_len=qo_len, kv_len=kv_len, q_block=rows, kv_block=kv_block, scalars=scalars,
                         tensors=tensors, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, batch_idx=b,
                         causal=causal).kinds
        ranges = BlockRanges.of(kinds)
        per = kv_block // page_size
        for i, r0 in enumerate(range(0, qo_len, rows)):
            r = min(rows, qo_len - r0)
            runs = _page_runs(ranges, kinds, i, per, n_pages)
            # the struct's key segments: local keys below `seg` are run A's (kv = local + shift_a), the rest run B's
            seg, shift_a, shift_b = _NO_SECOND_RUN, runs[0][0] * page_size, 0
            if len(runs) == 2:
                seg = (runs[0][1] - runs[0][0]) * page_size  # run A ends before the last page: whole pages
                shift_b = runs[1][0] * page_size - seg
            last = int(last_page_len[b]) if runs[-1][1] == n_pages else page_size
            n_read = sum(hi - lo for lo, hi in runs)
            local_len = (n_read - 1) * page_size + last
            q_rows.append(int(qo_h[b]) + r0)
            kv_counts.append(n_read)
            indices.append(torch.cat([pages[b][lo:hi] for lo, hi in runs]))
            lasts.append(last)
            # keys of FULL blocks (the mask keeps them for every row of the block), local, inside the run holding them
            full = (0, 0)
            f0, f1 = int(ranges.full_lo[i]) * kv_block, int(ranges.full_hi[i]) * kv_block
            for j, (lo, hi) in enumerate(runs):
                shift = shift_a if j == 0 else shift_b
                if lo * page_size <= f0 < hi * page_size:
                    f_lo, f_hi = max(f0 - shift, 0), min(f1, hi * page_size) - shift
                    full = (f_lo, min(f_hi, local_len)) if f_lo < min(f_hi, local_len) else (0, 0)
            # row j of the block: q_idx = r0 + j + kv_len - qo_len; the kernel computes j + local_len - r
            segs.append((seg, shift_a, shift_b, r0 + kv_len - qo_len - (local_len - r), b) + full)
            read += local_len
            total += kv_len
    q_rows.append(int(qo_h[-1]))
    counts = torch.tensor(kv_counts, dtype=torch.long)
    return BlockLayout(
        qo_indptr=torch.tensor(q_rows, dtype=torch.int32),
        kv_indptr=torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32),
        kv_indices=(torch.cat(indices) if indices else torch.zeros(0, dtype=torch.long)).to(torch.int32),
        kv_last_page_len=torch.tensor(lasts, dtype=torch.int32),
        segments=torch.tensor(segs, dtype=torch.int64).clamp(max=2**31 - 1).to(torch.int32).view(-1, 7),
        keys_read=read, keys_total=total)
