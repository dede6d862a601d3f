"""FA3 for every mask that is more than a band: the device block map, and one request per query tile over the list
of its non-empty key tiles.

FlashInfer's FA3 kernels visit every key of a request and know no mask; a variant's mask is part of its logits
transform. This lowering gives them only what the mask keeps, for any mask the spec language accepts:

1. the Triton twin's `block_map_kernel` evaluates the mask (with causal and both lengths) over every tile of
   `block_rows` query rows x TILE keys on the device: empty, cut or whole (every pair of the tile kept);
2. each query tile becomes one request of FA3's paged kernel over the keys of its non-empty key tiles, whole tiles
   first, then cut ones, a request's short last tile last, read as pages of up to TILE keys (page_size_for: the
   largest power of two that the requests' first tokens, or the cache's pages, allow; a page-table entry per page);
3. the tile-list struct (fivar.codegen.fa3.TILE_FIELDS) keeps every key of a whole tile with one compare, and reads
   a key of the other tiles from their bits (`block_bits_kernel`, one 32-bit word per row and tile, causal folded
   in), the key mapped back to its kv_idx through its tile's first key for the logits transform. The kernel
   evaluates no mask: one module serves every mask of the same logits (fivar.codegen.tile_list.bits_kernel).

A mask reading the head gets the union of its heads' maps (a tile is whole only where every head keeps all of
it) and bits per query head, or, in a ragged batch whose heads keep tiles so different that the union makes every
head do much more than its own (`head_requests_pay`: a window per head beside global heads), one request per query
tile and head, each over its own head's tiles (`HeadRequests`: q gathered head-major, k/v read through a view whose
pages hold one KV head's keys). A paged batch composes the same keys through its page table. Planning costs one map
pass and two device->host copies (three for a mask reading the head); `plan_ragged` / `plan_paged` make it once per
batch layout, the one-shot calls once per call signature.

FA2 batch prefill runs the same plan (TileListPrefill's `target`): its paged kernel calls the struct's hooks with the
request's local row and key as FA3's does (fivar.codegen.fa2._tile_list_decl), at FA2's query tile
(fivar.runtime.fa2_blocks.tile_list_rows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codegen.fa3 import BLOCKS, CUT_BITS, TILE_KEYS, TILE_WIDTH
from ..codegen.tile_list import reads_heads

#: Zero words after the last request's bits: a thread reads every 32-key word its keys of a KV tile touch, up to
#: (CTA_KV - 7 + 30) // 32 + 1 from its first (csrc/fivar_cut_bits.cuh, RAW): 4 at the paged kernel's 96 keys; 8 past
#: the last request's words cover any CTA_KV up to 256.
CUT_WORDS_PAST = 8
from ..codegen.triton import kernel_arg_values
from ..jit.module_key import ModuleKey
from ..jit.targets import target_of
from ..jit.triton_module import load_triton_module
from . import fa2_blocks, position_tables
from .launch import _module, direct_paged_run, release_wrapper, take_wrapper
from .fp8_kv import ScaledArgs
from .lse import empty_lse
from .params import kernel_args
from .rows import indptr



def block_rows(head_dim: int) -> int:
    """FA3 paged prefill's query tile (CTA_Q): one request per tile wastes no rows."""
    return 192 if head_dim == 64 else 128


def head_union(kinds: torch.Tensor) -> torch.Tensor:
    """[batch, heads, q tiles, key tiles] -> [batch, q tiles, key tiles]: whole where every head's tile is whole,
    empty where every head's is empty, else cut."""
    if kinds.shape[1] == 1:
        return kinds[:, 0]
    whole, live = (kinds == 2).all(1), (kinds > 0).any(1)
    return torch.where(whole, 2, torch.where(live, 1, 0)).to(torch.int8)


@dataclass
class TileList:
    """The lowered batch: FA3 paged requests over the listed keys, read as pages of `page` keys."""
    qo_indptr: torch.Tensor   # host int32 [R + 1]: each request is one query tile's rows
    kv_indptr: torch.Tensor   # host int32 [R + 1]: its pages (`page` listed keys each, the last one maybe fewer)
    kv_indices: torch.Tensor  # device int32 [pages]: k/v viewed as [tokens / page, page, H, D], each page's index
    kv_last_page_len: torch.Tensor  # host int32 [R]
    page: int                 # keys a page: divides TILE_WIDTH, and every listed tile starts a page
    blocks: torch.Tensor      # device int32 [R, TILE_FIELDS]
    tile_keys: torch.Tensor   # device int32 [entries]: kv_idx of each listed tile's first key
    cut_bits: torch.Tensor    # device int32 [heads, tiles after the whole ones, rows]: kept pairs, bit j for key j
    keys_read: int            # keys the requests read (a request with no kept key reads one)
    keys_total: int           # keys an unsplit batch would read: every query tile over all its request's keys


