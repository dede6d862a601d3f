"""The KV band read off a mask must be implied by it: every pair the mask keeps lies inside the band.
Checked by brute force over all (q_idx, kv_idx) pairs with random scalar params, for masks written in
the shapes users write them, plus masks where no band (or only part of one) may be claimed."""
import pytest
import torch

from fivar import AttentionVariant, Scalar, Tensor
from fivar.codegen.torch_ref import eval_scalar
from fivar.spec.bounds import kv_band


def _variant(mask):
    return AttentionVariant(name="band_probe", mask=mask, params={
        "w": Scalar(int, default=4), "r": Scalar(int, default=2), "doc": Tensor("int32", ("position",))})


def m_window(b, h, kh, q, kv, p):
    return q - kv < p.w


def m_flipped(b, h, kv_h, q, kv, p):
    return kv - q > -p.w


def m_shifted(b, h, kh, q, kv, p):
    return q - p.w <= kv


def m_two_sided(b, h, kh, q, kv, p):
    lo = q - kv <= p.w + 1
    return lo and kv <= q + p.r


def m_right_only(b, h, kh, q, kv, p):
    return kv - q < p.r


def m_window_and_doc(b, h, kh, q, kv, p):
    return q - kv < p.w and p.doc[q] == p.doc[kv]


def m_two_windows(b, h, kh, q, kv, p):
    return q - kv < p.w and q - kv <= p.r + 3


def m_either(b, h, kh, q, kv, p):
    return q - kv < p.w or kv < 2  # a disjunction: no band may be claimed


def m_scaled(b, h, kh, q, kv, p):
    return 2 * q - kv < p.w  # not unit coefficients: not a band fivar reads


def m_doc(b, h, kh, q, kv, p):
    return p.doc[q] == p.doc[kv]


def m_chunk(b, h, kh, q, kv, p):
    return q // p.w == kv // p.w and kv <= q  # chunked local attention: a loose band of the chunk's width


def m_chunk_other(b, h, kh, q, kv, p):
    return q // p.w == kv // p.r  # different divisors: no band


CASES = {m_window: ("left", True), m_flipped: ("left", True), m_shifted: ("left", True),
         m_two_sided: ("both", True), m_right_only: ("right", True), m_window_and_doc: ("left", False),
         m_two_windows: ("left", True), m_either: (None, False), m_scaled: (None, False), m_doc: (None, False),
         m_chunk: ("both", False), m_chunk_other: (None, False)}


@pytest.mark.parametrize("mask", list(CASES), ids=lambda f: f.__name__)
def test_band_is_implied_by_the_mask(mask):
    v = _variant(mask)
    band = kv_band(v.ir.mask)
    sides, exact = CASES[mask]
    assert (band.left is not None) == (sides in ("left", "both"))
    assert (band.right is not None) == (sides in ("right", "both"))
    assert band.exact == exact
    n = 40
    q_idx = torch.arange(n).view(-1, 1).expand(n, n)
    kv_idx = torch.arange(n).view(1, -1).expand(n, n)
    for _ in range(20):
        scalars = {"w": int(torch.randint(-3, 12, ())), "r": int(torch.randint(-3, 12, ()))}
        scalars = {k: x or 1 for k, x in scalars.items()}  # never 0: the chunk masks divide by them
        doc = torch.randint(0, 3, (n,)).sort().values.to(torch.int32)
        keep = torch.tensor([[bool(mask(0, 0, 0, int(i), int(j), _P(scalars, doc))) for j in range(n)]
                             for i in range(n)])
        inside = torch.ones(n, n, dtype=torch.bool)
        if band.left is not None:
            inside &= kv_idx >= q_idx - int(eval_scalar(band.left, scalars, 1.0))
        if band.right is not None:
            inside &= kv_idx <= q_idx + int(eval_scalar(band.right, scalars, 1.0))
        assert not (keep & ~inside).any(), f"{mask.__name__} keeps pairs outside its band for {scalars}"
        if band.exact:
            assert torch.equal(keep, inside), f"{mask.__name__}: an exact band must equal the mask"


class _P:
    def __init__(self, scalars, doc):
        self.w, self.r, self.doc = scalars["w"], scalars["r"], doc.tolist()


# FA3 runs a mask that is exactly a left band as its own sliding window, with no mask in the struct. The
# kernel's rule (hopper/mainloop_mma.cuh, col_limit_left/right): keep kv_idx >= q + kv_len - qo_len -
# window_left, and kv_idx <= q + kv_len - qo_len under causal. With the window_left fivar passes, that rule
# must equal the mask for every param, empty and right-of-diagonal windows included.
WINDOW_FORM = {m_window: True, m_flipped: True, m_shifted: True, m_two_windows: True, m_two_sided: False,
               m_right_only: False, m_window_and_doc: False, m_doc: False}


