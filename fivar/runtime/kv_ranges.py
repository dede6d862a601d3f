"""FA3 for a mask that is more than a band (a document mask): attend each query block over the keys its
mask can keep.

FlashInfer's FA3 kernels visit every KV tile of a request, and a variant's mask is only a logits transform
to them, so a document mask used to cost a full S x S pass (0.28x FlexAttention on an H200). A band gets
FA3's sliding-window schedule; any other mask goes through this lowering:

1. the Triton twin's mask pre-pass (`mask_ranges`, index arithmetic only) finds, per 16 query rows, the
   first and last key the mask keeps;
2. each request is cut into query blocks of one FA3 CTA tile (128 rows, 192 at head_dim 64) and each block
   becomes its own FA3 request over [lo, hi) of its keys, the union of its rows' ranges (and, if causal,
   no key right of its last row);
3. FA3's ragged batch kernel runs them all. The requests overlap in K/V, which FA3's scheduler allows: its
   plan takes every request's KV start and length as separate arrays (`PrefillSM90Plan`), and the run reads
   KV offsets from that plan. The KV-range form of the variant struct (fivar.codegen.fa3) maps a block's
   local rows and keys back through `fv_blocks` and still applies the mask (and causal) to every pair.

The pre-pass also records each row's runs of kept keys. When every row keeps one run (a document mask, a
per-head window), the struct's row-run form checks the key against its row's run (one load per row)
instead of evaluating the mask per element: the mask's per-element gathers made FA3's consumer warps spill
(H200: the mask form ran 4.3x slower per tile than stock FA3 even when the mask was skipped by a branch).
When rows keep up to two runs (sink tokens and a window), the two-run form checks both (`two_run_table`), and a
query block whose rows share a gap between their runs runs as two requests over copies of its rows, one per
run, merged through their LSEs (`kv_range_layout(split_runs=True)`).

A paged batch gets the same blocks over pages (`paged_kv_ranges`): each block is a request of FA3's paged kernel
whose page list is the run of its request's pages from the one holding its first kept key (so the block's first
key is page-aligned, and `fv_blocks` says so) to the one holding its last; pages may be shared by blocks, so no
KV-starts plan is needed there. A batch whose mask drops no page keeps a request per request.

Two shapes of mask skip most of that. Called causally, a batch the mask cuts into segments (documents, chunks:
every row keeps exactly the keys from its segment's first key to itself) runs a request of FA3's causal mode per
segment with the mask-free struct (fivar.runtime.segments), as stock FlashInfer runs packed documents. And a mask
keeping different keys per head (a window per head) would make every block read the union of its heads' keys, so
where the heads' own ranges read far fewer keys the batch becomes a request per (head, request) over head-major
rows (`head_requests`), and the whole lowering above runs on those.

FlashInfer's own BlockSparseAttentionWrapper maps a block-sparse mask onto batch prefill the same way
(one request per block row). Planning costs one pre-pass and one device->host copy; `plan_ragged` does it
once per batch layout, as FlashInfer's wrappers do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codegen import fa3
from ..codegen.fa3 import BLOCKS, ROW_RUNS
from ..codegen.triton import kernel_arg_values
from ..errors import FivarError
from ..jit.triton_module import load_triton_module
from ..spec.sparsity import FULL, classify_bounds
from .launch import _module, release_wrapper, take_wrapper
from .lse import empty_lse, merge_states
from .rows import concat_ranges, indptr, write_rows
from . import position_tables, segments
from .params import kernel_args

_RANGE_ROWS = 16  # the pre-pass granularity (RANGE_ROWS in templates/triton/attention.py.jinja)


def block_rows(head_dim: int) -> int:
    """FA3's query tile (PrefillSM90Plan's cta_tile_q): one request per tile wastes no rows."""
    return 192 if head_dim == 64 else 128


@dataclass
class KvRangeLayout:
    """The lowered batch. Host tensors except `blocks`, which the kernel reads."""
    qo_indptr: torch.Tensor  # int32 [R + 1]: the blocks' rows (a refinement of the batch's qo_indptr)
    kv_starts: torch.Tensor  # int32 [R + 1]: the token in k/v of each block's first key (last entry unused)
    kv_lens: torch.Tensor    # int32 [R]
    blocks: torch.Tensor     # int32 [R, 5]: (batch, q_idx of the block's first row, kv_idx of its first key, then
    #                          fivar.codegen.fa3.BLOCKS: the full range, or where the block's row runs are)
    parts: "RunParts | None" = None  # rows read twice, once per run of kept keys (kv_range_layout's split_runs)


@dataclass
class RunParts:
    """A lowered batch whose query blocks with two runs of kept keys (a sink and a window) run as two requests, one
    per run: attention over each run, merged through the LSEs (fivar.runtime.lse). The first `blocks` requests are
    the blocks in order (a split one over its last run), so lowered rows [0, len(q)) are q's rows; the requests
    after them are the split blocks' first runs, over copies of their rows. Host int64 tensors."""
    src: torch.Tensor    # [lowered rows]: the row of q each lowered row is (a copy of)
    twice: torch.Tensor  # src of the rows after q's: the rows of q with two parts, the second's order
    blocks: int          # the requests over q's own rows


@dataclass
class _QueryBlocks:
    """Each request cut into query blocks of `rows` rows, with the keys the blocks' rows may keep: host tensors
    [R], relative to the block's request."""
    batch: torch.Tensor  # the block's request
    row0: torch.Tensor   # its first row (a multiple of `rows`)
    shift: torch.Tensor  # q_idx - row of the request: kv_len - qo_len (bottom-right aligned)
    lo: torch.Tensor     # [lo, hi): the keys any of its rows keeps (one key, masked, when none)
    hi: torch.Tensor
    tail: tuple          # fivar.codegen.fa3.BLOCKS' last two fields
    gap: tuple | None = None  # [gap_lo, gap_hi): keys every row of the block drops between its two runs, if any


