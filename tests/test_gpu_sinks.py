"""Attention sinks on the FlashInfer kernels (marked `gpu`): FA2 and FA3 prefill and FA2 decode against the torch
reference, output and log-sum-exp, bf16 hd128 GQA 32/8 at awkward lengths. Few cases: every FA3 module is a long
build. Modules: gpt_oss (window + per-head sink) FA2/FA3 single prefill and FA2 batch prefill; a soft-capped variant
with a per-request sink (on FA3 the bounded, emulated-exp2 updater, wrapped) FA2/FA3 batch prefill; a tiny gpt-oss
model through transformers on FA2."""
import pytest
import torch

import fivar
from fivar import AttentionVariant, Tensor
from fivar.testing import _ragged_reference, _to_paged, compare, example_params, generation_mismatch

pytestmark = pytest.mark.gpu
DTYPE, HQ, HKV, D = torch.bfloat16, 32, 8, 128


def _softcap(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return 5.0 * fivar.tanh(score / 5.0)  # narrow enough for FA3's bounded softmax (fa3.bounded_softmax_applies)


def _request_sink(batch, qo_head, params):
    return params.sinks[qo_head] + params.per_request[batch]


GPT_OSS = fivar.load("gpt_oss")
PER_REQUEST = AttentionVariant(name="gpu_sink_per_request", logits=_softcap, sink=_request_sink,
                               params={"sinks": Tensor("float32", ("qo_head",)),
                                       "per_request": Tensor("float32", ("batch",))})


def _params(v, batch, max_len, large=False):
    p = example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=batch, max_len=max_len, device="cuda")
    if large:
        _large_sinks(p)
    return p


def _large_sinks(p):
    """A sink far above every logit (soft-capped at 5, or random scores): outputs shrink by ~e^-5 or more. The
    per-request part, if any, is zeroed: a random one could pull the sink back down."""
    p["sinks"] = torch.full((HQ,), 10.0, device="cuda") + torch.rand(HQ, device="cuda")
    if "per_request" in p:
        p["per_request"] = torch.zeros_like(p["per_request"])


def _assert_out(v, case, out, ref, large):
    if large:
        assert float(ref.abs().max()) < 0.1, case  # the sink dominates (outputs are O(1) without it)
        # one bf16 ulp of the largest output: the output's own rounding is half an ulp of each element
        torch.testing.assert_close(out.float(), ref.float(), atol=2 ** -7 * float(ref.abs().max()) + 1e-6, rtol=0)
    else:
        r = compare(v.name, case, out, ref, DTYPE)
        assert r.passed, r


def _assert_lse(lse, want, case):
    assert lse.dtype == torch.float32 and lse.shape == want.shape, case
    assert torch.isfinite(lse).all(), case  # every row keeps a key in these cases, and has the sink
    torch.testing.assert_close(lse, want.to(lse.device), atol=2e-2, rtol=1e-3, msg=case)


@pytest.mark.parametrize("large", [False, True], ids=["sinks", "large_sinks"])
@pytest.mark.parametrize("qo_len,kv_len,causal", [(37, 129, True), (257, 1000, False), (300, 300, True),
                                                  (1, 4099, False)])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_single_prefill(backend, qo_len, kv_len, causal, large):
    q = torch.randn(qo_len, HQ, D, dtype=DTYPE, device="cuda")
    k, v = (torch.randn(kv_len, HKV, D, dtype=DTYPE, device="cuda") for _ in range(2))
    p = _params(GPT_OSS, 1, kv_len, large)
    out, lse = GPT_OSS.prefill(q, k, v, causal=causal, backend=backend, return_lse=True, **p)
    ref, ref_lse = GPT_OSS.reference(q, k, v, causal=causal, return_lse=True, **p)
    case = f"{backend} qo{qo_len} kv{kv_len} causal={causal} large={large}"
    _assert_out(GPT_OSS, case, out, ref, large)
    _assert_lse(lse, ref_lse, case)


def _lse_reference(v, q, k, vv, qo_lens, kv_lens, causal, params):
    outs, qo, ko = [], 0, 0
    for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens)):
        outs.append(v.reference(q[qo:qo + lq], k[ko:ko + lk], vv[ko:ko + lk], causal=causal, batch_idx=b,
                                batch_size=len(qo_lens), return_lse=True, **params)[1])
        qo, ko = qo + lq, ko + lk
    return torch.cat(outs)