@pytest.mark.parametrize("mask", list(WINDOW_FORM), ids=lambda f: f.__name__)
def test_fa3_window_form_is_the_mask(mask):
    from fivar.codegen import fa3
    from fivar.runtime.attention import _window_left
    from fivar.runtime.params import bind_params
    v = _variant(mask)
    assert fa3.runs_as_window(v) == WINDOW_FORM[mask]
    struct = fa3.variant_decl(v).source
    assert ("fv_keep" in struct) != WINDOW_FORM[mask], "the struct masks exactly when FA3's window cannot"
    if not WINDOW_FORM[mask]:
        return
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        scalars = {"w": int(torch.randint(-6, 50, (), generator=gen)), "r": int(torch.randint(-6, 50, (), generator=gen))}
        kv_len = int(torch.randint(1, 60, (), generator=gen))
        qo_len = int(torch.randint(1, kv_len + 1, (), generator=gen))
        doc = torch.zeros(kv_len, dtype=torch.int32)
        bound = bind_params(v, {**scalars, "doc": doc}, num_qo_heads=1, num_kv_heads=1, batch_size=1, device="cpu")
        window_left = _window_left(v, "fa3", bound)
        q_pos = torch.arange(qo_len).view(-1, 1) + kv_len - qo_len
        kv_idx = torch.arange(kv_len).view(1, -1)
        truth = torch.tensor([[bool(mask(0, 0, 0, int(q), int(k), _P(scalars, doc))) for k in range(kv_len)]
                              for q in q_pos.flatten()])
        for causal in (False, True):
            fa3_keeps = kv_idx >= q_pos - window_left
            if causal:
                fa3_keeps &= kv_idx <= q_pos
            want = truth & (kv_idx <= q_pos) if causal else truth
            assert torch.equal(fa3_keeps, want), (mask.__name__, scalars, qo_len, kv_len, causal, window_left)


def _fa2_batch_kernel_keeps(mask_fn, scalars, doc, qo_len, kv_len, window_left, causal_mode, custom, causal,
                            cta_q, cta_kv, group):
    """Which pairs FlashInfer's FA2 batch-prefill kernel keeps (prefill.cuh, BatchPrefillWithRaggedKVCacheKernel:
    kv_start_idx, num_iterations, window_iteration, mask_iteration), unsplit, with fivar's struct as the variant:
    a tile that is not masked keeps every pair it visits; a masked one applies kCausal's rule (in that mode) and
    the struct's mask (with `causal` folded in as fivar's runtime flag)."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    sub0 = lambda a, b: max(a - b, 0)  # noqa: E731
    keep = torch.zeros(qo_len, kv_len, dtype=torch.bool)
    wl = window_left if window_left >= 0 else kv_len  # the struct: -1 means no window
    for t in range(cdiv(qo_len * group, cta_q)):
        chunk_start = sub0(kv_len + (t * cta_q) // group, qo_len + wl)
        chunk_size = kv_len - chunk_start
        num_iter = cdiv(min(chunk_size, sub0(kv_len - qo_len + cdiv((t + 1) * cta_q, group), chunk_start))
                        if causal_mode else chunk_size, cta_kv)
        window_iter = cdiv(sub0(kv_len + cdiv((t + 1) * cta_q, group), qo_len + wl + chunk_start), cta_kv)
        mask_iter = (min(chunk_size, sub0(kv_len + cdiv(t * cta_q, group) - qo_len, chunk_start))
                     if causal_mode else chunk_size) // cta_kv
        for r in range((t * cta_q) // group, min(qo_len, cdiv((t + 1) * cta_q, group))):
            q = r + kv_len - qo_len
            for kv in range(chunk_start, min(kv_len, chunk_start + num_iter * cta_kv)):
                it = (kv - chunk_start) // cta_kv
                if custom or it >= mask_iter or it < window_iter:
                    ok = not (causal_mode and kv > q) and bool(mask_fn(0, 0, 0, q, kv, _P(scalars, doc)))
                    keep[r, kv] = ok and not (causal and kv > q)
                else:
                    keep[r, kv] = True
    return keep


FA2_CASES = [m_window, m_flipped, m_shifted, m_two_windows, m_two_sided, m_window_and_doc, m_right_only, m_chunk]


@pytest.mark.parametrize("mask", FA2_CASES, ids=lambda f: f.__name__)
def test_fa2_window_skips_only_masked_tiles(mask):
    """fivar's FA2 launch (window_left from the band, kCausal for the window form called causally, else kCustom)
    keeps exactly the pairs of mask & causal, for every param, shape and tile."""
    from fivar.codegen import fa2
    from fivar.runtime.attention import _owns_mask, _plan_causal, _window_left
    from fivar.runtime.params import bind_params
    v = _variant(mask)
    gen = torch.Generator().manual_seed(1)
    for _ in range(25):
        ri = lambda lo, hi: int(torch.randint(lo, hi, (), generator=gen))  # noqa: E731
        scalars = {"w": ri(-6, 60) or 1, "r": ri(-6, 40) or 1}
        kv_len = ri(1, 90)
        qo_len = ri(1, kv_len + 1)
        doc = torch.randint(0, 3, (kv_len,), generator=gen).sort().values.to(torch.int32)
        bound = bind_params(v, {**scalars, "doc": doc}, num_qo_heads=1, num_kv_heads=1, batch_size=1, device="cpu")
        wl = _window_left(v, "fa2", bound)
        assert (wl >= 0) == (v.kv_band.left is not None)
        for causal in (False, True):
            custom = _owns_mask(v, "fa2", causal, wl)
            causal_mode = _plan_causal(v, "fa2", causal, wl)
            assert custom != causal_mode or not causal
            assert (not custom) == fa2.runs_window_mode(v, causal, wl)
            q_pos = torch.arange(qo_len).view(-1, 1) + kv_len - qo_len
            truth = torch.tensor([[bool(mask(0, 0, 0, int(q), k, _P(scalars, doc))) and not (causal and k > q)
                                   for k in range(kv_len)] for q in q_pos.flatten()]).view(qo_len, kv_len)
            for cta_q, cta_kv, group in ((16, 16, 1), (64, 32, 4), (128, 64, 1)):
                got = _fa2_batch_kernel_keeps(mask, scalars, doc, qo_len, kv_len, wl, causal_mode, custom, causal,
                                              cta_q, cta_kv, group)
                assert torch.equal(got, truth), (mask.__name__, scalars, qo_len, kv_len, causal, wl, cta_q, group)
