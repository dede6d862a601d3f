"""The FA2 plans' block form and decode page trimming, end to end on the CPU: PagedAttentionPlan /
RaggedAttentionPlan build their page lists and key-segments tables as on the GPU, and a stand-in for FlashInfer's
paged wrapper runs them with the kernel's semantics and the struct's (each request's rows and pages, the
key-segments mapping of positions and batch, the causal guard, the mask and logits evaluated by the torch
reference's evaluator). The result must be the reference's for the whole batch."""
import types

import pytest
import torch


from fivar.codegen import fa2
from fivar.codegen.cuda import additional_params
from fivar.runtime import attention
from fivar.testing import _ragged_reference, _to_paged

from kernel_standin import attend
from test_sparsity import _variant, m_chunk_causal, m_document, m_prefix_lm, m_sinks_window


class _FakePagedWrapper:
    """FlashInfer's FA2 paged prefill as fivar's struct sees it (kCustom, or kCausal's causal rule)."""

    def __init__(self, variant, fmod):
        self.variant, self.fmod = variant, fmod

    def plan(self, qo_indptr, kv_indptr, kv_indices, last, hq, hkv, d, page, causal=False, window_left=-1, **kw):
        assert window_left == -1 or not self.fmod.kv_segments
        self.p = dict(qo=qo_indptr.long().cpu(), kv=kv_indptr.long().cpu(), idx=kv_indices.long().cpu(),
                      last=last.long().cpu(), page=page, causal=causal)

    def run(self, q, cache, *args, return_lse=False):
        v, p = self.variant, self.p
        k_cache, v_cache = cache
        extra = [fa2.KV_SEGMENTS] if self.fmod.kv_segments else []
        t_names, _, s_names, _ = additional_params(v, with_causal_flag=True, extra_tensors=extra)
        named = dict(zip(t_names + s_names, args))
        hq, hkv = q.shape[1], k_cache.shape[2]
        out = torch.zeros(q.shape, dtype=torch.float64)
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
            if self.fmod.kv_segments:
                seg = named[fa2.KV_SEGMENTS][r].long()
                kv_idx = torch.where(local_kv < seg[0], local_kv + seg[1], local_kv + seg[2])
                q_idx, batch = local_q + seg[3], int(seg[4])
            seg_full = (seg[5], seg[6]) if self.fmod.kv_segments else None

            def keep(ev, env, local_q=local_q, local_kv=local_kv, full=seg_full):
                kept = ev.run(v.ir.mask).bool()
                if full is not None:  # the struct's full range: the mask is skipped there (kept)
                    kept = kept | ((local_kv >= full[0]) & (local_kv < full[1]))
                if named["fv_causal"]:  # the struct's guard: mapped positions in the key-segments form, local else
                    kept = kept & ((env["kv_idx"] <= env["q_idx"]) if full is not None else (local_kv <= local_q))
                if p["causal"]:
                    kept = kept & (local_kv <= local_q)
                return kept
            out[p["qo"][r]:p["qo"][r + 1]] = attend(v, named, rows, keys, vals, q_idx, kv_idx, batch, keep)[0]
        return out.to(q.dtype)


@pytest.fixture
def cpu_fa2(monkeypatch):
    """The plans on the CPU: no CUDA checks, fivar's module a stand-in, FlashInfer's wrapper the fake above."""
    current, made = [None], []

    def plan_setup(plan, variant, qo_indptr, kv_indptr, hq, hkv, d, dtype, backend, device):
        plan.variant, plan.device, plan.target, plan.batch = variant, torch.device("cpu"), "fa2", qo_indptr.numel() - 1
        return dtype, qo_indptr, kv_indptr

    def module(variant, op, target, dtype, head_dim, bound, sm_scale, row_runs=False, kv_segments=False,
               kv_dtype=None):
        return types.SimpleNamespace(kv_segments=kv_segments, uri=f"fake_{kv_segments}", target=target)

    def take(kind, fmod, device, owns_mask):
        assert kind == "paged" and owns_mask, "the block form and trimmed decode run in kCustom mode"
        made.append(fmod)
        return _FakePagedWrapper(current[0], fmod)

    monkeypatch.setattr(attention, "_plan_setup", plan_setup)
    monkeypatch.setattr(attention, "_module", module)
    monkeypatch.setattr(attention, "take_wrapper", take)
    monkeypatch.setattr(attention, "release_wrapper", lambda *a: None)
    monkeypatch.setattr(attention, "_check_qkv", lambda *a, **kw: None)
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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [m_document, m_chunk_causal, m_sinks_window, m_prefix_lm],
                         ids=lambda f: f.__name__)
