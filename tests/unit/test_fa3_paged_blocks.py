"""FA3's KV-range form over pages (fivar.runtime.kv_ranges.paged_range_layout / paged_kv_ranges), on the CPU.

A paged batch whose mask is more than a band is cut into one FA3 request per query block over the pages holding
the keys its rows may keep. Checked against the mask evaluated on every (row, key) pair by the torch evaluator,
for random page tables and ragged lengths (off every tile and page size): every kept pair is read by exactly
its block, through a page list that is a run of its request's pages in order, and the struct's view of the block
(fv_blocks' offsets, the full range or the row runs, the causal guard) keeps exactly the request's pairs. A
corrupted layout must fail that check. Then PagedAttentionPlan end to end with a stand-in for FlashInfer's FA3
paged wrapper (the kernel's and the struct's semantics), against the reference."""
import functools
import types

import pytest
import torch

import fivar
from fivar import AttentionVariant, Scalar, Tensor
from fivar.bench.suites.zoo import load as load_zoo
from fivar.codegen.cuda import additional_params
from fivar.codegen.fa3 import BLOCKS, ROW_RUNS
from fivar.codegen.torch_ref import TorchEvaluator
from fivar.codegen.triton import kernel_arg_values
from fivar.jit.triton_module import load_triton_module
from fivar.runtime import attention
from fivar.runtime.kv_ranges import paged_kv_ranges, run_kind, paged_range_layout, relative_runs
from fivar.runtime.params import bind_params
from fivar.testing import _ragged_reference, _to_paged

from kernel_standin import attend