def _query_blocks(ranges: torch.Tensor, qo_lens: torch.Tensor, kv_lens: torch.Tensor, rows: int, causal: bool,
                  runs_shape: tuple | None) -> _QueryBlocks:
    """The lowering both the ragged and the paged layouts share: the pre-pass's ranges reduced to query blocks."""
    if rows % _RANGE_ROWS:
        raise ValueError(f"block rows {rows} must be a multiple of {_RANGE_ROWS}")
    qo_lens, kv_lens = qo_lens.long(), kv_lens.long()
    batch = qo_lens.numel()
    lo = ranges[..., 0].long().amin(1)  # the union over heads: the kernel still masks per head
    hi = ranges[..., 1].long().amax(1)
    per = rows // _RANGE_ROWS
    pad = -lo.shape[1] % per
    full_lo = ranges[..., 2].long().amax(1)  # kept by every row of every head
    full_hi = ranges[..., 3].long().amin(1)
    pad_to_blocks = lambda x, fill, reduce: reduce(  # noqa: E731
        torch.nn.functional.pad(x, (0, pad), value=fill).view(batch, -1, per), -1)
    gap_lo = gap_hi = None
    if ranges.shape[-1] >= 6:  # the pre-pass's gaps, dropped by every head; a group keeping no key drops everything
        keeps = (ranges[..., 1].long() > ranges[..., 0].long()).any(1)
        gap_lo = torch.where(keeps, ranges[..., 4].long().amax(1), -(1 << 40))
        gap_hi = torch.where(keeps, ranges[..., 5].long().amin(1), 1 << 40)
        gap_lo, gap_hi = pad_to_blocks(gap_lo, -(1 << 40), torch.amax), pad_to_blocks(gap_hi, 1 << 40, torch.amin)
    lo, hi = pad_to_blocks(lo, 1 << 40, torch.amin), pad_to_blocks(hi, 0, torch.amax)
    full_lo, full_hi = pad_to_blocks(full_lo, 0, torch.amax), pad_to_blocks(full_hi, 1 << 40, torch.amin)
    counts = (qo_lens + rows - 1) // rows
    b = torch.repeat_interleave(torch.arange(batch), counts)
    t = torch.arange(b.numel()) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    row0 = t * rows
    row1 = torch.minimum(row0 + rows, qo_lens[b])
    shift = kv_lens[b] - qo_lens[b]  # q_idx of row r is r + kv_len - qo_len (bottom-right aligned)
    lo_b, hi_b = lo[b, t], hi[b, t]
    if causal:
        hi_b = torch.minimum(hi_b, row1 - 1 + shift + 1)
    empty = hi_b <= lo_b  # no row keeps a key: one key, masked in the kernel like any other
    lo_b = torch.where(empty, 0, lo_b)
    hi_b = torch.where(empty, torch.clamp(kv_lens[b], max=1), hi_b)
    if runs_shape is None:
        tail = (full_lo[b, t], torch.maximum(full_hi[b, t], full_lo[b, t]))
    else:  # offset of (request b, head 0, row row0) in the runs, and the step to the next query head
        _, run_heads, max_rows, _ = runs_shape
        head_step = 2 * max_rows if run_heads > 1 else 0
        tail = ((b * run_heads * max_rows + row0) * 2, torch.full_like(b, head_step))
    gap = None if gap_lo is None else (gap_lo[b, t], gap_hi[b, t])
    return _QueryBlocks(b, row0, shift, lo_b, hi_b, tail, gap)


def _blocks_table(q: _QueryBlocks, first_key: torch.Tensor) -> torch.Tensor:
    """fivar.codegen.fa3.BLOCKS: (batch, q_idx of the first row, kv_idx of the first key read, *tail)."""
    return torch.stack([q.batch, q.row0 + q.shift, first_key, *q.tail], 1).clamp(max=2**31 - 1).to(torch.int32)


def kv_range_layout(ranges: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, rows: int,
                    causal: bool, runs_shape: tuple | None = None, split_runs: bool = False) -> KvRangeLayout:
    """From the pre-pass's ranges ([batch, heads, ceil(max_qo_len / 16), 6] of [lo, hi, full_lo, full_hi, gap_lo,
    gap_hi) relative to each request's keys; host tensors) to one request per `rows` query rows over the keys any of
    them keeps. With `runs_shape` (the pre-pass's per-row runs, contiguous [batch, heads, max_qo_len, 2]) the
    blocks point into the runs (the row-run form) instead of carrying a full range. With `split_runs`, a block whose
    rows all keep two runs of keys with a gap between them becomes two requests over copies of its rows, one per
    run (`parts`; the caller merges their outputs through the LSEs)."""
    qo_indptr, kv_indptr = qo_indptr.long(), kv_indptr.long()
    q = _query_blocks(ranges, qo_indptr.diff(), kv_indptr.diff(), rows, causal, runs_shape)
    split = torch.zeros_like(q.lo, dtype=torch.bool)
    if split_runs and q.gap is not None:
        gap_lo, gap_hi = torch.maximum(q.gap[0], q.lo), torch.minimum(q.gap[1], q.hi)
        split = (gap_lo > q.lo) & (gap_hi < q.hi) & (gap_lo < gap_hi)
    if not bool(split.any()):
        starts = kv_indptr[q.batch] + q.lo
        return KvRangeLayout(
            qo_indptr=torch.cat([qo_indptr[q.batch] + q.row0, qo_indptr[-1:]]).to(torch.int32),
            kv_starts=torch.cat([starts, torch.zeros(1, dtype=torch.long)]).to(torch.int32),
            kv_lens=(q.hi - q.lo).to(torch.int32),
            blocks=_blocks_table(q, q.lo))
    # requests: each block once over its last run [gap_hi, hi) if split, else all of [lo, hi), in order (so their
    # rows are q's); then each split block again over its first run [lo, gap_lo)
    n_blocks = q.lo.numel()
    block = torch.cat([torch.arange(n_blocks), torch.nonzero(split).view(-1)])
    again = torch.arange(block.numel()) >= n_blocks
    lo = torch.where(again, q.lo[block], torch.where(split[block], gap_hi[block], q.lo[block]))
    hi = torch.where(again, gap_lo[block], q.hi[block])
    first_row = qo_indptr[q.batch] + q.row0  # the block's first row of q
    n_rows = torch.minimum(torch.full_like(q.row0, rows), qo_indptr[q.batch + 1] - first_row)[block]
    lowered_start = torch.cat([torch.zeros(1, dtype=torch.long), n_rows.cumsum(0)])
    lowered = torch.arange(int(lowered_start[-1]))
    req = torch.repeat_interleave(torch.arange(block.numel()), n_rows)  # the request of each lowered row
    src = first_row[block][req] + (lowered - lowered_start[:-1][req])
    sub = _QueryBlocks(q.batch[block], q.row0[block], q.shift[block], lo, hi, tuple(x[block] for x in q.tail))
    return KvRangeLayout(
        qo_indptr=lowered_start.to(torch.int32),
        kv_starts=torch.cat([kv_indptr[sub.batch] + lo, torch.zeros(1, dtype=torch.long)]).to(torch.int32),
        kv_lens=(hi - lo).to(torch.int32),
        blocks=_blocks_table(sub, lo),
        parts=RunParts(src=src, twice=src[int(qo_indptr[-1]):], blocks=n_blocks))