def test_paged_block_form_matches_the_reference(cpu_fa2, mask, causal):
    current, made = cpu_fa2
    gen = torch.Generator().manual_seed(4)
    v, qo_lens, kv_lens, params = _case(mask, gen)
    current[0] = v
    q, k, vv = _qkv(qo_lens, kv_lens, gen)
    (k_cache, v_cache), indptr, indices, last = _to_paged(k, vv, kv_lens, 4)
    qo_indptr = torch.tensor([0, 37, 38, 108], dtype=torch.int32)
    plan = attention.PagedAttentionPlan(v, qo_indptr, indptr, indices, last, num_qo_heads=4, num_kv_heads=2,
                                        head_dim=16, page_size=4, dtype=torch.float16, causal=causal,
                                        backend="fa2", device="cpu", params=params)
    if mask in (m_document, m_chunk_causal, m_sinks_window):  # (prefix-LM: every key is some row's)
        assert made[-1].kv_segments and plan.keys_read[0] < plan.keys_read[1]
    out = plan.run(q, (k_cache, v_cache)).double()
    ref = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, causal, params)
    assert torch.allclose(out, ref.double(), atol=2e-3), (out - ref.double()).abs().max()


@pytest.mark.parametrize("mask", [m_document, m_chunk_causal], ids=lambda f: f.__name__)
def test_ragged_block_form_matches_the_reference(cpu_fa2, mask):
    current, made = cpu_fa2
    gen = torch.Generator().manual_seed(5)
    v, qo_lens, kv_lens, params = _case(mask, gen)
    current[0] = v
    q, k, vv = _qkv(qo_lens, kv_lens, gen)
    qo = torch.tensor([0, 37, 38, 108], dtype=torch.int32)
    kv = torch.tensor([0, 37, 127, 277], dtype=torch.int32)
    plan = attention.RaggedAttentionPlan(v, qo, kv, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                                         dtype=torch.float16, causal=True, backend="fa2", device="cpu",
                                         params=params)
    ref = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, True, params).double()
    out = plan.run(q, k, vv).double()
    assert plan._blocks is not None and torch.allclose(out, ref, atol=2e-3), (out - ref).abs().max()


@pytest.mark.parametrize("kv_lens,page", [([48, 80, 160], 16), ([40, 88, 152], 8), ([38, 90, 150], 2)])
@pytest.mark.parametrize("mask", [m_document, m_chunk_causal], ids=lambda f: f.__name__)
def test_ragged_block_form_reads_keys_as_the_largest_pages_that_align(cpu_fa2, mask, kv_lens, page):
    """Every request's first key on a multiple of 16 (8, 2): the ragged K/V are read in place as pages of that many
    keys, and the result is the reference's."""
    current, made = cpu_fa2
    gen = torch.Generator().manual_seed(7)
    v, qo_lens, _, params = _case(mask, gen)
    params["doc"] = torch.randint(0, 4, (3, max(kv_lens)), generator=gen).sort(1).values.to(torch.int32)
    current[0] = v
    q, k, vv = _qkv(qo_lens, kv_lens, gen)
    qo = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32)
    kv = torch.tensor([0] + kv_lens).cumsum(0).to(torch.int32)
    plan = attention.RaggedAttentionPlan(v, qo, kv, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                                         dtype=torch.float16, causal=True, backend="fa2", device="cpu",
                                         params=params)
    assert plan._blocks is not None and plan._page == page
    ref = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, True, params).double()
    out = plan.run(q, k, vv).double()
    assert torch.allclose(out, ref, atol=2e-3), (out - ref).abs().max()


@pytest.mark.parametrize("mask", [m_document, m_sinks_window, m_chunk_causal], ids=lambda f: f.__name__)
def test_trimmed_decode_matches_the_reference(cpu_fa2, mask):
    current, made = cpu_fa2
    gen = torch.Generator().manual_seed(6)
    v, _, kv_lens, params = _case(mask, gen)
    current[0] = v
    _, k, vv = _qkv([1], kv_lens, gen)
    dq = torch.randn(3, 4, 16, generator=gen).half()
    (k_cache, v_cache), indptr, indices, last = _to_paged(k, vv, kv_lens, 4)
    dplan = attention.PagedAttentionPlan(v, torch.arange(4, dtype=torch.int32), indptr, indices, last,
                                         num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                                         dtype=torch.float16, backend="fa2", device="cpu", params=params)
    assert dplan.pages_read is not None and dplan.pages_read[0] < dplan.pages_read[1]
    out = dplan.run(dq, (k_cache, v_cache)).double()
    ref = _ragged_reference(v, dq.float(), k.float(), vv.float(), [1, 1, 1], kv_lens, False, params).double()
    assert torch.allclose(out, ref, atol=2e-3), (out - ref).abs().max()
