"""The FA2 plans' forms of a mask beyond a band (the tile-list form, the block form, decode page trimming), end to
end on the CPU: PagedAttentionPlan / RaggedAttentionPlan build their page lists and tables as on the GPU, and a
stand-in for FlashInfer's paged wrapper runs them with the kernel's semantics and the struct's (each request's rows
and pages, the key-segments mapping of positions and batch, or the tile list's, the causal guard, the mask and
logits evaluated by the torch reference's evaluator). The result must be the reference's for the whole batch."""
import os
import types

import pytest
import torch


from fivar.codegen import fa2, tile_list
from fivar.codegen.cuda import additional_params
from fivar.jit import build
from fivar.runtime import attention, fa3_tile_list, forms, plans
from fivar.codegen.tile_list import TILE_WIDTH
from fivar.runtime.decode_pages import HULL_SLACK
from fivar.runtime.params import bind_params
from fivar.testing import _ragged_reference, _to_paged

from kernel_standin import attend
from test_sparsity import (_variant, m_causal, m_causal_window, m_chunk_causal, m_document, m_document_causal, m_hole,
                           m_mod_keys, m_per_head_window, m_prefix_lm, m_sinks_window)


#: FlashInfer's FA2 KV tile (keys per iteration) the stand-in emulates: 64 at CTA_TILE_Q 128 and head dim 128, 128
#: at the smaller query tiles; the block form must be right for any.
CTA_TILE_KV = {"keys": 64}