def tile_list(kinds: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, rows: int,
              token_of, bits_of, page: int = 1, heads: int = 1) -> TileList:
    """The requests from a block map `kinds` ([batch, q tiles, key tiles] at `rows` x TILE_WIDTH: head_union's, or a
    per-head map as a batch of batch x heads entries, HeadRequests) of a
    batch given by host token indptrs. `token_of(batch, kv_idx)` (device int64 tensors) is the token of a key in the
    k/v the kernel reads; `bits_of(cut)` (block_map's) the bits of the tiles after each request's whole ones
    (int32 [tiles, 2]: (map row, key tile)) for each of `heads` query heads (1: one set for all), int64 [heads *
    tiles, rows]. `page` (a power
    of two dividing TILE_WIDTH): the kernel reads k/v as pages of that many keys, so every `page` keys of a tile must
    be `page` consecutive tokens starting at a multiple of `page` (page_size_for); a page table entry per `page` keys
    instead of per key."""
    dev, T = kinds.device, TILE_WIDTH
    qo_lens, kv_lens = qo_indptr.long().diff(), kv_indptr.long().diff()
    n_qt = (qo_lens + rows - 1) // rows
    batch = torch.repeat_interleave(torch.arange(len(n_qt)), n_qt)  # host [R]: each request's batch entry
    q_tile = torch.arange(len(batch)) - torch.repeat_interleave(n_qt.cumsum(0) - n_qt, n_qt)
    b_dev, qt_dev = batch.to(dev), q_tile.to(dev)
    k = kinds[b_dev, qt_dev]  # [R, key tiles]
    n_kv = k.shape[1]
    lens_dev = kv_lens.to(dev)
    starts = torch.arange(n_kv, device=dev) * T
    short = (starts[None, :] + T > lens_dev[b_dev, None])  # the request's last tile, when shorter than T
    order_key = torch.where(k > 0, k.to(torch.int32) + 4 * (~short).to(torch.int32), 0)
    order = torch.sort(order_key, dim=1, descending=True, stable=True).indices
    n_list = (k > 0).sum(1)
    n_whole = ((k == 2) & ~short).sum(1)
    short_kept = ((k > 0) & short).any(1)
    cut_short = torch.where(short_kept, (T - lens_dev[b_dev] % T) % T, 0)
    keys = torch.where(n_list > 0, n_list * T - cut_short, 1)  # a request keeping no key reads one, masked
    n_entries = n_list.clamp(min=1)
    counts = torch.stack([keys, n_entries]).cpu()  # the one device->host copy of the plan's sizes
    keys_h, entries_h = counts[0], counts[1]
    pos = torch.arange(n_kv, device=dev)[None, :]
    chosen = pos < n_entries[:, None]
    tiles = torch.where(n_list[:, None] > 0, order, 0)[chosen]  # [entries] in request order; a dead request: tile 0
    entry_req = torch.repeat_interleave(torch.arange(len(batch), device=dev), n_entries,
                                        output_size=int(entries_h.sum()))
    first_key = tiles.long() * T
    offs = torch.arange(0, T, page, device=dev)[None, :]  # each page's first key within its tile
    kv_idx = first_key[:, None] + offs
    live = (n_list[entry_req] > 0)[:, None]
    valid = torch.where(live, kv_idx < lens_dev[b_dev[entry_req], None], offs == 0)
    # only a live request's own keys are looked up (a page past a request's last is not in its page table); a
    # request keeping no key reads any page, masked
    read = valid & live
    tokens = torch.zeros_like(kv_idx)
    tokens[read] = token_of(b_dev[entry_req][:, None].expand_as(kv_idx)[read], kv_idx[read])
    pages = tokens[valid] // page
    n_pages = (keys_h + page - 1) // page
    entry_start = torch.cumsum(entries_h, 0) - entries_h
    q0 = q_tile * rows + kv_lens[batch] - qo_lens[batch]
    whole = torch.where(n_list.cpu() > 0, n_whole.cpu() * T, -1)
    # the tiles after the whole ones, in list order: the struct finds a key's word as its (key - whole) // T-th
    cut_sel = (pos >= n_whole[:, None]) & (pos < n_list[:, None])
    n_cut = cut_sel.sum(1).cpu()
    cut_bits = torch.zeros(heads, 0, rows, dtype=torch.int32, device=dev)
    if int(n_cut.sum()):
        req, at = cut_sel.nonzero().unbind(1)
        map_row = b_dev[req] * kinds.shape[1] + qt_dev[req]  # the map's row of (batch, query tile)
        cut = torch.stack([map_row, order[req, at]], 1).to(torch.int32).contiguous()
        cut_bits = bits_of(cut).view(torch.int32)[..., ::2].reshape(heads, -1, rows)  # low words (TILE_WIDTH bits)
    # the struct reads every word a thread's keys of a KV tile touch (csrc/fivar_tile_mask.cuh), so a request's last
    # tile can read up to CUT_WORDS_PAST words past its own: zeros there, never memory beyond the tensor
    cut_bits = torch.cat([cut_bits, cut_bits.new_zeros(heads, CUT_WORDS_PAST, rows)], 1).contiguous()
    bit_start = (torch.cumsum(n_cut, 0) - n_cut) * rows
    head_words = torch.full_like(batch, cut_bits.shape[1] * rows if heads > 1 else 0)  # a head's bits after another's
    blocks = torch.stack([batch, q0, entry_start, whole, bit_start, torch.full_like(batch, rows), head_words],
                         1).to(torch.int32)
    rows_h = torch.minimum(qo_lens[batch] - q_tile * rows, torch.tensor(rows))
    return TileList(indptr(rows_h), indptr(n_pages), pages.to(torch.int32).contiguous(),
                    (keys_h - (n_pages - 1) * page).to(torch.int32), page, blocks.to(dev),
                    first_key.to(torch.int32).contiguous(), cut_bits, int(keys_h[n_list.cpu() > 0].sum()),
                    int((n_qt * kv_lens).sum()))


