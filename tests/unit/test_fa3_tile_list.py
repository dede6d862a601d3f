"""FA3's tile-list form (fivar.runtime.fa3_tile_list), on the CPU: the requests it plans, read the way the generated struct
reads them, against every pair of the torch reference's evaluator.

For the masks of test_block_map (no band describes them) over random ragged and paged batches, causal and not: each
request's keys, mapped back through its tile list, must keep exactly the pairs the reference keeps for each of its
rows (none twice, none missed), every key before the request's whole count must be kept by every row and head (the
struct skips the mask there), the token each key is read from must hold that key, and a request keeping no key must
say so. Corrupted lists must fail the same check.
"""
import random
import shutil
import subprocess

import pytest
import torch

from fivar.codegen.fa3 import TILE_WIDTH
from fivar.runtime.fa3_tile_list import block_map, page_size_for, tile_list
from fivar.runtime.launch import _prepare
from fivar.spec.sparsity import keep_matrix

from test_block_map import HEADS, KV_HEADS, MASKS, _batch, _variant

ROWS = 16  # the query tile under the interpreter (block_rows on a GPU)


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _ind(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def _plan(v, params, qo, kv, causal, token_of, page=1, rows=ROWS):
    q = torch.zeros(max(sum(qo), 1), HEADS, 16, dtype=torch.float16)
    bound, sm_scale = _prepare(v, params, q, KV_HEADS, len(qo), None)
    kinds, bits_of, heads = block_map(v, bound, _ind(qo), _ind(kv), HEADS, KV_HEADS, 128, causal, sm_scale, "cpu",
                                      rows)
    return tile_list(kinds, _ind(qo), _ind(kv), rows, token_of, bits_of, page, heads), bound


def list_errors(v, bound, layout, qo, kv, causal, key_at, custom=None) -> list[str]:
    """Where the requests, read as the struct reads them, disagree with every pair. `key_at(token)`: (batch, kv_idx)
    of the key a token holds. `custom`: per request a bool [qo_len, kv_len] custom mask ANDed in (the struct then
    reads bits)."""
    keeps = [keep_matrix(v.ir.mask, qo_len=lq, kv_len=lk, scalars=bound.scalars, tensors=bound.tensors,
                         num_qo_heads=HEADS, num_kv_heads=KV_HEADS, batch_idx=b, causal=causal)
             & (True if custom is None else custom[b])
             for b, (lq, lk) in enumerate(zip(qo, kv))]
    seen = [torch.zeros_like(k, dtype=torch.int32) for k in keeps]  # how often each pair is kept
    qo_ind, page, lasts = layout.qo_indptr.tolist(), layout.page, layout.kv_last_page_len.tolist()
    page_ind = layout.kv_indptr.tolist()
    # each request's keys as the kernel reads them: page p of the request holds its keys p*page.., the last page fewer
    kv_ind, tokens = [0], []
    for r in range(len(lasts)):
        pages = layout.kv_indices[page_ind[r]:page_ind[r + 1]].tolist()
        for i, p in enumerate(pages):
            tokens += [p * page + j for j in range(lasts[r] if i == len(pages) - 1 else page)]
        kv_ind.append(len(tokens))
    tile_keys, blocks = layout.tile_keys.tolist(), layout.blocks.tolist()
    words = layout.cut_bits.view(-1).long() & 0xFFFFFFFF
    errors = []
    rows_of = [0] * len(qo)
    for r, (b, q0, e0, whole, bit0, stride, head_words) in enumerate(blocks):
        n_rows, n_keys = qo_ind[r + 1] - qo_ind[r], kv_ind[r + 1] - kv_ind[r]
        first = q0 - (kv[b] - qo[b])  # the request's first row within its batch entry's queries
        if first != rows_of[b]:
            errors.append(f"request {r}: its rows start at query {first} of request {b}, expected {rows_of[b]}")
        rows_of[b] += n_rows
        for k in range(n_keys):
            kv_idx = tile_keys[e0 + k // TILE_WIDTH] + k % TILE_WIDTH
            if whole < 0:
                continue  # the struct keeps nothing
            if key_at(tokens[kv_ind[r] + k]) != (b, kv_idx):
                errors.append(f"request {r} key {k}: token {tokens[kv_ind[r] + k]} holds "
                              f"{key_at(tokens[kv_ind[r] + k])}, the list says ({b}, {kv_idx})")
                continue
            if not 0 <= kv_idx < kv[b]:
                errors.append(f"request {r} key {k}: kv_idx {kv_idx} outside request {b}'s {kv[b]} keys")
                continue
            pairs = keeps[b][:, first:first + n_rows, kv_idx]
            if k < whole:
                if not bool(pairs.all()):
                    errors.append(f"request {r} key {k} (kv_idx {kv_idx}) counts as whole, but not every row keeps it")
                kept = torch.ones_like(pairs)
            else:  # the struct reads the word of its head, row and tile
                c = k - whole
                at = (bit0 + torch.arange(HEADS)[:, None] * head_words + (c // TILE_WIDTH) * stride
                      + torch.arange(n_rows)[None, :])
                kept = ((words[at] >> (c % TILE_WIDTH)) & 1).bool()
            seen[b][:, first:first + n_rows, kv_idx] += kept.to(torch.int32)
    for b, lq in enumerate(qo):
        if rows_of[b] != lq:
            errors.append(f"request {b}: the requests cover {rows_of[b]} of its {lq} rows")
        if not torch.equal(seen[b], keeps[b].to(torch.int32)):
            bad = (seen[b] != keeps[b].to(torch.int32)).nonzero()[:3].tolist()
            errors.append(f"request {b}: pairs (head, row, key) kept {[int(seen[b][tuple(p)]) for p in bad]} times "
                          f"at {bad}, the reference keeps them {[int(keeps[b][tuple(p)]) for p in bad]}")
    return errors


def _ragged(kv):
    starts = _ind(kv).long()
    token_of = lambda b, kv_idx: starts[b] + kv_idx  # noqa: E731

    def key_at(token):
        b = int(torch.searchsorted(starts, torch.tensor(token), right=True)) - 1
        return b, token - int(starts[b])
    return token_of, key_at


def _paged(kv, page):
    """A random page table: request b's key j is in page table[b][j // page] at j % page."""
    n_pages = [(k + page - 1) // page for k in kv]
    perm = torch.randperm(sum(n_pages) + 3).tolist()
    table, owner, i = [], {}, 0
    for b, n in enumerate(n_pages):
        table.append(perm[i:i + n])
        for j, p in enumerate(perm[i:i + n]):
            owner[p] = (b, j)
        i += n
    width = max(max(n_pages), 1)
    flat = torch.tensor([t + [0] * (width - len(t)) for t in table], dtype=torch.long)
    lens = torch.tensor(kv)

    def token_of(b, kv_idx):  # as a page table does: nothing past a request's own pages
        assert bool((kv_idx < lens[b]).all()), "a key past its request's pages was looked up"
        return flat[b, kv_idx // page] * page + kv_idx % page

    def key_at(token):
        b, j = owner[token // page]
        return b, j * page + token % page
    return token_of, key_at


@pytest.mark.parametrize("kv_form", ["ragged", "paged"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(MASKS))
def test_tile_lists_keep_exactly_the_pairs(name, causal, kv_form):
    v, draw = _variant(name)
    for _ in range(2):  # fresh lengths, params and pages each time
        qo, kv = _batch()
        kv = [k * random.choice([1, 2]) for k in kv]  # past two tiles of keys, a short last tile or none
        if causal:
            qo = [min(q, k) for q, k in zip(qo, kv)]
        params = draw(len(qo), max(kv))
        if kv_form == "ragged":  # requests starting at multiples of 8 keys (pages of 8) or anywhere (pages of 1)
            kv = [k + (-k % 8) for k in kv] if random.random() < 0.5 else kv
            token_of, key_at = _ragged(kv)
            page = page_size_for(_ind(kv))
        else:
            cache_page = random.choice([1, 5, 16, 64])
            token_of, key_at = _paged(kv, cache_page)
            page = page_size_for(cache_page_size=cache_page)
        layout, bound = _plan(v, params, qo, kv, causal, token_of, page)
        assert layout.page == page
        assert list_errors(v, bound, layout, qo, kv, causal, key_at) == []


@pytest.mark.parametrize("name", sorted(MASKS)[:4])
def test_a_query_tile_of_rows_no_power_of_two_is_classified_in_row_blocks(name):
    """FA3's query tile at head dim 64 is 192 rows, which tl.arange cannot take: the map and the bits are made in
    row blocks of a power of two (here 24 = 3 x 8) and combined; the pairs kept stay exactly the reference's."""
    v, draw = _variant(name)
    for causal in (False, True):
        qo, kv = _batch()
        kv = [k * 2 for k in kv]
        if causal:
            qo = [min(q, k) for q, k in zip(qo, kv)]
        token_of, key_at = _paged(kv, 16)
        layout, bound = _plan(v, draw(len(qo), max(kv)), qo, kv, causal, token_of, page_size_for(cache_page_size=16),
                              rows=24)
        assert list_errors(v, bound, layout, qo, kv, causal, key_at) == []


@pytest.mark.parametrize("corrupt", ["whole", "tile", "token", "dead", "bit"])
def test_a_corrupted_list_fails_the_check(corrupt):
    v, _ = _variant("flagged")
    qo, kv = [40, 0, 33], [70, 20, 50]
    flags = torch.zeros(3, 70, dtype=torch.int32)
    flags[:, 45] = 1
    token_of, key_at = _ragged(kv)
    layout, bound = _plan(v, {"window": 6, "flags": flags}, qo, kv, False, token_of)
    assert list_errors(v, bound, layout, qo, kv, False, key_at) == []
    live = (layout.blocks[:, 3] >= 0).nonzero().view(-1)
    r = int(live[0])
    if corrupt == "whole":
        cut = (layout.blocks[:, 3] < layout.kv_indptr.diff()) & (layout.blocks[:, 3] >= 0)
        r = int(cut.nonzero()[0])
        layout.blocks[r, 3] += TILE_WIDTH
    elif corrupt == "tile":
        layout.tile_keys[int(layout.blocks[r, 2])] += TILE_WIDTH
    elif corrupt == "token":
        layout.kv_indices[int(layout.kv_indptr[r])] += 1  # the request's first page, one page on
    elif corrupt == "dead":
        layout.blocks[r, 3] = -1
    else:
        layout.cut_bits.view(-1)[int(layout.cut_bits.view(-1).nonzero()[0])] ^= 1 << 2
    assert list_errors(v, bound, layout, qo, kv, False, key_at)


def test_a_request_keeping_nothing_reads_one_key_and_keeps_none():
    """More queries than keys, a window of 1: the first rows sit left of every key, so their query tiles keep
    nothing; each still reads one key (FA3 needs one) and its whole count says to keep none."""
    v, _ = _variant("flagged")
    qo, kv = [40, 9], [8, 9]
    token_of, key_at = _ragged(kv)
    layout, bound = _plan(v, {"window": 1, "flags": torch.zeros(2, 9, dtype=torch.int32)}, qo, kv, False, token_of)
    assert list_errors(v, bound, layout, qo, kv, False, key_at) == []
    dead = layout.blocks[:, 3] < 0
    assert int(dead.sum()) == 2 and bool((layout.kv_indptr.diff()[dead] == 1).all())


def test_the_module_is_the_paged_kernel_alone_and_says_how_it_reads_cut_tiles(monkeypatch):
    """One FA3 module for every mask beyond a band of the same logits: the paged kernel in kNone mode only (causal is
    the map's), the ragged entry points linked to stubs; every mask reads bits and evaluates nothing per score, one
    reading the head at its CTA's query head's bits."""
    from fivar.jit.build import gen_module, serving_modules
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    flagged, heads = _variant("flagged")[0], _variant("head_window_sinks")[0]
    m = gen_module(flagged, "batch_prefill", "fa3")
    kernels = sorted(n for n in m.sources if "kernel" in n)
    assert kernels == ["batch_prefill_paged_sm90_kernel_mask_0.cu"]
    assert "_tiles_" in m.uri and m.options["tile_list"]
    unit = m.sources[kernels[0]]  # one kernel compiled: the per-head schedule; stubs for the rest
    assert unit.count("template cudaError_t BatchPrefillWithPagedKVCacheDispatched") == 1
    assert "/*SAME_SCHEDULER_FOR_ALL_HEADS=*/false, Fivar_any_mask, PagedParams>(\n    PagedParams& params, bool " \
        "enable_pdl, cudaStream_t stream);" in unit
    assert unit.count("BatchPrefillWithRaggedKVCacheDispatched<") == 2 and unit.count("cudaErrorNotSupported") == 3
    struct = m.sources["batch_prefill_sm90_config.inc"]
    assert "fv_cut_bits" in struct and "fvp_flags" not in struct  # the mask's tensor is the block map's alone
    assert "int32_t(qo_head_idx) * params.additional_params.fv_blocks[7 * batch_idx + 6]" in struct
    assert gen_module(heads, "batch_prefill", "fa3").uri == m.uri  # a mask reading the head: the same kernel
    free = gen_module(flagged, "batch_prefill", "fa3", mask_free=True)  # a causal batch of segments runs it
    assert [x.uri for x in serving_modules(flagged, "single_prefill", "fa3")] == [m.uri, free.uri]


@pytest.mark.nvcc
@pytest.mark.skipif(not shutil.which("nm"), reason="no nm to read the library's symbols")
def test_the_module_compiles_and_defines_every_entry_it_links(monkeypatch):
    """The host unit calls the paged and ragged dispatch for one mask mode with either schedule: the library defines
    all four (the tile list's per-head paged kernel, the mask-free module's two ragged kernels, stubs for the rest,
    which the mask-free module's host unit defines itself; a shared library links with undefined symbols, and would
    only fail at load on the GPU host)."""
    from fivar.jit.build import build_many, gen_module
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    flagged = _variant("flagged")[0]
    tiles = gen_module(flagged, "batch_prefill", "fa3")
    free = gen_module(flagged, "batch_prefill", "fa3", mask_free=True)
    assert [kind for kind, _ in build_many([tiles, free])] == ["cold", "cold"]
    for m in (tiles, free):
        syms = subprocess.run(["nm", "-C", str(m.library_path)], capture_output=True, text=True, check=True).stdout
        for kind in ("Paged", "Ragged"):
            found = [ln for ln in syms.splitlines() if f"BatchPrefillWith{kind}KVCacheDispatched<" in ln]
            assert len(found) == 2 and not [ln for ln in found if ln.split()[0] == "U"], (m.uri, found)


def test_the_mask_free_module_compiles_the_ragged_kernels_alone(monkeypatch):
    """The logits' mask-free module runs ragged requests alone, a causal batch's segments: its ragged kernel in
    kCausal mode alone, its paged entry points stubs that the host unit includes (no nvcc unit of their own)."""
    from fivar.jit.build import gen_module
    from fivar.jit.fa3_sources import PAGED_STUBS
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    m = gen_module(_variant("flagged")[0], "batch_prefill", "fa3", mask_free=True)
    assert sorted(n for n in m.sources if n.endswith(".cu")) == [
        "batch_prefill_ragged_sm90_kernel_mask_1.cu", "batch_prefill_sm90_jit_binding.cu"]
    host = m.sources["batch_prefill_sm90_jit_binding.cu"]
    assert host.index(f'#include "{PAGED_STUBS}"') < host.index("BatchPrefillWithPagedKVCacheDispatched")
    stubs = m.sources[PAGED_STUBS]
    assert "template cudaError_t" not in stubs and stubs.count("cudaErrorNotSupported") == 2
    assert "MaskMode::kNone" not in stubs and "MaskMode::kNone" not in m.sources["batch_prefill_sm90_config.inc"]
    for mode in ("kCausal",):  # the host unit's dispatch: kCausal alone, either schedule (the stub macro's
        # definitions link as the tile-list module's do: test_the_module_compiles_and_defines_every_entry_it_links)
        for same in ("true", "false"):
            assert (f"BatchPrefillWithPagedKVCacheDispatched<128, 128, MaskMode::{mode},\n    /*USE_SLIDING_WINDOW=*/"
                    f"false, /*SAME_SCHEDULER_FOR_ALL_HEADS=*/{same},\n    Fivar_any_mask, PagedParams>(PagedParams& "
                    "params, bool enable_pdl, cudaStream_t stream) {") in stubs


def test_pages_are_the_largest_power_of_two_the_layout_allows():
    assert page_size_for(torch.tensor([0, 8192])) == 32 and page_size_for(torch.tensor([0, 1000])) == 8
    assert page_size_for(torch.tensor([0, 64, 96, 130])) == 2 and page_size_for(torch.tensor([0, 7])) == 1
    assert page_size_for(cache_page_size=16) == 16 and page_size_for(cache_page_size=128) == 32
    assert page_size_for(cache_page_size=48) == 16 and page_size_for(cache_page_size=1) == 1
