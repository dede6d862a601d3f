"""Engine features on the GPU (marked `gpu`): return_lse on every entry point and backend against the reference's
LSE, chunks merged with fivar.merge_states against attention over all keys, custom ops under torch.compile,
CUDA-graph decode plans replayed with new lengths and page tables, and a transformers model through fivar."""
import math

import pytest
import torch

import fivar
from fivar.testing import _ragged_reference, _to_paged, compare, example_params

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16
#: log2 units. tanh.approx in the soft-caps (~5e-4 relative) moves a capped logit by up to ~0.02.
LSE_ATOL = 5e-2
LSE_VARIANTS = ["softcap", "alibi", "sliding_window", "document_mask", "relative_bias", "softcap_sliding_window"]


def _params(v, hq, hkv, batch, max_len):
    p = example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=batch, max_len=max_len, device="cuda")
    if "window" in v.params:
        p["window"] = max(2, max_len // 3)
    return p


def _qkv(lq, lk, hq, hkv, d=128):
    return (torch.randn(lq, hq, d, dtype=DTYPE, device="cuda"), torch.randn(lk, hkv, d, dtype=DTYPE, device="cuda"),
            torch.randn(lk, hkv, d, dtype=DTYPE, device="cuda"))


def _ref_lse(v, q, k, vv, qo_lens, kv_lens, causal, params):
    outs, lses, qo, ko = [], [], 0, 0
    for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens)):
        o, s = v.reference(q[qo:qo + lq], k[ko:ko + lk], vv[ko:ko + lk], causal=causal, batch_idx=b,
                           batch_size=len(qo_lens), return_lse=True, **params)
        outs.append(o)
        lses.append(s)
        qo, ko = qo + lq, ko + lk
    return torch.cat(outs), torch.cat(lses)


def _check_lse(name, got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape, (got.shape, want.shape)
    finite = torch.isfinite(want)
    assert bool((got[~finite] < -1e30).all()), f"{name}: rows with no kept key must have lse -inf"
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err < LSE_ATOL, f"{name}: lse off by {err}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["fa2", "fa3", "triton"])
@pytest.mark.parametrize("name", LSE_VARIANTS)
def test_single_prefill_lse(name, backend, causal):
    v = fivar.load(name)
    q, k, vv = _qkv(300, 700, 32, 8)
    params = _params(v, 32, 8, 1, 700)
    out, lse = v.prefill(q, k, vv, causal=causal, backend=backend, return_lse=True, **params)
    ref, ref_lse = v.reference(q, k, vv, causal=causal, return_lse=True, **params)
    assert compare(name, backend, out, ref, DTYPE).passed
    _check_lse(f"{name} {backend}", lse, ref_lse)


@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("name", LSE_VARIANTS)
def test_batch_prefill_lse(name, backend, paged):
    v = fivar.load(name)
    qo_lens, kv_lens = [17, 1, 300, 64], [17, 513, 300, 1000]
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), 32, 8)
    params = _params(v, 32, 8, 4, max(kv_lens))
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    if paged:
        cache, indptr, indices, last = _to_paged(k, vv, kv_lens, 16)
        out, lse = v.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, causal=True, backend=backend,
                                         return_lse=True, **params)
        plan = v.plan_paged(qo_indptr, indptr, indices, last, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                            page_size=16, dtype=DTYPE, causal=True, backend=backend, **params)
        p_out, p_lse = plan.run(q, cache, return_lse=True)
    else:
        kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        out, lse = v.batch_prefill_ragged(q, k, vv, qo_indptr, kv_indptr, causal=True, backend=backend,
                                          return_lse=True, **params)
        plan = v.plan_ragged(qo_indptr, kv_indptr, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=DTYPE,
                             causal=True, backend=backend, **params)
        p_out, p_lse = plan.run(q, k, vv, return_lse=True)
    ref, ref_lse = _ref_lse(v, q, k, vv, qo_lens, kv_lens, True, params)
    for o, s, how in ((out, lse, "one-shot"), (p_out, p_lse, "plan")):
        assert compare(name, f"{backend} {how}", o, ref, DTYPE).passed
        _check_lse(f"{name} {backend} {how}", s, ref_lse)