class _FakePagedWrapper:
    """FlashInfer's FA2 paged prefill as fivar's struct sees it: kCustom (the mask on every key), or kCausal with the
    kernel's tile rules (per query tile of packed rows: the keys from the window's start to the diagonal, the mask
    evaluated only on the tiles at or right of the tile's first row's diagonal or left of its last row's window
    edge); the struct's per-request qo_len/kv_len (skip) and window_left from the key-segments table."""

    def __init__(self, variant, fmod, owns_mask):
        self.variant, self.fmod, self.owns_mask = variant, fmod, owns_mask

    def plan(self, qo_indptr, kv_indptr, kv_indices, last, hq, hkv, d, page, causal=False, window_left=-1, **kw):
        from fivar.runtime.fa2_blocks import cta_tile_q
        assert window_left == -1 or not self.fmod.kv_segments
        # the tile-list module is built in kNone alone: causal is the block map's
        assert not (self.fmod.tile_list and (causal or self.owns_mask or window_left != -1))
        assert not (self.owns_mask and causal), "kCustom folds causal into the struct"
        self.p = dict(qo=qo_indptr.long().cpu(), kv=kv_indptr.long().cpu(), idx=kv_indices.long().cpu(),
                      last=last.long().cpu(), page=page, causal=causal, window_left=window_left, split=kw)
        packed = (self.p["qo"].diff() * (hq // hkv)).tolist()
        self.cta_q = cta_tile_q(packed, d)

    def _tile_rule(self, n_rows, n_keys, group, hq, window):
        """(visited, masked) bool [hq, rows, keys] of one request in kCausal mode (FlashInfer's prefill.cuh)."""
        cta_q, cta_kv = self.cta_q, CTA_TILE_KV["keys"]
        ceil = lambda a, b: -(-a // b)  # noqa: E731
        visited = torch.zeros(hq, n_rows, n_keys, dtype=torch.bool)
        masked = torch.zeros_like(visited)
        keys = torch.arange(n_keys)
        for h in range(hq):
            for j in range(n_rows):
                t = (j * group + h % group) // cta_q
                start = max(0, n_keys + t * cta_q // group - (n_rows + window))
                size = n_keys - start
                n_iter = ceil(min(size, max(0, n_keys - n_rows + ceil((t + 1) * cta_q, group) - start)), cta_kv)
                window_iter = ceil(max(0, n_keys + ceil((t + 1) * cta_q, group) - (n_rows + window + start)), cta_kv)
                # uint32 in the kernel: kv_len + tile start - qo_len wraps when negative, and the causal rule then
                # masks only the last, partial tile
                diag = n_keys + t * cta_q // group - n_rows
                mask_iter = (size if diag < 0 else min(size, max(0, diag - start))) // cta_kv
                it = torch.div(keys - start, cta_kv, rounding_mode="floor")
                visited[h, j] = (keys >= start) & (it < n_iter)
                masked[h, j] = (it >= mask_iter) | (it < window_iter)
        return visited, masked

    def run(self, q, cache, *args, out=None, lse=None, return_lse=False):
        v, p = self.variant, self.p
        k_cache, v_cache = cache
        extra = [fa2.KV_SEGMENTS] if self.fmod.kv_segments else tile_list.tables() if self.fmod.tile_list else []
        mask_free = getattr(self.fmod, "mask_free", False)  # the struct has no mask: kCausal is all there is
        # the args of the struct the module was rendered from (a tile list: the shared mask-free one, causal in its bits)
        t_names, _, s_names, _ = additional_params(self.fmod.kernel_variant,
                                                   with_causal_flag=not mask_free and not self.fmod.tile_list,
                                                   extra_tensors=extra)
        named = dict(zip(t_names + s_names, args))
        hq, hkv = q.shape[1], k_cache.shape[2]
        out = torch.zeros(q.shape, dtype=q.dtype) if out is None else out
        lse = torch.zeros(q.shape[:2]) if return_lse and lse is None else lse
        kernel_causal = p["causal"] and not self.owns_mask
        for r in range(p["qo"].numel() - 1):
            rows = q[p["qo"][r]:p["qo"][r + 1]].double()
            pages = p["idx"][p["kv"][r]:p["kv"][r + 1]]
            n_keys = (pages.numel() - 1) * p["page"] + int(p["last"][r]) if pages.numel() else 0
            keys = k_cache[pages].reshape(-1, hkv, k_cache.shape[-1])[:n_keys].double()
            vals = v_cache[pages].reshape(-1, hkv, k_cache.shape[-1])[:n_keys].double()
            n_rows = rows.shape[0]
            local_q = torch.arange(n_rows).view(1, -1, 1) + n_keys - n_rows
            local_kv = torch.arange(n_keys).view(1, 1, -1)
            q_idx, kv_idx, batch = local_q, local_kv, r
            window = p["window_left"] if p["window_left"] >= 0 else n_keys
            if self.fmod.kv_segments:
                seg = named[fa2.KV_SEGMENTS][r].long()
                if int(seg[7]):  # another launch's request: the kernel reads and writes none of it
                    continue
                window = int(seg[8]) if int(seg[8]) >= 0 else window
                kv_idx = torch.where(local_kv < seg[0], local_kv + seg[1], local_kv + seg[2])
                q_idx, batch = local_q + seg[3], int(seg[4])
            seg_full = (seg[5], seg[6]) if self.fmod.kv_segments else None
            tiles = self._tile_rule(n_rows, n_keys, hq // hkv, hq, window) if kernel_causal else None
            listed = None
            if self.fmod.tile_list:  # the struct's fv_blocks row: the request is a query tile over listed key tiles
                listed = [int(x) for x in named[tile_list.BLOCKS][r]]
                b, q0, first = listed[:3]
                k = local_kv.view(-1)
                kv_idx = (named[tile_list.TILE_KEYS][first + k // tile_list.TILE_WIDTH].long()
                          + k % tile_list.TILE_WIDTH).view(1, 1, -1)
                q_idx, batch = torch.arange(n_rows).view(1, -1, 1) + q0, b

            def keep(ev, env, local_q=local_q, local_kv=local_kv, full=seg_full, tiles=tiles, listed=listed):
                if listed is not None:  # kNone: the struct's keep is all there is
                    _, _, _, whole, bit0, stride, head_words = listed
                    if whole < 0:
                        return torch.zeros(1, 1, 1, dtype=torch.bool)
                    c = (local_kv - whole).clamp(min=0)
                    words = named[tile_list.CUT_BITS].view(-1).long() & 0xFFFFFFFF
                    at = (bit0 + env["qo_head"] * head_words + (c // tile_list.TILE_WIDTH) * stride
                          + torch.arange(local_q.shape[1]).view(1, -1, 1))
                    cut = ((words[at.clamp(max=words.numel() - 1)] >> (c % tile_list.TILE_WIDTH)) & 1).bool()
                    return (local_kv < whole) | cut
                if mask_free:
                    return (local_kv <= local_q) if p["causal"] else torch.ones(1, 1, 1, dtype=torch.bool)
                kept = ev.run(v.ir.mask).bool() if v.ir.mask is not None else torch.ones(1, 1, 1, dtype=torch.bool)
                if full is not None:  # the struct's full range: the mask is skipped there (kept)
                    kept = kept | ((local_kv >= full[0]) & (local_kv < full[1]))
                if named.get("fv_causal"):  # (a variant with no mask has no guard)  # the struct's guard: mapped positions in the key-segments form, local else
                    kept = kept & ((env["kv_idx"] <= env["q_idx"]) if full is not None else (local_kv <= local_q))
                if p["causal"]:
                    kept = kept & (local_kv <= local_q)
                if tiles is not None:  # unmasked tiles keep every key the kernel visits
                    visited, masked = tiles
                    kept = visited & (~masked | kept)
                return kept
            o, l2 = attend(self.fmod.kernel_variant, named, rows, keys, vals, q_idx, kv_idx, batch, keep)
            out[p["qo"][r]:p["qo"][r + 1]] = o.to(out.dtype)
            if return_lse:
                lse[p["qo"][r]:p["qo"][r + 1]] = l2.to(lse.dtype)
        return (out, lse) if return_lse else out


class _FakeRaggedWrapper(_FakePagedWrapper):
    """FlashInfer's FA2 ragged prefill: the paged stand-in over pages of one key (request r reads tokens
    [kv_indptr[r], kv_indptr[r + 1]) of k/v)."""

    def plan(self, qo_indptr, kv_indptr, hq, hkv, d, causal=False, window_left=-1, **kw):
        kv = kv_indptr.long().cpu()
        super().plan(qo_indptr, kv - kv[0], torch.arange(int(kv[0]), int(kv[-1])), (kv.diff() > 0).long(), hq, hkv,
                     d, 1, causal=causal, window_left=window_left, **kw)

    def run(self, q, k, v, *args, return_lse=False):
        return super().run(q, (k.unsqueeze(1), v.unsqueeze(1)), *args, return_lse=return_lse)


@pytest.fixture(autouse=True, scope="module")
def interpret():
    """The mask pre-pass (FA2's segments form reads its row runs) in Triton's interpreter."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture
def cpu_fa2(monkeypatch):
    """The plans on the CPU: no CUDA checks, fivar's module a stand-in, FlashInfer's wrapper the fake above."""
    current, made = [None], []

    def plan_setup(plan, variant, qo_indptr, kv_indptr, hq, hkv, d, dtype, backend, device):
        plan.variant, plan.device, plan.target, plan.batch = variant, torch.device("cpu"), "fa2", qo_indptr.numel() - 1
        return dtype, qo_indptr, kv_indptr

    def module(variant, key, bound, sm_scale):
        assert not key.custom_mask  # FA2 takes no custom mask
        key = key.replace(head_dim=128).checked(variant)  # as gen_module resolves it (FA3: the tile list)
        return types.SimpleNamespace(kv_segments=key.kv_segments, mask_free=key.mask_free, tile_list=key.tile_list,
                                     uri=f"fake_{key.kv_segments}_{key.mask_free}_{key.tile_list}", target=key.target,
                                     kernel_variant=build.rendered_from(variant, key))

    def take(kind, fmod, device, owns_mask):
        made.append(fmod)
        return (_FakePagedWrapper if kind == "paged" else _FakeRaggedWrapper)(current[0], fmod, owns_mask)

    monkeypatch.setattr(plans, "_plan_setup", plan_setup)
    for where in (plans, fa3_tile_list):  # the tile-list form takes its module and wrapper itself
        monkeypatch.setattr(where, "_module", module)
        monkeypatch.setattr(where, "take_wrapper", take)
        monkeypatch.setattr(where, "release_wrapper", lambda *a: None)
    monkeypatch.setattr(plans, "_check_qkv", lambda *a, **kw: None)
    return current, made


def _case(mask, gen):
    v = _variant(mask)
    qo_lens, kv_lens = [37, 1, 70], [37, 90, 150]
    if mask is m_sinks_window:  # keys far enough behind the last rows for a sink and a window to be two runs
        kv_lens = [37, 90, 400]
    scalars = {"w": 19, "r": 3, "c": 24, "n_sink": 5, "hole": 2}
    width = max(kv_lens)
    tensors = {"doc": torch.randint(0, 4, (3, width), generator=gen).sort(1).values.to(torch.int32),
               "prefix": torch.tensor([5, 40, 17], dtype=torch.int32),
               "hw": torch.randint(0, 40, (4,), generator=gen).to(torch.int32)}
    return v, qo_lens, kv_lens, {**scalars, **tensors}


def _qkv(qo_lens, kv_lens, gen):
    q = torch.randn(sum(qo_lens), 4, 16, generator=gen).half()
    k = torch.randn(sum(kv_lens), 2, 16, generator=gen).half()
    return q, k, torch.randn(sum(kv_lens), 2, 16, generator=gen).half()


def _ragged_plan(v, qo_lens, kv_lens, params, causal, backend="fa2"):
    qo = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32)
    kv = torch.tensor([0] + kv_lens).cumsum(0).to(torch.int32)
    return attention.RaggedAttentionPlan(v, qo, kv, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                                         dtype=torch.float16, causal=causal, backend=backend, device="cpu",
                                         params=params)


@pytest.fixture
def cpu_fa3(cpu_fa2, monkeypatch):
    """cpu_fa2's stand-ins with the plans on FA3 (its struct and tile list; the stand-in runs its kernels alike)."""
    setup = plans._plan_setup

    def on_fa3(plan, *a):
        out = setup(plan, *a)
        plan.target = "fa3"
        return out
    monkeypatch.setattr(plans, "_plan_setup", on_fa3)
    return cpu_fa2


@pytest.mark.parametrize("form", ["tile list", "blocks"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [m_document, m_chunk_causal, m_sinks_window, m_prefix_lm],
                         ids=lambda f: f.__name__)
def test_paged_forms_match_the_reference(cpu_fa2, monkeypatch, mask, causal, form):
    """Paged prefill runs the tile-list form; the block form is what an FP8 cache (and a batch of one query a request
    the decode trimming leaves) runs."""
    current, made = cpu_fa2
    if form == "blocks":
        monkeypatch.setattr(plans, "tile_list_form", lambda *a, **kw: False)
    gen = torch.Generator().manual_seed(4)
    v, qo_lens, kv_lens, params = _case(mask, gen)
    current[0] = v
    q, k, vv = _qkv(qo_lens, kv_lens, gen)
    (k_cache, v_cache), indptr, indices, last = _to_paged(k, vv, kv_lens, 4)
    qo_indptr = torch.tensor([0, 37, 38, 108], dtype=torch.int32)
    plan = attention.PagedAttentionPlan(v, qo_indptr, indptr, indices, last, num_qo_heads=4, num_kv_heads=2,
                                        head_dim=16, page_size=4, dtype=torch.float16, causal=causal,
                                        backend="fa2", device="cpu", params=params)
    if form == "tile list":
        assert made[-1].tile_list and plan._tiles is not None
    elif mask in (m_document, m_chunk_causal, m_sinks_window):  # (prefix-LM: every key is some row's)
        assert made[-1].kv_segments and plan.keys_read[0] < plan.keys_read[1]
    out = plan.run(q, (k_cache, v_cache)).double()
    ref = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, causal, params)
    assert torch.allclose(out, ref.double(), atol=2e-3), (out - ref.double()).abs().max()


@pytest.mark.parametrize("mask,segments", [(m_document, True), (m_chunk_causal, True), (m_prefix_lm, True),
                                           (m_sinks_window, False), (m_hole, False)],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_ragged_causal_forms_match_the_reference(cpu_fa2, mask, segments):
    """Called causally, documents and chunks run as segments (a ragged request each, kCausal, no mask), and so
    does a prefix-LM mask (causal leaves it plain causal); masks that are more than segments on the batch (sinks +
    a window, a hole) run in another form."""
    current, made = cpu_fa2
    gen = torch.Generator().manual_seed(5)
    v, qo_lens, kv_lens, params = _case(mask, gen)
    current[0] = v
    q, k, vv = _qkv(qo_lens, kv_lens, gen)
    plan = _ragged_plan(v, qo_lens, kv_lens, params, True)
    assert (plan.segments is not None) == segments
    if segments:  # the mask-free struct: FlashInfer's causal mode is the whole mask
        assert made[-1].kv_segments and made[-1].mask_free and not plan._wrapper.owns_mask
        assert plan._wrapper.p["causal"]
    ref, ref_lse = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, True, params,
                                     return_lse=True)
    out, lse = plan.run(q, k, vv, return_lse=True)
    assert torch.allclose(out.double(), ref.double(), atol=2e-3), (out.double() - ref.double()).abs().max()
    assert torch.allclose(lse.double(), ref_lse.double(), atol=1e-3)


@pytest.mark.parametrize("mask,segments", [(m_document, True), (m_chunk_causal, True), (m_sinks_window, False)],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_fa3_runs_documents_as_segments_on_the_logits_alone(cpu_fa3, mask, segments):
    """FA3, called causally: documents and chunks run as a ragged request per segment in causal mode on the logits'
    mask-free kernel (no key-segments table: a mask-only variant reads no position), the rest in the tile list."""
    current, made = cpu_fa3
    gen = torch.Generator().manual_seed(6)
    v, qo_lens, kv_lens, params = _case(mask, gen)
    current[0] = v
    q, k, vv = _qkv(qo_lens, kv_lens, gen)
    plan = _ragged_plan(v, qo_lens, kv_lens, params, True, "fa3")
    assert (plan.segments is not None) == segments
    if segments:
        key = made[-1]
        assert key.target == "fa3" and key.mask_free and not key.kv_segments and plan._wrapper.p["causal"]
        assert key.kernel_variant.mask is None and key.kernel_variant.name == tile_list.BITS_KERNEL
    else:
        assert made[-1].tile_list and plan._tile_list is not None
    ref = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, True, params)
    out = plan.run(q, k, vv)
    assert torch.allclose(out.double(), ref.double(), atol=2e-3), (out.double() - ref.double()).abs().max()


@pytest.mark.parametrize("mask", [m_prefix_lm, m_document, m_document_causal, m_sinks_window],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("seed", range(3))
def test_fa3_runs_a_non_causal_batch_of_a_mask_beyond_a_band_in_the_tile_list(cpu_fa3, mask, seed):
    """FA3, not causal: a mask beyond a band (a prefix-LM, documents seen both ways) runs in the tile list, whatever
    its row runs on the batch; one that implies causal (documents seen causally) as causal segments. Out and LSE
    equal the reference's, with every random draw."""
    current, made = cpu_fa3
    gen = torch.Generator().manual_seed(20 + seed)
    v, qo_lens, kv_lens, params = _case(mask, gen)
    params["prefix"] = torch.randint(2, 60, (3,), generator=gen).to(torch.int32)  # request 0 keeps a rectangle
    current[0] = v
    q, k, vv = _qkv(qo_lens, kv_lens, gen)
    plan = _ragged_plan(v, qo_lens, kv_lens, params, False, "fa3")
    if mask is m_document_causal:
        assert plan.segments and made[-1].mask_free and plan._wrapper.p["causal"]
    else:
        assert plan.segments is None and plan._tile_list is not None and made[-1].tile_list
    ref, ref_lse = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, False, params,
                                     return_lse=True)
    out, lse = plan.run(q, k, vv, return_lse=True)
    assert torch.allclose(out.double(), ref.double(), atol=2e-3), (out.double() - ref.double()).abs().max()
    assert torch.allclose(lse.double(), ref_lse.double(), atol=1e-3)
    assert torch.allclose(plan.run(q, k, vv).double(), out.double())


def _prefix_lm_with(**extra):
    from fivar import AttentionVariant, Tensor
    from test_sparsity import _params
    params = {**_params(), "sinks": Tensor("float32", ("qo_head",))} if "sink" in extra else _params()
    name = "prefix_lm_" + "_".join(sorted(extra))
    return AttentionVariant(name=name, mask=m_prefix_lm, params=params, **extra)


@pytest.mark.parametrize("extra", [dict(sink=lambda qo_head, params: params.sinks[qo_head]), dict(softmax=False)],
                         ids=["sink", "no softmax"])
def test_fa3_keeps_a_prefix_with_a_sink_or_no_softmax_in_the_tile_list(cpu_fa3, extra):
    """Not causal, a prefix-LM with a sink or without a softmax runs in the tile list too."""
    current, made = cpu_fa3
    v = _prefix_lm_with(**extra)
    current[0] = v
    gen = torch.Generator().manual_seed(7)
    _, qo_lens, kv_lens, params = _case(m_prefix_lm, gen)
    if "sink" in extra:
        params["sinks"] = torch.randn(4, generator=gen)
    plan = _ragged_plan(v, qo_lens, kv_lens, params, False, "fa3")
    assert plan.segments is None and plan._tile_list is not None


def _batch_scaled(score, b, h, kh, q, kv, p):
    return score * (1.0 + 0.5 * b)


@pytest.mark.parametrize("causal", [False, True])
def test_fa3_requests_per_head_run_through_the_plan(cpu_fa3, monkeypatch, causal):
    """A ragged FA3 batch of a mask reading the head, planned as a request per head (forced here): q gathered
    head-major, one KV head's pages through the view, logits reading the batch entry (the struct's batch index is the
    entry's, not the virtual one's), output and LSE scattered back, against the reference."""
    from fivar import AttentionVariant
    current, made = cpu_fa3
    chosen = []
    monkeypatch.setattr(fa3_tile_list, "head_requests_pay", lambda kinds: chosen.append(kinds.shape[1]) or True)
    gen = torch.Generator().manual_seed(7)
    base, qo_lens, kv_lens, params = _case(m_per_head_window, gen)
    v = AttentionVariant(name="head_window_scaled", mask=m_per_head_window, logits=_batch_scaled, params=base.params)
    current[0] = v
    q, k, vv = _qkv(qo_lens, kv_lens, gen)
    plan = _ragged_plan(v, qo_lens, kv_lens, params, causal, "fa3")
    assert chosen == [4] and plan._tile_list._heads is not None
    ref, ref_lse = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, causal, params,
                                     return_lse=True)
    out, lse = plan.run(q, k, vv, return_lse=True)
    assert torch.allclose(out.double(), ref.double(), atol=2e-3), (out.double() - ref.double()).abs().max()
    assert torch.allclose(lse.double(), ref_lse.double(), atol=1e-3)


def _brute_runs(v, params, qo_lens, kv_lens, heads):
    """The pre-pass's row runs from the mask evaluated on every (row, key, head): [batch, heads, max_qo_len, 4],
    [a0, a1, b0, b1) per row, a0 = -1 for rows keeping more than two runs."""
    from fivar.runtime.params import bind_params
    bound = bind_params(v, params, num_qo_heads=heads, num_kv_heads=heads, batch_size=len(qo_lens), device="cpu")
    runs = torch.zeros(len(qo_lens), heads, max(qo_lens), 4, dtype=torch.int32)
    for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens)):
        kept = _kept(v, bound, b, lq, lk, heads, causal=False)
        for h in range(heads):
            for r in range(lq):
                keys = torch.nonzero(kept[h, r]).flatten().tolist()
                spans = []
                for j in keys:
                    if spans and spans[-1][1] == j:
                        spans[-1][1] = j + 1
                    else:
                        spans.append([j, j + 1])
                spans = (spans + [[0, 0], [0, 0]])[:2] if len(spans) <= 2 else [[-1, -1], [0, 0]]
                runs[b, h, r] = torch.tensor(spans[0] + spans[1])
    return runs


def _kept(v, bound, b, lq, lk, heads, causal):
    """bool [heads, rows, keys]: what the mask (and causal) keeps for request b, evaluated by the reference's
    evaluator."""
    from fivar.codegen.torch_ref import TorchEvaluator
    head = torch.arange(heads).view(-1, 1, 1)
    q_idx = (torch.arange(lq) + lk - lq).view(1, -1, 1)
    kv_idx = torch.arange(lk).view(1, 1, -1)
    env = {"batch": torch.tensor(b), "qo_head": head, "kv_head": head, "q_idx": q_idx, "kv_idx": kv_idx,
           "sm_scale": 1.0}
    kept = TorchEvaluator(env, {**bound.scalars, **bound.tensors}).run(v.ir.mask).bool()
    kept = kept & torch.ones(heads, lq, lk, dtype=torch.bool)
    return kept & (kv_idx <= q_idx) if causal else kept


def m_strictly_before(b, h, kh, q, kv, p):
    return kv < q  # no row keeps its own key: causal leaves no segment


def m_chunks_per_head(b, h, kh, q, kv, p):
    return q // p.hw[h] == kv // p.hw[h]  # segments, but each head its own


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mask", [m_document, m_document_causal, m_chunk_causal, m_causal, m_sinks_window, m_hole,
                                  m_prefix_lm, m_per_head_window, m_causal_window, m_strictly_before,
                                  m_chunks_per_head], ids=lambda f: f.__name__)
def test_segments_attend_exactly_the_kept_keys(mask, seed):
    """segment_layout against the mask on every (row, key, head): when it gives segments, every row of the batch is
    in exactly one request, the struct maps that request's local keys to the very tokens the kernel reads, and
    causal over the mapped positions keeps exactly what the mask and causal keep; documents and chunks always
    give segments (a window, sinks, a prefix or a hole only where the batch happens to be plain causal)."""
    from fivar.runtime.segments import segment_layout
    from fivar.runtime.params import bind_params
    gen = torch.Generator().manual_seed(seed)
    v = _variant(mask)
    qo_lens = [int(x) for x in torch.randint(1, 60, (3,), generator=gen)]
    kv_lens = [lq + int(torch.randint(0, 40, (), generator=gen)) for lq in qo_lens]
    qo_lens[1] = 0 if seed % 2 else qo_lens[1]  # a request with no rows
    heads = 2
    draw = lambda lo, hi: int(torch.randint(lo, hi, (), generator=gen))  # noqa: E731
    params = {"w": draw(2, 20), "r": 3, "c": draw(3, 30), "n_sink": 3, "hole": 2,
              "doc": torch.randint(0, 5, (3, max(kv_lens)), generator=gen).sort(1).values.to(torch.int32),
              "prefix": torch.tensor([9, 5, 12], dtype=torch.int32),
              "hw": torch.randint(1, 20, (heads,), generator=gen).to(torch.int32)}
    qo = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32)
    kv = torch.tensor([0] + kv_lens).cumsum(0).to(torch.int32)
    layout = segment_layout(_brute_runs(v, params, qo_lens, kv_lens, heads), qo, kv)
    if mask in (m_document, m_document_causal, m_chunk_causal, m_causal):
        assert layout is not None
    bound = bind_params(v, params, num_qo_heads=heads, num_kv_heads=heads, batch_size=3, device="cpu")
    kept = [_kept(v, bound, b, lq, lk, heads, causal=True) for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens))]
    if layout is None:
        return
    seen = torch.zeros(int(qo[-1]), dtype=torch.int32)
    sq, skv, table = layout.qo_indptr.long(), layout.kv_indptr.long(), layout.segments.long()
    assert int(skv[0]) == int(kv[0]) and int(skv[-1]) == int(kv[-1]) and bool((skv.diff() >= 0).all())
    for s in range(table.shape[0]):
        rows, n_keys = int(sq[s + 1] - sq[s]), int(skv[s + 1] - skv[s])
        if table[s, 7] or not rows:
            continue
        b = int(table[s, 4])
        seen[sq[s]:sq[s + 1]] += 1
        local_kv = torch.arange(n_keys)
        kv_idx = torch.where(local_kv < table[s, 0], local_kv + table[s, 1], local_kv + table[s, 2])
        assert bool((skv[s] + local_kv == kv[b] + kv_idx).all())  # the struct's key is the token read
        q_idx = torch.arange(rows) + n_keys - rows + table[s, 3]
        first_row = int(sq[s] - qo[b])
        want = kept[b][:, first_row:first_row + rows]  # [heads, rows, keys of request b]
        got = torch.zeros_like(want)
        got[:, :, kv_idx] = (kv_idx.view(1, -1) <= q_idx.view(-1, 1)).expand(heads, -1, -1)
        assert torch.equal(got, want), (s, b)
    assert bool((seen == 1).all())


