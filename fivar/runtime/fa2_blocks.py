"""FA2 prefill of a mask that is more than a band: each query block attends over the keys its mask may keep.

FlashInfer's FA2 kernels take no per-block KV ranges, and a mask that is more than a band runs in kCustom mode
on every tile (causal included: kCustom skips nothing right of the diagonal). On FA2's paged kernel, each request
is cut into query blocks of one CTA tile (the block's rows times the GQA group fill FlashInfer's query tile), and
each block becomes a request of its own over the pages that hold the keys fivar.spec.sparsity's block map says it
may keep (the hull of its non-empty KV blocks, or its two runs of them: a sink and a window). Requests over overlapping keys are just page lists that
share pages. The key-segments form of the struct (fivar.codegen.fa2.KV_SEGMENTS) maps each block's local rows and
keys back to their q_idx and kv_idx and applies causal on those.

Two launches split the blocks:
* kCausal, for the blocks of a causal call whose keys end at their last row's diagonal and whose mask keeps every
  key but the first and the last `rows` of them for every row (a chunk or a document seen from inside it).
  FlashInfer evaluates the mask only on the tiles its causal rule (the last keys) and its window rule (the first
  keys, through the struct's per-request window_left) name, and runs every other tile as it is, as stock FA2 does
  with its own causal mask: no per-pair work there.
* kCustom, for the rest (a block cut by a chunk or document boundary, two runs, a non-causal call): the mask on
  every pair outside the block's run of FULL KV blocks. When both run, the kCausal launch covers every row (the
  others' requests read and write nothing: the table's skip field) and the kCustom one runs over copies of its
  blocks' rows, written over theirs: each may split its KV (FlashInfer's merge writes every row of a launch).

Before any of that, a causal call whose mask cuts the batch into segments (documents, chunks: every row keeps
exactly the keys from its segment's first key to itself) runs as stock FlashInfer runs documents: one request of
FA2's ragged kernel per segment, in kCausal mode, no mask evaluated (fivar.runtime.segments, from the mask
pre-pass's row runs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codegen.fa2 import NO_SECOND_RUN
from ..spec.sparsity import FULL, BlockRanges, classify, classify_bounds
from .rows import concat_ranges, indptr

#: KV block of the analysis for ragged K/V (read as pages): finer finds more empty keys, costs more planning.
RAGGED_KV_BLOCK = 64


def block_rows(group: int, head_dim: int) -> int:
    """Query rows per block: one FA2 query tile of packed rows (rows x GQA group; FlashInfer's 128-row tile below
    head dim 256, its 64-row one at 256)."""
    return max(1, (128 if head_dim < 256 else 64) // group)


def tile_list_rows(group: int, head_dim: int) -> int:
    """FA2's query tile in the tile-list form (fivar.runtime.fa3_tile_list): block_rows rounded down to a power of
    two, the Triton twin's map block (each request then fills one FA2 query tile of packed rows)."""
    return 1 << (block_rows(group, head_dim).bit_length() - 1)


def cta_tile_q(packed_lens: list[int], head_dim: int) -> int:
    """The FA2 query tile FlashInfer's scheduler picks for requests of these packed lengths (FA2DetermineCtaTileQ,
    sm80 and later, head dims up to 256)."""
    avg = sum(packed_lens) // max(1, len(packed_lens))
    if avg > 64 and head_dim < 256:
        return 128
    return 64 if avg > 16 else 16