@dataclass
class PagedRangeLayout:
    """A paged batch lowered to one request per query block over the pages holding the keys it may keep. Host
    tensors except `blocks`' copy the kernel reads (made by the caller)."""
    qo_indptr: torch.Tensor         # int32 [R + 1]: the blocks' rows (a refinement of the batch's qo_indptr)
    kv_indptr: torch.Tensor         # int32 [R + 1]: pages per block
    kv_indices: torch.Tensor        # int32: each block's pages, a run of its request's pages in order
    kv_last_page_len: torch.Tensor  # int32 [R]: its keys end at the block's hi (or the request's end)
    blocks: torch.Tensor            # int32 [R, 5]: as KvRangeLayout's; kv_idx of the first key is page-aligned
    keys_read: int                  # keys the blocks read, and what the unsplit form (a request per request,
    keys_total: int                 # FA3's causal mode skipping right of the diagonal) reads for the same rows


def paged_range_layout(ranges: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                       kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int, rows: int,
                       causal: bool, runs_shape: tuple | None = None) -> PagedRangeLayout:
    """kv_range_layout's blocks over pages: a block reads its request's pages from the one holding its first kept
    key (its first key read is that page's first) to the one holding its last. Host tensors in and out."""
    qo_indptr, kv_indptr = qo_indptr.long(), kv_indptr.long()
    kv_indices, last = kv_indices.long(), kv_last_page_len.long()
    n_pages = kv_indptr.diff()
    kv_lens = (n_pages - 1).clamp(min=0) * page_size + torch.where(n_pages > 0, last, 0)
    qo_lens = qo_indptr.diff()
    q = _query_blocks(ranges, qo_lens, kv_lens, rows, causal, runs_shape)
    b = q.batch
    first = q.lo // page_size
    to_end = q.hi >= kv_lens[b]  # the request's last page and its own last-page length (any trailing pages too)
    end = torch.where(to_end, n_pages[b], (q.hi + page_size - 1) // page_size)
    last_b = torch.where(to_end, last[b], q.hi - (end - 1) * page_size)
    counts = end - first
    offsets = torch.repeat_interleave(kv_indptr[b] + first - (counts.cumsum(0) - counts), counts)
    pages = kv_indices[torch.arange(int(counts.sum())) + offsets]
    read = (counts - 1).clamp(min=0) * page_size + torch.where(counts > 0, last_b, 0)
    row1 = torch.minimum(q.row0 + rows, qo_lens[b])
    unsplit = torch.minimum(kv_lens[b], (row1 + q.shift).clamp(min=0)) if causal else kv_lens[b]
    return PagedRangeLayout(
        qo_indptr=torch.cat([qo_indptr[b] + q.row0, qo_indptr[-1:]]).to(torch.int32),
        kv_indptr=torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32),
        kv_indices=pages.to(torch.int32), kv_last_page_len=last_b.to(torch.int32),
        blocks=_blocks_table(q, first * page_size),
        keys_read=int(read.sum()), keys_total=int(unsplit.sum()))


