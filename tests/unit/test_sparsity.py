"""The block map read off a mask (fivar.spec.sparsity) against brute force over every (q_idx, kv_idx) pair.

Every claim must hold for random shapes, block sizes, heads and params: a block called full keeps every pair, a
block called empty keeps none. For the mask shapes the analysis is exact on (bands, causal, chunks, documents,
prefixes, per-head windows) the map must equal the truth. Mutations of the classifier (a partial block called
full, a block bound shifted by one, a comparison rule loosened) must be caught by the same check."""
import zlib

import pytest
import torch

from fivar import AttentionVariant, Scalar, Tensor, abs, maximum, where
from fivar.spec import sparsity
from fivar.spec.sparsity import EMPTY, FULL, PARTIAL, brute_force, classify, keep_matrix, violations


def _params():
    return {"w": Scalar(int, default=4), "r": Scalar(int, default=2), "c": Scalar(int, default=8),
            "n_sink": Scalar(int, default=4), "hole": Scalar(int, default=3),
            "doc": Tensor("int32", ("batch", "position")), "prefix": Tensor("int32", ("batch",)),
            "hw": Tensor("int32", ("qo_head",))}


def m_causal(b, h, kh, q, kv, p):
    return kv <= q


def m_window(b, h, kh, q, kv, p):
    return q - kv < p.w


def m_causal_window(b, h, kh, q, kv, p):
    return q - kv < p.w and kv <= q


def m_two_sided(b, h, kh, q, kv, p):
    return q - kv <= p.w and kv - q <= p.r


def m_chunk(b, h, kh, q, kv, p):
    return q // p.c == kv // p.c


def m_chunk_causal(b, h, kh, q, kv, p):
    return q // p.c == kv // p.c and kv <= q


def m_prefix_lm(b, h, kh, q, kv, p):
    return kv < p.prefix[b] or kv <= q


def m_sinks_window(b, h, kh, q, kv, p):
    return (kv < p.n_sink or q - kv < p.w) and kv <= q


def m_document(b, h, kh, q, kv, p):
    return p.doc[b, q] == p.doc[b, kv]


def m_document_causal(b, h, kh, q, kv, p):
    return p.doc[b, q] == p.doc[b, kv] and kv <= q


def m_hole(b, h, kh, q, kv, p):
    return kv <= q and q - kv != p.hole


def m_periodic_holes(b, h, kh, q, kv, p):
    return kv <= q and (q - kv) % 7 != 3


def m_per_head_window(b, h, kh, q, kv, p):
    return q - kv < p.hw[h] and kv <= q


def m_abs_band(b, h, kh, q, kv, p):
    return abs(q - kv) <= p.w


def m_clamped_start(b, h, kh, q, kv, p):
    return kv >= maximum(q - p.w, 0) and kv <= q


def m_select(b, h, kh, q, kv, p):
    return where(p.r > 0, q - kv < p.w, kv <= q)


def m_not(b, h, kh, q, kv, p):
    return not (q - kv >= p.w)


def m_float(b, h, kh, q, kv, p):
    return float(q - kv) * 0.5 < p.w  # float arithmetic: not analysed, must fall back to partial


def m_mod_keys(b, h, kh, q, kv, p):
    return kv % p.c < 3


EXACT = [m_causal, m_window, m_causal_window, m_two_sided, m_chunk, m_chunk_causal, m_prefix_lm, m_document,
         m_document_causal, m_per_head_window, m_abs_band, m_not]
SOUND_ONLY = [m_select, m_sinks_window, m_hole, m_periodic_holes, m_clamped_start, m_float, m_mod_keys]
_variants: dict = {}


def _variant(mask):
    if mask not in _variants:
        _variants[mask] = AttentionVariant(name=mask.__name__, mask=mask, params=_params())
    return _variants[mask]


