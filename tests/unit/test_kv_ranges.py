"""FA3's KV-range lowering of masks that are more than a band (fivar.runtime.kv_ranges), on the CPU: the
mask pre-pass runs in Triton's interpreter, and the lowered batch is checked against the mask evaluated
on every (row, key) pair by the torch evaluator. The GPU tests run the FA3 kernels themselves."""
import functools
import math
import types

import pytest
import torch

import fivar
from fivar import AttentionVariant, Scalar, Tensor
from fivar.codegen.cuda import additional_params
from fivar.codegen.fa3 import BLOCKS, ROW_RUNS
from fivar.codegen.torch_ref import TorchEvaluator
from fivar.codegen.triton import kernel_arg_values
from fivar.jit.triton_module import load_triton_module
from fivar.runtime.kv_ranges import run_kind, block_rows, kv_range_layout, relative_runs
from fivar.runtime.params import bind_params
from fivar.testing import document_ids

from kernel_standin import attend


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _per_head_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.windows[qo_head] and kv_idx <= q_idx


def _band_and_doc(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx <= params.left and params.doc[q_idx] == params.doc[kv_idx]


def _holed(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < q_idx - params.gap or kv_idx > q_idx + params.gap  # each row: two runs of keys


PER_HEAD_WINDOW = AttentionVariant(name="kvr_per_head_window", mask=_per_head_window,
                                   params={"windows": Tensor("int32", ("qo_head",))})
BAND_AND_DOC = AttentionVariant(name="kvr_band_and_doc", mask=_band_and_doc,
                                params={"left": Scalar(int), "doc": Tensor("int32", ("position",))})
HOLED = AttentionVariant(name="kvr_holed", mask=_holed, params={"gap": Scalar(int)})


def _cases(total):
    """(variant, params) pairs over sequences of up to `total` positions, batch of 3 requests."""
    doc_ids = torch.stack([document_ids([1, 130, 3, 200, total - 334]),
                           document_ids([total // 2, total - total // 2]), document_ids([total])])
    return [(fivar.load("document_mask"), {"doc_ids": doc_ids}),
            (PER_HEAD_WINDOW, {"windows": torch.tensor([3, 150, 1, 40], dtype=torch.int32)}),
            (BAND_AND_DOC, {"left": 90, "doc": doc_ids[0]}),
            (HOLED, {"gap": 70})]


def _kept(variant, bound, b, qo_len, kv_len, heads, causal):
    """[heads, qo_len, kv_len] bool: the mask (and causal) on every pair of request b."""
    env = {"batch": torch.tensor(b), "qo_head": torch.arange(heads).view(-1, 1, 1),
           "kv_head": torch.arange(heads).view(-1, 1, 1) // 2,
           "q_idx": torch.arange(qo_len).view(1, -1, 1) + kv_len - qo_len,
           "kv_idx": torch.arange(kv_len).view(1, 1, -1), "sm_scale": 1.0}
    keep = TorchEvaluator(env, {**bound.scalars, **bound.tensors}).run(variant.ir.mask)
    keep = keep.expand(heads, qo_len, kv_len)
    if causal:
        keep = keep & (env["kv_idx"] <= env["q_idx"])
    return keep


_HEADS, _QO_LENS, _KV_LENS = 4, [500, 0, 77], [520, 40, 600]
_QO_INDPTR = torch.tensor([0] + _QO_LENS).cumsum(0).to(torch.int32)
_KV_INDPTR = torch.tensor([0] + _KV_LENS).cumsum(0).to(torch.int32)


@functools.cache
def _prescanned():
    """Each case's params (drawn once per test run) and its Triton pre-scan, which neither causal nor the head
    dim changes: the interpreter runs it once, not once per parametrization."""
    out = []
    for variant, params in _cases(600):
        bound = bind_params(variant, params, num_qo_heads=_HEADS, num_kv_heads=2, batch_size=3, device="cpu")
        ranges, runs = load_triton_module(variant).mask_ranges(_QO_INDPTR, _KV_INDPTR, max(_QO_LENS), _HEADS, 2,
                                                               kernel_arg_values(variant, bound, 1.0), row_runs=True)
        out.append((variant, params, bound, ranges, runs))
    return out


@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_every_kept_key_is_in_its_blocks_range(causal, head_dim):
    """Each lowered request covers one FA3 query tile of one original request; its KV range holds every key
    any of its rows keeps, lies inside that request's keys, and `fv_blocks` maps local rows and keys back
    to the original q_idx / kv_idx. Holes, documents, per-head windows, requests shorter than a tile and
    qo_len < kv_len all appear."""
    heads, rows = _HEADS, block_rows(head_dim)
    qo_lens, kv_lens, qo_indptr, kv_indptr = _QO_LENS, _KV_LENS, _QO_INDPTR, _KV_INDPTR
    for variant, params, bound, ranges, runs4 in _prescanned():
        _check_row_runs(variant, bound, runs4, qo_lens, kv_lens, heads)
        runs = runs4[..., :2].contiguous()  # the one-run form's table
        lay = kv_range_layout(ranges, qo_indptr, kv_indptr, rows, causal)
        run_lay = kv_range_layout(ranges, qo_indptr, kv_indptr, rows, causal, runs_shape=tuple(runs.shape))
        one_run_rows = run_kind(runs4) == 1
        assert run_kind(runs4) == (2 if variant is HOLED else 1)
        flat_rel = relative_runs(runs, run_lay, qo_indptr, kv_indptr, rows, causal).reshape(-1)
        assert torch.equal(run_lay.blocks[:, :3], lay.blocks[:, :3]) and torch.equal(run_lay.kv_lens, lay.kv_lens)
        covered_rows, kv_work, kept_of = 0, 0, {}
        for r in range(lay.kv_lens.numel()):
            b, q0, k0, full_lo, full_hi = lay.blocks[r].tolist()
            row0, row1 = int(lay.qo_indptr[r] - qo_indptr[b]), int(lay.qo_indptr[r + 1] - qo_indptr[b])
            assert 0 < row1 - row0 <= rows and row0 % rows == 0, (variant.name, r)
            assert q0 == row0 + kv_lens[b] - qo_lens[b]
            assert int(lay.kv_starts[r]) == int(kv_indptr[b]) + k0
            k1 = k0 + int(lay.kv_lens[r])
            assert 0 <= k0 < k1 <= kv_lens[b], (variant.name, r, k0, k1)
            if b not in kept_of:  # a request's kept pairs, once (each of its blocks reads a slice)
                kept_of[b] = _kept(variant, bound, b, qo_lens[b], kv_lens[b], heads, causal)
            keep = kept_of[b][:, row0:row1]
            keys = keep.any(0).any(0).nonzero().flatten()
            # the kernel skips the mask on [full_lo, full_hi): every row of every head keeps those keys
            assert bool(_kept(variant, bound, b, qo_lens[b], kv_lens[b], heads, False)[:, row0:row1,
                                                                                     full_lo:full_hi].all())
            if keys.numel():
                assert k0 <= int(keys.min()) and int(keys.max()) < k1, (variant.name, causal, r, k0, k1)
            # the row-run form finds row row0 + i of head h at run_base + head_step * h + 2 * i, relative to the
            # block's first key and cut at the diagonal: exactly the pairs the mask (and causal) keeps
            run_base, head_step = run_lay.blocks[r, 3:].tolist()
            for h in range(heads if one_run_rows else 0):  # the row-run form runs only then
                got = flat_rel[run_base + head_step * h: run_base + head_step * h + 2 * (row1 - row0)].view(-1, 2)
                local = torch.arange(k1 - k0)
                by_runs = (local[None, :] >= got[:, :1]) & (local[None, :] < got[:, 1:])
                assert torch.equal(by_runs, keep[h, :, k0:k1]), (variant.name, causal, r, h)
                outside = keep[h].clone()
                outside[:, k0:k1] = False
                assert not bool(outside.any())
            covered_rows += row1 - row0
            kv_work += (row1 - row0) * (k1 - k0)
        assert covered_rows == sum(qo_lens) and int(lay.qo_indptr[-1]) == sum(qo_lens)
        if variant.name == "document_mask":  # the point of it: far less than every key for every row
            assert kv_work < 0.7 * sum(q * k for q, k in zip(qo_lens, kv_lens))


def _check_row_runs(variant, bound, runs, qo_lens, kv_lens, heads):
    """Each row's two runs [a0, a1) and [b0, b1) hold exactly the keys it keeps, the second empty when it keeps one
    run (all -1 when it keeps more than two)."""
    for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens)):
        keep = _kept(variant, bound, b, lq, lk, heads, False)
        for h in range(runs.shape[1]):
            for i in range(lq):
                a0, a1, b0, b1 = runs[b, h, i].tolist()
                kept = keep[h, i] if runs.shape[1] > 1 else keep[0, i]
                if a0 < 0:
                    idx = kept.nonzero().flatten()
                    assert idx.numel() and idx.numel() != int(idx.max() - idx.min() + 1), (variant.name, b, h, i)
                    continue
                want = torch.zeros(lk, dtype=torch.bool)
                want[max(a0, 0):max(a1, 0)] = True
                want[max(b0, 0):max(b1, 0)] = True
                assert a1 <= b0 or b0 >= b1, (variant.name, b, h, i)  # ordered, disjoint
                assert torch.equal(kept, want), (variant.name, b, h, i, (a0, a1, b0, b1))
    if variant is HOLED:
        assert bool((runs[..., 2] < runs[..., 3]).any())  # rows with two runs: the two-run form


def _streaming(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < params.sink or q_idx - kv_idx < params.window


def _one_hole(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx != q_idx - params.hole  # two runs a row, one key apart


STREAMING = AttentionVariant(name="kvr_streaming", mask=_streaming, params={"sink": Scalar(int), "window": Scalar(int)})
ONE_HOLE = AttentionVariant(name="kvr_one_hole", mask=_one_hole, params={"hole": Scalar(int)})


@pytest.mark.parametrize("rows", [128, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_mask_free_requests_keep_exactly_their_form(causal, rows):
    """mask_free_requests against the mask on every (row, key, head): a CAUSAL_WINDOW request's rows keep exactly
    the keys FA3's causal mode with window_left = W - 1 keeps of the request (bottom-right aligned on its own rows
    and keys), an ALL_KEYS request's rows keep every key of it; sinks with a window, a window inside documents,
    per-head windows (no one W), holes and documents; split and unsplit layouts."""
    from fivar.runtime.kv_ranges import ALL_KEYS, CAUSAL_WINDOW, mask_free_requests
    cases = [(v, b, rg, rn) for v, _, b, rg, rn in _prescanned()]
    # sinks wider than a block: rows up to sink + window keep [0, q_idx], wider than the window
    aligned = document_ids([128, 256, 3, 125, 600])  # documents starting on block edges
    for variant, params in ((STREAMING, {"sink": 40, "window": 60}), (ONE_HOLE, {"hole": 3}),
                            (BAND_AND_DOC, {"left": 127, "doc": aligned})):
        bound = bind_params(variant, params, num_qo_heads=_HEADS, num_kv_heads=2, batch_size=3, device="cpu")
        cases.append((variant, bound, *load_triton_module(variant).mask_ranges(
            _QO_INDPTR, _KV_INDPTR, max(_QO_LENS), _HEADS, 2, kernel_arg_values(variant, bound, 1.0), row_runs=True)))
    seen = set()
    for variant, bound, ranges, runs in cases:
        for split in (False, True):
            lay = kv_range_layout(ranges, _QO_INDPTR, _KV_INDPTR, rows, causal, split_runs=split)
            src = lay.parts.src if lay.parts is not None else torch.arange(int(lay.qo_indptr[-1]))
            for two in (runs, runs[..., :2].contiguous()) if run_kind(runs) == 1 else (runs,):
                got = mask_free_requests(two, lay, _QO_INDPTR, _KV_INDPTR, causal, windows=True)
                window = got.window
                for r, kind in enumerate(got.kind.tolist()):
                    if kind not in (ALL_KEYS, CAUSAL_WINDOW):
                        continue
                    seen.add((variant.name, kind, window))
                    b, _, k0 = lay.blocks[r, :3].tolist()
                    k1 = k0 + int(lay.kv_lens[r])
                    t = src[int(lay.qo_indptr[r]):int(lay.qo_indptr[r + 1])] - int(_QO_INDPTR[b])
                    keep = _kept(variant, bound, b, _QO_LENS[b], _KV_LENS[b], _HEADS, causal)[:, t, k0:k1]
                    n, n_keys = keep.shape[1:]
                    if kind == ALL_KEYS:
                        assert bool(keep.all()), (variant.name, causal, r)
                        continue
                    assert causal
                    key, local_q = torch.arange(n_keys).view(1, -1), torch.arange(n).view(-1, 1) + n_keys - n
                    fa3 = (key <= local_q) & ((key >= local_q - (window - 1)) if window is not None else True)
                    assert torch.equal(keep, fa3.expand_as(keep)), (variant.name, r, window)
                    if window is not None and bool(got.inside[r]):  # whole windows: none cut at the first key
                        assert bool((local_q - (window - 1) >= 0).all()), (variant.name, r, window)
    if causal:  # the forms are found where they should be
        assert ("kvr_streaming", CAUSAL_WINDOW, 60) in seen and ("kvr_streaming", ALL_KEYS, 60) in seen, seen
        assert ("kvr_band_and_doc", CAUSAL_WINDOW, 91) in seen, seen
        assert ("document_mask", CAUSAL_WINDOW, None) in seen, seen
    else:
        assert ("document_mask", ALL_KEYS, None) in seen, seen


def test_adjacent_mask_free_requests_merge_only_when_one_request_computes_them():
    """KvRangePrefill._requests on a made-up layout: adjacent requests of one batch merge when keyed from one first
    key (causal, any window), when each keeps whole windows and starts no further left (a window), or when they
    share their keys exactly (every key); never across requests, rows that are not adjacent, or a request left
    out; the merged request spans the first one's first key to the last one's last."""
    from fivar.runtime import kv_ranges
    from fivar.runtime.kv_ranges import ALL_KEYS, CAUSAL_WINDOW, NEEDS_MASK, KvRangeLayout, MaskFreeRequests
    # (batch, q_first, lo, rows, keys): rows and keys as FA3's causal mode needs them (keys end at the diagonal)
    spec = [(0, 0, 0, 128, 128), (0, 128, 0, 128, 256), (0, 256, 100, 128, 284), (0, 384, 150, 128, 362),
            (0, 512, 140, 128, 500), (1, 0, 0, 128, 128), (1, 128, 0, 128, 256), (1, 256, 0, 128, 384),
            (1, 640, 5, 128, 3), (1, 768, 5, 128, 3), (1, 896, 5, 128, 3)]
    b, q0, lo, n, keys = (torch.tensor(x) for x in zip(*spec))
    layout = KvRangeLayout(qo_indptr=torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]).int(),
                           kv_starts=torch.cat([lo, torch.zeros(1, dtype=torch.long)]).int(), kv_lens=keys.int(),
                           blocks=torch.stack([b, q0, lo, lo * 0, lo * 0], 1).int())
    plan = kv_ranges.KvRangePrefill.__new__(kv_ranges.KvRangePrefill)
    plan.layout = layout

    def groups(kind, window=None, inside=None, member=None, form=CAUSAL_WINDOW):
        """The first launch over every request (`member` None: those of `form`), else a later one of `member`."""
        plan.mask_free = MaskFreeRequests(torch.tensor(kind), window, None if inside is None else torch.tensor(inside))
        sel = torch.tensor(kind) == form if member is None else torch.tensor(member)
        req = torch.arange(len(kind)) if member is None else torch.nonzero(sel).view(-1)
        first, rows, kv = plan._requests(req, sel, form)
        return first.tolist(), rows.tolist(), kv.tolist()

    W = CAUSAL_WINDOW
    # no window: one first key per merged request; 2..4 have other first keys; batches stay apart
    assert groups([W] * 11) == ([0, 2, 3, 4, 5, 8], [256, 128, 128, 128, 384, 384], [256, 284, 362, 500, 384, 3])
    # a window: 2 and 3 keep whole windows and start no further left (merged into 0's), 4 starts left of 3 (not)
    inside = [False, False, True, True, True, False, False, False, True, True, True]
    assert groups([W] * 11, 100, inside)[0] == [0, 4, 5, 8]
    inside[3] = False  # 3's first rows' windows are cut at its first key: it keeps its own
    assert groups([W] * 11, 100, inside)[0] == [0, 3, 4, 5, 8]
    # request 1 needs the mask: 0 and 2 are not adjacent as one launch's members, and the others read one key
    assert groups([W, NEEDS_MASK] + [W] * 9) == ([0, 1, 2, 3, 4, 5, 8], [128] * 4 + [128, 384, 384],
                                                 [128, 1, 284, 362, 500, 384, 3])
    # every key of [5, 8): 8..10 share their keys and are adjacent rows; a later launch of 5 and 8..10 (not adjacent)
    assert groups([NEEDS_MASK] * 8 + [ALL_KEYS] * 3, form=ALL_KEYS)[0] == list(range(9))
    member = [False] * 5 + [True] + [False] * 2 + [True] * 3
    kind = [NEEDS_MASK] * 5 + [ALL_KEYS] + [NEEDS_MASK] * 2 + [ALL_KEYS] * 3
    assert groups(kind, member=member, form=ALL_KEYS)[0] == [5, 8]
    assert groups(kind, member=member, form=NEEDS_MASK)[0] == [5, 8, 9, 10]  # the mask form never merges


def test_a_block_that_keeps_nothing_gets_one_masked_key():
    """A query block whose rows keep no key at all still runs (the kernel masks its one key: zeros out)."""
    ranges = torch.tensor([[[[50, 0, 50, 50]] * 8]], dtype=torch.int32)  # lo = kv_len, hi = 0: nothing kept
    lay = kv_range_layout(ranges, torch.tensor([0, 128]), torch.tensor([0, 50]), 128, causal=False)
    assert lay.kv_lens.tolist() == [1] and lay.blocks.tolist()[0][:3] == [0, -78, 0]


def _range_groups(rows=16):
    """Each RANGE_ROWS group of every pre-scanned case: (variant, where, the group's rows as some head keeps them and
    as every head does, its RANGE_FIELDS, kv_len)."""
    for variant, _, bound, ranges, _ in _prescanned():
        heads = ranges.shape[1]
        for b, (lq, lk) in enumerate(zip(_QO_LENS, _KV_LENS)):
            keep = _kept(variant, bound, b, lq, lk, _HEADS, False)
            for h in range(heads):
                some, every = (keep[h], keep[h]) if heads > 1 else (keep.any(0), keep.all(0))
                for g in range((lq + rows - 1) // rows):
                    yield (variant, (variant.name, b, h, g), some[g * rows:(g + 1) * rows],
                           every[g * rows:(g + 1) * rows], [int(x) for x in ranges[b, h, g]], lk)


def test_pre_pass_gaps_hold_no_kept_key():
    """[gap_lo, gap_hi) of each RANGE_ROWS group: no row of the group keeps a key there (the twin skips its tiles);
    a mask whose rows keep two runs gets non-empty gaps."""
    holed_gaps = 0
    for variant, where, some, _, (lo_all, hi_all, _, _, lo, hi), _ in _range_groups():
        if lo >= hi:
            continue
        holed_gaps += variant is HOLED
        assert not some[:, lo:hi].any(), (where, lo, hi)
        assert lo_all < lo and hi < hi_all, ("a gap lies between runs", where)
    assert holed_gaps > 0


def test_pre_pass_full_range_is_kept_by_every_row():
    """[full_lo, full_hi) of each RANGE_ROWS group: every row of the group keeps every key there (the twin and FA3's
    mask form skip the mask on it); a mask whose rows keep two runs gets it inside the last runs, after the gap."""
    after_gap = 0
    for variant, where, _, every, (_, _, lo, hi, gap_lo, gap_hi), kv_len in _range_groups():
        if lo >= hi:
            continue
        assert 0 <= lo and hi <= kv_len, (where, lo, hi)
        assert every[:, lo:hi].all(), (where, lo, hi)
        after_gap += variant is HOLED and gap_lo < gap_hi <= lo
    assert after_gap > 0


@pytest.mark.parametrize("causal", [False, True])
def test_twin_skips_gaps_and_matches_the_reference(causal):
    """The Triton twin with the pre-pass's gaps (sink tokens and a window; a hole around the diagonal), ragged
    lengths that are not multiples of the tiles, against the reference."""
    from fivar.testing import compare

    def sinks_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
        return kv_idx < params.sink or q_idx - kv_idx < params.window

    streaming = AttentionVariant(name="kvr_streaming", mask=sinks_window,
                                 params={"sink": Scalar(int), "window": Scalar(int)})
    torch.manual_seed(0)
    qo, kv = [70, 1, 130], [200, 33, 130]
    qi = torch.tensor([0] + qo).cumsum(0).to(torch.int32)
    ki = torch.tensor([0] + kv).cumsum(0).to(torch.int32)
    q = torch.randn(sum(qo), 4, 32, dtype=torch.float16)
    k, v = (torch.randn(sum(kv), 2, 32, dtype=torch.float16) for _ in range(2))
    for variant, params in ((streaming, {"sink": 3, "window": 40}), (HOLED, {"gap": 20})):
        out = variant.batch_prefill_ragged(q, k, v, qi, ki, causal=causal, backend="triton", **params)
        ref = torch.cat([variant.reference(q[qi[b]:qi[b + 1]], k[ki[b]:ki[b + 1]], v[ki[b]:ki[b + 1]], causal=causal,
                                           batch_idx=b, batch_size=3, **params) for b in range(3)])
        r = compare(variant.name, f"twin causal={causal}", out, ref, torch.float16)
        assert r.passed, r


# --- rows keeping two runs of keys: a request per run over copies of the rows, merged through the LSEs -----------

def _token_rows(qo_lens):
    return [(b, i) for b, n in enumerate(qo_lens) for i in range(n)]


@pytest.mark.parametrize("causal", [False, True])
def test_split_runs_read_each_kept_key_exactly_once(causal):
    """With split_runs each row of q is read by one or two lowered requests whose key ranges are disjoint and hold
    every key the row keeps; the parts' bookkeeping maps lowered rows back to q. The holed mask splits."""
    from fivar.runtime.kv_ranges import kv_range_layout
    for variant, _, bound, ranges, _ in _prescanned():
        lay = kv_range_layout(ranges, _QO_INDPTR, _KV_INDPTR, 128, causal, split_runs=True)
        if lay.parts is None:
            assert variant is not HOLED, "two runs a row: some block splits"
            continue
        p = lay.parts
        reads = {}  # row of q -> its parts' [k0, k1)
        for r in range(lay.kv_lens.numel()):
            k0 = int(lay.blocks[r, 2])
            k1 = k0 + int(lay.kv_lens[r])
            for lowered in range(int(lay.qo_indptr[r]), int(lay.qo_indptr[r + 1])):
                reads.setdefault(int(p.src[lowered]), []).append((k0, k1))
        tokens = _token_rows(_QO_LENS)
        assert sorted(reads) == list(range(len(tokens)))
        n = len(tokens)  # the blocks over q's own rows first (a split one over its last run), then the first runs
        assert torch.equal(p.src[:n], torch.arange(n)) and torch.equal(p.src[n:], p.twice)
        assert int(lay.qo_indptr[p.blocks]) == n
        kept = {b: _kept(variant, bound, b, _QO_LENS[b], _KV_LENS[b], _HEADS, causal).any(0)
                for b in range(len(_QO_LENS)) if _QO_LENS[b]}
        for t, parts in reads.items():
            b, i = tokens[t]
            assert len(parts) == (2 if t in set(p.twice.tolist()) else 1)
            read = torch.zeros(_KV_LENS[b], dtype=torch.int64)
            for k0, k1 in parts:
                read[k0:k1] += 1
            assert int(read.max()) == 1, (variant.name, t, parts)  # no key twice: the merge adds the parts
            assert bool((read[kept[b][i]] == 1).all()), (variant.name, t, parts)


class _FakeFA3RaggedWrapper:
    """FlashInfer's FA3 ragged prefill with per-request KV starts, as fivar's KV-range struct sees it: rows, keys
    from kv_starts, fv_blocks' mapping, then the mask form's full range and causal guard, or the two-run form's
    runs (`row_runs` 2: a row's [a0, a1, b0, b1) at field 3 + field 4 * head + 4 * row); out and the log2 LSE."""

    def __init__(self, variant, row_runs=0, mask_free=False, sliding_window=False, head_requests=False):
        self.variant, self.row_runs, self.mask_free = variant, 0 if mask_free else row_runs, mask_free
        self.sliding_window, self.head_requests = sliding_window, head_requests
        self._jit_module = types.SimpleNamespace(kv_starts=None)

    def plan(self, qo_indptr, kv_indptr, hq, hkv, d, causal=False, window_left=-1, **kw):
        assert self.mask_free or not causal, "only the mask-free form runs FA3's causal mode"
        assert (window_left >= 0) == self.sliding_window, "a window needs the module built with FA3's sliding window"
        self.qo, self.lens, self.causal, self.window_left = qo_indptr.long(), kv_indptr.long().diff(), causal, window_left

    def run(self, q, k, v, *args, return_lse=False):
        var = self.variant
        t_names, _, s_names, _ = additional_params(var, with_causal_flag=not self.row_runs and not self.mask_free,
                                                   extra_tensors=[BLOCKS, ROW_RUNS] if self.row_runs else [BLOCKS])
        named = dict(zip(t_names + s_names, args))
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
        for r in range(self.qo.numel() - 1):
            rows = q[self.qo[r]:self.qo[r + 1]]
            s0 = int(self._jit_module.kv_starts[r])
            keys, vals = k[s0:s0 + int(self.lens[r])], v[s0:s0 + int(self.lens[r])]
            fields = named[BLOCKS][r].tolist()
            assert len(fields) == (7 if self.head_requests else 5)
            b, q0, k0, f3, f4 = fields[:5]
            heads = fields[5:] if self.head_requests else None  # the struct's heads: one head a request

            def keep(ev, env, f3=f3, f4=f4, k0=k0, n=rows.shape[0], n_keys=keys.shape[0]):
                if self.mask_free:  # FA3's causal mode (and window), bottom-right aligned on the request's rows and keys
                    key, local_q = torch.arange(n_keys).view(1, 1, -1), torch.arange(n).view(1, -1, 1) + n_keys - n
                    kept = (key <= local_q) if self.causal else torch.ones(1, n, n_keys, dtype=torch.bool)
                    return kept & (key >= local_q - self.window_left) if self.window_left >= 0 else kept
                if self.row_runs == 1:  # one run [a, b) a row, relative to the request's first key, causal folded in
                    flat = named[ROW_RUNS].reshape(-1).long()
                    runs = torch.stack([flat[f3 + f4 * h: f3 + f4 * h + 2 * n].view(n, 2) for h in range(q.shape[1])])
                    k = env["kv_idx"] - k0
                    return (k >= runs[..., 0:1]) & (k < runs[..., 1:2])
                if self.row_runs:  # runs relative to the request's first key, causal folded in
                    flat = named[ROW_RUNS].reshape(-1).long()
                    runs = torch.stack([flat[f3 + f4 * h: f3 + f4 * h + 4 * n].view(n, 4) for h in range(q.shape[1])])
                    k = env["kv_idx"] - k0
                    return (((k >= runs[..., 0:1]) & (k < runs[..., 1:2]))
                            | ((k >= runs[..., 2:3]) & (k < runs[..., 3:4])))
                kept = ev.run(var.ir.mask).bool() | ((env["kv_idx"] >= f3) & (env["kv_idx"] < f4))
                return kept & (env["kv_idx"] <= env["q_idx"]) if named["fv_causal"] else kept
            out[self.qo[r]:self.qo[r + 1]], lse[self.qo[r]:self.qo[r + 1]] = attend(
                var, named, rows, keys, vals, torch.arange(rows.shape[0]).view(1, -1, 1) + q0,
                torch.arange(keys.shape[0]).view(1, 1, -1) + k0, b, keep, heads=heads)
        return (out.to(q.dtype), lse.float()) if return_lse else out.to(q.dtype)


def _fake_fa3_batch(monkeypatch, seed, qo_lens, kv_lens):
    """KvRangePrefill on the CPU (fivar's modules stand-ins) and a random fp16 batch of 4/2 heads:
    (generator, qo_indptr, kv_indptr, q, k, v)."""
    from fivar.runtime import kv_ranges
    monkeypatch.setattr(kv_ranges, "_module", lambda *a, row_runs=0, mask_free=False, sliding_window=False,
                        head_requests=False, **kw: types.SimpleNamespace(
                            uri="fake", row_runs=row_runs, mask_free=mask_free, sliding_window=sliding_window,
                            head_requests=head_requests))
    monkeypatch.setattr(kv_ranges, "release_wrapper", lambda *a: None)
    gen = torch.Generator().manual_seed(seed)
    qo_indptr = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32)
    kv_indptr = torch.tensor([0] + kv_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(qo_lens), 4, 16, generator=gen).half()
    k, v = (torch.randn(sum(kv_lens), 2, 16, generator=gen).half() for _ in range(2))
    return gen, qo_indptr, kv_indptr, q, k, v


def _assert_reference(variant, params, q, k, v, qo_indptr, kv_indptr, causal, out, lse):
    """Every request's output and LSE (sm_scale 0.25) against the torch reference."""
    for b in range(qo_indptr.numel() - 1):
        s, e, ks, ke = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(kv_indptr[b]), int(kv_indptr[b + 1])
        ref, ref_lse = variant.reference(q[s:e].float(), k[ks:ke].float(), v[ks:ke].float(), causal=causal,
                                         sm_scale=0.25, batch_idx=b, batch_size=qo_indptr.numel() - 1,
                                         return_lse=True, **params)
        assert torch.allclose(out[s:e].double(), ref.double(), atol=2e-3), (variant.name, b)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite, torch.isfinite(lse[s:e]))
        assert torch.allclose(lse[s:e][finite].double(), ref_lse[finite].double(), atol=2e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_split_runs_merged_equal_the_reference(monkeypatch, causal):
    """KvRangePrefill over a holed mask and sink tokens with a window: the two runs' outputs merged through their
    LSEs equal attention over every kept key (FlashInfer's FA3 wrapper a stand-in, the pre-pass in Triton)."""
    from fivar.runtime import kv_ranges

    def sinks_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
        return kv_idx < params.sink or q_idx - kv_idx < params.window

    def head_sinks_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
        return kv_idx < params.sinks[qo_head] or q_idx - kv_idx < params.window

    streaming = AttentionVariant(name="kvr_split_streaming", mask=sinks_window,
                                 params={"sink": Scalar(int), "window": Scalar(int)})
    # sinks per head: the sink parts need the mask, as does the block where the window leaves the sinks
    head_sinks = AttentionVariant(name="kvr_split_head_sinks", mask=head_sinks_window,
                                  params={"sinks": Tensor("int32", ("qo_head",)), "window": Scalar(int)})
    gen, qo_indptr, kv_indptr, q, k, v = _fake_fa3_batch(monkeypatch, 5, [300, 7, 260], [420, 9, 260])
    mixed = False
    for variant, params in ((streaming, {"sink": 5, "window": 30}), (HOLED, {"gap": 70}),
                            (head_sinks, {"sinks": torch.tensor([3, 9, 1, 5], dtype=torch.int32), "window": 40})):
        monkeypatch.setattr(kv_ranges, "_fa3_wrapper", lambda fmod, device, var=variant: _FakeFA3RaggedWrapper(
            var, fmod.row_runs, fmod.mask_free, fmod.sliding_window, fmod.head_requests))
        bound = bind_params(variant, params, num_qo_heads=4, num_kv_heads=2, batch_size=3, device="cpu")
        plan = kv_ranges.KvRangePrefill(variant, qo_indptr, kv_indptr, num_qo_heads=4, num_kv_heads=2, head_dim=128,
                                        dtype=torch.float16, causal=causal, bound=bound, sm_scale=0.25, device="cpu")
        assert plan.layout.parts is not None and plan.layout.parts.twice.numel() > 0, variant.name
        assert plan.row_runs == 2, variant.name  # each row's two runs checked, not the mask
        if variant is streaming and causal:  # the window parts in FA3's sliding window, the sink parts unmasked
            assert plan.mask_free.window == 30
            assert {kv_ranges.CAUSAL_WINDOW, kv_ranges.ALL_KEYS} <= set(plan.mask_free.kind.tolist())
            # each request's window parts run as one windowed request
            windowed = plan._launches[0].wrapper
            assert windowed.window_left == 29 and windowed.qo.numel() - 1 < plan.layout.parts.blocks
        mixed |= any(x.to_out is not None and x.to_first_runs is not None for x in plan._launches)
        out, lse = plan.run(q, k, v, return_lse=True)
        _assert_reference(variant, params, q, k, v, qo_indptr, kv_indptr, causal, out, lse)
    assert mixed or not causal, "a launch over rows of q and first runs both"


def _planned_on_fakes(monkeypatch, variant, params, qo_indptr, kv_indptr, causal):
    """KvRangePrefill of a batch of 3 (4/2 heads, sm_scale 0.25) on the FA3 stand-in: the plan and the stand-in
    wrappers it made, in order."""
    from fivar.runtime import kv_ranges
    made = []

    def wrapper(fmod, device):
        made.append(_FakeFA3RaggedWrapper(variant, fmod.row_runs, fmod.mask_free, fmod.sliding_window,
                                          fmod.head_requests))
        return made[-1]
    monkeypatch.setattr(kv_ranges, "_fa3_wrapper", wrapper)
    bound = bind_params(variant, params, num_qo_heads=4, num_kv_heads=2, batch_size=3, device="cpu")
    plan = kv_ranges.KvRangePrefill(variant, qo_indptr, kv_indptr, num_qo_heads=4, num_kv_heads=2, head_dim=128,
                                    dtype=torch.float16, causal=causal, bound=bound, sm_scale=0.25, device="cpu")
    return plan, made


def _documents(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.docs[batch, q_idx] == params.docs[batch, kv_idx]


def _chunks(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx // params.chunk == kv_idx // params.chunk


def _distance_bias(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.slope * (kv_idx - q_idx) + batch


@pytest.mark.parametrize("causal", [False, True])
def test_blocks_inside_a_document_run_mask_free(monkeypatch, causal):
    """A document or chunk mask called non-causally: the query blocks inside one document (chunk) run without the
    mask, every row at once, and the blocks a boundary cuts run in the row-run form over copies of their rows,
    written over theirs. Called causally, a request of FA3's causal mode per document (chunk), one launch, no
    mask; where rows keep many runs (interleaved documents), the blocks again, in FA3's causal mode where they
    can. The whole batch, output and LSE, is the reference's."""
    from fivar.runtime import kv_ranges
    gen, qo_indptr, kv_indptr, q, k, v = _fake_fa3_batch(monkeypatch, 6, [700, 7, 390], [900, 9, 390])
    docs = torch.cat([torch.zeros(3, 1, dtype=torch.int32),
                      (torch.rand(3, 899, generator=gen) < 1 / 300).to(torch.int32)], 1).cumsum(1).to(torch.int32)
    documents = AttentionVariant(name="kvr_documents", mask=_documents,
                                 params={"docs": Tensor("int32", ("batch", "position"))})
    chunks = AttentionVariant(name="kvr_chunks", mask=_chunks, params={"chunk": Scalar(int)})
    # request 0 of these alternates two documents every 50 tokens: its rows keep many runs (the mask form), while
    # the other requests are one document each
    interleaved = torch.cat([((torch.arange(900) // 50) % 2).view(1, -1).to(torch.int32),
                             torch.zeros(2, 900, dtype=torch.int32)])
    # a position bias: the struct must map each request's rows and keys back to their q_idx and kv_idx
    biased = AttentionVariant(name="kvr_documents_biased", mask=_documents, logits=_distance_bias,
                              params={"docs": Tensor("int32", ("batch", "position")), "slope": Scalar(float)})
    merged = False
    for variant, params in ((documents, {"docs": docs}), (chunks, {"chunk": 300}),
                            (documents, {"docs": interleaved}), (biased, {"docs": docs, "slope": 0.03})):
        plan, made = _planned_on_fakes(monkeypatch, variant, params, qo_indptr, kv_indptr, causal)
        segments = causal and params.get("docs") is not interleaved
        assert (plan.segments is not None) == segments, variant.name
        if segments:  # a request per document (chunk) that has rows, in FA3's causal mode with no mask
            assert len(plan._launches) == 1 and made[-1].mask_free and made[-1].causal
            assert plan.segments == made[-1].qo.numel() - 1 > 3
            out, lse = plan.run(q, k, v, return_lse=True)
            _assert_reference(variant, params, q, k, v, qo_indptr, kv_indptr, causal, out, lse)
            continue
        # most blocks lie inside one document (chunk), and some are cut by a boundary
        kinds = set(plan.mask_free.kind.tolist())
        assert len(plan._launches) > 1 and kv_ranges.NEEDS_MASK in kinds, (variant.name, kinds)
        for form in (kv_ranges.CAUSAL_WINDOW, kv_ranges.ALL_KEYS):  # a chunk's blocks run as one request
            sel = plan.mask_free.kind == form
            merged |= bool(sel.any()) and plan._requests(torch.nonzero(sel).view(-1), sel, form)[0].numel() < sel.sum()
        out, lse = plan.run(q, k, v, return_lse=True)
        _assert_reference(variant, params, q, k, v, qo_indptr, kv_indptr, causal, out, lse)
    assert merged


def _head_window_biased(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.slope[qo_head] * (kv_idx - q_idx) + kv_head


def _head_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.windows[qo_head] and kv_idx <= q_idx


def _head_chunks(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx // params.chunks[qo_head] == kv_idx // params.chunks[qo_head]


@pytest.mark.parametrize("lens", [([300, 5, 200], [420, 5, 260]), ([250, 0, 190], [250, 40, 300])],
                         ids=["ragged", "a request of no rows"])
@pytest.mark.parametrize("causal", [False, True])
def test_head_requests_read_each_heads_own_keys(monkeypatch, causal, lens):
    """A mask keeping different keys per head (a window per head, one head global; chunks per head): a request
    per (head, request) over head-major q/k/v, each reading its own head's keys, the struct given the heads and the
    request of the batch; output and LSE are the reference's. A window per head with a per-head logits term checks
    that the struct sees the right heads."""
    gen, qo_indptr, kv_indptr, q, k, v = _fake_fa3_batch(monkeypatch, 9, *lens)
    windowed = AttentionVariant(name="kvr_head_window", mask=_head_window, logits=_head_window_biased,
                                params={"windows": Tensor("int32", ("qo_head",)),
                                        "slope": Tensor("float32", ("qo_head",))})
    chunked = AttentionVariant(name="kvr_head_chunks", mask=_head_chunks,
                               params={"chunks": Tensor("int32", ("qo_head",))})
    cases = [(windowed, {"windows": torch.tensor([17, 1 << 20, 40, 5], dtype=torch.int32),
                         "slope": torch.tensor([0.02, -0.01, 0.05, 0.0])}),
             (chunked, {"chunks": torch.tensor([64, 1 << 20, 100, 48], dtype=torch.int32)})]
    for variant, params in cases:
        plan, made = _planned_on_fakes(monkeypatch, variant, params, qo_indptr, kv_indptr, causal)
        assert plan.heads is not None and made and all(w.head_requests for w in made), variant.name
        assert (plan.segments is not None) == (causal and variant is chunked), variant.name
        out, lse = plan.run(q, k, v, return_lse=True)
        _assert_reference(variant, params, q, k, v, qo_indptr, kv_indptr, causal, out, lse)


def test_head_requests_only_where_heads_keep_different_keys():
    """The head-requests form is chosen by the keys its blocks read: not when every head keeps the same keys, nor
    when the union over heads reads little more; and its requests map to the head-major k/v rows of their KV
    head."""
    from fivar.runtime.kv_ranges import HEAD_REQUESTS_GAIN, head_requests
    qo = torch.tensor([0, 512, 600], dtype=torch.long)
    kv = torch.tensor([0, 700, 800], dtype=torch.long)

    def ranges(widths):  # a causal window per head: row groups of 16 keep [q - w + 1, q + 1)
        out = torch.zeros(2, len(widths), 512 // 16, 6, dtype=torch.int32)
        for b in range(2):
            n_q, n_kv = int(qo[b + 1] - qo[b]), int(kv[b + 1] - kv[b])
            for g in range((n_q + 15) // 16):
                q_hi = min(16 * g + 15, n_q - 1) + n_kv - n_q
                for h, w in enumerate(widths):
                    out[b, h, g, 0], out[b, h, g, 1] = max(0, 16 * g + n_kv - n_q - w + 1), q_hi + 1
        return out
    assert head_requests(ranges([64, 64, 64, 64]), qo, kv, 4, 2, 128, True) is None
    assert head_requests(ranges([600, 64, 700, 650]), qo, kv, 4, 2, 128, True) is None
    hr = head_requests(ranges([16, 1 << 20, 32, 64]), qo, kv, 4, 2, 128, True)
    assert hr is not None and HEAD_REQUESTS_GAIN < 1
    assert hr.qo_indptr.tolist() == [0, 512, 600, 1112, 1200, 1712, 1800, 2312, 2400]
    for r in range(8):
        h, b = divmod(r, 2)
        assert (int(hr.batch[r]), int(hr.qo_head[r]), int(hr.kv_head[r])) == (b, h, h // 2)
        # key j of request r is token kv[b] + j of KV head h // 2: row (h // 2) * 800 + kv[b] + j of head-major k
        assert int(hr.kv_indptr[r] + hr.kv_shift[r]) == (h // 2) * 800 + int(kv[b])
        assert int(hr.kv_indptr[r + 1] - hr.kv_indptr[r]) == int(kv[b + 1] - kv[b])