@pytest.mark.parametrize("kv_lens,page", [([48, 80, 160], 16), ([40, 88, 152], 8), ([38, 90, 150], 2)])
@pytest.mark.parametrize("mask", [m_document, m_chunk_causal], ids=lambda f: f.__name__)
def test_ragged_tile_list_reads_keys_as_the_largest_pages_that_align(cpu_fa2, mask, kv_lens, page):
    """Every request's first key on a multiple of 16 (8, 2): the ragged K/V are read in place as pages of that many
    keys in the tile-list form, and the result is the reference's (called non-causally: causally, these masks run
    as segments)."""
    current, made = cpu_fa2
    gen = torch.Generator().manual_seed(7)
    v, qo_lens, _, params = _case(mask, gen)
    current[0] = v
    q, k, vv = _qkv(qo_lens, kv_lens, gen)
    plan = _ragged_plan(v, qo_lens, kv_lens, params, False)
    assert plan._tile_list is not None and plan._tile_list.page == page and made[-1].tile_list
    ref = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, False, params).double()
    out = plan.run(q, k, vv).double()
    assert torch.allclose(out, ref, atol=2e-3), (out - ref).abs().max()


@pytest.mark.parametrize("cta_kv,page", [(16, 4), (64, 4), (16, 16), (128, 16), (16, 32)])
@pytest.mark.parametrize("mask", [m_document, m_sinks_window, m_chunk_causal], ids=lambda f: f.__name__)
def test_trimmed_decode_matches_the_reference(cpu_fa2, monkeypatch, mask, cta_kv, page):
    """Decode over the pages holding kept keys: one run of pages a request (a document, a chunk) in kCausal mode,
    the mask evaluated only on the tiles the struct's window and the last key name (under FlashInfer's tile rules
    for any KV tile); two runs (sinks and a window) in kCustom mode."""
    current, made = cpu_fa2
    monkeypatch.setitem(CTA_TILE_KV, "keys", cta_kv)
    gen = torch.Generator().manual_seed(6 + page)
    v, _, kv_lens, params = _case(mask, gen)
    current[0] = v
    _, k, vv = _qkv([1], kv_lens, gen)
    dq = torch.randn(3, 4, 16, generator=gen).half()
    (k_cache, v_cache), indptr, indices, last = _to_paged(k, vv, kv_lens, page)
    dplan = attention.PagedAttentionPlan(v, torch.arange(4, dtype=torch.int32), indptr, indices, last,
                                         num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=page,
                                         dtype=torch.float16, backend="fa2", device="cpu", params=params)
    assert dplan.pages_read is not None and dplan.pages_read[0] < dplan.pages_read[1]
    if page <= 16:  # (a partial first page of 32 keys may outgrow the kernel's first KV tile: kCustom then)
        assert (not dplan._wrapper.owns_mask) == (mask is not m_sinks_window)
    out = dplan.run(dq, (k_cache, v_cache)).double()
    ref = _ragged_reference(v, dq.float(), k.float(), vv.float(), [1, 1, 1], kv_lens, False, params).double()
    assert torch.allclose(out, ref, atol=2e-3), (out - ref).abs().max()