@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["tensor-core", "decode-kernel"])
@pytest.mark.parametrize("backend", ["fa2", "triton"])
@pytest.mark.parametrize("name", LSE_VARIANTS)
def test_decode_lse(name, backend, heads):
    v = fivar.load(name)
    hq, hkv = heads
    kv_lens = [1, 77, 1000, 4096]
    q = torch.randn(len(kv_lens), hq, 128, dtype=DTYPE, device="cuda")
    _, k, vv = _qkv(1, sum(kv_lens), hq, hkv)
    params = _params(v, hq, hkv, len(kv_lens), max(kv_lens))
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, 16)
    out, lse = v.decode(q, cache, indptr, indices, last, backend=backend, return_lse=True, **params)
    ref, ref_lse = _ref_lse(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params)
    assert compare(name, backend, out, ref, DTYPE).passed
    _check_lse(f"{name} {backend}", lse, ref_lse)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("name,window", [("sliding_window", -37), ("sliding_window", 37), ("document_mask", None)])
def test_paged_runs_write_every_output_row(name, window, backend, monkeypatch):
    """Paged runs leave their output unfilled (the kernels write every row: fivar.flashinfer_compat.wrappers.DirectPagedRun,
    and the tile-list form a mask beyond a band runs in). Here every floating-point torch.empty comes back full of NaN,
    so a row no kernel writes shows; rows that keep no key (a negative window), a document mask's tile list and its
    FA2 decode included."""
    v = fivar.load(name)
    qo_lens, kv_lens = [17, 1, 300, 64], [17, 513, 300, 1000]
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), 32, 8)
    params = _params(v, 32, 8, 4, max(kv_lens))
    if window is not None:
        params["window"] = window
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, 16)
    dq = torch.randn(len(kv_lens), 32, 128, dtype=DTYPE, device="cuda")
    shape = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=DTYPE)
    plan = v.plan_paged(qo_indptr, indptr, indices, last, causal=True, backend=backend, **shape, **params)
    assert (plan._tiles is not None) == v.scans_mask  # a mask beyond a band runs in the tile-list form
    if plan._tiles is None:  # a band: FlashInfer's paged kernels, launched without the wrapper's run
        assert plan._direct[0] is not None, "the planned paged run fell back to FlashInfer's wrapper.run"
    runs = [("prefill one-shot", q, lambda: v.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last,
                                                                  causal=True, backend=backend, **params)),
            ("prefill plan", q, lambda: plan.run(q, cache))]
    if backend == "fa2":  # decode runs FA2's kernels
        dplan = v.plan_decode(indptr, indices, last, **shape, **params)
        assert dplan._direct[0] is not None, "the planned decode fell back to FlashInfer's wrapper.run"
        runs += [("decode one-shot", dq, lambda: v.decode(dq, cache, indptr, indices, last, **params)),
                 ("decode plan", dq, lambda: dplan.run(dq, cache))]
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    for how, x, run in runs:
        causal = how.startswith("prefill")
        ref = _ref_lse(v, x, k, vv, qo_lens if causal else [1] * len(kv_lens), kv_lens, causal, params)[0]
        for _ in range(2):  # the second time through a kept plan
            with monkeypatch.context() as m:
                m.setattr(torch, "empty", poisoned)
                out = run()
            assert not bool(out.isnan().any()), f"{name} {backend} {how}: rows left unwritten"
            assert compare(name, f"{backend} {how}", out, ref, DTYPE).passed


@pytest.mark.parametrize("backend", ["fa2", "fa3", "triton"])
def test_chunks_merged_equal_whole_kv(backend):
    v = fivar.load("softcap")  # logits from the score only: a chunk of keys is attention over those keys
    q, k, vv = _qkv(512, 3000, 32, 8)
    cuts = [(0, 700), (700, 2048), (2048, 3000)]
    parts = [v.prefill(q, k[a:b], vv[a:b], backend=backend, return_lse=True) for a, b in cuts]
    out, lse = fivar.merge_states([o for o, _ in parts], [s for _, s in parts])
    ref, ref_lse = v.reference(q, k, vv, return_lse=True)
    assert compare("softcap", f"{backend} merged", out, ref, DTYPE).passed
    _check_lse(f"softcap {backend} merged", lse, ref_lse)


