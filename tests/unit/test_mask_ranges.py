"""The Triton twin's mask pre-pass (`mask_ranges`: per 16 query rows, the keys kept by some row and by every row, and
the gap between two runs of kept keys), which the twin's backward and FA2's segments form read, on the CPU in
Triton's interpreter, against the mask evaluated on every (row, key) pair by the torch evaluator."""
import functools

import pytest
import torch

import fivar
from fivar import AttentionVariant, Scalar, Tensor
from fivar.codegen.torch_ref import TorchEvaluator
from fivar.codegen.triton import kernel_arg_values
from fivar.jit.triton_module import load_triton_module
from fivar.runtime.params import bind_params
from fivar.testing import document_ids



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


PER_HEAD_WINDOW = AttentionVariant(name="mr_per_head_window", mask=_per_head_window,
                                   params={"windows": Tensor("int32", ("qo_head",))})
BAND_AND_DOC = AttentionVariant(name="mr_band_and_doc", mask=_band_and_doc,
                                params={"left": Scalar(int), "doc": Tensor("int32", ("position",))})
HOLED = AttentionVariant(name="mr_holed", mask=_holed, params={"gap": Scalar(int)})


def _cases(total):
    """(variant, params) pairs over sequences of up to `total` positions, batch of 3 requests."""
    doc_ids = torch.stack([document_ids([1, 65, 3, 100, total - 169]),
                           document_ids([total // 2, total - total // 2]), document_ids([total])])
    return [(fivar.load("document_mask"), {"doc_ids": doc_ids}),
            (PER_HEAD_WINDOW, {"windows": torch.tensor([3, 75, 1, 20], dtype=torch.int32)}),
            (BAND_AND_DOC, {"left": 45, "doc": doc_ids[0]}),
            (HOLED, {"gap": 35})]


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


# Several documents and 16-row groups per request, lengths off the tiles: half the sizes cost a quarter of the time.
_HEADS, _QO_LENS, _KV_LENS = 4, [250, 0, 39], [260, 40, 300]
_QO_INDPTR = torch.tensor([0] + _QO_LENS).cumsum(0).to(torch.int32)
_KV_INDPTR = torch.tensor([0] + _KV_LENS).cumsum(0).to(torch.int32)


@functools.cache
def _prescanned():
    """Each case's params (drawn once per test run) and its Triton pre-scan, which neither causal nor the head
    dim changes: the interpreter runs it once, not once per parametrization."""
    out = []
    for variant, params in _cases(300):
        bound = bind_params(variant, params, num_qo_heads=_HEADS, num_kv_heads=2, batch_size=3, device="cpu")
        ranges, runs = load_triton_module(variant).mask_ranges(_QO_INDPTR, _KV_INDPTR, max(_QO_LENS), _HEADS, 2,
                                                               kernel_arg_values(variant, bound, 1.0), row_runs=True)
        out.append((variant, params, bound, ranges, runs))
    return out


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

    streaming = AttentionVariant(name="mr_streaming", mask=sinks_window,
                                 params={"sink": Scalar(int), "window": Scalar(int)})
    torch.manual_seed(0)
    qo, kv = [40, 1, 70], [110, 33, 70]
    qi = torch.tensor([0] + qo).cumsum(0).to(torch.int32)
    ki = torch.tensor([0] + kv).cumsum(0).to(torch.int32)
    q = torch.randn(sum(qo), 4, 32, dtype=torch.float16)
    k, v = (torch.randn(sum(kv), 2, 32, dtype=torch.float16) for _ in range(2))
    for variant, params in ((streaming, {"sink": 3, "window": 25}), (HOLED, {"gap": 12})):
        out = variant.batch_prefill_ragged(q, k, v, qi, ki, causal=causal, backend="triton", **params)
        ref = torch.cat([variant.reference(q[qi[b]:qi[b + 1]], k[ki[b]:ki[b + 1]], v[ki[b]:ki[b + 1]], causal=causal,
                                           batch_idx=b, batch_size=3, **params) for b in range(3)])
        r = compare(variant.name, f"twin causal={causal}", out, ref, torch.float16)
        assert r.passed, r


