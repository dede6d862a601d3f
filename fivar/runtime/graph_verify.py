"""Speculative verify steps for CUDA graphs: a paged batch of several queries a request, with a custom mask (a draft
tree), in the tile-list form (fivar.runtime.fa3_tile_list) held in buffers of fixed capacity, re-planned outside
the graph and replayed inside, as GraphDecodePlan (fivar.runtime.graph) does for decode:

    plan = v.plan_paged(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, cuda_graph=True, max_batch=64,
                        max_qo_len=16, max_pages=65536, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                        dtype=torch.bfloat16, packed_custom_mask=packed, mask_indptr=mask_indptr)
    q = torch.empty(64 * 16, 32, 128, ...)        # static input: max_batch * max_qo_len rows
    out = plan.run(q, cache)                      # warm up (builds/loads the module) on the side
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = plan.run(q, cache)
    for step ...:
        plan.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, packed_custom_mask=packed,
                  mask_indptr=mask_indptr)        # new lengths, pages and draft trees: outside the graph
        q[:tokens].copy_(new_q)                   # into the static input, request by request
        g.replay()                                # out[:tokens] holds this step's attention

`plan` (host work and copies): the device block map of the batch with its custom mask ANDed in (the Triton twin's
map kernel), one device->host copy of the tile list's sizes, the list written into the fixed buffers (zeros past its
end), and FlashInfer's host scheduler into the fixed workspace of a `use_cuda_graph=True` paged wrapper, whose
indptr / page-table buffers are the list's. The captured grid never changes: the list always holds `requests`
tile-list requests, a step's own first and then padding requests of no query rows and no pages, for which
FlashInfer schedules no work. Capacity: up to max_batch requests of up to max_qo_len queries each over max_pages
pages in all; the list's key tiles, pages and cut tiles are bounded from those (`capacity`). A step past any limit
is a one-line FivarError before anything is written; should FlashInfer plan a step with another launch layout than
the captured one (also a one-line error), the plan is not to be replayed again: make a new one.

uniform_qo_len=True promises every request of every step max_qo_len queries (a fixed draft count, as EAGLE's
target verify): on FA2, for requests shorter than its query tile, each request is then one tile-list request of
max_qo_len rows, padding requests too (over q's rows past the step's, no keys: zeros), and FlashInfer's scheduler is
told so (`uniform_q_len`): it sizes its query tile for those rows instead of for one request holding every row of
the capacity. A step breaking the promise is a one-line FivarError. The padding requests are work items of
FlashInfer's schedule (it clamps their key count to one): in a step far below max_batch they take most of its budget
for splitting the real requests' keys (2 x SMs / KV heads work items), so the promise suits graphs captured per
batch size, as engines capture them, not one graph of a large capacity replayed with a few long requests.

Keep the plan alive as long as the graph may replay (the graph holds its buffers' addresses). Params are bound at
plan creation (batch size max_batch; tensor params read through their pointers: update them in place). A plan made
with a custom mask runs the tile-list kernel reading cut tiles as bits (custom_mask=True): a step without a custom
mask runs the same module over the bits of the variant's mask and causal alone. A plan made without one (draft
chains planned as causal, as engines plan chains) takes none in its steps: on FA2, for a variant whose mask is a band,
it runs the requests themselves (VerifyRequests) through the variant's batch-prefill module in FlashInfer's causal
and window modes, as stock's graph does, with no tile list; elsewhere the tile list of the mask alone.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..codegen.fa3 import BLOCKS, CUT_BITS, TILE_KEYS, TILE_WIDTH
from ..codegen.tile_list import TILE_FIELDS, mask_reads_head
from ..errors import FivarError
from ..flashinfer_compat.wrappers import plan_layout, plan_takes_uniform_q_len, uniform_plan_kwargs
from ..jit.module_key import ModuleKey
from ..jit.targets import runs_twin, target_of
from ..spec.inputs import check_lse
from . import position_tables
from .custom_mask import check_custom_mask, paged_kv_lens
from .fa3_tile_list import CUT_WORDS_PAST, block_map, page_size_for, paged_keys, tile_list, tile_rows
from .forms import (_check_backend, _kernel_causal, _owns_mask, _paged_args, _plan_causal, _split_kwargs,
                    _window_left)
from .graph import check_graph_plan
from .fp8_kv import plan_kv_dtype
from .launch import (_check_indptr, _check_pages, _module, _paged_kv, _prepare, _workspace, attach,
                     direct_paged_run)
from .plan_handles import register_plan
from .params import kernel_args
from .rows import indptr



def _limits(variant, qo_h, kv_h, max_batch, max_qo_len, max_pages) -> tuple[int, int, int]:
    """A verify plan's capacity: the limits given, the first step's where left out; checked."""
    max_batch = max_batch if max_batch is not None else qo_h.numel() - 1
    max_qo_len = max_qo_len if max_qo_len is not None else max(int(qo_h.diff().max()) if qo_h.numel() > 1 else 0, 1)
    max_pages = max_pages if max_pages is not None else max(int(kv_h[-1]), 1)
    _check_limits(variant, max_batch=max_batch, max_qo_len=max_qo_len, max_pages=max_pages)
    return max_batch, max_qo_len, max_pages


def _check_step(variant, qo_indptr, kv_indptr, max_batch: int, max_qo_len: int, max_pages: int,
                uniform: bool = False):
    """(qo, kv) host indptrs of a step within the plan's capacity, or its one-line FivarError. uniform: every
    request must hold exactly max_qo_len queries (the plan's promise, uniform_qo_len=True)."""
    name = variant.name
    qo = _check_indptr(variant, "qo_indptr", qo_indptr, "cpu")
    kv = _check_indptr(variant, "kv_indptr", kv_indptr, "cpu")
    if kv.numel() != qo.numel():
        raise FivarError(f"variant '{name}': qo_indptr and kv_indptr must have the same length")
    batch, pages = qo.numel() - 1, int(kv[-1])
    longest = int(qo.diff().max()) if batch else 0
    over = [f"{what}={limit} ({got})" for what, got, limit in (
        ("max_batch", batch, max_batch), ("max_qo_len", longest, max_qo_len), ("max_pages", pages, max_pages))
        if got > limit]
    if over:
        raise FivarError(f"variant '{name}': this verify step is past the CUDA-graph plan's capacity: "
                         f"{', '.join(over)}; plan again with larger limits")
    if uniform and batch and bool((qo.diff() != max_qo_len).any()):
        lens = qo.diff()
        raise FivarError(f"variant '{name}': the CUDA-graph plan was made with uniform_qo_len=True (every request "
                         f"max_qo_len={max_qo_len} queries); this step has requests of {int(lens.min())}.."
                         f"{int(lens.max())}")
    return qo, kv


def _check_run(plan, q, k_cache, check_kv_dtype: bool = True) -> None:
    """q and the cache of a verify plan's run: q of max_tokens rows, the cache's pages as planned."""
    hq, hkv, d, page, dtype = plan._shape
    if q.shape != (plan.max_tokens, hq, d) or k_cache.shape[1:] != (page, hkv, d) or q.dtype != dtype \
            or (check_kv_dtype and k_cache.dtype != dtype):
        raise FivarError(f"variant '{plan.variant.name}': inputs do not match the plan (q [{plan.max_tokens}, {hq}, "
                         f"{d}] (max_batch * max_qo_len rows), cache [*, {page}, {hkv}, {d}], {dtype}); got q "
                         f"{tuple(q.shape)}, cache {tuple(k_cache.shape)}, {q.dtype}")

class Capacity(NamedTuple):
    """The fixed sizes of a verify plan's tile list."""
    requests: int  # tile-list requests: max_batch x ceil(max_qo_len / rows) query tiles
    entries: int   # listed key tiles (and cut tiles, a subset of them)
    pages: int     # the list's pages of `page` keys


def capacity(max_batch: int, max_qo_len: int, max_pages: int, page_size: int, rows: int) -> Capacity:
    """Bounds of the tile list of any batch within the limits. A request of kv keys lists at most
    max(1, ceil(kv / TILE_WIDTH)) <= kv / TILE_WIDTH + 1 key tiles per query tile, so all list at most
    ceil(max_qo_len / rows) x (max_pages * page_size // TILE_WIDTH + max_batch); each listed tile is at most
    TILE_WIDTH / page pages."""
    tiles = -(-max_qo_len // rows)
    entries = tiles * (max_pages * page_size // TILE_WIDTH + max_batch)
    return Capacity(max_batch * tiles, entries, entries * (TILE_WIDTH // page_size_for(cache_page_size=page_size)))


def _check_uniform(variant, uniform) -> bool:
    if not isinstance(uniform, bool):
        raise FivarError(f"variant '{variant.name}': uniform_qo_len must be True (every request of every step holds "
                         f"max_qo_len queries) or False, got {uniform!r}")
    return uniform


def _check_limits(variant, **limits) -> None:
    for arg, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FivarError(f"variant '{variant.name}': {arg} must be a positive int, got {value!r}")


class VerifyTiles:
    """The planning half of a CUDA-graph verify plan, on any device (the CPU under TRITON_INTERPRET=1 in tests):
    fixed buffers of a tile list and `plan`, which refills them for a batch and returns the padded host indptrs
    FlashInfer's scheduler takes. The buffers keep their addresses for the plan's life."""

    def __init__(self, variant, bound, *, target: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, causal: bool, sm_scale: float, max_batch: int, max_qo_len: int, max_pages: int,
                 device, uniform: bool = False, hint: bool = False):
        name = variant.name
        _check_limits(variant, max_batch=max_batch, max_qo_len=max_qo_len, max_pages=max_pages)
        _check_uniform(variant, uniform)
        self.variant, self.bound, self.target, self.device = variant, bound, target, torch.device(device)
        self.heads_kv = (num_qo_heads, num_kv_heads, head_dim)
        self.page_size, self.causal, self.sm_scale = page_size, causal, sm_scale
        self.max_batch, self.max_qo_len, self.max_pages = max_batch, max_qo_len, max_pages
        self.rows = tile_rows(target, num_qo_heads, num_kv_heads, head_dim)
        # uniform (every step's requests hold max_qo_len queries) and shorter than FA2's query tile: each request is
        # one tile-list request of max_qo_len rows, padding requests too, and FlashInfer's FA2 CUDA-graph scheduler,
        # told so (`hint`: its plan takes the promise), sizes its query tile for them, not for one request holding
        # every row of the capacity (8 drafts x 4 heads in a 128-row tile: a quarter of its work used). Longer
        # requests fill whole tiles either way; without the hint padding requests keep no rows (no work items).
        self.uniform = uniform
        self.uniform_rows = max_qo_len if uniform and hint and target_of(target).packs_query_heads \
            and max_qo_len < self.rows else None
        self.page = page_size_for(cache_page_size=page_size)
        self.heads = num_qo_heads if mask_reads_head(variant) else 1  # the bits' heads (block_map's)
        self.capacity = cap = capacity(max_batch, max_qo_len, max_pages, page_size, self.rows)
        limit = target_of(target).tile_list_launch_requests
        if limit is not None and cap.requests > limit:  # the graph holds one launch (fivar.jit.targets)
            raise FivarError(f"variant '{name}': a CUDA-graph verify plan on {target_of(target).label} holds one "
                             f"launch of at most {limit} tile-list requests; max_batch={max_batch} x "
                             f"ceil(max_qo_len={max_qo_len} / {self.rows}) = {cap.requests} is past it (lower "
                             f"max_batch or max_qo_len, or use backend='fa2')")
        i32 = dict(dtype=torch.int32, device=self.device)
        self.qo_indptr = torch.zeros(cap.requests + 1, **i32)
        self.kv_indptr = torch.zeros(cap.requests + 1, **i32)
        self.kv_indices = torch.zeros(cap.pages, **i32)
        self.kv_last_page_len = torch.zeros(cap.requests, **i32)
        self.blocks = torch.zeros(cap.requests, TILE_FIELDS, **i32)
        self.tile_keys = torch.zeros(cap.entries, **i32)
        self.cut_bits = torch.zeros(self.heads, cap.entries + CUT_WORDS_PAST, self.rows, **i32)
        self._used = (0, 0, 0, 0)  # what the last plan wrote: pages, requests, entries, cut tiles' words
        self.requests = self.batch = 0  # this step's tile-list requests (the rest are padding) and requests

    def tables(self) -> dict:
        """The module's tile-list tables (its struct's params) as the fixed buffers."""
        return {BLOCKS: self.blocks, TILE_KEYS: self.tile_keys, CUT_BITS: self.cut_bits}

    def seed(self):
        """(qo_indptr, kv_indptr, kv_indices, kv_last_page_len) of the capacity's largest batch: every request
        max_qo_len queries over a page. FlashInfer's CUDA-graph planner sizes its schedule by its first plan's rows
        (its later plans may have fewer, never more)."""
        tiles = self.capacity.requests // self.max_batch
        per = [self.rows] * (tiles - 1) + [self.max_qo_len - (tiles - 1) * self.rows]  # uniform_rows: one tile
        n = self.capacity.requests
        return (indptr(torch.tensor(per * self.max_batch)), torch.arange(n + 1, dtype=torch.int32),
                self.kv_indices[:n], torch.ones(n, dtype=torch.int32))

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, custom_mask=None, packed_custom_mask=None,
             mask_indptr=None):
        """Check this step, plan its tile list and write it into the buffers; returns the padded host
        (qo_indptr, kv_indptr, kv_last_page_len) of `capacity.requests` requests and the list's page count. Nothing
        is written unless every check passes."""
        v = self.variant
        qo, kv = _check_step(v, qo_indptr, kv_indptr, self.max_batch, self.max_qo_len, self.max_pages,
                             self.uniform)
        batch = qo.numel() - 1
        kv_indices, last = _check_pages(v, kv, kv_indices, kv_last_page_len, 1 << 62, self.page_size, self.device)
        custom = check_custom_mask(v, custom_mask, packed_custom_mask, mask_indptr, qo.diff(),
                                   paged_kv_lens(kv, last, self.page_size), self.device)
        layout = None
        if int(qo[-1]):  # a step of no queries runs padding alone
            hq, hkv, d = self.heads_kv
            token_of, kv_h = paged_keys(kv, kv_indices, last, self.page_size, self.device)
            kinds, bits_of, heads = block_map(v, self.bound, qo, kv_h, hq, hkv, d, self.causal, self.sm_scale,
                                              self.device, self.rows, custom)
            layout = tile_list(kinds, qo, kv_h, self.rows, token_of, bits_of, self.page, heads)
        filled = self._fill(layout)
        self.batch = batch
        return filled

    def _fill(self, layout):
        cap, name = self.capacity, self.variant.name
        if layout is None:
            qo, kv = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            last = torch.zeros(0, dtype=torch.int32)
            sizes = (0, 0, 0, 0)
        else:
            qo, kv, last = layout.qo_indptr, layout.kv_indptr, layout.kv_last_page_len
            if layout.cut_bits.shape[0] != self.heads:
                raise FivarError(f"variant '{name}': the block map has bits for {layout.cut_bits.shape[0]} heads, the "
                                 f"plan's buffers for {self.heads} (a fivar bug)")
            sizes = (int(kv[-1]), qo.numel() - 1, layout.tile_keys.numel(), layout.cut_bits.shape[1])
        limits = (cap.pages, cap.requests, cap.entries, cap.entries + CUT_WORDS_PAST)
        if any(s > c for s, c in zip(sizes, limits)):  # the bounds of `capacity` make this unreachable
            raise FivarError(f"variant '{name}': this step's tile list (pages, requests, key tiles, cut words "
                             f"{sizes}) is past the plan's buffers {limits} (a fivar bug)")
        n_pages, n_req, n_entries, n_words = sizes
        pad = cap.requests - n_req  # padding requests: no pages, and no query rows (uniform_rows: q's rows past
        # the step's, whose outputs come out zeros: no keys)
        step = self.uniform_rows or 0
        if step and bool((qo.diff() != step).any()):
            raise FivarError(f"variant '{name}': a uniform verify step's tile list has requests of other than "
                             f"{step} rows (a fivar bug)")
        qo, kv, last = _write_padded(self, qo, kv, last, pad, step)
        old_pages, old_req, old_entries, old_words = self._used
        if layout is not None:
            self.kv_indices[:n_pages].copy_(layout.kv_indices)
            self.blocks[:n_req].copy_(layout.blocks)
            if self.heads > 1:  # a head's bits start one buffer height after the previous head's
                self.blocks[:n_req, TILE_FIELDS - 1] = self.cut_bits.shape[1] * self.rows
            self.tile_keys[:n_entries].copy_(layout.tile_keys)
            self.cut_bits[:, :n_words].copy_(layout.cut_bits)
        # zeros past this step's list where the last step's reached: the buffers then hold what a fresh plan of
        # this step would (no stale tile a padding request or a short last tile could read)
        self.kv_indices[n_pages:old_pages].zero_()
        self.blocks[n_req:old_req].zero_()
        self.tile_keys[n_entries:old_entries].zero_()
        self.cut_bits[:, n_words:old_words].zero_()
        self._used, self.requests = sizes, n_req
        return qo, kv, last, n_pages


def _write_padded(plan, qo, kv, last, pad: int, rows: int):
    """A step's host (qo_indptr, kv_indptr, kv_last_page_len) with `pad` padding requests of `rows` query rows each
    and no pages after its own, written into the plan's fixed buffers; returned as written (int32)."""
    qo = torch.cat([qo, qo[-1:] + rows * torch.arange(1, pad + 1, dtype=qo.dtype)]).to(torch.int32)
    kv = torch.cat([kv, kv[-1:].expand(pad)]).to(torch.int32)
    last = torch.cat([last.to(torch.int32), torch.zeros(pad, dtype=torch.int32)])
    for buf, t in ((plan.qo_indptr, qo), (plan.kv_indptr, kv), (plan.kv_last_page_len, last)):
        buf.copy_(t)
    return qo, kv, last


_SMALLEST_KV_CHUNK = 128  # keys: FlashInfer's FA2 scheduler splits a request's keys in chunks of at least this


def _refuse_step_mask(variant, masks) -> None:
    """A plan made without a custom mask runs a kernel reading no bits: its steps take none either."""
    if any(m is not None for m in masks):
        raise FivarError(f"variant '{variant.name}': this verify plan was made without a custom mask (its steps run "
                         "the variant's own mask and causal, reading no bits); make the plan with the first step's "
                         "packed_custom_mask and mask_indptr to take draft trees")


class VerifyRequests:
    """The planning half of a verify plan made without a custom mask on FA2, for a variant whose mask is a band (draft
    chains run as causal, as engines run chains): the requests themselves in fixed buffers, FlashInfer's own causal
    and window modes deciding, no tile list and no bits (the FA2 batch-prefill module stock's graph runs).
    Padding requests have no pages; with the promise (uniform_rows) they hold q's rows past the step's, which the
    kernel writes as zeros (no keys), and FlashInfer's scheduler sizes its query tile for max_qo_len rows."""

    def __init__(self, variant, *, page_size: int, max_batch: int, max_qo_len: int, max_pages: int, device,
                 uniform: bool = False, hint: bool = False):
        _check_limits(variant, max_batch=max_batch, max_qo_len=max_qo_len, max_pages=max_pages)
        self.variant, self.device, self.page = variant, torch.device(device), page_size
        self.max_batch, self.max_qo_len, self.max_pages = max_batch, max_qo_len, max_pages
        self.uniform = _check_uniform(variant, uniform)
        self.uniform_rows = max_qo_len if uniform and hint else None
        i32 = dict(dtype=torch.int32, device=self.device)
        self.qo_indptr = torch.zeros(max_batch + 1, **i32)
        self.kv_indptr = torch.zeros(max_batch + 1, **i32)
        self.kv_indices = torch.zeros(max(max_pages, max_batch), **i32)  # the seed's page a request too
        self.kv_last_page_len = torch.zeros(max_batch, **i32)
        self._pages = 0  # pages the last step wrote
        self.requests = self.batch = 0

    def tables(self) -> dict:
        return {}

    def seed(self):
        """The capacity's largest batch (max_batch requests of max_qo_len queries over a page each): FlashInfer's
        CUDA-graph planner sizes its schedule by its first plan's rows."""
        n = self.max_batch
        return (indptr(torch.full((n,), self.max_qo_len)), torch.arange(n + 1, dtype=torch.int32),
                self.kv_indices[:n], torch.ones(n, dtype=torch.int32))

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, custom_mask=None, packed_custom_mask=None,
             mask_indptr=None):
        """Check this step and write it, padded to max_batch requests, into the buffers; returns the padded host
        (qo_indptr, kv_indptr, kv_last_page_len) and the step's page count. Nothing is written unless every check
        passes."""
        v = self.variant
        _refuse_step_mask(v, (custom_mask, packed_custom_mask, mask_indptr))
        qo, kv = _check_step(v, qo_indptr, kv_indptr, self.max_batch, self.max_qo_len, self.max_pages,
                             self.uniform)
        kv_indices, last = _check_pages(v, kv, kv_indices, kv_last_page_len, 1 << 62, self.page, self.device)
        batch, n_pages = qo.numel() - 1, int(kv[-1])
        qo, kv, last = _write_padded(self, qo, kv, last.cpu(), self.max_batch - batch, self.uniform_rows or 0)
        self.kv_indices[:n_pages].copy_(kv_indices[:n_pages])
        self.kv_indices[n_pages:self._pages].zero_()
        self._pages, self.requests, self.batch = n_pages, batch, batch
        return qo, kv, last, n_pages


class GraphVerifyPlan:
    """A verify step over a paged KV cache with buffers of fixed capacity (this module's docstring)."""

    kv_form = "paged"  # run(q, paged_kv_cache), as fivar.runtime.ops' plan_run calls it

    def __init__(self, variant, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int, max_batch: int | None = None,
                 max_qo_len: int | None = None, max_pages: int | None = None, dtype=None, causal: bool = False,
                 sm_scale=None, backend: str = "auto", device="cuda", params=None, kv_dtype=None, custom_mask=None,
                 packed_custom_mask=None, mask_indptr=None, uniform_qo_len: bool = False):
        import flashinfer
        from .plans import verify_target
        register_plan(self)
        self.variant, self.device = variant, torch.device(device)
        name = variant.name
        dtype = dtype or torch.bfloat16
        if runs_twin(backend):
            raise FivarError(f"variant '{name}': GraphVerifyPlan holds FlashInfer's kernels (fa2, fa3); the Triton "
                             "twin's is TwinGraphVerifyPlan (plan_paged(cuda_graph=True, backend='triton'))")
        check_graph_plan(variant, dtype, head_dim, num_qo_heads, num_kv_heads, self.device, "verify")
        target = _check_backend(variant, backend, "batch_prefill", self.device)
        qo_h = _check_indptr(variant, "qo_indptr", qo_indptr, "cpu")
        kv_h = _check_indptr(variant, "kv_indptr", kv_indptr, "cpu")
        max_batch, max_qo_len, max_pages = _limits(variant, qo_h, kv_h, max_batch, max_qo_len, max_pages)
        # auto: FA2 where the longest request the graph takes fills at most a quarter of FA3's query tile
        target = verify_target(target, backend, torch.tensor([max_qo_len]), head_dim)
        if plan_kv_dtype(variant, dtype, kv_dtype) is not None:
            raise FivarError(f"variant '{name}': a CUDA-graph verify plan reads a cache in q's dtype ({dtype}), not "
                             f"{kv_dtype}")
        self.target = target
        self._shape = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
        probe = torch.empty(1, num_qo_heads, head_dim, dtype=dtype, device=self.device)
        bound, sm_scale = _prepare(variant, params or {}, probe, num_kv_heads, max_batch, sm_scale)
        causal = _kernel_causal(variant, causal)
        t = target_of(target)
        # made without a custom mask, a band's steps need no bits: FA2 runs the requests themselves in its causal and
        # window modes (as stock's graph runs them); else the tile list, its cut tiles read as bits
        self.maskless = all(m is None for m in (custom_mask, packed_custom_mask, mask_indptr))
        band = self.maskless and t.packs_query_heads and not variant.scans_mask
        # replays change the lengths: position tables cover the capacity (fivar.runtime.position_tables)
        bound = position_tables.bind(variant, bound, (max_qo_len, max_pages * page_size))
        if band:
            tiles = VerifyRequests(variant, page_size=page_size, max_batch=max_batch, max_qo_len=max_qo_len,
                                   max_pages=max_pages, device=self.device, uniform=uniform_qo_len,
                                   hint=plan_takes_uniform_q_len())
            fmod = _module(variant, ModuleKey("batch_prefill", target, dtype, head_dim), bound, sm_scale)
            window_left = _window_left(variant, target, bound)
            self._mode = dict(causal=_plan_causal(variant, target, causal, window_left), window_left=window_left)
            self._split = _split_kwargs(variant, target, causal, window_left)
            if causal and 0 <= window_left and window_left + max_qo_len <= 2 * max(_SMALLEST_KV_CHUNK, page_size):
                # FlashInfer's CUDA-graph schedule always splits, merging after every replay; a causal window this
                # short has at most two of its smallest key chunks a request to split into: not worth the merge pass
                self._split = {"disable_split_kv": True}
            owns_mask = _owns_mask(variant, target, causal, window_left)
            self._args = _paged_args(variant, target, bound, sm_scale, causal, tiles.qo_indptr, tiles.kv_indptr,
                                     tiles.kv_last_page_len, page_size)
        else:
            tiles = VerifyTiles(variant, bound, target=target, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, page_size=page_size, causal=causal, sm_scale=sm_scale,
                                max_batch=max_batch, max_qo_len=max_qo_len, max_pages=max_pages, device=self.device,
                                uniform=uniform_qo_len, hint=plan_takes_uniform_q_len())
            fmod = _module(variant, ModuleKey("batch_prefill", target, dtype, head_dim, tile_list=t.keys_tile_list,
                                              custom_mask=True), bound, sm_scale)
            self._mode, owns_mask = dict(causal=False), False  # the list's bits hold causal and the mask
            # FA2 may split a request's keys: not without softmax (its partials merge through the LSE)
            self._split = {"disable_split_kv": True} if t.splits_kv and not variant.softmax else {}
            self._args = kernel_args(fmod.kernel_variant, bound, sm_scale, None, tables=tiles.tables())
        self._tiles = tiles
        self.max_batch, self.max_qo_len, self.max_pages = max_batch, max_qo_len, max_pages
        self.max_tokens = max_batch * max_qo_len
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            _workspace(self.device, target), kv_layout="NHD", use_cuda_graph=True, qo_indptr_buf=tiles.qo_indptr,
            paged_kv_indptr_buf=tiles.kv_indptr, paged_kv_indices_buf=tiles.kv_indices,
            paged_kv_last_page_len_buf=tiles.kv_last_page_len, backend=target)
        attach(self._wrapper, fmod.load(), fmod, owns_mask)
        self._uniform = uniform_plan_kwargs(tiles.uniform_rows)
        self._plan_wrapper(*tiles.seed())
        self._layout = plan_layout(self._wrapper)  # what a captured launch replays with
        # the module's paged_run on q of max_tokens rows (the wrapper's run wants qo_indptr[-1] of them)
        self._direct = direct_paged_run(self._wrapper, name, self.device, self._args, rows=self.max_tokens,
                                        planned_rows=tiles.uniform_rows is not None)
        if self._direct is None:
            raise FivarError(f"variant '{name}': a CUDA-graph verify plan launches its module's paged run directly, "
                             "which this FlashInfer's wrappers do not allow (fivar.flashinfer_compat: paged_run_direct)")
        self.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, custom_mask=custom_mask,
                  packed_custom_mask=packed_custom_mask, mask_indptr=mask_indptr)

    @property
    def page_size(self) -> int:
        return self._shape[3]

    def _plan_wrapper(self, qo, kv, indices, last):
        hq, hkv, d, _, dtype = self._shape
        self._wrapper.plan(qo, kv, indices, last, hq, hkv, d, self._tiles.page, q_data_type=dtype,
                           kv_data_type=dtype, o_data_type=dtype, **self._mode, **self._split, **self._uniform)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, custom_mask=None, packed_custom_mask=None,
             mask_indptr=None) -> None:
        """This step's lengths, page table and custom mask (host work and copies into the fixed buffers): call it
        outside the graph, before each replay. Up to max_batch requests of up to max_qo_len queries (exactly, with
        uniform_qo_len), max_pages pages."""
        if self.maskless:
            _refuse_step_mask(self.variant, (custom_mask, packed_custom_mask, mask_indptr))
        qo, kv, last, n_pages = self._tiles.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, custom_mask,
                                                 packed_custom_mask, mask_indptr)
        self._plan_wrapper(qo, kv, self._tiles.kv_indices[:n_pages], last)
        if plan_layout(self._wrapper) != self._layout:
            raise FivarError(f"variant '{self.variant.name}': FlashInfer planned this verify step with another launch "
                             "layout than the captured one; a graph of this plan cannot replay it")

    @property
    def batch(self) -> int:
        """This step's requests."""
        return self._tiles.batch

    def run(self, q, paged_kv_cache, *, return_lse: bool = False):
        """q [max_batch * max_qo_len, Hq, D]: this step's tokens first, request by request (the rows past them are
        padding); capture this call in the graph. Returns [max_batch * max_qo_len, Hq, D] (zeros past the step's
        tokens), and the LSE [rows, Hq] with return_lse (past the step's tokens unspecified: a row of no keys)."""
        if torch.compiler.is_compiling():  # under torch.compile: the plan_run custom op (fivar.runtime.ops)
            from . import ops
            return ops.plan_run(self, q, *_paged_kv(self.variant, paged_kv_cache), return_lse)
        return_lse = check_lse(self.variant, return_lse)
        k_cache, v_cache = _paged_kv(self.variant, paged_kv_cache)
        _check_run(self, q, k_cache)
        hkv, d = self._shape[1:3]
        # keys as pages of the list's `page` (a view of the cache's own pages)
        k, v = (x.reshape(-1, self._tiles.page, hkv, d) for x in (k_cache, v_cache))
        return self._direct(q, k, v, self._args, return_lse)