def relative_runs(runs: torch.Tensor, layout: KvRangeLayout, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                  rows: int, causal: bool) -> torch.Tensor:
    """The pre-pass's row runs ([batch, heads, max_qo_len, 2] of [first, end) in request kv_idx) made what the
    row-run struct compares the kernel's kv_idx with: relative to the first key of the row's block, and cut at
    the diagonal if causal. Runs on the runs' device; host tensors for the rest."""
    batch, _, max_rows, _ = runs.shape
    qo_lens = qo_indptr.long().diff()
    b = layout.blocks[:, 0].long()
    tile = (layout.qo_indptr[:-1].long() - qo_indptr.long()[b]) // rows
    k0 = torch.zeros(batch, max(1, (max_rows + rows - 1) // rows), dtype=torch.long)
    k0[b, tile] = layout.blocks[:, 2].long()  # [request, tile] -> kv_idx of the block's first key
    dev = runs.device
    row = torch.arange(max_rows, device=dev)
    k0_rows = k0.to(dev)[:, row // rows]  # [batch, max_rows]
    out = runs.long()
    if causal:  # q_idx of row r is r + kv_len - qo_len
        shift = (kv_indptr.long().diff() - qo_lens).to(dev)
        out[..., 1] = torch.minimum(out[..., 1], (row[None, :] + shift[:, None] + 1)[:, None, :])
    return (out - k0_rows[:, None, :, None]).to(torch.int32).contiguous()


class _KvStartsModule:
    """FlashInfer's module with its `plan` given the blocks' KV starts: the wrapper derives KV starts and
    lengths from one indptr, which cannot describe overlapping ranges; the lengths it derives are kept."""

    def __init__(self, module):
        self._module, self.kv_starts = module, None

    def plan(self, *args):
        from ..flashinfer_compat import problem, wrappers
        args, at = list(args), wrappers.KV_STARTS_POSITION  # kv_indptr_host in FA3's plan arguments
        why = problem("fa3_plan_kv_starts")
        if why or self.kv_starts is None or args[at].shape != self.kv_starts.shape:
            raise FivarError(f"fivar KV ranges: FlashInfer's FA3 plan arguments changed ({why or 'kv_indptr_host'}); "
                             "this flashinfer version is not supported")
        args[at] = self.kv_starts
        return self._module.plan(*args)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _fa3_wrapper(fmod, device):
    """A ragged FA3 wrapper running fivar's module with the KV-starts plan."""
    w = take_wrapper("ragged", fmod, device, owns_mask=False)
    w._jit_module = _KvStartsModule(w._jit_module)
    return w


def run_kind(runs: torch.Tensor) -> int:
    """What the pre-pass's row runs ([..., 4]: [a0, a1, b0, b1) per row) allow: 1 when every row keeps one run of
    keys or none (the row-run form), 2 when some keep two (the two-run form), 0 when some keep more (the mask
    form)."""
    if bool((runs[..., 0] < 0).any()):
        return 0
    return 1 if bool((runs[..., 2] == runs[..., 3]).all()) else 2


def mask_scan(variant, bound, qo_indptr, kv_indptr, max_qo_len, num_qo_heads, num_kv_heads, sm_scale, device):
    """The mask pre-pass over a batch given by token indptrs: (ranges on the host, run_kind, the rows' runs on
    `device` as that form reads them: [..., 2] for one run a row, [..., 4] for two, None for the mask form)."""
    ranges, runs = load_triton_module(variant).mask_ranges(
        qo_indptr.to(device), kv_indptr.to(device), max_qo_len, num_qo_heads, num_qo_heads // num_kv_heads,
        kernel_arg_values(variant, bound, sm_scale), row_runs=True)
    kind = run_kind(runs)
    return ranges.cpu(), kind, {0: None, 1: runs[..., :2].contiguous(), 2: runs}[kind]


def two_run_table(runs: torch.Tensor, layout: KvRangeLayout, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-run form's ROW_RUNS and the blocks' last two fields: for each lowered row (a copy of a row of q, once
    per request reading it) its two runs [a0, a1, b0, b1) relative to its request's first key and cut at the
    diagonal if causal, as [heads, lowered rows, 4]; a request's rows start at field 3 of its block, the next query
    head's `field 4` further. `runs` is the pre-pass's [batch, heads, max_qo_len, 4] on its device."""
    qo_indptr, kv_indptr = qo_indptr.long(), kv_indptr.long()
    lowered = layout.qo_indptr.long()
    n = int(lowered[-1])
    src = layout.parts.src if layout.parts is not None else torch.arange(n)  # the row of q each lowered row copies
    b = torch.searchsorted(qo_indptr, src, right=True) - 1
    row = src - qo_indptr[b]
    req = torch.repeat_interleave(torch.arange(lowered.numel() - 1), lowered.diff())
    k0 = layout.blocks[:, 2].long()[req]
    dev = runs.device
    out = runs[b.to(dev), :, row.to(dev)].long()  # [lowered rows, heads, 4]
    if causal:  # q_idx of row r is r + kv_len - qo_len: nothing right of it
        q_idx = (row + kv_indptr.diff()[b] - qo_indptr.diff()[b]).to(dev)
        out[..., 1::2] = torch.minimum(out[..., 1::2], (q_idx + 1)[:, None, None])
    table = (out - k0.to(dev)[:, None, None]).to(torch.int32).permute(1, 0, 2).contiguous()
    head_step = 4 * n if runs.shape[1] > 1 else 0
    tail = torch.stack([lowered[:-1] * 4, torch.full_like(lowered[:-1], head_step)], 1).to(torch.int32)
    return table, tail


#: what a lowered request needs (mask_free_requests): the planned form, FA3's causal mode with no mask (and its
#: sliding window if one is set), or no mask at all
NEEDS_MASK, CAUSAL_WINDOW, ALL_KEYS = 0, 1, 2


@dataclass
class MaskFreeRequests:
    """Which lowered requests run without the mask (host tensors)."""
    kind: torch.Tensor  # int64 [R]: NEEDS_MASK, CAUSAL_WINDOW or ALL_KEYS
    window: int | None  # CAUSAL_WINDOW requests' rows keep the keys q_idx - window < kv_idx <= q_idx of the request's
    #                     (None: every key up to q_idx): FA3's causal mode with window_left = window - 1
    inside: torch.Tensor | None = None  # bool [R]: every row keeps its whole window (not cut at the first key)


def mask_free_requests(runs: torch.Tensor, layout: KvRangeLayout, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                       causal: bool, windows: bool) -> MaskFreeRequests:
    """From the pre-pass's row runs ([batch, heads, max_qo_len, 2 or 4]: one or two runs [first, end) a row, in
    request kv_idx, on their device), what each lowered request's rows keep of its keys [lo, hi), every head:
    all of them (ALL_KEYS; causal calls: none right of a row's diagonal), or exactly a causal window ending at each
    row's diagonal (CAUSAL_WINDOW: q_idx - W < kv_idx <= q_idx; a row whose window reaches left of lo keeps
    [lo, q_idx], which fits any W that wide), else NEEDS_MASK. The window W is one per launch: the one the most
    rows need (with `windows` False, only windows reaching left of every request's keys: plain causal blocks)."""
    qo_indptr, kv_indptr = qo_indptr.long(), kv_indptr.long()
    lowered = layout.qo_indptr.long()
    n_req, n = lowered.numel() - 1, int(lowered[-1])
    src = layout.parts.src if layout.parts is not None else torch.arange(n)
    b = torch.searchsorted(qo_indptr, src, right=True) - 1
    row = src - qo_indptr[b]
    req = torch.repeat_interleave(torch.arange(n_req), lowered.diff())
    dev = runs.device
    lo = layout.blocks[:, 2].long()[req]
    big = 1 << 40
    q_idx = row + kv_indptr.diff()[b] - qo_indptr.diff()[b]
    cut = (q_idx + 1) if causal else torch.full_like(q_idx, big)
    lo, hi, q_idx, cut = (x.to(dev)[:, None] for x in (lo, lo + layout.kv_lens.long()[req], q_idx, cut))
    r = runs[b.to(dev), :, row.to(dev)].long()  # [lowered rows, heads, 2 or 4]
    end = torch.minimum(hi, cut)
    s1, e1 = torch.maximum(r[..., 0], lo), torch.minimum(r[..., 1], end)
    s2, e2 = ((torch.maximum(r[..., 2], lo), torch.minimum(r[..., 3], end)) if r.shape[-1] == 4
              else (torch.zeros_like(s1), torch.zeros_like(e1)))
    has1, has2 = e1 > s1, e2 > s2
    # the keys kept as one interval [s, e) (two runs that touch are one), else not mask-free
    single = (has1 | has2) & ~(has1 & has2 & (s2 > e1))
    s = torch.where(has1, s1, s2)
    e = torch.where(has2, torch.maximum(e2, torch.where(has1, e1, e2)), e1)
    full = single & (s == lo) & (e == hi)
    band = single & (e == q_idx + 1) if causal else torch.zeros_like(single)
    exact = band & (s > lo)  # the window's left edge inside the request: W = q_idx - s + 1
    width = q_idx - s + 1
    w_min = torch.where(exact, width, big).amin(1)
    w_max = torch.where(exact, width, -1).amax(1)
    reach = q_idx - lo + 1  # W must reach lo from the rows keeping [lo, q_idx]
    w_low = torch.where(band & ~exact, reach, 0).amax(1)
    w_low_min = torch.where(band & ~exact, reach, big).amin(1)
    reduce = lambda x, how, init: torch.full((n_req,), init, dtype=x.dtype, device=dev).scatter_reduce(  # noqa: E731
        0, req.to(dev), x, how, include_self=True)
    per_request = torch.stack([  # one device->host copy
        reduce(full.all(1).long(), "amin", 1), reduce(band.all(1).long(), "amin", 1), reduce(w_min, "amin", big),
        reduce(w_max, "amax", -1), reduce(w_low, "amax", 0), reduce(w_low_min, "amin", big)]).cpu()
    all_full, all_band = per_request[0].bool(), per_request[1].bool()
    w_min, w_max, w_low, w_low_min = per_request[2:]
    one_width = all_band & (w_min == w_max)  # every exact row of the request needs the same W
    window = None
    if windows and bool(one_width.any()):
        values, which = torch.unique(w_min[one_width], return_inverse=True)
        rows = torch.zeros(values.numel(), dtype=torch.long).index_add_(
            0, which, layout.qo_indptr.diff().long()[one_width])
        window = int(values[rows.argmax()])
    plain = all_band & (w_max < 0)  # no exact row: the window only has to reach lo
    fits = plain if window is None else (plain & (w_low <= window)) | (one_width & (w_min == window) &
                                                                        (w_low <= window))
    kind = torch.where(fits, CAUSAL_WINDOW, torch.where(all_full, ALL_KEYS, NEEDS_MASK))
    # every row keeps exactly [q_idx - W + 1, q_idx], so the request's keys may start further left
    inside = None if window is None else (w_low == 0) | ((w_low == window) & (w_low_min == window))
    return MaskFreeRequests(kind, window, inside)


#: The head-requests form runs when its blocks read at most this share of the keys the blocks of all heads together
#: read: it pays moves of q's rows, the output's and k/v's (about 90 us at S=8192, 32/8 heads, on an H200).
HEAD_REQUESTS_GAIN = 0.75


@dataclass
class HeadRequests:
    """A batch as one request per (query head, request), for a mask keeping different keys per head (a window per
    head): q, k and v head-major (query head h's rows of request b are rows h * T + qo_indptr[b] onwards, one head
    a row), so each head's query blocks read its own keys, not their union over heads. Host int64 tensors over the
    H * B requests, request h * B + b."""
    qo_indptr: torch.Tensor  # [H * B + 1]: rows of the head-major q
    kv_indptr: torch.Tensor  # [H * B + 1]: each request's keys in a key space of their own (what the lowering reads)
    kv_shift: torch.Tensor   # [H * B]: added to a key of that space, its token in the head-major k/v
    batch: torch.Tensor      # [H * B]: the request of the batch
    qo_head: torch.Tensor    # [H * B]
    kv_head: torch.Tensor    # [H * B]
    num_heads: int           # H

    def token_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the head-major q -> the same rows of q viewed a head a row ([tokens * heads, 1, head_dim])."""
        tokens = int(self.qo_indptr[-1]) // self.num_heads
        return (rows % tokens) * self.num_heads + rows // tokens

    def blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """fivar.codegen.fa3.HEAD_BLOCK_FIELDS from a lowering's blocks over these requests: the batch's request
        in field 0, and the heads."""
        r = blocks[:, 0].long()
        return torch.cat([self.batch[r, None], blocks[:, 1:].long(), self.qo_head[r, None], self.kv_head[r, None]],
                         1).to(torch.int32)


def head_requests(ranges: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int,
                  num_kv_heads: int, rows: int, causal: bool) -> HeadRequests | None:
    """The head-requests form of a batch whose pre-pass ranges ([batch, heads, groups, 6], host) differ per head,
    or None when its query blocks would not read fewer than HEAD_REQUESTS_GAIN of the keys of the blocks of all
    heads over their union."""
    batch, heads = qo_indptr.numel() - 1, ranges.shape[1]
    if heads == 1 or batch == 0:
        return None
    qo_h, kv_h = qo_indptr.long(), kv_indptr.long()
    h, b = torch.arange(heads).repeat_interleave(batch), torch.arange(batch).repeat(heads)
    kv_lens = kv_h.diff()[b]
    kv_v = indptr(kv_lens).long()
    per_head = _query_blocks(ranges.permute(1, 0, 2, 3).reshape(heads * batch, 1, *ranges.shape[2:]),
                             qo_h.diff()[b], kv_lens, rows, causal, None)
    union = _query_blocks(ranges, qo_h.diff(), kv_h.diff(), rows, causal, None)
    if int((per_head.hi - per_head.lo).sum()) > HEAD_REQUESTS_GAIN * heads * int((union.hi - union.lo).sum()):
        return None
    n_q, n_kv = int(qo_h[-1]), int(kv_h[-1])
    kv_head = h // (num_qo_heads // num_kv_heads)
    return HeadRequests(qo_indptr=torch.cat([qo_h[:-1][b] + h * n_q, torch.tensor([heads * n_q])]),
                        kv_indptr=kv_v, kv_shift=kv_head * n_kv + kv_h[:-1][b] - kv_v[:-1], batch=b, qo_head=h,
                        kv_head=kv_head, num_heads=heads)


@dataclass
class _Launch:
    """One FA3 launch of a planned batch: its wrapper and run arguments, the rows of q it reads (None: q itself,
    the first launch, whose requests are the blocks over q's own rows; those it does not compute read one key and
    are written over), and where its output rows go: (positions in its output or None for all, rows of the
    output) and (the same, rows of the split blocks' first-run output)."""
    wrapper: object
    args: list
    release: tuple
    gather: torch.Tensor | None = None
    to_out: tuple | None = None
    to_first_runs: tuple | None = None


def _rows_of(result, pos, lse_too: bool):
    if pos is None:
        return result
    return tuple(x.index_select(0, pos) for x in result) if lse_too else result.index_select(0, pos)


class KvRangePrefill:
    """A ragged batch (a single request is a batch of one) planned on FA3 in the KV-range form; `run(q, k, v)`
    per layer. Checks of q/k/v against the plan are the caller's (RaggedAttentionPlan).

    Requests whose rows keep exactly their keys, or a causal window of them (mask_free_requests; plain_blocks
    for a mask the pre-pass gives no runs for), run with no mask in the struct: FA3's causal mode (with its
    sliding window) or no mask. The first launch runs the form most of q's rows take over q itself; each form
    then runs its other requests in one launch over copies of their rows."""

    def __init__(self, variant, qo_indptr, kv_indptr, *, num_qo_heads, num_kv_heads, head_dim, dtype, causal,
                 bound, sm_scale, device):
        qo_h, kv_h = qo_indptr.cpu(), kv_indptr.cpu()
        bound = position_tables.bind(variant, bound, lambda: position_tables.max_lengths(qo_h, kv_h))
        max_qo_len = int(qo_h.diff().max()) if qo_h.numel() > 1 else 0
        self.empty = max_qo_len == 0
        self._launches: list[_Launch] = []
        self.heads = self._kv_rows = None
        if self.empty:
            return
        ranges, self.row_runs, runs = mask_scan(variant, bound, qo_indptr, kv_indptr, max_qo_len, num_qo_heads,
                                            num_kv_heads, sm_scale, device)
        # a mask keeping different keys per head: a request per head, so each reads its own keys (row runs needed:
        # the mask form's analytic check takes one head for all)
        if runs is not None and fa3.mask_reads_head(variant):
            self.heads = head_requests(ranges, qo_h, kv_h, num_qo_heads, num_kv_heads, block_rows(head_dim), causal)
        if self.heads is not None:
            to_requests = lambda x: x.transpose(0, 1).reshape(-1, 1, *x.shape[2:])  # noqa: E731  [H*B, 1, ...]
            ranges, runs = to_requests(ranges), to_requests(runs).contiguous()
            # head-major row r of k/v is token r % n_kv of KV head r // n_kv (made here: a CUDA graph may capture run)
            n_kv, r = int(kv_h[-1]), torch.arange(int(kv_h[-1]) * num_kv_heads, device=device)
            self._kv_rows = (r % max(n_kv, 1)) * num_kv_heads + r // max(n_kv, 1)
            qo_h, kv_h = self.heads.qo_indptr, self.heads.kv_indptr
            num_qo_heads = num_kv_heads = 1
        self.segments = None  # the segments form: how many requests it runs
        if causal and self.row_runs == 1:
            found = segments.segment_layout(runs, qo_h, kv_h)
            if found is not None:
                self._plan_segments(variant, bound, sm_scale, found, num_qo_heads, num_kv_heads, head_dim, dtype,
                                    device)
                return
        # rows keeping two runs (a sink and a window) read each run, not the keys between (merged by the LSEs)
        layout = kv_range_layout(ranges, qo_h, kv_h, block_rows(head_dim), causal,
                                 runs_shape=tuple(runs.shape) if self.row_runs == 1 else None,
                                 split_runs=self.row_runs != 1 and variant.softmax and variant.sink is None
                                 and self.heads is None)
        if self.heads is not None:  # from each request's key space to its head's keys in the head-major k/v
            layout.kv_starts[:-1] += self.heads.kv_shift[layout.blocks[:, 0].long()].to(torch.int32)
        two_runs = None
        if self.row_runs == 2:
            two_runs, layout.blocks[:, 3:] = two_run_table(runs, layout, qo_h, kv_h, causal)
        self.layout = layout
        if runs is not None:
            self.mask_free = mask_free_requests(runs, layout, qo_h, kv_h, causal, fa3.may_keep_windows(variant))
        else:  # the mask form: the analytic check of the blocks (their rows keep every key)
            plain = plain_blocks(variant, bound, layout, causal, num_qo_heads, num_kv_heads)
            self.mask_free = MaskFreeRequests(torch.where(plain, CAUSAL_WINDOW if causal else ALL_KEYS, NEEDS_MASK),
                                              None)
        kind = self.mask_free.kind
        tables = {BLOCKS: self._blocks_table(layout.blocks).to(device)}
        if self.row_runs:
            tables[ROW_RUNS] = (two_runs if self.row_runs == 2 else
                                relative_runs(runs, layout, qo_h, kv_h, block_rows(head_dim), causal))
        parts = layout.parts
        own = torch.arange(kind.numel()) < (parts.blocks if parts is not None else kind.numel())  # over q's rows
        counts = layout.qo_indptr.diff().long()
        forms = [f for f in (CAUSAL_WINDOW, ALL_KEYS, NEEDS_MASK) if bool((kind == f).any())]
        # the first launch runs the form most of q's own rows take, over q itself; then each form its other requests
        lead = max(forms, key=lambda f: int(counts[own & (kind == f)].sum()))
        first_sel = own & (kind == lead)
        launches = [(lead, first_sel, True)] + [(f, (kind == f) & ~first_sel, False) for f in forms]
        if self.heads is not None:  # every launch gathers its rows from q as it is (fivar.runtime.kv_ranges.run)
            launches = [(f, kind == f, False) for f in forms]
        window = self.mask_free.window
        for form, sel, first in launches:
            if not bool(sel.any()):
                continue
            if form == NEEDS_MASK:
                fmod = _module(variant, "batch_prefill", "fa3", dtype, head_dim, bound, sm_scale,
                               row_runs=self.row_runs, head_requests=self.heads is not None)
                args_causal = None if self.row_runs else causal
                form_tables, launch_causal, window_left = tables, False, -1
            else:
                fmod = _module(variant, "batch_prefill", "fa3", dtype, head_dim, bound, sm_scale, mask_free=True,
                               sliding_window=form == CAUSAL_WINDOW and window is not None,
                               head_requests=self.heads is not None)
                args_causal, form_tables = None, {BLOCKS: tables[BLOCKS]}
                launch_causal = form == CAUSAL_WINDOW
                window_left = window - 1 if form == CAUSAL_WINDOW and window is not None else -1
            launch = self._plan_launch(variant, bound, sm_scale, fmod, sel, own if first else None, form_tables,
                                       args_causal, launch_causal, window_left, num_qo_heads, num_kv_heads, head_dim,
                                       dtype, device, form)
            self._launches.append(launch)
        self._twice = None if parts is None else parts.twice.to(device)

    def _plan_segments(self, variant, bound, sm_scale, layout: "segments.SegmentLayout", num_qo_heads,
                       num_kv_heads, head_dim, dtype, device):
        """Documents and chunks called causally (fivar.runtime.segments): one request of FA3's causal mode per
        segment over its own keys, as stock FlashInfer runs packed documents, the mask-free struct mapping each
        back to its positions. Every row of q is in exactly one, in order, so one launch writes q's output."""
        rows, keys, starts, blocks = layout.with_rows()
        if self.heads is not None:
            starts = starts + self.heads.kv_shift[blocks[:, 0].long()]
        blocks = self._blocks_table(blocks)
        fmod = _module(variant, "batch_prefill", "fa3", dtype, head_dim, bound, sm_scale, mask_free=True,
                       head_requests=self.heads is not None)
        w = _fa3_wrapper(fmod, device)
        w._jit_module.kv_starts = torch.cat([starts, starts.new_zeros(1)]).to(torch.int32)
        w.plan(indptr(rows), indptr(keys), num_qo_heads, num_kv_heads, head_dim, causal=True, q_data_type=dtype,
               kv_data_type=dtype, o_data_type=dtype)
        launch = _Launch(w, kernel_args(variant, bound, sm_scale, None, tables={BLOCKS: blocks.to(device)}),
                         ("ragged", fmod, device))
        if self.heads is not None:  # every row of head-major q, in order, gathered from q viewed a head a row
            launch.gather = self.heads.token_rows(torch.arange(int(layout.qo_indptr[-1]), device=device))
            launch.to_out = (None, launch.gather)
        self._launches = [launch]
        self._twice = None
        self.segments = int(rows.numel())

    def _blocks_table(self, blocks: torch.Tensor) -> torch.Tensor:
        """The struct's BLOCKS table from a lowering's (host): the head-requests form's has the heads."""
        return blocks if self.heads is None else self.heads.blocks(blocks)

    def _requests(self, req: torch.Tensor, sel: torch.Tensor, form: int):
        """A launch's FA3 requests from the lowered requests `req` (in order): runs of adjacent mask-free ones that
        one request computes alike are merged (a chunk's or a document's blocks, keyed from one first key, become
        one causal request, as stock FlashInfer's request per document; windows whose every row starts right of
        its block's first key, one windowed request); `sel`'s others read one key. Returns each request's first
        lowered request, rows and keys."""
        layout = self.layout
        batch, q_first, lo = (layout.blocks[req, i].long() for i in range(3))
        n_rows, kv_lens = layout.qo_indptr.diff().long()[req], layout.kv_lens.long()[req]
        member = sel[req]
        joins = torch.zeros_like(member)
        if form != NEEDS_MASK and req.numel() > 1:
            hi = lo + kv_lens
            same = (lo[1:] == lo[:-1]) & ((hi[1:] == hi[:-1]) if form == ALL_KEYS else True)
            if form == CAUSAL_WINDOW and self.mask_free.window is not None:
                same = same | (self.mask_free.inside[req[1:]] & (lo[1:] >= lo[:-1]))
            joins[1:] = (member[1:] & member[:-1] & (batch[1:] == batch[:-1])
                         & (q_first[1:] == q_first[:-1] + n_rows[:-1]) & same)
        group = torch.cumsum(~joins, 0) - 1
        first = torch.nonzero(~joins).view(-1)
        rows = torch.zeros(first.numel(), dtype=torch.long).index_add_(0, group, n_rows)
        last = torch.cat([first[1:] - 1, torch.tensor([req.numel() - 1])])
        keys = torch.where(member[first], lo[last] + kv_lens[last] - lo[first], kv_lens[first].clamp(max=1))
        return req[first], rows, keys

    def _plan_launch(self, variant, bound, sm_scale, fmod, sel, own, tables, args_causal, causal, window_left,
                     num_qo_heads, num_kv_heads, head_dim, dtype, device, form) -> _Launch:
        """A launch of the selected requests: the first (`own`: the requests over q's own rows) over q, a later
        one over copies of its requests' rows."""
        layout = self.layout
        w = _fa3_wrapper(fmod, device)
        if own is not None:
            req = torch.arange(int(own.sum()))
            launch = _Launch(w, [], ("ragged", fmod, device))
        else:
            req = torch.nonzero(sel).view(-1)
            rows = concat_ranges(layout.qo_indptr[:-1][sel], layout.qo_indptr.diff()[sel])
            n_q = int(layout.qo_indptr[layout.parts.blocks if layout.parts is not None else -1])  # rows of q
            src = layout.parts.src[rows] if layout.parts is not None else rows
            in_q = rows < n_q
            place = lambda m, dst: (None if bool(m.all()) else torch.nonzero(m).view(-1).to(device),  # noqa: E731
                                    dst.to(device))
            launch = _Launch(w, [], ("ragged", fmod, device), gather=src.to(device),
                             to_out=place(in_q, rows[in_q]) if bool(in_q.any()) else None,
                             to_first_runs=place(~in_q, rows[~in_q] - n_q) if bool((~in_q).any()) else None)
        if self.heads is not None:  # rows of head-major q -> rows of q viewed a head a row
            launch.gather = self.heads.token_rows(launch.gather)
            launch.to_out = (None, launch.gather)
        leader, counts, kv_lens = self._requests(req, sel, form)
        starts = torch.cat([layout.kv_starts[:-1][leader], layout.kv_starts[-1:]])
        # the row-run tables are found through each block's own fields: only the blocks table is cut
        blocks = tables[BLOCKS][leader.to(tables[BLOCKS].device)]
        w._jit_module.kv_starts = starts
        w.plan(indptr(counts), indptr(kv_lens), num_qo_heads, num_kv_heads, head_dim, causal=causal,
               window_left=window_left, q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype)
        launch.args = kernel_args(variant, bound, sm_scale, args_causal, tables={**tables, BLOCKS: blocks})
        return launch

    def run(self, q, k, v, return_lse: bool = False):
        if self.empty:
            return (torch.empty_like(q), empty_lse(q)) if return_lse else torch.empty_like(q)
        if self.heads is None:
            return self._run_rows(q, k, v, return_lse)
        # the head-requests form: each launch gathers its rows (a token of a head each) from q viewed a head a row
        # and writes them back there; k and v head-major
        from ..triton_ops.rows import gather_rows, scatter_rows
        d = q.shape[-1]
        k, v = (gather_rows(x.reshape(-1, d), self._kv_rows).view(-1, 1, d) for x in (k, v))
        rows = q.reshape(-1, d)
        out = torch.empty_like(rows)
        lse = torch.empty(rows.shape[0], dtype=torch.float32, device=q.device) if return_lse else None
        for launch in self._launches:
            result = launch.wrapper.run(gather_rows(rows, launch.gather).view(-1, 1, d), k, v, *launch.args,
                                        return_lse=return_lse)
            o, s = result if return_lse else (result, None)
            scatter_rows(out, launch.to_out[1], o.view(-1, d))
            if return_lse:
                lse.index_copy_(0, launch.to_out[1], s.view(-1))
        out = out.view(q.shape)
        return (out, lse.view(q.shape[:2])) if return_lse else out

    def _run_rows(self, q, k, v, return_lse: bool):
        twice = self._twice
        lse_too = return_lse or twice is not None
        first, *rest = self._launches
        out = first.wrapper.run(q, k, v, *first.args, return_lse=lse_too)
        first_runs = None
        if twice is not None:  # the split blocks' first runs
            first_runs = tuple(x.new_empty((twice.numel(),) + x.shape[1:]) for x in out)
        for launch in rest:
            result = launch.wrapper.run(q.index_select(0, launch.gather), k, v, *launch.args, return_lse=lse_too)
            for target, place in ((out, launch.to_out), (first_runs, launch.to_first_runs)):
                if place is not None:
                    write_rows(target, place[1], _rows_of(result, place[0], lse_too), lse_too)
        if twice is None:
            return out
        (o, s), (o1, s1) = out, first_runs
        if o.is_cuda:  # in place, one pass over the rows merged
            from ..triton_ops.merge_states import merge_into_rows
            merge_into_rows(o, s, twice, o1, s1)
        else:
            merged, merged_lse = merge_states([o.index_select(0, twice), o1], [s.index_select(0, twice), s1])
            o.index_copy_(0, twice, merged)
            s.index_copy_(0, twice, merged_lse)
        return (o, s) if return_lse else o

    def release(self):
        """Hand the wrappers on (the one-shot plan cache, on dropping this plan); the plan is unusable after."""
        for launch in self._launches:
            release_wrapper(*launch.release, launch.wrapper)
        self._launches = []


def plain_blocks(variant, bound, layout: KvRangeLayout, causal: bool, num_qo_heads: int,
                 num_kv_heads: int) -> torch.Tensor:
    """bool [R]: the blocks whose every row, every head, keeps exactly the block's keys [lo, hi), causally if causal
    (then the keys end at the block's last row's diagonal), so FA3 computes the mask by its causal mode or needs
    none: the mask, without the causal term, keeps every pair of the block's rows and keys (one interval query per
    block, fivar.spec.sparsity); the pre-pass's hull holds every key any row keeps."""
    n_rows = layout.qo_indptr.diff().long()
    batch, q_first, lo = (layout.blocks[:, i].long() for i in range(3))
    hi = lo + layout.kv_lens.long()
    plain = torch.zeros_like(n_rows, dtype=torch.bool)
    asked = (n_rows > 0) & (hi > lo) & ((hi == q_first + n_rows) if causal else True)
    tensors = {n: t.cpu() for n, t in bound.tensors.items()}
    for b in torch.unique(batch[asked]).tolist():
        sel = torch.nonzero(asked & (batch == b)).view(-1)
        kinds = classify_bounds(variant.ir.mask, q_first[sel], q_first[sel] + n_rows[sel] - 1, lo[sel], hi[sel] - 1,
                                scalars=bound.scalars, tensors=tensors, num_qo_heads=num_qo_heads,
                                num_kv_heads=num_kv_heads, batch_idx=b, causal=False, pairs=True)
        plain[sel] = kinds == FULL
    return plain


@dataclass
class PagedKvRanges:
    """A paged batch lowered to the KV-range form (`paged_kv_ranges`): what FA3's paged wrapper plans and runs."""
    layout: PagedRangeLayout
    row_runs: bool  # the row-run form (tables holds ROW_RUNS; causal folded into the runs)
    tables: dict    # the struct's tables on the device: BLOCKS (and ROW_RUNS)


def paged_kv_ranges(variant, bound, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, page_size: int,
                    num_qo_heads: int, num_kv_heads: int, head_dim: int, causal: bool, sm_scale: float,
                    device) -> PagedKvRanges | None:
    """A paged batch on FA3 for a mask that is more than a band: one request per query block over the pages
    holding the keys its rows may keep (the ragged form's pre-pass and blocks, paged_range_layout). None when
    the blocks would read no fewer keys than a request per request (the mask drops no page): the unsplit form
    runs FA3's own causal mode and plans fewer requests."""
    qo_h, pages_h, last_h = qo_indptr.long().cpu(), kv_indptr.long().cpu(), kv_last_page_len.long().cpu()
    bound = position_tables.bind(variant, bound, lambda: position_tables.max_lengths(qo_h, pages_h, last_h, page_size))
    n_pages = pages_h.diff()
    kv_lens = (n_pages - 1).clamp(min=0) * page_size + torch.where(n_pages > 0, last_h, 0)
    kv_h = torch.cat([torch.zeros(1, dtype=torch.long), kv_lens.cumsum(0)])  # the keys as a ragged batch
    max_qo_len = int(qo_h.diff().max()) if qo_h.numel() > 1 else 0
    if max_qo_len == 0:
        return None
    ranges, kind, runs = mask_scan(variant, bound, qo_h, kv_h, max_qo_len, num_qo_heads, num_kv_heads, sm_scale, device)
    row_runs = kind == 1  # two runs a row: the mask form (the paged blocks do not split)
    rows = block_rows(head_dim)
    layout = paged_range_layout(ranges, qo_h, pages_h, kv_indices.cpu(), last_h, page_size, rows, causal,
                                runs_shape=tuple(runs.shape) if row_runs else None)
    if layout.keys_read >= layout.keys_total:
        return None
    tables = {BLOCKS: layout.blocks.to(device)}
    if row_runs:
        tables[ROW_RUNS] = relative_runs(runs, layout, qo_h, kv_h, rows, causal)
    return PagedKvRanges(layout, row_runs, tables)