def m_global_window(b, h, kh, q, kv, p):
    return (p.doc[b, kv] == 3 or q - kv < p.w) and kv <= q  # a window and keys a tensor flags, anywhere before it


def m_dilated(b, h, kh, q, kv, p):
    return (q - kv) % p.c == 0 and q - kv < 8 * p.c  # every c-th key back over 8 of them


@pytest.mark.parametrize("page", [4, 16, 64])
@pytest.mark.parametrize("mask,spacing", [(m_global_window, "sparse"), (m_dilated, "sparse"), (m_mod_keys, "sparse"),
                                          (m_dilated, "dense"), (m_mod_keys, "dense")],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_decode_of_scattered_keys_reads_the_fewer_keys(cpu_fa2, mask, spacing, page):
    """A mask keeping more than two runs of pages a request (flagged global keys, a dilated window, periodic keys)
    would read the gaps of its pages' hull: decode runs the tile-list form where that reads fewer keys (kept keys
    four or more tiles apart), else the trimmed pages (kept keys under a tile apart: every tile holds one). Either
    way the result is the reference's (fresh draws: flags, lengths, window, stride)."""
    current, made = cpu_fa2
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    v = _variant(mask)
    current[0] = v
    draw = lambda lo, hi: int(torch.randint(lo, hi, (), generator=gen))  # noqa: E731
    unit = max(page, TILE_WIDTH)  # what either form reads around a kept key
    stride = draw(4 * unit, 6 * unit) if spacing == "sparse" else draw(unit // 2, unit)
    kv_lens = [draw(30 * unit, 40 * unit) for _ in range(3)]  # five runs of kept keys or more a request
    flags = torch.zeros(3, max(kv_lens), dtype=torch.int32)  # keys flagged global: doc == 3, `stride` or so apart
    for row in flags:
        at = torch.randint(0, 20, (1,), generator=gen) + (stride + torch.randint(0, 3, (20,), generator=gen)).cumsum(0)
        row[at[at < row.numel()]] = 3
    params = {"w": draw(8, 40), "c": stride, "r": 3, "n_sink": 5, "hole": 2, "doc": flags.to(torch.int32),
              "prefix": torch.tensor([5, 40, 17], dtype=torch.int32),
              "hw": torch.randint(0, 40, (4,), generator=gen).to(torch.int32)}
    _, k, vv = _qkv([1], kv_lens, gen)
    dq = torch.randn(3, 4, 16, generator=gen).half()
    (k_cache, v_cache), indptr, indices, last = _to_paged(k, vv, kv_lens, page)
    trimmed = forms._trimmed_decode_pages(v, bind_params(v, params, num_qo_heads=4, num_kv_heads=2, batch_size=3,
                                                         device="cpu"), indptr, indices, last, page, 4, 2)
    dplan = attention.PagedAttentionPlan(v, torch.arange(4, dtype=torch.int32), indptr, indices, last,
                                         num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=page,
                                         dtype=torch.float16, backend="fa2", device="cpu", params=params)
    sparse = spacing == "sparse"
    if sparse:
        assert trimmed.tile_list_reads_less(), (kv_lens, stride, trimmed.keys_read, trimmed.tile_keys)
        assert dplan._tiles is not None and made[-1].tile_list and dplan.pages_read is None
        assert dplan.keys_read[0] * HULL_SLACK < trimmed.keys_read, (kv_lens, stride, dplan.keys_read, trimmed)
    else:  # the trimmed pages (every page, where each holds a kept key)
        assert not trimmed.tile_list_reads_less(), (trimmed.keys_read, trimmed.tile_keys)
        assert dplan._tiles is None and made[-1].kv_segments and not made[-1].tile_list
        assert dplan.pages_read == (trimmed.keys_read // page, trimmed.pages_total)
    out = dplan.run(dq, (k_cache, v_cache)).double()
    ref = _ragged_reference(v, dq.float(), k.float(), vv.float(), [1, 1, 1], kv_lens, False, params).double()
    assert torch.allclose(out, ref, atol=2e-3), (out - ref).abs().max()

def m_left_pad(b, h, kh, q, kv, p):
    return kv >= p.prefix[b]  # left padding: a block's first rows keep no key, its hull starts after them


def _long_case(mask, gen, group):
    """Requests long enough for query blocks of a whole tile (128 packed rows), documents and chunks wider than a
    block, so the kCausal launch runs most blocks and the kCustom one those a boundary cuts."""
    v = _variant(mask)
    qo_lens, kv_lens = [300, 1, 170], [300, 90, 410]
    params = {"w": 40, "r": 3, "c": 96, "n_sink": 5, "hole": 2,
              "doc": torch.randint(0, 3, (3, 410), generator=gen).sort(1).values.to(torch.int32),
              "prefix": torch.tensor([70, 40, 17], dtype=torch.int32),
              "hw": torch.randint(0, 80, (2 * group,), generator=gen).to(torch.int32)}
    return v, qo_lens, kv_lens, params


@pytest.mark.parametrize("cta_kv,page", [(16, 4), (64, 4), (128, 4), (64, 16)])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("mask,runs", [(m_document, "both"), (m_chunk_causal, "causal+"), (m_prefix_lm, "causal"),
                                       (m_sinks_window, "both"), (m_hole, "both"), (m_per_head_window, None),
                                       (m_left_pad, "causal+")],
                         ids=lambda x: getattr(x, "__name__", x))
def test_causal_launch_matches_the_reference(cpu_fa2, monkeypatch, mask, runs, group, cta_kv, page):
    """A causal call of a mask beyond a band on FA2 in the block form (an FP8 cache's): the blocks whose keys the
    mask keeps whole (but for their first and last `rows` keys) run in kCausal mode, under FlashInfer's tile rules
    for any KV tile, the others in a second, kCustom launch into the same output and LSE; the whole batch is the
    reference's."""
    from fivar.codegen.torch_ref import reference_attention
    current, made = cpu_fa2
    monkeypatch.setattr(plans, "tile_list_form", lambda *a, **kw: False)
    monkeypatch.setitem(CTA_TILE_KV, "keys", cta_kv)
    gen = torch.Generator().manual_seed(11 + group)
    v, qo_lens, kv_lens, params = _long_case(mask, gen, group)
    current[0] = v
    hq, hkv = 2 * group, 2
    q = torch.randn(sum(qo_lens), hq, 16, generator=gen).half()
    k = torch.randn(sum(kv_lens), hkv, 16, generator=gen).half()
    vv = torch.randn(sum(kv_lens), hkv, 16, generator=gen).half()
    (k_cache, v_cache), indptr, indices, last = _to_paged(k, vv, kv_lens, page)
    qo_indptr = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32)
    plan = attention.PagedAttentionPlan(v, qo_indptr, indptr, indices, last, num_qo_heads=hq, num_kv_heads=hkv,
                                        head_dim=16, page_size=page, dtype=torch.float16, causal=True,
                                        backend="fa2", device="cpu", params=params)
    # (sinks + window, a hole: the blocks near a request's start keep all their keys, the others need kCustom;
    # chunks: a kCustom launch only where blocks of 128 / group rows straddle a chunk boundary)
    launches = (not plan._wrapper.owns_mask, plan._rest is not None)
    if runs == "causal+":
        assert launches[0]
    else:
        assert runs is None or launches == {"both": (True, True), "causal": (True, False)}[runs]
    out, lse = plan.run(q, (k_cache, v_cache), return_lse=True)
    refs, lses, qo, ko = [], [], 0, 0
    for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens)):
        o, l2 = reference_attention(v, q[qo:qo + lq].float(), k[ko:ko + lk].float(), vv[ko:ko + lk].float(),
                                    causal=True, params=params, batch_idx=b, batch_size=3, return_lse=True)
        refs.append(o), lses.append(l2)
        qo, ko = qo + lq, ko + lk
    ref, ref_lse = torch.cat(refs).double(), torch.cat(lses).double()
    assert torch.allclose(out.double(), ref, atol=2e-3), (out.double() - ref).abs().max()
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3), (lse.double() - ref_lse).abs().max()