def test_no_softmax_refuses_lse_on_the_gpu():
    v = fivar.load("sigmoid")
    q, k, vv = _qkv(16, 16, 8, 8)
    params = _params(v, 8, 8, 1, 16)
    with pytest.raises(fivar.FivarError, match="variant 'sigmoid': return_lse=True needs a softmax variant"):
        v.prefill(q, k, vv, backend="fa2", return_lse=True, **params)


# --- CUDA-graph decode plans ---------------------------------------------------------------------------
def _page_table(kv_lens, page_size, pool):
    """Each request's pages drawn at random from a pool of `pool` pages: (indptr, indices, last_page_len)."""
    counts = [-(-n // page_size) for n in kv_lens]
    indices = torch.randperm(pool)[:sum(counts)].to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (c - 1) * page_size for n, c in zip(kv_lens, counts)], dtype=torch.int32)
    return indptr.cuda(), indices.cuda(), last.cuda()


def _gathered(cache, indptr, indices, kv_lens):
    """Contiguous K (or V) of every request, read back out of the pages."""
    parts = []
    for b, n in enumerate(kv_lens):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        parts.append(cache[pages].reshape(-1, *cache.shape[2:])[:n])
    return torch.cat(parts)


@pytest.mark.parametrize("name,heads", [("softcap", (32, 8)), ("softcap", (8, 8)), ("sliding_window", (32, 8)),
                                        ("alibi", (8, 8)), ("sigmoid", (32, 8)), ("softcap_sliding_window", (16, 4))])
def test_cuda_graph_decode_replays_new_lengths_and_pages(name, heads):
    v = fivar.load(name)
    hq, hkv = heads
    max_batch, page, pool, d = 8, 16, 1024, 128
    k_cache = torch.randn(pool, page, hkv, d, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(pool, page, hkv, d, dtype=DTYPE, device="cuda")
    params = _params(v, hq, hkv, max_batch, 3000)
    first = [100] * max_batch
    plan = v.plan_decode(*_page_table(first, page, pool), cuda_graph=True, max_batch=max_batch, max_pages=pool,
                         num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page, dtype=DTYPE, **params)
    q_static = torch.zeros(max_batch, hq, d, dtype=DTYPE, device="cuda")
    with_lse = v.softmax
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (module load, lazy allocations)
        plan.run(q_static, (k_cache, v_cache), return_lse=with_lse)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan.run(q_static, (k_cache, v_cache), return_lse=with_lse)
    for kv_lens in ([1, 17, 300, 2049, 5, 64, 1000, 16], [3000, 1, 77], [16] * max_batch):
        table = _page_table(kv_lens, page, pool)
        plan.plan(*table)
        q = torch.randn(len(kv_lens), hq, d, dtype=DTYPE, device="cuda")
        q_static.normal_()  # padding rows: anything
        q_static[:len(kv_lens)].copy_(q)
        graph.replay()
        torch.cuda.synchronize()
        out, lse = captured if with_lse else (captured, None)
        k = _gathered(k_cache, *table[:2], kv_lens)
        vv = _gathered(v_cache, *table[:2], kv_lens)
        if with_lse:
            ref, ref_lse = _ref_lse(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params)
            _check_lse(f"{name} graph {kv_lens}", lse[:len(kv_lens)], ref_lse)
        else:
            ref = _ragged_reference(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params)
        r = compare(name, f"graph replay {kv_lens}", out[:len(kv_lens)], ref, DTYPE)
        assert r.passed, r


def test_cuda_graph_plan_refuses_more_than_its_capacity():
    v = fivar.load("softcap")
    plan = v.plan_decode(*_page_table([40, 40], 16, 64), cuda_graph=True, max_batch=2, max_pages=8,
                         num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=DTYPE)
    with pytest.raises(fivar.FivarError, match="at most max_batch=2 and max_pages=8"):
        plan.plan(*_page_table([40, 40, 40], 16, 64))
    with pytest.raises(fivar.FivarError, match="at most max_batch=2 and max_pages=8"):
        plan.plan(*_page_table([100, 100], 16, 64))


# --- custom ops under torch.compile ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["fa2", "fa3", "triton"])
def test_compiled_entry_points_match_eager(backend):
    v = fivar.load("softcap")
    q, k, vv = _qkv(300, 700, 32, 8)
    qo_indptr = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    kv_indptr = torch.tensor([0, 200, 700], dtype=torch.int32, device="cuda")
    cache, indptr, indices, last = _to_paged(k, vv, [200, 500], 16)

    def step(q, k, vv, cache_k, cache_v):
        a, lse = v.prefill(q, k, vv, causal=True, backend=backend, return_lse=True, softcap=20.0)
        b = v.batch_prefill_ragged(q, k, vv, qo_indptr, kv_indptr, causal=True, backend=backend, softcap=20.0)
        c = v.decode(q[:2], (cache_k, cache_v), indptr, indices, last, backend="fa2" if backend == "fa3" else backend,
                     softcap=20.0)
        return a * 2, lse, b, c

    got = torch.compile(step, fullgraph=True)(q, k, vv, *cache)
    want = step(q, k, vv, *cache)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert (g.float() - w.float()).abs().max() < 1e-2


def test_compiled_plan_run():
    v = fivar.load("sliding_window")
    qo_lens, kv_lens = [64, 1], [64, 900]
    q, k, vv = _qkv(65, 964, 32, 8)
    qo_indptr = torch.tensor([0, 64, 65], dtype=torch.int32, device="cuda")
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, 16)
    plan = v.plan_paged(qo_indptr, indptr, indices, last, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                        page_size=16, dtype=DTYPE, causal=True, window=100)
    got = torch.compile(lambda q, c0, c1: plan.run(q, (c0, c1)) + 1, fullgraph=True)(q, *cache)
    ref = _ragged_reference(v, q, k, vv, qo_lens, kv_lens, True, {"window": 100}) + 1
    assert compare("sliding_window", "compiled plan", got, ref, DTYPE).passed