def block_map(variant, bound, qo_indptr, kv_indptr, num_qo_heads: int, num_kv_heads: int, head_dim: int,
              causal: bool, sm_scale: float, device, rows: int | None = None, custom=None, per_head: bool = False):
    """(head_union of the Triton twin's block map of this batch at `rows` (else block_rows) x TILE_WIDTH on `device`,
    bits_of for tile_list, the heads its bits are per: num_qo_heads for a mask reading the head, else 1). `custom`: a
    custom mask (fivar.runtime.custom_mask.CustomMask) ANDed into both. `per_head`: the map of every head instead
    ([batch, heads, q tiles, key tiles]) and bits_at, the bits of tiles given by their row of that map
    ((batch * heads + head) * q tiles + q tile, key tile)."""
    qo_lens, kv_lens = qo_indptr.long().diff(), kv_indptr.long().diff()
    module, args = load_triton_module(variant), kernel_arg_values(variant, bound, sm_scale)
    qo_d, kv_d, group, block = qo_indptr.to(device), kv_indptr.to(device), num_qo_heads // num_kv_heads, \
        (rows or block_rows(head_dim), TILE_WIDTH)
    bits = None if custom is None else (custom.packed, custom.indptr)
    kinds = module.tile_kinds(qo_d, kv_d, int(qo_lens.max()), max(int(kv_lens.max()), 1), num_qo_heads, group,
                              causal, args, block, custom=bits)
    heads, n_q = kinds.shape[1], kinds.shape[2]

    def bits_at(at):
        return module.tile_bits(at, qo_d, kv_d, n_q, group, causal, args, block, custom=bits, heads=heads)
    if per_head:
        return kinds, bits_at, heads
    return head_union(kinds), union_bits(bits_at, heads, n_q), heads


def union_bits(bits_at, heads: int, n_q: int):
    """bits_of for tile_list over head_union's map: each cut tile (its row batch * n_q + q tile of the union) at
    every head's row of the per-head map."""
    def bits_of(cut):
        b, q = cut[:, 0] // n_q, cut[:, 0] % n_q
        h = torch.arange(heads, device=cut.device, dtype=cut.dtype)[:, None]
        return bits_at(torch.stack([((b[None, :] * heads + h) * n_q + q[None, :]).reshape(-1),
                                    cut[:, 1].repeat(heads)], 1).contiguous())
    return bits_of