HEADS, KV_HEADS = 4, 2


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _two_runs(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < params.sink or (q_idx - kv_idx < params.window and kv_idx <= q_idx)  # sinks + window


def _padded_documents(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.doc[batch, q_idx] == params.doc[batch, kv_idx] and params.doc[batch, q_idx] >= 0  # -1: padding


PADDED_DOCS = AttentionVariant(name="fa3pb_padded_documents", mask=_padded_documents,
                               params={"doc": Tensor("int32", ("batch", "position"))})
SINKS = AttentionVariant(name="fa3pb_sinks_window", mask=_two_runs,
                         params={"sink": Scalar(int, default=3), "window": Scalar(int, default=40)})

# ragged lengths off 16 and off every page size; a request with no rows; qo_len < kv_len and qo_len == kv_len
QO_LENS, KV_LENS = [203, 0, 77, 290], [203, 50, 301, 333]


def _cases():
    """(name, variant, params): the bundled document mask and zoo variants (chunked, prefix-LM, per-head window),
    and a mask keeping two runs per row (the mask form, not the row-run form)."""
    gen = torch.Generator().manual_seed(11)
    width = max(KV_LENS)
    starts = torch.rand(len(KV_LENS), width, generator=gen) < 5.0 / width
    return [
        ("document", fivar.load("document_mask"), {"doc_ids": starts.to(torch.int32).cumsum(1).to(torch.int32)}),
        ("chunked", load_zoo("llama4_chunked"), {"chunk": 70}),
        ("prefix_lm", load_zoo("prefix_lm"), {"prefix_len": torch.tensor([20, 3, 150, 64], dtype=torch.int32)}),
        ("head_window", load_zoo("per_head_window"), {"windows": torch.tensor([5, 120, 33, 90],
                                                                             dtype=torch.int32)}),
        ("sinks", SINKS, {}),
        # padding rows keep nothing: a block's last rows may keep no key near their diagonal, so FA3's own causal
        # rule (aligned to the block's last key) would cut the rows above them wrongly
        ("padded_documents", PADDED_DOCS, {"doc": _padded(starts, 23)}),
    ]


def _padded(starts, pad):
    """Document ids with each request's last `pad` positions padding (-1)."""
    doc = starts.to(torch.int32).cumsum(1).to(torch.int32)
    for b, n in enumerate(KV_LENS):
        doc[b, max(0, n - pad):n] = -1
    return doc


def _indptr(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


@functools.cache
def _prescanned():
    """Each case bound and pre-scanned once (the pre-scan sees keys as a ragged batch; pages do not change it)."""
    out = []
    for name, variant, params in _cases():
        bound = bind_params(variant, params, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, batch_size=len(QO_LENS),
                            device="cpu")
        ranges, runs = load_triton_module(variant).mask_ranges(
            _indptr(QO_LENS), _indptr(KV_LENS), max(QO_LENS), HEADS, HEADS // KV_HEADS,
            kernel_arg_values(variant, bound, 1.0), row_runs=True)
        # the paged blocks use the one-run form only: the rows' single runs, or -1 where rows keep more
        runs = runs[..., :2].contiguous() if run_kind(runs) == 1 else torch.full_like(runs[..., :2], -1)
        out.append((name, variant, params, bound, ranges, runs))
    return out


def _kept(variant, bound, b, causal):
    """[heads, qo_len, kv_len] bool: the mask (and causal) on every pair of request b."""
    qo_len, kv_len = QO_LENS[b], KV_LENS[b]
    env = {"batch": torch.tensor(b), "qo_head": torch.arange(HEADS).view(-1, 1, 1),
           "kv_head": torch.arange(HEADS).view(-1, 1, 1) // (HEADS // KV_HEADS),
           "q_idx": torch.arange(qo_len).view(1, -1, 1) + kv_len - qo_len,
           "kv_idx": torch.arange(kv_len).view(1, 1, -1), "sm_scale": 1.0}
    keep = TorchEvaluator(env, {**bound.scalars, **bound.tensors}).run(variant.ir.mask).bool()
    keep = keep.expand(HEADS, qo_len, kv_len)
    return keep & (env["kv_idx"] <= env["q_idx"]) if causal else keep


def _page_table(kv_lens, page_size, seed):
    """A shuffled pool: (kv_indptr, kv_indices, kv_last_page_len) as a cache manager hands them out."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = [max(1, -(-n // page_size)) for n in kv_lens]
    pool = torch.randperm(sum(n_pages) + 17, generator=gen)[:sum(n_pages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, n_pages)], dtype=torch.int32)
    return _indptr(n_pages), pool, last


def _struct_keeps(variant, bound, lay, r, runs_flat, causal, row_runs):
    """[heads, rows, local keys] bool: what the KV-range struct keeps for request r of the lowered batch, computed
    as the kernel does: local row/key mapped back through fv_blocks, the full range or the row's run, causal."""
    b, q0, k0, f3, f4 = lay.blocks[r].tolist()
    rows = int(lay.qo_indptr[r + 1] - lay.qo_indptr[r])
    n_pages = int(lay.kv_indptr[r + 1] - lay.kv_indptr[r])
    page_size = _struct_keeps.page_size
    n_keys = (n_pages - 1) * page_size + int(lay.kv_last_page_len[r]) if n_pages else 0
    local_q, local_kv = torch.arange(rows).view(1, -1, 1), torch.arange(n_keys).view(1, 1, -1)
    if row_runs:
        head = torch.arange(HEADS).view(-1, 1)
        at = f3 + f4 * head + 2 * torch.arange(rows).view(1, -1)  # [heads, rows]
        run = runs_flat[at.unsqueeze(-1) + torch.tensor([0, 1])]   # [heads, rows, 2]
        return (local_kv >= run[..., :1]) & (local_kv < run[..., 1:])
    env = {"batch": torch.tensor(b), "qo_head": torch.arange(HEADS).view(-1, 1, 1),
           "kv_head": torch.arange(HEADS).view(-1, 1, 1) // (HEADS // KV_HEADS),
           "q_idx": local_q + q0, "kv_idx": local_kv + k0, "sm_scale": 1.0}
    keep = TorchEvaluator(env, {**bound.scalars, **bound.tensors}).run(variant.ir.mask).bool()
    keep = keep.expand(HEADS, rows, n_keys) | ((env["kv_idx"] >= f3) & (env["kv_idx"] < f4))
    return keep & (env["kv_idx"] <= env["q_idx"]) if causal else keep


def check_layout(variant, bound, lay, page_table, page_size, rows, causal, runs=None):
    """Asserts the lowered paged batch reads, for every request, exactly its kept pairs (see the module doc)."""
    kv_indptr, kv_indices, last = page_table
    qo_indptr = _indptr(QO_LENS)
    row_runs = runs is not None
    runs_flat = (relative_runs(runs, lay, qo_indptr, _indptr(KV_LENS), rows, causal).reshape(-1) if row_runs
                 else None)
    _struct_keeps.page_size = page_size
    seen_rows = {b: torch.zeros(n, dtype=torch.long) for b, n in enumerate(QO_LENS)}
    read = 0
    assert lay.qo_indptr.numel() == lay.kv_indptr.numel() == lay.kv_last_page_len.numel() + 1
    assert int(lay.kv_indptr[-1]) == lay.kv_indices.numel() and int(lay.qo_indptr[-1]) == sum(QO_LENS)
    for r in range(lay.kv_last_page_len.numel()):
        b, q0, k0 = lay.blocks[r, :3].tolist()
        row0 = int(lay.qo_indptr[r] - qo_indptr[b])
        row1 = int(lay.qo_indptr[r + 1] - qo_indptr[b])
        assert 0 < row1 - row0 <= rows and row0 % rows == 0 and row1 <= QO_LENS[b], (r, b, row0, row1)
        seen_rows[b][row0:row1] += 1
        assert q0 == row0 + KV_LENS[b] - QO_LENS[b], (r, q0)
        # the block's pages: a run of its request's pages, in order, from the page holding its first key read
        assert k0 % page_size == 0, (r, k0)
        own = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        pages = lay.kv_indices[lay.kv_indptr[r]:lay.kv_indptr[r + 1]]
        first = k0 // page_size
        assert torch.equal(pages, own[first:first + pages.numel()]) and first + pages.numel() <= own.numel(), r
        n_keys = (pages.numel() - 1) * page_size + int(lay.kv_last_page_len[r]) if pages.numel() else 0
        assert 0 < int(lay.kv_last_page_len[r]) <= page_size or (n_keys == 0 and KV_LENS[b] == 0), r
        k1 = k0 + n_keys
        assert k1 <= KV_LENS[b], (r, k0, k1)
        # the slot each local key is read from holds the request's key kv_idx = k0 + local
        local = torch.arange(n_keys)
        if n_keys:
            slot = pages[local // page_size].long() * page_size + local % page_size
            want = own[(k0 + local) // page_size].long() * page_size + (k0 + local) % page_size
            assert torch.equal(slot, want), r
        keep = _kept(variant, bound, b, causal)[:, row0:row1]
        outside = keep.clone()
        outside[..., k0:k1] = False
        assert not bool(outside.any()), (variant.name, causal, r, k0, k1)  # every kept key is read
        got = _struct_keeps(variant, bound, lay, r, runs_flat, causal, row_runs)
        assert torch.equal(got, keep[..., k0:k1]), (variant.name, causal, r)  # and the struct keeps exactly those
        read += n_keys
    assert all(bool((s == 1).all()) for s in seen_rows.values())  # every row in exactly one block
    assert lay.keys_read == read
    if causal:
        unsplit = sum(min(KV_LENS[b], max(0, min(r0 + rows, QO_LENS[b]) + KV_LENS[b] - QO_LENS[b]))
                      for b in range(len(QO_LENS)) for r0 in range(0, QO_LENS[b], rows))
    else:
        unsplit = sum(KV_LENS[b] * -(-QO_LENS[b] // rows) for b in range(len(QO_LENS)))
    assert lay.keys_total == unsplit
    return lay


def _layouts(page_size, rows, causal, seed=0):
    table = _page_table(KV_LENS, page_size, seed)
    for name, variant, params, bound, ranges, runs in _prescanned():
        one_run = not bool((runs[..., 0] < 0).any())
        assert one_run == (variant is not SINKS)  # so both forms are exercised
        forms = [None, runs] if one_run else [None]
        for form in forms:
            lay = paged_range_layout(ranges, _indptr(QO_LENS), *table, page_size, rows, causal,
                                     runs_shape=None if form is None else tuple(runs.shape))
            yield name, variant, bound, lay, table, form


@pytest.mark.parametrize("rows", [128, 32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [16, 1, 7])
def test_blocks_read_exactly_the_kept_pairs_through_their_pages(page_size, causal, rows):
    saved = {}
    for name, variant, bound, lay, table, form in _layouts(page_size, rows, causal, seed=page_size + rows):
        check_layout(variant, bound, lay, table, page_size, rows, causal, form)
        saved[name] = lay.keys_total - lay.keys_read
    # the point of it: documents, chunks and windows leave pages unread
    assert all(saved[n] > 0 for n in ("document", "chunked", "head_window", "padded_documents")), saved


def _first_kept_block(variant, bound, lay, causal, at_end: bool):
    """A block whose last (first) key read is kept by some row: moving its end (start) must drop a kept pair."""
    for r in range(lay.kv_last_page_len.numel()):
        b, _, k0 = lay.blocks[r, :3].tolist()
        n_pages = int(lay.kv_indptr[r + 1] - lay.kv_indptr[r])
        k1 = k0 + (n_pages - 1) * 16 + int(lay.kv_last_page_len[r])
        row0 = int(lay.qo_indptr[r] - _indptr(QO_LENS)[b])
        rows = int(lay.qo_indptr[r + 1] - lay.qo_indptr[r])
        keep = _kept(variant, bound, b, causal)[:, row0:row0 + rows]
        if at_end and int(lay.kv_last_page_len[r]) > 1 and bool(keep[..., k1 - 1].any()):
            return r
        if not at_end and n_pages > 1 and bool(keep[..., k0:k0 + 16].any()):
            return r
    raise AssertionError("no block to corrupt")


def _copy(lay, **changes):
    return types.SimpleNamespace(**{**lay.__dict__, **{k: v for k, v in changes.items()}})


@pytest.mark.parametrize("causal", [False, True])
def test_a_corrupted_layout_fails_the_check(causal):
    """The check is not vacuous: one key short at a block's end, a block starting a page late, two pages of a
    block swapped, a block mapped to another row offset, and a wrong full range each fail it."""
    page_size, rows = 16, 128
    for name, variant, bound, lay, table, form in _layouts(page_size, rows, causal):
        if name not in ("document", "sinks"):
            continue
        check_layout(variant, bound, lay, table, page_size, rows, causal, form)
        mutants = []
        r = _first_kept_block(variant, bound, lay, causal, at_end=True)
        last = lay.kv_last_page_len.clone()
        last[r] -= 1  # off by one: [lo, hi - 1)
        mutants.append(_copy(lay, kv_last_page_len=last, keys_read=lay.keys_read - 1))
        r = _first_kept_block(variant, bound, lay, causal, at_end=False)
        blocks, indptr = lay.blocks.clone(), lay.kv_indptr.clone()
        blocks[r, 2] += page_size  # the block's first page dropped: its keys start one page later
        keep_pages = torch.ones(lay.kv_indices.numel(), dtype=torch.bool)
        keep_pages[int(lay.kv_indptr[r])] = False
        indptr[r + 1:] -= 1
        mutants.append(_copy(lay, blocks=blocks, kv_indptr=indptr, kv_indices=lay.kv_indices[keep_pages],
                             keys_read=lay.keys_read - page_size))
        indices = lay.kv_indices.clone()
        p0 = int(lay.kv_indptr[r])
        indices[p0], indices[p0 + 1] = lay.kv_indices[p0 + 1], lay.kv_indices[p0]  # pages out of order
        mutants.append(_copy(lay, kv_indices=indices))
        blocks = lay.blocks.clone()
        blocks[r, 1] += 1  # q_idx of the first row off by one
        mutants.append(_copy(lay, blocks=blocks))
        if form is None:  # the mask form: a full range wider than what every row keeps
            blocks = lay.blocks.clone()
            blocks[:, 3], blocks[:, 4] = 0, torch.tensor(KV_LENS)[blocks[:, 0].long()]
            mutants.append(_copy(lay, blocks=blocks))
        for i, m in enumerate(mutants):
            with pytest.raises(AssertionError):
                check_layout(variant, bound, m, table, page_size, rows, causal, form)
                pytest.fail(f"{name} mutant {i} passed")  # not an AssertionError: it escapes pytest.raises


@pytest.mark.parametrize("causal", [False, True])
def test_paged_kv_ranges_tables_and_the_unsplit_fallback(causal):
    """paged_kv_ranges (what PagedAttentionPlan calls): pre-scan, layout and the struct's tables on the device;
    None when the blocks would read as many keys as a request per request (a prefix covering every key)."""
    page_size, rows = 16, 128  # head dim 128: FA3's 128-row tile
    table = _page_table(KV_LENS, page_size, 3)
    for name, variant, params, bound, _, runs in _prescanned():
        split = paged_kv_ranges(variant, bound, _indptr(QO_LENS), *table, page_size=page_size, num_qo_heads=HEADS,
                                num_kv_heads=KV_HEADS, head_dim=128, causal=causal, sm_scale=1.0, device="cpu")
        if causal and name in ("prefix_lm", "sinks"):  # causal already drops what the hull of their keys does
            assert split is None, name
            continue
        assert split is not None, name
        assert split.row_runs == (variant is not SINKS)
        assert torch.equal(split.tables[BLOCKS], split.layout.blocks)
        assert (ROW_RUNS in split.tables) == split.row_runs
        check_layout(variant, bound, split.layout, table, page_size, rows, causal, runs if split.row_runs else None)
    everything = {"prefix_len": torch.tensor(KV_LENS, dtype=torch.int32)}
    variant = load_zoo("prefix_lm")
    bound = bind_params(variant, everything, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, batch_size=len(QO_LENS),
                        device="cpu")
    assert paged_kv_ranges(variant, bound, _indptr(QO_LENS), *table, page_size=page_size, num_qo_heads=HEADS,
                           num_kv_heads=KV_HEADS, head_dim=128, causal=False, sm_scale=1.0, device="cpu") is None


# --- PagedAttentionPlan end to end, FlashInfer's FA3 paged wrapper a stand-in -------------------------------

class _FakeFA3PagedWrapper:
    """FlashInfer's FA3 paged prefill as fivar's KV-range struct sees it: per request its rows and pages, FA3's
    own causal mode (bottom-right aligned to the request it is given), the struct's fv_blocks mapping, full range
    or row runs, and causal guard; the mask and logits by the torch reference's evaluator."""

    def __init__(self, variant, fmod):
        self.variant, self.fmod = variant, fmod

    def plan(self, qo_indptr, kv_indptr, kv_indices, last, hq, hkv, d, page, causal=False, window_left=-1, **kw):
        assert window_left == -1
        self.p = dict(qo=qo_indptr.long().cpu(), kv=kv_indptr.long().cpu(), idx=kv_indices.long().cpu(),
                      last=last.long().cpu(), page=page, causal=causal)

    def run(self, q, cache, *args, return_lse=False):
        v, p, row_runs = self.variant, self.p, self.fmod.row_runs
        k_cache, v_cache = cache
        t_names, _, s_names, _ = additional_params(v, with_causal_flag=not row_runs,
                                                   extra_tensors=[BLOCKS, ROW_RUNS] if row_runs else [BLOCKS])
        named = dict(zip(t_names + s_names, args))
        hkv = k_cache.shape[2]
        out = torch.zeros(q.shape, dtype=torch.float64)
        for r in range(p["qo"].numel() - 1):
            rows = q[p["qo"][r]:p["qo"][r + 1]].double()
            pages = p["idx"][p["kv"][r]:p["kv"][r + 1]]
            n_keys = max(0, (pages.numel() - 1) * p["page"] + int(p["last"][r])) if pages.numel() else 0
            keys = k_cache[pages].reshape(-1, hkv, k_cache.shape[-1])[:n_keys].double()
            vals = v_cache[pages].reshape(-1, hkv, k_cache.shape[-1])[:n_keys].double()
            n_rows = rows.shape[0]
            local_q, local_kv = torch.arange(n_rows).view(1, -1, 1), torch.arange(n_keys).view(1, 1, -1)
            b, q0, k0, f3, f4 = named[BLOCKS][r].tolist()

            def keep(ev, env, local_q=local_q, local_kv=local_kv, n_rows=n_rows, n_keys=n_keys, f3=f3, f4=f4):
                if row_runs:
                    flat = named[ROW_RUNS].reshape(-1).long()
                    head = env["qo_head"]
                    at = f3 + f4 * head.view(-1, 1) + 2 * torch.arange(n_rows).view(1, -1)
                    run = flat[at.unsqueeze(-1) + torch.tensor([0, 1])]
                    kept = (local_kv >= run[..., :1]) & (local_kv < run[..., 1:])
                else:
                    kept = ev.run(v.ir.mask).bool() | ((env["kv_idx"] >= f3) & (env["kv_idx"] < f4))
                    if named["fv_causal"]:
                        kept = kept & (env["kv_idx"] <= env["q_idx"])
                if p["causal"]:
                    kept = kept & (local_kv <= local_q + n_keys - n_rows)
                return kept
            out[p["qo"][r]:p["qo"][r + 1]] = attend(v, named, rows, keys, vals, local_q + q0, local_kv + k0, b,
                                                    keep)[0]
        return out.to(q.dtype)


@pytest.fixture
def cpu_fa3(monkeypatch):
    """The paged plan on the CPU: no CUDA checks, fivar's module a stand-in, FlashInfer's wrapper the fake above."""
    current, made = [None], []

    def plan_setup(plan, variant, qo_indptr, kv_indptr, hq, hkv, d, dtype, backend, device):
        plan.variant, plan.device, plan.target, plan.batch = variant, torch.device("cpu"), "fa3", qo_indptr.numel() - 1
        return dtype, qo_indptr, kv_indptr

    def module(variant, op, target, dtype, head_dim, bound, sm_scale, row_runs=False, kv_segments=False,
               kv_dtype=None):
        assert target == "fa3" and not kv_segments
        return types.SimpleNamespace(row_runs=row_runs, uri=f"fake_{row_runs}", target=target)

    def take(kind, fmod, device, owns_mask):
        assert kind == "paged" and not owns_mask
        made.append(fmod)
        return _FakeFA3PagedWrapper(current[0], fmod)

    monkeypatch.setattr(attention, "_plan_setup", plan_setup)
    monkeypatch.setattr(attention, "_module", module)
    monkeypatch.setattr(attention, "take_wrapper", take)
    monkeypatch.setattr(attention, "release_wrapper", lambda *a: None)
    return current, made


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["document", "chunked", "head_window", "sinks", "padded_documents"])
def test_paged_plan_matches_the_reference(cpu_fa3, name, causal, page_size):
    current, made = cpu_fa3
    _, variant, params = next(c for c in _cases() if c[0] == name)
    current[0] = variant
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(QO_LENS), HEADS, 16, generator=gen).half()
    k = torch.randn(sum(KV_LENS), KV_HEADS, 16, generator=gen).half()
    vv = torch.randn(sum(KV_LENS), KV_HEADS, 16, generator=gen).half()
    cache, indptr, indices, last = _to_paged(k, vv, KV_LENS, page_size)
    plan = attention.PagedAttentionPlan(variant, _indptr(QO_LENS), indptr, indices, last, num_qo_heads=HEADS,
                                        num_kv_heads=KV_HEADS, head_dim=16, page_size=page_size,
                                        dtype=torch.float16, causal=causal, backend="fa3", device="cpu",
                                        params=params)
    if name != "sinks":  # documents, chunks and windows leave keys unread; the row-run form
        assert plan.keys_read is not None and plan.keys_read[0] < plan.keys_read[1], plan.keys_read
        assert made[-1].row_runs
    out = plan.run(q, cache).double()
    ref = _ragged_reference(variant, q.float(), k.float(), vv.float(), QO_LENS, KV_LENS, causal, params)
    assert torch.allclose(out, ref.double(), atol=2e-3), (out - ref.double()).abs().max()


def test_paged_plan_of_a_mask_dropping_nothing_runs_unsplit(cpu_fa3):
    """A prefix covering every key: a request per request, FA3's own causal mode, no keys_read."""
    current, made = cpu_fa3
    variant = load_zoo("prefix_lm")
    current[0] = variant
    params = {"prefix_len": torch.tensor(KV_LENS, dtype=torch.int32)}
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(sum(QO_LENS), HEADS, 16, generator=gen).half()
    k = torch.randn(sum(KV_LENS), KV_HEADS, 16, generator=gen).half()
    vv = torch.randn(sum(KV_LENS), KV_HEADS, 16, generator=gen).half()
    cache, indptr, indices, last = _to_paged(k, vv, KV_LENS, 16)
    for causal in (False, True):
        plan = attention.PagedAttentionPlan(variant, _indptr(QO_LENS), indptr, indices, last, num_qo_heads=HEADS,
                                            num_kv_heads=KV_HEADS, head_dim=16, page_size=16, dtype=torch.float16,
                                            causal=causal, backend="fa3", device="cpu", params=params)
        assert plan.keys_read is None and not made[-1].row_runs
        assert plan._wrapper.p["qo"].numel() == len(QO_LENS) + 1 and plan._wrapper.p["causal"] == causal
        out = plan.run(q, cache).double()
        ref = _ragged_reference(variant, q.float(), k.float(), vv.float(), QO_LENS, KV_LENS, causal, params)
        assert torch.allclose(out, ref.double(), atol=2e-3), (out - ref.double()).abs().max()