@dataclass
class BlockLayout:
    qo_indptr: torch.Tensor         # int32 [R + 1]: the blocks' rows (a refinement of the batch's)
    kv_indptr: torch.Tensor         # int32 [R + 1]: pages per block
    kv_indices: torch.Tensor        # int32: the blocks' page lists
    kv_last_page_len: torch.Tensor  # int32 [R]
    segments: torch.Tensor          # int32 [R, 9]: fivar.codegen.fa2.KV_SEGMENTS (skip field 0)
    keys_read: int                  # keys the blocks read, and what every block reading its request's keys would
    keys_total: int
    causal_mode: torch.Tensor       # bool [R]: the block runs in the kCausal launch (else the kCustom one)

    def launch_table(self, causal_mode: bool) -> torch.Tensor:
        """The segments of one launch: the other launch's blocks skipped."""
        table = self.segments.clone()
        table[:, 7] = (self.causal_mode != causal_mode).to(torch.int32)
        return table

    def subset(self, keep: torch.Tensor) -> tuple["BlockLayout", torch.Tensor]:
        """The layout of the blocks `keep` selects, over their rows packed together, and those rows' indices in the
        batch (the rows to gather from q and write back)."""
        counts, p_counts = self.qo_indptr.diff()[keep], self.kv_indptr.diff()[keep]
        rows = concat_ranges(self.qo_indptr[:-1][keep], counts)
        pages = concat_ranges(self.kv_indptr[:-1][keep], p_counts)
        sub = BlockLayout(
            qo_indptr=indptr(counts), kv_indptr=indptr(p_counts),
            kv_indices=self.kv_indices[pages], kv_last_page_len=self.kv_last_page_len[keep],
            segments=self.segments[keep], keys_read=self.keys_read, keys_total=self.keys_total,
            causal_mode=self.causal_mode[keep])
        return sub, rows


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
                 num_kv_heads: int, causal: bool, kv_block: int | None = None, rows: int | None = None,
                 head_dim: int = 128) -> BlockLayout:
    """Host tensors in, host tensors out. `pages[b]`: request b's page ids in order (for ragged K/V read as pages of
    several keys, groups of its tokens); `kv_lens`/`last_page_len` per request."""
    group = max(1, num_qo_heads // num_kv_heads)
    rows = rows or block_rows(group, head_dim)
    kv_block = kv_block or page_size
    if kv_block % page_size:
        raise ValueError(f"kv_block {kv_block} must be a multiple of the page size {page_size}")
    tensors = {n: t.cpu() for n, t in tensors.items()}
    qo_h = qo_indptr.long().cpu()
    q_rows, kv_counts, indices, lasts, segs, causal_mode = [], [], [], [], [], []
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
                segs.append((NO_SECOND_RUN, 0, 0, 0, b, 0, 0, 0, -1))
                causal_mode.append(False)
            continue
        kinds = classify(mask, qo_len=qo_len, kv_len=kv_len, q_block=rows, kv_block=kv_block, scalars=scalars,
                         tensors=tensors, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, batch_idx=b,
                         causal=causal).kinds
        ranges = BlockRanges.of(kinds)
        per = kv_block // page_size
        starts = list(range(0, qo_len, rows))
        block_runs = [_page_runs(ranges, kinds, i, per, n_pages) for i in range(len(starts))]
        ends = (_diagonal_ends(mask, block_runs, starts, rows, qo_len, kv_len, page_size, scalars=scalars,
                               tensors=tensors, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, batch_idx=b)
                if causal else [None] * len(starts))
        for i, r0 in enumerate(starts):
            r, runs, end = min(rows, qo_len - r0), block_runs[i], ends[i]
            if end is not None:  # the kCausal launch: the block's keys end at its last row's diagonal
                runs = [(runs[0][0], -(-end // page_size))]
            # the struct's key segments: local keys below `seg` are run A's (kv = local + shift_a), the rest run B's
            seg, shift_a, shift_b = NO_SECOND_RUN, runs[0][0] * page_size, 0
            if len(runs) == 2:
                seg = (runs[0][1] - runs[0][0]) * page_size  # run A ends before the last page: whole pages
                shift_b = runs[1][0] * page_size - seg
            last = int(last_page_len[b]) if runs[-1][1] == n_pages else page_size
            if end is not None:
                last = end - (runs[0][1] - 1) * page_size
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
            # kCausal: the kernel masks the first keys of a block through the window rule (window_left = its keys
            # less its rows: FlashInfer then masks the KV tiles left of the rows' diagonal less window_left). Fewer
            # keys than rows: 0, so that every tile is masked (the kernel's causal rule subtracts qo_len from kv_len
            # in unsigned arithmetic, and its wrapped result would leave the tiles unmasked)
            window = max(0, local_len - r) if end is not None else -1
            segs.append((seg, shift_a, shift_b, r0 + kv_len - qo_len - (local_len - r), b) + full + (0, window))
            causal_mode.append(end is not None)
            read += local_len
            total += kv_len
    q_rows.append(int(qo_h[-1]))
    counts = torch.tensor(kv_counts, dtype=torch.long)
    packed = [(q_rows[i + 1] - q_rows[i]) * group for i in range(len(q_rows) - 1)]
    causal_mode = torch.tensor(causal_mode, dtype=torch.bool)
    if packed and max(packed) > cta_tile_q(packed, head_dim):  # a block over two tiles: the rules above do not hold
        causal_mode[:] = False
        segs = [s_[:8] + (-1,) for s_ in segs]
    return BlockLayout(
        qo_indptr=torch.tensor(q_rows, dtype=torch.int32),
        kv_indptr=indptr(counts),
        kv_indices=(torch.cat(indices) if indices else torch.zeros(0, dtype=torch.long)).to(torch.int32),
        kv_last_page_len=torch.tensor(lasts, dtype=torch.int32),
        segments=torch.tensor(segs, dtype=torch.int64).clamp(max=2**31 - 1).to(torch.int32).view(-1, 9),
        keys_read=read, keys_total=total, causal_mode=causal_mode)


def _diagonal_ends(mask, block_runs, starts, rows: int, qo_len: int, kv_len: int, page_size: int,
                   **analysis) -> list[int | None]:
    """For each query block of one request of a causal call: the end of its keys in the kCausal launch (its last
    row's position + 1: its keys stop at the diagonal), or None where that launch cannot run it.

    FlashInfer's causal mode evaluates the mask on the KV tiles from the block's first row's diagonal on (at least
    its last r keys), and the struct's window_left = keys - r makes it evaluate the tiles below its first r keys
    (the query tile holds r rows or more) and skip none; every other tile runs unmasked, so the mask must keep
    those keys for every row of the block (checked without the causal term, which they satisfy: one interval
    query per block)."""
    offset, ends, asked = kv_len - qo_len, [None] * len(starts), []
    for i, (runs, r0) in enumerate(zip(block_runs, starts)):
        r = min(rows, qo_len - r0)
        lo, q_end = runs[0][0] * page_size, r0 + r + offset
        if len(runs) != 1 or q_end <= lo:
            continue
        ends[i] = q_end
        if lo + r < q_end - r:
            asked.append((i, r0 + offset, q_end - 1, lo + r, q_end - r - 1))
    if asked:
        i, q_lo, q_hi, kv_lo, kv_hi = (torch.tensor(c, dtype=torch.int64) for c in zip(*asked))
        kinds = classify_bounds(mask, q_lo, q_hi, kv_lo, kv_hi, causal=False, pairs=True, **analysis)
        for block in i[kinds != FULL].tolist():
            ends[block] = None
    return ends
