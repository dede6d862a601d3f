"""A causal batch whose mask cuts it into segments (documents, chunks): every row keeps exactly the keys from its
segment's first key to itself. Such a batch runs as stock FlashInfer runs packed documents, one request per
segment in the kernel's causal mode with no mask evaluated; the struct maps each request's local rows and keys back
to their q_idx and kv_idx (FA2's key-segments table, fivar.codegen.fa2.KV_SEGMENTS). Read off the mask pre-pass's
row runs (`mask_scan`), so any mask qualifies on a batch where it happens to be segments."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codegen.fa2 import NO_SECOND_RUN
from ..codegen.triton import kernel_arg_values
from ..jit.triton_module import load_triton_module


@dataclass
class SegmentLayout:
    """Rows [qo_indptr[s], qo_indptr[s+1]) of q attend keys [kv_indptr[s], kv_indptr[s+1]) of k/v, causally
    (bottom-right aligned); the segments' KV ranges tile each request's keys, so a segment of no rows covers keys
    that no row keeps. Host tensors."""
    qo_indptr: torch.Tensor  # int32 [S + 1], rows of q
    kv_indptr: torch.Tensor  # int32 [S + 1], tokens of k/v
    batch: torch.Tensor      # int64 [S]: the request of the batch each segment is a piece of
    first_key: torch.Tensor  # int64 [S]: kv_idx (in its request) of the segment's first key

    @property
    def segments(self) -> torch.Tensor:
        """FA2's key-segments table (int32 [S, 9]): local key j is kv_idx first_key + j, local row i sits at q_idx
        (kv_len_s - qo_len_s + i) + first_key; a segment of no rows is skipped."""
        n = self.batch.numel()
        no_rows = self.qo_indptr.diff() == 0
        lo, zero = self.first_key, torch.zeros(n, dtype=torch.long)
        return torch.stack([torch.full((n,), NO_SECOND_RUN), lo, zero, lo, self.batch, zero,
                            self.kv_indptr.diff().long(), no_rows.long(), torch.full((n,), -1)], 1).to(torch.int32)



def _one_run_a_row(runs: torch.Tensor) -> torch.Tensor | None:
    """The pre-pass's row runs ([batch, heads, rows, 2 or 4]) as [batch, rows, 2] on the host, or None when a row
    keeps two runs or the heads keep different keys (a segment is the batch's, not a head's)."""
    runs = runs.cpu().long()
    if runs.shape[-1] >= 4 and not bool((runs[..., 2] == runs[..., 3]).all()):
        return None
    if not bool((runs[:, :1, :, :2] == runs[..., :2]).all()):
        return None
    return runs[:, 0, :, :2]


def segment_layout(runs: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor) -> SegmentLayout | None:
    """The segments of a causal batch, or None when the mask is not segments on it. `runs`: the mask pre-pass's
    row runs ([batch, heads, max_qo_len, 2 or 4], relative to each request's keys, causal not applied). Row r of a
    request sits at p = r + kv_len - qo_len; it is in a segment when every head keeps one run of keys [a0, a1) with
    a0 <= p < a1, so that causal leaves it [a0, p]. Consecutive rows with the same a0 form one segment; a new
    segment must start at its first row's own position (a0 = p), so that the segments' keys do not overlap."""
    runs = _one_run_a_row(runs)
    if runs is None:
        return None
    qo_h, kv_h = qo_indptr.long().cpu(), kv_indptr.long().cpu()
    q_rows, kv_keys, batch, first_key = [0], [int(kv_h[0])], [], []
    for b in range(qo_h.numel() - 1):
        qo_len, kv_len = int(qo_h[b + 1] - qo_h[b]), int(kv_h[b + 1] - kv_h[b])
        a0, a1 = runs[b, :qo_len, 0], runs[b, :qo_len, 1]
        p = torch.arange(qo_len) + (kv_len - qo_len)
        if not bool(((a0 <= p) & (p < a1)).all()):
            return None
        start = torch.ones(qo_len, dtype=torch.bool)
        start[1:] = a0[1:] != a0[:-1]
        if qo_len and not bool((a0[1:][start[1:]] == p[1:][start[1:]]).all()):
            return None  # a segment starting left of its first row: its keys overlap the one before
        first = torch.nonzero(start).flatten().tolist()
        lead = int(a0[0]) if qo_len else kv_len
        if lead:  # keys no row keeps, left of the first segment: a segment of no rows
            q_rows.append(q_rows[-1])
            kv_keys.append(kv_keys[-1] + lead)
            batch.append(b), first_key.append(0)
        for i, r0 in enumerate(first):
            r1 = first[i + 1] if i + 1 < len(first) else qo_len
            lo, hi = int(a0[r0]), int(p[r1 - 1]) + 1
            q_rows.append(int(qo_h[b]) + r1)
            kv_keys.append(int(kv_h[b]) + hi)
            batch.append(b), first_key.append(lo)
    return SegmentLayout(torch.tensor(q_rows, dtype=torch.int32), torch.tensor(kv_keys, dtype=torch.int32),
                         torch.tensor(batch, dtype=torch.long), torch.tensor(first_key, dtype=torch.long))


def run_kind(runs: torch.Tensor) -> int:
    """What the pre-pass's row runs ([..., 4]: [a0, a1, b0, b1) per row) say: 1 when every row keeps one run of keys
    or none, 2 when some keep two, 0 when some keep more."""
    if bool((runs[..., 0] < 0).any()):
        return 0
    return 1 if bool((runs[..., 2] == runs[..., 3]).all()) else 2


def mask_scan(variant, bound, qo_indptr, kv_indptr, max_qo_len, num_qo_heads, num_kv_heads, sm_scale, device):
    """The Triton twin's mask pre-pass over a batch given by token indptrs: (ranges on the host, run_kind, the rows'
    runs on `device`: [..., 2] for one run a row, [..., 4] for two, None otherwise)."""
    ranges, runs = load_triton_module(variant).mask_ranges(
        qo_indptr.to(device), kv_indptr.to(device), max_qo_len, num_qo_heads, num_qo_heads // num_kv_heads,
        kernel_arg_values(variant, bound, sm_scale), row_runs=True)
    kind = run_kind(runs)
    return ranges.cpu(), kind, {0: None, 1: runs[..., :2].contiguous(), 2: runs}[kind]