#: Requests per head when the heads' own non-empty tiles are at most this share of what the union makes them visit:
#: below it the saved tiles outweigh gathering q and scattering the output (a few microseconds per head at S = 8k).
HEAD_REQUESTS_WORK = 0.75


def head_requests_pay(kinds: torch.Tensor) -> bool:
    """Whether a per-head map ([batch, heads, q tiles, key tiles]) runs cheaper as a request per query tile and head
    than as the union of its heads' tiles for every head (one device->host copy)."""
    if kinds.shape[1] == 1:
        return False
    live = kinds > 0
    own, union = torch.stack([live.sum(), live.any(1).sum() * kinds.shape[1]]).tolist()
    return own <= HEAD_REQUESTS_WORK * union


@dataclass
class HeadRequests:
    """A batch run as a request per (query head, batch entry) and query tile: virtual entry h * batch + b holds the
    rows of query head h of entry b, head-major, so q's rows for the requests are one permuted copy ([heads, tokens,
    D]) and the output one copy back (a row gather and scatter ran at a fifth of that speed); each request is
    planned as one query head over one KV head."""
    heads: int
    kv_heads: int
    batch: int

    @classmethod
    def of(cls, qo_h: torch.Tensor, heads: int, kv_heads: int) -> "HeadRequests":
        return cls(heads, kv_heads, qo_h.numel() - 1)

    def indptr(self, host_indptr: torch.Tensor) -> torch.Tensor:
        """The virtual batch's indptr: every entry's length, once per head."""
        return indptr(host_indptr.diff().repeat(self.heads))

    def entry(self, v: torch.Tensor) -> torch.Tensor:
        """The batch entry of virtual entries `v`."""
        return v % self.batch

    def map(self, kinds: torch.Tensor) -> torch.Tensor:
        """A per-head map [batch, heads, q tiles, key tiles] as the virtual batch's [heads * batch, ...]."""
        return kinds.transpose(0, 1).reshape(-1, *kinds.shape[2:])

    def bits_of(self, bits_at, n_q: int):
        """tile_list's bits_of over map(): each cut tile (virtual row v * n_q + q tile) at its row of the per-head
        map (block_map's bits_at: (b * heads + h) * n_q + q tile)."""
        def at(cut):
            v, qt = cut[:, 0] // n_q, cut[:, 0] % n_q
            row = (self.entry(v) * self.heads + v // self.batch) * n_q + qt
            return bits_at(torch.stack([row, cut[:, 1]], 1).contiguous())
        return at

    def token_of(self, token_of, page: int):
        """Where virtual entry h * batch + b finds kv_idx in `kv_view`: its token's page of one KV head."""
        group = self.heads // self.kv_heads

        def at(v, kv_idx):
            t = token_of(self.entry(v), kv_idx)
            return ((t // page) * page * self.kv_heads + (v // self.batch) // group) * page + t % page
        return at

    def kv_view(self, x: torch.Tensor, page: int) -> torch.Tensor:
        """k or v ([tokens, H, D]) as pages of `page` keys of one KV head: page (t // page) * page * H + g holds keys
        t.. of head g, read in place where the heads of a token are its row (else this call's k/v are copied once, a
        slice of packed qkv for one)."""
        d = x.shape[-1]
        s_h = x.stride(-2)
        if x.stride(-1) != 1 or x.stride(-3) != self.kv_heads * s_h:
            x, s_h = x.contiguous(), d
        tokens = x.shape[0]
        return torch.as_strided(x, ((tokens - page + 1) * self.kv_heads, page, 1, d),
                                (s_h, self.kv_heads * s_h, s_h, 1), x.storage_offset())

    def gather(self, q: torch.Tensor) -> torch.Tensor:
        """q [tokens, heads, D] (the plan's rows: its callers check) as the virtual batch's [heads * tokens, 1, D]."""
        return q.transpose(0, 1).reshape(-1, 1, q.shape[-1])

    def scatter(self, out_v: torch.Tensor, lse_v: torch.Tensor | None, q: torch.Tensor):
        tokens = q.shape[0]
        out = torch.empty(q.shape, dtype=out_v.dtype, device=out_v.device)
        out.copy_(out_v.view(self.heads, tokens, q.shape[-1]).transpose(0, 1))
        if lse_v is None:
            return out
        lse = torch.empty(q.shape[:2], dtype=lse_v.dtype, device=lse_v.device)
        lse.copy_(lse_v.view(self.heads, tokens).t())
        return out, lse


def page_size_for(kv_indptr: torch.Tensor | None = None, cache_page_size: int | None = None) -> int:
    """The largest power of two up to TILE_WIDTH that every listed tile's keys can be read as pages of: one dividing
    every request's first token and the token count (ragged k/v, `kv_indptr` on the host), or the cache's page
    size (paged)."""
    n = cache_page_size if cache_page_size is not None else math.gcd(*torch.unique(kv_indptr.long()).tolist())
    page = TILE_WIDTH
    while page > 1 and n % page:
        page //= 2
    return page


def tile_rows(target: str, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """A tile-list request's query rows on `target`: FA3's query tile of one head, FA2's of a GQA group's rows."""
    if target_of(target).packs_query_heads:
        return fa2_blocks.tile_list_rows(num_qo_heads // num_kv_heads, head_dim)
    return block_rows(head_dim)


def paged_keys(kv_indptr: torch.Tensor, page_table: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int,
               device):
    """A paged batch's keys as tile_list takes them: (token_of, int64 host [batch + 1] indptr of the requests' key
    counts), each key found through the page table (page indptr and last-page lengths on the host)."""
    kv_h = kv_indptr.long().cpu()
    n_pages = kv_h.diff()
    last = kv_last_page_len.long().cpu()
    kv_lens = (n_pages - 1).clamp(min=0) * page_size + torch.where(n_pages > 0, last, 0)
    page_start = kv_h.to(device)
    page_table = page_table.to(device).long()

    def token_of(b, kv_idx):  # (a request of no keys reads any page: the table's last at most)
        at = (page_start[b] + kv_idx // page_size).clamp(max=page_table.numel() - 1)
        return page_table[at] * page_size + kv_idx % page_size
    return token_of, indptr(kv_lens).long()


class TileListPrefill:
    """A batch planned on FA3 (or FA2: `target`) in the tile-list form; `run(q, k, v)` with k/v [tokens, H, D]
    (ragged) or [pages, page_size, H, D] (paged: `pages` = (kv_indices, page_size) on the device, kv_indptr then a
    page indptr and kv_last_page_len given). Checks of the inputs against the plan are the caller's. `custom`: a
    custom mask (fivar.runtime.custom_mask.CustomMask, checked) ANDed into the map and the bits, which a
    variant with no mask beyond a band then runs through the same bits-reading module (custom_mask=True)."""

    def __init__(self, variant, qo_indptr, kv_indptr, *, num_qo_heads, num_kv_heads, head_dim, dtype, causal, bound,
                 sm_scale, device, pages=None, kv_last_page_len=None, target: str = "fa3", custom=None):
        qo_h, kv_h = qo_indptr.long().cpu(), kv_indptr.long().cpu()
        if pages is not None:  # keys as a ragged batch, each key found through the page table
            page_table, page_size = pages
            n_pages, last = kv_h.diff(), kv_last_page_len.long().cpu()
            token_of, kv_h = paged_keys(kv_h, page_table, last, page_size, device)
            lengths = lambda: position_tables.max_lengths(qo_h, indptr(n_pages), last, page_size)  # noqa: E731
            self.page = page_size_for(cache_page_size=page_size)
        else:
            start = kv_h.to(device)

            def token_of(b, kv_idx):
                return start[b] + kv_idx
            lengths = lambda: position_tables.max_lengths(qo_h, kv_h)  # noqa: E731
            self.page = page_size_for(kv_h)
        bound = position_tables.bind(variant, bound, lengths)
        self.variant, self.empty = variant, int(qo_h[-1]) == 0
        self.no_keys = int(kv_h[-1]) == 0
        self._launch = None
        self.keys_read = None
        if self.empty or self.no_keys:
            return
        t = target_of(target)
        rows = tile_rows(target, num_qo_heads, num_kv_heads, head_dim)
        kinds, bits_at, heads = block_map(variant, bound, qo_h, kv_h, num_qo_heads, num_kv_heads, head_dim, causal,
                                          sm_scale, device, rows, custom, per_head=True)
        self._heads = None
        # (not on a paged cache: its pages are strided by the cache's layout, often k and v interleaved, which a view
        # of one KV head's pages could only read after copying the whole cache)
        if heads > 1 and pages is None and not t.packs_query_heads and not reads_heads(variant) and \
                head_requests_pay(kinds):
            self._heads = h = HeadRequests.of(qo_h, num_qo_heads, num_kv_heads)
            layout = tile_list(h.map(kinds), h.indptr(qo_h), h.indptr(kv_h), rows, h.token_of(token_of, self.page),
                               h.bits_of(bits_at, kinds.shape[2]), self.page)
            layout.blocks[:, 0] = h.entry(layout.blocks[:, 0])  # the struct's batch_idx (the entry's), for the logits
            num_qo_heads = num_kv_heads = 1
        else:
            layout = tile_list(head_union(kinds), qo_h, kv_h, rows, token_of,
                               union_bits(bits_at, heads, kinds.shape[2]), self.page, heads)
        self.keys_read = (layout.keys_read, layout.keys_total)
        self.requests = layout.qo_indptr.numel() - 1
        fmod = _module(variant, ModuleKey("batch_prefill", target, dtype, head_dim, tile_list=t.keys_tile_list,
                                          custom_mask=custom is not None), bound, sm_scale)
        # FA2 may split a request's keys: not without softmax (its partials merge through the LSE)
        split = {"disable_split_kv": True} if t.splits_kv and not variant.softmax else {}
        qo_i, kv_i = layout.qo_indptr, layout.kv_indptr
        step = t.tile_list_launch_requests or self.requests  # the module's one kernel
        self._launches = []
        for r0 in range(0, self.requests, step):  # launches of consecutive requests: rows [qo_i[r0], qo_i[r1])
            r1 = min(r0 + step, self.requests)
            w = take_wrapper("paged", fmod, device, False)
            w.plan((qo_i[r0:r1 + 1] - qo_i[r0]).to(device), (kv_i[r0:r1 + 1] - kv_i[r0]).to(device),
                   layout.kv_indices[int(kv_i[r0]):int(kv_i[r1])], layout.kv_last_page_len[r0:r1].to(device),
                   num_qo_heads, num_kv_heads, head_dim, self.page, causal=False, q_data_type=dtype,
                   kv_data_type=dtype, o_data_type=dtype, **split)
            # the params the module's struct takes (its kernel_variant's); a launch's requests index BLOCKS from 0
            tables = {BLOCKS: layout.blocks[r0:r1], TILE_KEYS: layout.tile_keys, CUT_BITS: layout.cut_bits}
            args = ScaledArgs(lambda s, tables=tables: kernel_args(fmod.kernel_variant, bound, s, None, tables=tables),
                              sm_scale)
            self._launches.append((w, args, direct_paged_run(w, variant.name, device, args(1.0)),
                                   (int(qo_i[r0]), int(qo_i[r1]))))
        self._launch = ("paged", fmod, device)

    def run(self, q, k, v, return_lse: bool = False, k_scale: float = 1.0):
        """`k_scale`: a paged plan's run of a cache holding k / k_scale, folded into sm_scale."""
        if self.empty or self.no_keys:  # every row sees no key
            out = torch.zeros_like(q)
            return (out, empty_lse(q)) if return_lse else out
        q_in, heads = q, self._heads
        if heads is not None:  # a request per head: q head-major, each page one KV head's keys
            q, k, v = heads.gather(q), heads.kv_view(k, self.page), heads.kv_view(v, self.page)
        else:  # keys as pages of `page` (a view of contiguous k/v or of the cache's own pages)
            k, v = (x.reshape(-1, self.page, *x.shape[-2:]) for x in (k, v))
        outs = []
        for w, scaled, direct, (a, b) in self._launches:
            args, rows = scaled(k_scale), q if len(self._launches) == 1 else q[a:b]
            outs.append(direct(rows, k, v, args, return_lse) if direct is not None
                        else w.run(rows, (k, v), *args, return_lse=return_lse))
        if len(outs) == 1:
            out = outs[0]
        elif return_lse:
            out = torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])
        else:
            out = torch.cat(outs)
        if heads is None:
            return out
        return heads.scatter(*(out if return_lse else (out, None)), q_in)

    def release(self):
        """Hand the wrappers on (the one-shot plan cache, on dropping this plan); the plan is unusable after."""
        if self._launch is not None:
            for w, *_ in self._launches:
                release_wrapper(*self._launch, w)
        self._launch = None
