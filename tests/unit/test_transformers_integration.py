"""fivar as a transformers attention implementation: a tiny random-weight Gemma 2 (soft-capped logits, alternating
sliding-window layers) generates the same greedy tokens with close logits through fivar's Triton twin (interpreter,
float16 on the CPU) as through transformers' eager attention; gpt-oss-style sinks (the variant's own, or through the
LSE beside a soft-cap); padded batches."""
import math

import pytest
import torch

import fivar

transformers = pytest.importorskip("transformers")
import fivar.integrations.transformers as fivar_hf  # noqa: E402

DTYPE = torch.float16


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _gemma2(attn_implementation, seed=0):
    config = transformers.Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=5, attn_logit_softcapping=4.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=16, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(config).to(DTYPE).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def _generate(model, ids, mask=None, new=8):
    with torch.no_grad():
        r = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)
    return r.sequences, torch.stack(r.logits, 1).float()


def _same_greedy_run(ids, tokens, logits, want_tokens, want_logits):
    """fivar's generation follows eager's: each step's logits within tolerance of eager's, and the same token, until
    a step where eager's two best logits are within twice that tolerance (float16 rounding may pick either); the
    runs are compared no further than that step (their inputs differ after it)."""
    tol = 2e-2 * max(1.0, want_logits.abs().max().item())
    start = ids.shape[1]
    for step in range(want_logits.shape[1]):
        assert (logits[:, step] - want_logits[:, step]).abs().max() < tol, step
        if not torch.equal(tokens[:, start + step], want_tokens[:, start + step]):
            top2 = want_logits[:, step].topk(2, -1).values
            assert bool(((top2[:, 0] - top2[:, 1]) < 2 * tol).any()), f"step {step}: no near-tie, yet another token"
            return


def test_gemma2_generate_matches_eager(monkeypatch):
    from fivar.runtime import attention as triton_attention  # where the entry point calls it
    calls = []
    run = triton_attention.triton_batch_prefill_ragged
    monkeypatch.setattr(triton_attention, "triton_batch_prefill_ragged",
                        lambda variant, *a, **kw: calls.append(variant.name) or run(variant, *a, **kw))
    name = fivar_hf.register("fivar_triton", backend="triton")
    ids = torch.randint(1, 256, (1, 11))
    tokens, logits = _generate(_gemma2(name), ids)
    assert set(calls) == {"softcap", "softcap_sliding_window"} and len(calls) == 2 * 8  # 2 layers x 8 steps
    want_tokens, want_logits = _generate(_gemma2("eager"), ids)
    _same_greedy_run(ids, tokens, logits, want_tokens, want_logits)


def test_gemma2_left_padded_batch_matches_eager():
    name = fivar_hf.register("fivar_triton", backend="triton")
    ids = torch.randint(1, 256, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is 6 tokens, left padded
    ids[1, :3] = 0
    tokens, logits = _generate(_gemma2(name), ids, mask, new=5)
    want_tokens, want_logits = _generate(_gemma2("eager"), ids, mask, new=5)
    _same_greedy_run(ids, tokens, logits, want_tokens, want_logits)


def test_the_config_chooses_the_variant():
    def chosen(*args, **kw):  # by name: the integration keeps its first load, a registry reload makes new objects
        v, params = fivar_hf.variant_for(*args, **kw)
        return v.name, params
    assert chosen(50.0, 4096) == ("softcap_sliding_window", {"softcap": 50.0, "window": 4096})
    assert chosen(30.0, None) == ("softcap", {"softcap": 30.0})
    assert chosen(None, 128) == ("sliding_window", {"window": 128})
    assert fivar_hf.variant_for(None, None) == (fivar_hf.PLAIN, {})
    assert chosen(None, 128, sinks=True) == ("gpt_oss", {"window": 128})
    assert fivar_hf.variant_for(None, None, sinks=True) == (fivar_hf.SINK, {})
    assert chosen(30.0, None, sinks=True) == ("softcap", {"softcap": 30.0})
    for name in ("softcap_sliding_window", "softcap", "sliding_window", "gpt_oss"):
        assert fivar_hf._variant(name).ir == fivar.load(name).ir  # the same spec as a fresh load


class _Module(torch.nn.Module):
    is_causal = True


def _eager_with_sinks(q, k, v, sinks, scaling, window, softcap=None):
    """gpt-oss's eager attention: a per-head sink logit joins the softmax, then is dropped."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    w = q.float() @ k.transpose(2, 3) * scaling
    if softcap:
        w = softcap * torch.tanh(w / softcap)
    s, kv = q.shape[2], k.shape[2]
    qi = torch.arange(s)[:, None] + kv - s
    ki = torch.arange(kv)[None, :]
    keep = (ki <= qi) & ((qi - ki < window) if window else True)
    w = w.masked_fill(~keep, -math.inf)
    w = torch.cat([w, sinks.float().reshape(1, -1, 1, 1).expand(q.shape[0], -1, s, 1)], -1)
    p = torch.softmax(w, -1)[..., :-1]
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("window,softcap,variant", [(4, None, "gpt_oss"), (None, None, "attention_sink"),
                                                    (4, 3.0, "softcap_sliding_window")])
def test_sinks_match_eager_sinks(monkeypatch, window, softcap, variant):
    """In the kernel where a variant has a sink (gpt-oss's layers), through the LSE beside a soft-cap."""
    from fivar.runtime import attention as triton_attention  # where the entry point calls it
    calls = []
    run = triton_attention.triton_batch_prefill_ragged
    monkeypatch.setattr(triton_attention, "triton_batch_prefill_ragged",
                        lambda v, *a, **kw: calls.append((v.name, kw["return_lse"])) or run(v, *a, **kw))
    q = torch.randn(2, 4, 7, 16, dtype=DTYPE)
    k = torch.randn(2, 2, 12, 16, dtype=DTYPE)
    v = torch.randn(2, 2, 12, 16, dtype=DTYPE)
    sinks = (torch.randn(4) * 2).to(DTYPE)  # the model's dtype, as gpt-oss holds them
    out, _ = fivar_hf.fivar_attention(_Module(), q, k, v, None, scaling=0.3, sliding_window=window, softcap=softcap,
                                      s_aux=sinks, backend="triton")
    assert calls == [(variant, softcap is not None)]
    want = _eager_with_sinks(q, k, v, sinks, 0.3, window, softcap)
    assert out.shape == want.shape and out.dtype == DTYPE
    assert (out.float() - want).abs().max() < 3e-3


def test_refusals_are_named():
    q = torch.randn(1, 2, 3, 16, dtype=DTYPE)
    k = torch.randn(1, 2, 3, 16, dtype=DTYPE)
    holes = torch.tensor([[1, 0, 1]])
    with pytest.raises(fivar.FivarError, match="one run of positions"):
        fivar_hf.fivar_attention(_Module(), q, k, k, holes, backend="triton")
    with pytest.raises(fivar.FivarError, match="backend 'cuda' is not available"):
        fivar_hf.register("bad", backend="cuda")