# --- transformers ---------------------------------------------------------------------------------------------
def _gemma2(attn_implementation, dtype):
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, sliding_window=16, attn_logit_softcapping=20.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=128, max_position_embeddings=512,
        initializer_range=0.1)  # spread-out logits: fewer near-ties for bf16 to flip
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).to(device="cuda", dtype=dtype).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def _generate(model, ids, mask=None):
    with torch.no_grad():
        r = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)
    return r.sequences, torch.stack(r.logits, 1).float()


@pytest.mark.parametrize("backend", ["fa2", "fa3", "triton"])
def test_transformers_gemma2_generate_matches_eager(backend):
    import fivar.integrations.transformers as fivar_hf
    name = fivar_hf.register(f"fivar_{backend}", backend=backend)
    ids = torch.randint(1, 1024, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    tokens, logits = _generate(_gemma2(name, DTYPE), ids, mask)
    want_tokens, want_logits = _generate(_gemma2("eager", DTYPE), ids, mask)
    # bf16 end to end: the first steps must agree exactly; a late near-tie may flip one token
    assert torch.equal(tokens[:, :48], want_tokens[:, :48])
    assert (logits[:, :8] - want_logits[:, :8]).abs().max() < 0.1 * max(1.0, want_logits.abs().max().item())


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_transformers_gemma2_generate_under_torch_compile(backend):
    """The model's forward compiled (inductor): fivar's attention runs as its custom op inside the graphs, and
    greedy generation matches eager attention's as in the eager test."""
    import fivar.integrations.transformers as fivar_hf
    name = fivar_hf.register(f"fivar_{backend}", backend=backend)
    ids = torch.randint(1, 1024, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    torch._dynamo.reset()
    model = _gemma2(name, DTYPE)
    model.forward = torch.compile(model.forward)
    tokens, logits = _generate(model, ids, mask)
    want_tokens, want_logits = _generate(_gemma2("eager", DTYPE), ids, mask)
    torch._dynamo.reset()
    assert torch.equal(tokens[:, :48], want_tokens[:, :48])
    assert (logits[:, :8] - want_logits[:, :8]).abs().max() < 0.1 * max(1.0, want_logits.abs().max().item())