def _draw(gen, max_len=70):
    kv_len = int(torch.randint(1, max_len, (), generator=gen))
    qo_len = int(torch.randint(1, kv_len + 1, (), generator=gen))
    batch = 3
    b = int(torch.randint(0, batch, (), generator=gen))
    group = [1, 2, 4][int(torch.randint(0, 3, (), generator=gen))]
    hkv = int(torch.randint(1, 3, (), generator=gen))
    hq = hkv * group
    ri = lambda lo, hi: int(torch.randint(lo, hi, (), generator=gen))  # noqa: E731
    scalars = {"w": ri(-3, 40), "r": ri(-3, 20), "c": ri(1, 30), "n_sink": ri(0, 10), "hole": ri(0, 10)}
    n_docs = ri(1, 6)
    doc = torch.randint(0, n_docs, (batch, kv_len), generator=gen).sort(1).values.to(torch.int32)
    tensors = {"doc": doc, "prefix": torch.randint(0, kv_len + 1, (batch,), generator=gen).to(torch.int32),
               "hw": torch.randint(-2, 40, (hq,), generator=gen).to(torch.int32)}
    blocks = [1, 3, 7, 16, 32, 64]
    qb, kb = blocks[ri(0, len(blocks))], blocks[ri(0, len(blocks))]
    return dict(qo_len=qo_len, kv_len=kv_len, scalars=scalars, tensors=tensors, num_qo_heads=hq,
                num_kv_heads=hkv, batch_idx=b, causal=bool(ri(0, 2))), qb, kb


def _truth(v, case, qb, kb):
    return brute_force(keep_matrix(v.ir.mask, **case), qb, kb)


@pytest.mark.parametrize("mask", EXACT + SOUND_ONLY, ids=lambda f: f.__name__)
def test_block_map_is_sound_and_exact_where_claimed(mask):
    v = _variant(mask)
    gen = torch.Generator().manual_seed(zlib.crc32(mask.__name__.encode()))
    loose = 0
    for _ in range(40):
        case, qb, kb = _draw(gen)
        claimed = classify(v.ir.mask, q_block=qb, kv_block=kb, **case).kinds
        truth = _truth(v, case, qb, kb)
        assert claimed.shape == truth.shape
        bad = violations(claimed, truth)
        assert not bad, (mask.__name__, case, qb, kb, bad)
        if mask in EXACT:
            assert torch.equal(claimed, truth), (mask.__name__, case, qb, kb, claimed, truth)
        loose += int((claimed != truth).sum())
    if mask is m_float:
        assert loose > 0, "float comparisons are not analysed: some block must be left partial"


@pytest.mark.parametrize("mask", EXACT + SOUND_ONLY, ids=lambda f: f.__name__)
def test_pairs_are_the_matrix_diagonal(mask):
    """classify_bounds(pairs=True), the linear form the FA2 and FA3 plans ask one block of keys per query block
    with, is the diagonal of the full (query block x KV block) matrix over the same bounds."""
    from fivar.spec.sparsity import classify_bounds
    v = _variant(mask)
    gen = torch.Generator().manual_seed(zlib.crc32(b"pairs" + mask.__name__.encode()))
    for _ in range(6):
        case, _, _ = _draw(gen)
        n = int(torch.randint(1, 9, (), generator=gen))
        q_lo = torch.randint(0, case["kv_len"], (n,), generator=gen)
        q_hi = torch.minimum(q_lo + torch.randint(0, 20, (n,), generator=gen), torch.tensor(case["kv_len"] - 1))
        kv_lo = torch.randint(0, case["kv_len"], (n,), generator=gen)
        kv_hi = torch.minimum(kv_lo + torch.randint(0, 40, (n,), generator=gen), torch.tensor(case["kv_len"] - 1))
        kw = {k: case[k] for k in ("scalars", "tensors", "num_qo_heads", "num_kv_heads", "batch_idx", "causal")}
        full = classify_bounds(v.ir.mask, q_lo, q_hi, kv_lo, kv_hi, **kw)
        assert torch.equal(classify_bounds(v.ir.mask, q_lo, q_hi, kv_lo, kv_hi, pairs=True, **kw), full.diagonal())


