"""A paged batch of short and long requests on backend auto (an engine's step: prefill chunks beside decodes or
verify drafts): the short requests as one FA2 plan, the long ones as one FA3 plan, each writing its rows of one output.

FA3 gives each query head of a request a query tile of its own (block_rows rows), so a request of a few query tokens
fills a sliver of it and the kernel computes the rest of the tile for nothing over every key: 30 decodes over 8192 keys
cost about 1 ms of tensor-core time that way, where FA2's kernel, which packs a GQA group's rows into one tile (the
kernel of FlashInfer's tensor-core decode), reads the same keys at memory speed. An engine without mixed batches runs
the two kinds through two wrappers, one after the other; an auto plan runs both in one plan, at once where each
part's rows are consecutive (the FA2 part on a second stream: its memory-bound kernel fills what FA3's leaves idle).
A part renumbers its requests from 0, so a program may read `batch` only to index a batch-sized tensor, whose rows a
part then takes (batch_dims).
"""
from __future__ import annotations

import torch

from ..jit.targets import AUTO, FA2, target_of
from ..spec import ir
from .fa3_tile_list import block_rows
from .rows import write_rows


def short_requests(qo_lens: torch.Tensor, head_dim: int) -> torch.Tensor:
    """bool [batch]: requests whose queries fill at most a quarter of FA3's query tile (where FA2 won at GQA 32/8,
    docs/serving.md)."""
    return 4 * qo_lens <= block_rows(head_dim)


def batch_dims(variant) -> dict[str, tuple[int, ...]] | None:
    """The tensor params a part's own are sliced from, each with its dimensions named "batch", where the programs
    read the request's index only as those indices (`doc_ids[batch, q_idx]`: a part's request i is the batch's
    request requests[i], so its row of each such tensor is that request's); None where a program reads `batch`
    any other way (a part would renumber it) or indexes a batch dimension by anything else."""
    sized = {n: tuple(i for i, d in enumerate(getattr(p, "dims", ())) if d == "batch") for n, p in
             variant.params.items()}
    sized = {n: dims for n, dims in sized.items() if dims}
    vir = variant.ir

    def clean(e: ir.Expr) -> bool:  # `batch` read only as a batch index of a batch-sized tensor
        if isinstance(e, ir.Index):
            return e.name != "batch"
        if isinstance(e, ir.Load) and e.param in sized:
            return all((isinstance(x, ir.Index) and x.name == "batch") if i in sized[e.param] else clean(x)
                       for i, x in enumerate(e.indices))
        return all(clean(c) for c in e.children())
    programs = [p for p in (vir.mask, vir.logits, vir.sink) if p is not None]
    return sized if all(clean(e) for p in programs for e in p.exprs()) else None


def part_params(params: dict | None, dims: dict, requests: torch.Tensor) -> dict | None:
    """The call's params for a part of its requests: each batch-sized tensor's rows of those requests."""
    if not dims or not params:
        return params
    out = dict(params)
    for name, at in dims.items():
        t = params.get(name)
        if isinstance(t, torch.Tensor):
            for d in at:
                t = t.index_select(d, requests.to(t.device))
            out[name] = t
    return out


def splits(variant, backend: str, target: str, qo_lens: torch.Tensor, head_dim: int) -> bool:
    """Whether an auto plan of this paged batch runs as a short part on FA2 and a long part on `target`."""
    if backend != AUTO or target_of(target).packs_query_heads:
        return False
    short = short_requests(qo_lens, head_dim)  # before the IR walk: most batches are all short or all long
    return bool(short.any()) and not bool(short.all()) and batch_dims(variant) is not None


def _part(requests: torch.Tensor, qo: torch.Tensor, kv: torch.Tensor, kv_indices: torch.Tensor,
          kv_last_page_len: torch.Tensor):
    """The paged metadata of `requests` (int64, host) as a batch of their own, and their rows of q (a slice where
    they are consecutive, else an index tensor)."""
    qo_lens, n_pages = qo.diff()[requests], kv.diff()[requests]
    zero = torch.zeros(1, dtype=torch.int64)
    sub_qo, sub_kv = torch.cat([zero, qo_lens.cumsum(0)]), torch.cat([zero, n_pages.cumsum(0)])
    # each request's pages, gathered: page j of part request i is kv_indices[kv[requests[i]] + j]
    page_of = torch.repeat_interleave(kv[:-1][requests] - sub_kv[:-1], n_pages) + torch.arange(int(sub_kv[-1]))
    rows = torch.repeat_interleave(qo[:-1][requests] - sub_qo[:-1], qo_lens) + torch.arange(int(sub_qo[-1]))
    first = int(rows[0]) if rows.numel() else 0
    if torch.equal(rows, torch.arange(first, first + rows.numel())):
        rows = slice(first, first + rows.numel())
    return (sub_qo.to(torch.int32), sub_kv.to(torch.int32), kv_indices.cpu()[page_of],
            kv_last_page_len.cpu()[requests]), rows


class MixedPaged:
    """The two parts of a split paged batch: (plan, rows) each, run one after the other into one output."""

    def __init__(self, make_plan, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, head_dim: int, target: str,
                 variant, params: dict | None):
        qo, kv = qo_indptr.long().cpu(), kv_indptr.long().cpu()
        short = short_requests(qo.diff(), head_dim)
        dims = batch_dims(variant)
        self.parts = []
        for backend, chosen in ((FA2.name, short), (target, ~short)):
            requests = chosen.nonzero().view(-1)
            meta, rows = _part(requests, qo, kv, kv_indices, kv_last_page_len)
            self.parts.append((make_plan(*meta, backend=backend, params=part_params(params, dims, requests)), rows))

    def release(self):
        for plan, _ in self.parts:
            plan.release()

    def run(self, q, k_cache, v_cache, k_scale: float, return_lse: bool):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous whatever q's layout: FA2 assumes it
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        (short, short_rows), long = self.parts
        if q.is_cuda and isinstance(short_rows, slice) and isinstance(long[1], slice):
            # the short part's memory-bound kernel on a stream of its own, beside the long part's tensor-core kernel
            # (each has its own workspace: fivar.runtime.launch._workspace); a CUDA graph captures the fork and join
            main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                _run_part(short, short_rows, q, k_cache, v_cache, k_scale, out, lse)
            _run_part(*long, q, k_cache, v_cache, k_scale, out, lse)
            main.wait_stream(side)
        else:
            for plan, rows in self.parts:
                _run_part(plan, rows, q, k_cache, v_cache, k_scale, out, lse)
        return (out, lse) if return_lse else out


_side_streams: dict = {}


def _side_stream(device) -> torch.cuda.Stream:
    key = str(device)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device)
    return _side_streams[key]


def _run_part(plan, rows, q, k_cache, v_cache, k_scale: float, out, lse):
    """A part's plan run on its rows of q, written into its rows of out (and lse, where not None)."""
    return_lse = lse is not None
    if isinstance(rows, slice):  # consecutive rows (an engine's order): q's view, written in place
        into = (out[rows], lse[rows] if return_lse else None)
        got = plan._launch(q[rows], k_cache, v_cache, k_scale, return_lse, into=into)
        got_out, got_lse = got if return_lse else (got, None)
        if got_out is not into[0]:
            into[0].copy_(got_out)
            if return_lse:
                into[1].copy_(got_lse)
        return
    index = rows.to(q.device)
    write_rows((out, lse) if return_lse else out, index,
               plan._launch(q.index_select(0, index), k_cache, v_cache, k_scale, return_lse), return_lse)