@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("v", [GPT_OSS, PER_REQUEST], ids=lambda v: v.name)
def test_batch_prefill(v, backend, causal, paged):
    if v is GPT_OSS and backend == "fa3":
        pytest.skip("one FA3 batch module is enough: the per-request sink's")
    qo_lens, kv_lens = [17, 1, 40, 130], [17, 70, 300, 2000]
    q = torch.randn(sum(qo_lens), HQ, D, dtype=DTYPE, device="cuda")
    k, vv = (torch.randn(sum(kv_lens), HKV, D, dtype=DTYPE, device="cuda") for _ in range(2))
    p = _params(v, len(qo_lens), max(kv_lens))
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    if paged:
        cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=16)
        out, lse = v.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, causal=causal, backend=backend,
                                         return_lse=True, **p)
    else:
        kv_indptr = torch.tensor([0] + list(torch.tensor(kv_lens).cumsum(0)), dtype=torch.int32, device="cuda")
        out, lse = v.batch_prefill_ragged(q, k, vv, qo_indptr, kv_indptr, causal=causal, backend=backend,
                                          return_lse=True, **p)
    case = f"{backend} {'paged' if paged else 'ragged'} causal={causal}"
    _assert_out(v, case, out, _ragged_reference(v, q, k, vv, qo_lens, kv_lens, causal, p), False)
    _assert_lse(lse, _lse_reference(v, q, k, vv, qo_lens, kv_lens, causal, p), case)


@pytest.mark.parametrize("large", [False, True], ids=["sinks", "large_sinks"])
@pytest.mark.parametrize("hkv", [8, 32], ids=["gqa32/8", "mha32"])
@pytest.mark.parametrize("v", [GPT_OSS, PER_REQUEST], ids=lambda v: v.name)
def test_decode(v, hkv, large):
    """Few requests over long KV: FlashInfer splits the KV and merges the chunks, and only the first chunk adds the
    sink. 32/32 heads would take the CUDA-core decode kernel without a sink; with one it runs on batch prefill."""
    kv_lens = [1, 33, 517, 6001]
    q = torch.randn(len(kv_lens), HQ, D, dtype=DTYPE, device="cuda")
    k, vv = (torch.randn(sum(kv_lens), hkv, D, dtype=DTYPE, device="cuda") for _ in range(2))
    p = example_params(v, num_qo_heads=HQ, num_kv_heads=hkv, batch_size=len(kv_lens), max_len=max(kv_lens),
                       device="cuda")
    if large:
        _large_sinks(p)
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=16)
    out, lse = v.decode(q, cache, indptr, indices, last, backend="fa2", return_lse=True, **p)
    ones = [1] * len(kv_lens)
    case = f"decode 32/{hkv} large={large}"
    _assert_out(v, case, out, _ragged_reference(v, q, k, vv, ones, kv_lens, False, p), large)
    _assert_lse(lse, _lse_reference(v, q, k, vv, ones, kv_lens, False, p), case)


def test_gpt_oss_generate_matches_eager():
    """A tiny random gpt-oss (a sliding-window layer and a full one, both with sinks) through fivar's transformers
    attention on FA2 (prefill and decode steps as ragged batches): eager attention's greedy tokens, close logits.
    Every token goes to every expert: a top-k router turns an attention rounding into a jump in the logits."""
    transformers = pytest.importorskip("transformers")
    import fivar.integrations.transformers as fivar_hf

    def model(attn_implementation):
        config = transformers.GptOssConfig(
            vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=HQ,
            num_key_value_heads=HKV, head_dim=64, sliding_window=16, num_local_experts=4, num_experts_per_tok=4,
            max_position_embeddings=131072, layer_types=["sliding_attention", "full_attention"])
        torch.manual_seed(0)
        m = transformers.GptOssForCausalLM(config).to(DTYPE).cuda().eval()
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.sinks.normal_(1.0, 2.0)
        m.set_attn_implementation(attn_implementation)
        return m

    def generate(m, ids):
        with torch.no_grad():
            r = m.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True,
                           pad_token_id=0)
        return r.sequences, torch.stack(r.logits, 1).float()

    ids = torch.randint(1, 512, (1, 37), device="cuda")
    tokens, logits = generate(model(fivar_hf.register("fivar_fa2", backend="fa2")), ids)
    want_tokens, want_logits = generate(model("eager"), ids)
    tol = 3e-2 * max(1.0, want_logits.abs().max().item())
    assert (why := generation_mismatch(tokens, logits, want_tokens, want_logits, tol)) is None, why