def test_brute_force_kinds_by_hand():
    keep = torch.tensor([[[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]], dtype=torch.bool)
    assert brute_force(keep, 2, 2).tolist() == [[FULL, PARTIAL], [EMPTY, EMPTY]]
    # a ragged last block counts only its real pairs
    assert brute_force(keep[:, :3, :3], 2, 2).tolist() == [[FULL, PARTIAL], [EMPTY, EMPTY]]


def test_chunked_block_inside_one_chunk_is_full():
    v = _variant(m_chunk_causal)
    bm = classify(v.ir.mask, qo_len=512, kv_len=512, q_block=64, kv_block=64, scalars={"c": 256}, causal=False)
    # chunks of 256 = 4 blocks: below-diagonal blocks of the same chunk are full, other chunks empty
    k = bm.kinds
    assert k[1, 0] == FULL and k[5, 4] == FULL and k[4, 3] == EMPTY and k[1, 1] == PARTIAL and k[0, 1] == EMPTY
    assert bm.counts() == {"empty": 64 - 2 * 10, "partial": 8, "full": 12}


def test_ranges_cover_every_kept_block():
    gen = torch.Generator().manual_seed(5)
    for mask in (m_sinks_window, m_document, m_chunk_causal, m_hole):
        v = _variant(mask)
        for _ in range(10):
            case, qb, kb = _draw(gen)
            kinds = classify(v.ir.mask, q_block=qb, kv_block=kb, **case).kinds
            r = sparsity.BlockRanges.of(kinds)
            col = torch.arange(kinds.shape[1])
            inside = (col[None] >= r.kept_lo[:, None]) & (col[None] < r.kept_hi[:, None])
            assert not ((kinds != EMPTY) & ~inside).any()
            in_full = (col[None] >= r.full_lo[:, None]) & (col[None] < r.full_hi[:, None])
            assert (kinds[in_full] == FULL).all()
            for i in range(kinds.shape[0]):
                segs = r.segments(kinds, i)
                covered = [j for s, e, _ in segs for j in range(s, e)]
                assert covered == (kinds[i] != EMPTY).nonzero().flatten().tolist()


def test_sinks_and_window_keep_two_ranges():
    v = _variant(m_sinks_window)
    bm = classify(v.ir.mask, qo_len=256, kv_len=256, q_block=32, kv_block=32, scalars={"n_sink": 4, "w": 64})
    segs = bm.ranges().segments(bm.kinds, 7)
    # the sink block (4 of its 32 keys), then the window's blocks: its edges partial, its inside full
    assert segs == [(0, 1, PARTIAL), (5, 6, PARTIAL), (6, 7, FULL), (7, 8, PARTIAL)], segs
    assert (bm.ranges().kept_lo[7], bm.ranges().kept_hi[7]) == (0, 8)


# --- mutations: each must make the brute-force check fail ------------------------------------------------

def _cases(mask, n=30, seed=11):
    gen = torch.Generator().manual_seed(seed)
    v = _variant(mask)
    for _ in range(n):
        case, qb, kb = _draw(gen)
        if qb == 1 and kb == 1:
            qb = 8
        yield v, case, qb, kb


@pytest.mark.parametrize("mask", [m_window, m_chunk_causal, m_document, m_sinks_window],
                         ids=lambda f: f.__name__)
def test_mutation_partial_called_full_is_caught(mask):
    caught = 0
    for v, case, qb, kb in _cases(mask):
        claimed = classify(v.ir.mask, q_block=qb, kv_block=kb, **case).kinds.clone()
        truth = _truth(v, case, qb, kb)
        partial = (truth == PARTIAL).nonzero()
        if partial.numel():
            i, j = partial[0].tolist()
            claimed[i, j] = FULL
            assert violations(claimed, truth)
            caught += 1
        kept = (truth != EMPTY).nonzero()
        if kept.numel():
            mutated = classify(v.ir.mask, q_block=qb, kv_block=kb, **case).kinds.clone()
            mutated[tuple(kept[-1].tolist())] = EMPTY
            assert violations(mutated, truth)
    assert caught > 0


@pytest.mark.parametrize("shift", ["q_hi", "kv_lo", "q_lo", "kv_hi"])
@pytest.mark.parametrize("mask", [m_causal_window, m_chunk_causal, m_document], ids=lambda f: f.__name__)
def test_mutation_block_bound_off_by_one_is_caught(mask, shift):
    failed = 0
    for v, case, qb, kb in _cases(mask, n=60):
        q_lo, q_hi = sparsity._blocks(case["qo_len"], qb, case["kv_len"] - case["qo_len"])
        kv_lo, kv_hi = sparsity._blocks(case["kv_len"], kb)
        bounds = {"q_lo": q_lo, "q_hi": q_hi, "kv_lo": kv_lo, "kv_hi": kv_hi}
        bounds[shift] = bounds[shift] + (1 if shift.endswith("lo") else -1)  # each block loses an edge row/key
        kw = {k: case[k] for k in ("scalars", "tensors", "num_qo_heads", "num_kv_heads", "batch_idx", "causal")}
        claimed = sparsity.classify_bounds(v.ir.mask, **bounds, **kw)
        failed += bool(violations(claimed, _truth(v, case, qb, kb)))
    assert failed > 0, f"an off-by-one in {shift} went unnoticed for {mask.__name__}"


@pytest.mark.parametrize("rule", ["lt_as_le", "eq_must_any", "floordiv_off", "and_as_or"])
def test_mutation_interval_rule_is_caught(rule, monkeypatch):
    original = sparsity._Interpreter._binary

    def mutated(self, e):
        out = original(self, e)
        if rule == "lt_as_le" and e.op == "lt":
            a, b = sparsity._as_int(self.eval(e.a)), sparsity._as_int(self.eval(e.b))
            return sparsity._Iv(a.hi <= b.lo, a.lo <= b.hi, "bool")
        if rule == "eq_must_any" and e.op == "eq":
            return sparsity._Iv(out.hi, out.hi, "bool")
        if rule == "floordiv_off" and e.op == "floordiv":
            return sparsity._Iv(out.lo + 1, out.hi, out.type)
        if rule == "and_as_or" and e.op == "and":
            a, b = self.eval(e.a), self.eval(e.b)
            return sparsity._Iv(a.lo | b.lo, a.hi | b.hi, "bool")
        return out

    monkeypatch.setattr(sparsity._Interpreter, "_binary", mutated)
    mask = {"lt_as_le": m_causal_window, "eq_must_any": m_document, "floordiv_off": m_chunk,
            "and_as_or": m_causal_window}[rule]
    failed = 0
    for v, case, qb, kb in _cases(mask, n=40):
        claimed = classify(v.ir.mask, q_block=qb, kv_block=kb, **case).kinds
        failed += bool(violations(claimed, _truth(v, case, qb, kb)))
    assert failed > 0


# --- decode: the page map of a batch, and the trimmed page lists built from it ----------------------------------

DECODE_MASKS = [m_document, m_sinks_window, m_prefix_lm, m_chunk_causal, m_per_head_window, m_hole, m_mod_keys]


def _decode_batch(gen, page):
    batch = 5
    kv_lens = torch.randint(1, 140, (batch,), generator=gen)
    n_pages = (kv_lens + page - 1) // page
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), n_pages.cumsum(0)])
    indices = torch.randperm(int(n_pages.sum()) + 7, generator=gen)[:int(n_pages.sum())]
    last = kv_lens - (n_pages - 1) * page
    return kv_lens, indptr.int(), indices.int(), last.int()


def _decode_params(gen, kv_lens, hq):
    ri = lambda lo, hi: int(torch.randint(lo, hi, (), generator=gen))  # noqa: E731
    scalars = {"w": ri(1, 50), "r": ri(-3, 20), "c": ri(1, 40), "n_sink": ri(0, 20), "hole": ri(0, 10)}
    width = int(kv_lens.max())
    doc = torch.randint(0, ri(1, 6), (len(kv_lens), width), generator=gen).sort(1).values.to(torch.int32)
    tensors = {"doc": doc, "prefix": torch.randint(0, width + 1, (len(kv_lens),), generator=gen).to(torch.int32),
               "hw": torch.randint(-2, 60, (hq,), generator=gen).to(torch.int32)}
    return scalars, tensors


def _decode_truth(v, kv_lens, scalars, tensors, b, hq, hkv):
    n = int(kv_lens[b])
    return keep_matrix(v.ir.mask, qo_len=1, kv_len=n, scalars=scalars, tensors=tensors, num_qo_heads=hq,
                       num_kv_heads=hkv, batch_idx=b).any(0)[0]  # [kv_len]: kept by some head


@pytest.mark.parametrize("mask", DECODE_MASKS, ids=lambda f: f.__name__)
def test_decode_page_map_and_trimmed_pages(mask):
    from fivar.runtime.decode_pages import local_to_kv_idx, trim_pages
    v = _variant(mask)
    gen = torch.Generator().manual_seed(3)
    dropped = causal_runs = 0
    for _ in range(12):
        page = [1, 4, 16][int(torch.randint(0, 3, (), generator=gen))]
        hq, hkv = [(4, 2), (2, 2), (8, 1)][int(torch.randint(0, 3, (), generator=gen))]
        kv_lens, indptr, indices, last = _decode_batch(gen, page)
        scalars, tensors = _decode_params(gen, kv_lens, hq)
        kinds = sparsity.classify_decode(v.ir.mask, kv_lens, page_size=page, scalars=scalars, tensors=tensors,
                                         num_qo_heads=hq, num_kv_heads=hkv)
        for b in range(len(kv_lens)):
            truth = brute_force(keep_matrix(v.ir.mask, qo_len=1, kv_len=int(kv_lens[b]), scalars=scalars,
                                            tensors=tensors, num_qo_heads=hq, num_kv_heads=hkv, batch_idx=b),
                                1, page)[0]
            claimed = kinds[b, :truth.numel()]
            assert not violations(claimed.view(1, -1), truth.view(1, -1)), (mask.__name__, b, claimed, truth)
            assert (kinds[b, truth.numel():] == EMPTY).all()
        t = trim_pages(kinds, indptr, indices, last, page)
        if t is None:
            continue
        dropped += t.pages_total - t.pages_read
        causal_runs += t.causal
        for b in range(len(kv_lens)):
            n, n_local = int(kv_lens[b]), int((t.kv_indptr[b + 1] - t.kv_indptr[b] - 1) * page + t.kv_last_page_len[b])
            local = torch.arange(n_local).view(1, -1)
            kv = local_to_kv_idx(t.segments[b:b + 1], local)[0]
            assert (kv >= 0).all() and (kv < n).all() and kv.unique().numel() == n_local
            # the page the kernel reads for each local key holds that key's K/V
            new_page = t.kv_indices[t.kv_indptr[b] + local[0] // page]
            old_page = indices[indptr[b] + kv // page]
            assert torch.equal(new_page, old_page) and torch.equal(local[0] % page, kv % page)
            assert n_local - 1 + int(t.segments[b, 3]) == n - 1  # the query's q_idx
            assert int(t.segments[b, 4]) == b  # the request the mask's `batch` reads
            kept = _decode_truth(v, kv_lens, scalars, tensors, b, hq, hkv).nonzero().flatten()
            assert torch.isin(kept, kv).all(), (mask.__name__, b, kept, kv)
            if t.causal:  # kCausal: the mask runs only on the first KV tile (16 keys or more): every key after is kept
                f_lo, f_hi = int(t.segments[b, 5]), int(t.segments[b, 6])
                assert f_hi == n_local and f_lo <= 16 and int(t.segments[b, 8]) == max(0, n_local - 1)
                every_head = keep_matrix(v.ir.mask, qo_len=1, kv_len=n, scalars=scalars, tensors=tensors,
                                         num_qo_heads=hq, num_kv_heads=hkv, batch_idx=b).all(0)[0]
                assert bool(every_head[kv[f_lo:]].all()), (mask.__name__, b, f_lo)
    if mask in (m_document, m_sinks_window, m_chunk_causal, m_per_head_window):
        assert dropped > 0, "a mask that drops whole pages must trim some"
    if mask is m_prefix_lm:
        assert dropped == 0 and causal_runs  # decode keeps every key of a prefix-LM mask: kCausal, no mask


def test_trimmed_pages_mutations_are_caught():
    """The checks above catch a shift off by one page or a dropped page that holds a kept key."""
    from fivar.runtime.decode_pages import local_to_kv_idx, trim_pages
    v = _variant(m_sinks_window)
    page = 4
    kv_lens = torch.tensor([100, 61])
    n_pages = (kv_lens + page - 1) // page
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), n_pages.cumsum(0)]).int()
    indices = torch.arange(int(n_pages.sum())).int()
    last = (kv_lens - (n_pages - 1) * page).int()
    scalars = {"n_sink": 3, "w": 10}
    kinds = sparsity.classify_decode(v.ir.mask, kv_lens, page_size=page, scalars=scalars)
    t = trim_pages(kinds, indptr, indices, last, page)
    assert t is not None and t.pages_read < t.pages_total
    seg = t.segments.clone()
    seg[:, 2] += page  # the second run's shift off by a page
    local = torch.arange(int((t.kv_indptr[1] - 1) * page + t.kv_last_page_len[0])).view(1, -1)
    assert not torch.equal(indices[local_to_kv_idx(seg[:1], local)[0] // page],
                           t.kv_indices[local[0] // page])
    wrong = kinds.clone()
    wrong[0, 24] = EMPTY  # the page of the query (key 99) claimed empty
    t2 = trim_pages(wrong, indptr, indices, last, page)
    kv = local_to_kv_idx(t2.segments[:1], torch.arange(int((t2.kv_indptr[1] - 1) * page
                                                           + t2.kv_last_page_len[0])).view(1, -1))[0]
    assert not torch.isin(torch.tensor([99]), kv).all()


# --- FA2's block form: one request per query block over the pages of the keys it may keep -----------------------

@pytest.mark.parametrize("mask", [m_document_causal, m_chunk_causal, m_sinks_window, m_prefix_lm, m_hole,
                                  m_per_head_window], ids=lambda f: f.__name__)
def test_fa2_block_layout_reads_every_kept_key_at_its_position(mask):
    """Every block-request's local rows and keys map (through the key-segments table) to the q_idx and kv_idx of
    the batch, its pages hold those keys, the blocks partition the rows, and every key a row keeps is read."""
    from fivar.runtime.decode_pages import local_to_kv_idx
    from fivar.runtime.fa2_blocks import block_layout
    v = _variant(mask)
    gen = torch.Generator().manual_seed(9)
    saved = full_keys = two_runs = 0
    for _ in range(6):
        page = [1, 4, 16][int(torch.randint(0, 3, (), generator=gen))]
        hq, hkv = [(4, 2), (2, 2)][int(torch.randint(0, 2, (), generator=gen))]
        kv_lens, indptr, indices, last = _decode_batch(gen, page)
        qo_lens = torch.stack([torch.randint(1, int(n) + 1, (), generator=gen) for n in kv_lens])
        qo_indptr = torch.cat([torch.zeros(1, dtype=torch.long), qo_lens.cumsum(0)])
        scalars, tensors = _decode_params(gen, kv_lens, hq)
        causal = bool(torch.randint(0, 2, (), generator=gen))
        rows = [16, 32][int(torch.randint(0, 2, (), generator=gen))]
        pages = [indices[indptr[b]:indptr[b + 1]].long() for b in range(len(kv_lens))]
        lay = block_layout(v.ir.mask, qo_indptr, kv_lens, pages, last, page, scalars=scalars, tensors=tensors,
                           num_qo_heads=hq, num_kv_heads=hkv, causal=causal, kv_block=page * 2, rows=rows)
        saved += lay.keys_total - lay.keys_read
        two_runs += int((lay.segments[:, 0] < 2**30).sum())
        req_of_row = torch.bucketize(torch.arange(int(qo_indptr[-1])), qo_indptr[1:], right=True)
        covered = {}
        for r in range(lay.qo_indptr.numel() - 1):
            r0, r1 = int(lay.qo_indptr[r]), int(lay.qo_indptr[r + 1])
            b = int(req_of_row[r0])
            assert int(req_of_row[r1 - 1]) == b, "a block stays inside its request"
            n_local_pages = int(lay.kv_indptr[r + 1] - lay.kv_indptr[r])
            local_len = (n_local_pages - 1) * page + int(lay.kv_last_page_len[r]) if n_local_pages else 0
            seg = lay.segments[r:r + 1]
            assert int(seg[0, 4]) == b, "the struct's `batch` is the block's request"
            local = torch.arange(local_len).view(1, -1)
            kv = local_to_kv_idx(seg, local)[0]
            assert (kv >= 0).all() and (kv < int(kv_lens[b])).all()
            new_page = lay.kv_indices[lay.kv_indptr[r] + local[0] // page].long()
            assert torch.equal(new_page, pages[b][kv // page]) and torch.equal(local[0] % page, kv % page)
            qo_len, kv_len = int(qo_lens[b]), int(kv_lens[b])
            f_lo, f_hi = int(seg[0, 5]), int(seg[0, 6])
            if f_lo < f_hi:  # the struct skips the mask on these keys: every row of the block keeps them, every head
                assert 0 <= f_lo and f_hi <= local_len
                keep_all = keep_matrix(v.ir.mask, qo_len=qo_len, kv_len=kv_len, scalars=scalars, tensors=tensors,
                                       num_qo_heads=hq, num_kv_heads=hkv, batch_idx=b, causal=False).all(0)
                rows_b = slice(r0 - int(qo_indptr[b]), r1 - int(qo_indptr[b]))
                assert keep_all[rows_b][:, kv[f_lo:f_hi]].all(), (mask.__name__, r)
                full_keys += f_hi - f_lo
            for j in range(r1 - r0):  # the struct's q_idx of local row j
                q_struct = j + local_len - (r1 - r0) + int(seg[0, 3])
                row = r0 + j - int(qo_indptr[b])
                assert q_struct == row + kv_len - qo_len
                covered[r0 + j] = set(kv.tolist())
        assert sorted(covered) == list(range(int(qo_indptr[-1]))), "the blocks partition the rows"
        for b in range(len(kv_lens)):
            keep = keep_matrix(v.ir.mask, qo_len=int(qo_lens[b]), kv_len=int(kv_lens[b]), scalars=scalars,
                               tensors=tensors, num_qo_heads=hq, num_kv_heads=hkv, batch_idx=b, causal=causal).any(0)
            for row in range(int(qo_lens[b])):
                need = set(keep[row].nonzero().flatten().tolist())
                assert need <= covered[int(qo_indptr[b]) + row], (mask.__name__, b, row)
    if mask in (m_document_causal, m_chunk_causal, m_sinks_window, m_prefix_lm):
        assert saved > 0
    if mask in (m_document_causal, m_chunk_causal, m_prefix_lm):
        assert full_keys > 0, "FULL blocks reach the struct's fast path"
    if mask is m_sinks_window:
        assert two_runs > 0, "a sink and a window are read as two runs"
