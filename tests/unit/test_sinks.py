"""Attention sinks: a logit per (request, query head) in the softmax denominator with no value row.

The torch reference against the formula written out in float64; the Triton twin (interpreter) against the reference
for prefill (causal or not, GQA, ragged batches) and split-KV decode, with ordinary sinks, a sink that takes nearly
all the weight and one too small to count; the LSE includes the sink; spec errors; the FA2/FA3 structs render (and
FA2's compiles, marked nvcc)."""
import math
import os
import shutil

import pytest
import torch

import fivar
from fivar import AttentionVariant, FivarError, FivarSpecError, Scalar, Tensor
from fivar.testing import _ragged_reference, _to_paged, compare, generation_mismatch

DTYPE = torch.float16  # the interpreter has no bfloat16 arithmetic
LN2 = math.log(2.0)


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _softcap(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return 20.0 * fivar.tanh(score / 20.0)


def _request_sink(batch, qo_head, params):
    return params.sinks[qo_head] + params.per_request[batch]


GPT_OSS = fivar.load("gpt_oss")
# the full signature (request and head) beside the head-only lambda of gpt_oss, with a logits transform too
PER_REQUEST = AttentionVariant(name="sink_per_request", logits=_softcap, sink=_request_sink,
                               params={"sinks": Tensor("float32", ("qo_head",)),
                                       "per_request": Tensor("float32", ("batch",))})
# a sink and nothing else: plain softmax attention with sinks
SINK_ONLY = AttentionVariant(name="sink_only", sink=lambda qo_head, params: params.sinks[qo_head],
                             params={"sinks": Tensor("float32", ("qo_head",))})
VARIANTS = [GPT_OSS, PER_REQUEST, SINK_ONLY]


def _params(v, hq, batch, kind="random", window=None):
    sinks = {"random": torch.randn(hq) * 2, "large": torch.full((hq,), 12.0) + torch.rand(hq),
             "tiny": torch.full((hq,), -1e30)}[kind]
    p = {"sinks": sinks}
    if "window" in v.params:
        p["window"] = window if window is not None else int(torch.randint(3, 12, (1,)))
    if "per_request" in v.params:
        p["per_request"] = torch.randn(batch)
    return p


def _qkv(lq, lk, hq, hkv, d, dtype=DTYPE):
    return (torch.randn(lq, hq, d, dtype=dtype), torch.randn(lk, hkv, d, dtype=dtype),
            torch.randn(lk, hkv, d, dtype=dtype))


def _formula(q, k, v, sinks, sm_scale, causal, window=None, softcap=None):
    """out_i = sum_j exp(l_ij - M) v_j / (exp(s - M) + sum_j exp(l_ij - M)), written out in float64 per row; lse
    in base 2 over the keys and the sink."""
    q, k, v = q.double(), k.double(), v.double()
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    out = torch.zeros(lq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.zeros(lq, hq, dtype=torch.float64)
    for h in range(hq):
        kh = h // (hq // hkv)
        for i in range(lq):
            qi = i + lk - lq
            logits, vals = [], []
            for j in range(lk):
                if (causal and j > qi) or (window is not None and qi - j >= window):
                    continue
                s = float(q[i, h] @ k[j, kh]) * sm_scale
                logits.append(softcap * math.tanh(s / softcap) if softcap else s)
                vals.append(v[j, kh])
            sink = float(sinks[h])
            top = max(logits + [sink])
            den = math.exp(sink - top) + sum(math.exp(x - top) for x in logits)
            for x, val in zip(logits, vals):
                out[i, h] += math.exp(x - top) / den * val
            lse[i, h] = (top + math.log(den)) / LN2
    return out, lse


def _ref64(v, q, k, vv, **kw):
    from fivar.codegen.torch_ref import reference_attention
    params = {n: kw.pop(n) for n in list(kw) if n in v.params}
    return reference_attention(v, q, k, vv, params=params, float_dtype=torch.float64, return_lse=True, **kw)


@pytest.mark.parametrize("kind", ["random", "large", "tiny"])
@pytest.mark.parametrize("lq,lk,hq,hkv,causal", [(5, 13, 4, 2, True), (7, 7, 2, 2, False), (9, 4, 4, 1, True)])
def test_reference_is_the_formula(kind, lq, lk, hq, hkv, causal):
    """Both the head-only lambda (with a window) and the full signature (with a logits transform); 9 rows over 4
    keys, causal: the first rows keep no key, so their output is zeros and their lse the sink's."""
    q, k, vv = _qkv(lq, lk, hq, hkv, 16, torch.float64)
    sm_scale = 0.3
    p = _params(GPT_OSS, hq, 1, kind, window=4)
    out, lse = _ref64(GPT_OSS, q, k, vv, causal=causal, sm_scale=sm_scale, **p)
    want, want_lse = _formula(q, k, vv, p["sinks"], sm_scale, causal, window=4)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-12)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-9, atol=1e-9)

    p = _params(PER_REQUEST, hq, 3, kind)
    out, lse = _ref64(PER_REQUEST, q, k, vv, causal=causal, sm_scale=sm_scale, batch_idx=2, batch_size=3, **p)
    sinks = p["sinks"].double() + p["per_request"][2].double()
    want, want_lse = _formula(q, k, vv, sinks, sm_scale, causal, softcap=20.0)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-9, atol=1e-9)


def test_reference_with_a_sink_is_the_plain_output_rescaled_by_its_lse():
    """The identity the sink rests on: softmax over [logits, s] is softmax over the logits times
    sigmoid(lse_e - s) (lse_e the keys' natural-log LSE), and its lse is log2(2^lse + e^s)."""
    q, k, vv = _qkv(11, 30, 4, 2, 16, torch.float64)
    p = _params(GPT_OSS, 4, 1, window=9)
    plain = fivar.load("sliding_window")
    out, lse = _ref64(plain, q, k, vv, causal=True, window=p["window"])
    got, got_lse = _ref64(GPT_OSS, q, k, vv, causal=True, **p)
    sink = p["sinks"].double()
    torch.testing.assert_close(got, out * torch.sigmoid(lse * LN2 - sink)[..., None])
    torch.testing.assert_close(got_lse, torch.logaddexp(lse * LN2, sink) / LN2)


def _check(name, case, out, ref):
    r = compare(name, case, out, ref, DTYPE)
    assert r.passed, r


def _check_lse(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.isfinite(got).all() and torch.isfinite(want).all()  # a sink is a term of every row's sum
    torch.testing.assert_close(got.double(), want.double(), atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("kind", ["random", "large"])
@pytest.mark.parametrize("lq,lk,hq,hkv,causal", [(5, 19, 4, 2, False), (5, 19, 4, 2, True), (37, 45, 4, 1, True),
                                                 (23, 7, 2, 1, True)])
@pytest.mark.parametrize("v", [GPT_OSS, SINK_ONLY], ids=lambda v: v.name)
def test_triton_single_prefill(v, lq, lk, hq, hkv, causal, kind):
    q, k, vv = _qkv(lq, lk, hq, hkv, 16)
    p = _params(v, hq, 1, kind)
    out, lse = v.prefill(q, k, vv, causal=causal, backend="triton", return_lse=True, **p)
    ref, ref_lse = v.reference(q, k, vv, causal=causal, return_lse=True, **p)
    if kind == "large":  # the sink takes nearly all the weight: outputs shrink by ~e^-12, errors with them
        assert float(ref.abs().max()) < 1e-2
        torch.testing.assert_close(out.double(), ref.double(), atol=1e-6, rtol=0)
    else:
        _check(v.name, f"qo{lq} kv{lk} {hq}/{hkv} causal={causal}", out, ref)
    _check_lse(lse, ref_lse)


@pytest.mark.parametrize("sink", [-1e30, -math.inf])
def test_triton_a_vanishing_sink_is_no_sink(sink):
    """A sink of -1e30 (or -inf) adds nothing to a row that keeps a key: output and lse are the plain variant's.
    Rows that keep none (0..15 of 23 over 7 keys, causal) are zeros with lse the sink's: -1e30 * log2(e), or -inf."""
    q, k, vv = _qkv(23, 7, 2, 1, 16)
    p = {"sinks": torch.full((2,), sink), "window": 5}
    out, lse = GPT_OSS.prefill(q, k, vv, causal=True, backend="triton", return_lse=True, **p)
    plain, plain_lse = fivar.load("sliding_window").prefill(q, k, vv, causal=True, backend="triton",
                                                            return_lse=True, window=5)
    torch.testing.assert_close(out, plain)
    assert not out[:16].any() and torch.isfinite(plain_lse[16:]).all()
    torch.testing.assert_close(lse[16:], plain_lse[16:])
    assert bool((lse[:16] == torch.tensor(sink / LN2, dtype=torch.float32)).all())
    assert torch.equal(lse[:16], GPT_OSS.reference(q, k, vv, causal=True, return_lse=True, **p)[1][:16])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_triton_ragged_batch(v, causal):
    qo_lens, kv_lens, hq, hkv = [5, 1, 17], [19, 7, 17], 4, 2
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), hq, hkv, 16)
    p = _params(v, hq, 3)
    qo_indptr = torch.tensor([0, 5, 6, 23], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 19, 26, 43], dtype=torch.int32)
    out, lse = v.batch_prefill_ragged(q, k, vv, qo_indptr, kv_indptr, causal=causal, backend="triton",
                                      return_lse=True, **p)
    _check(v.name, f"ragged causal={causal}", out, _ragged_reference(v, q, k, vv, qo_lens, kv_lens, causal, p))
    want = torch.cat([v.reference(q[a:b], k[c:e], vv[c:e], causal=causal, batch_idx=i, batch_size=3,
                                  return_lse=True, **p)[1]
                      for i, (a, b, c, e) in enumerate(zip([0, 5, 6], [5, 6, 23], [0, 19, 26], [19, 26, 43]))])
    _check_lse(lse, want)


@pytest.mark.parametrize("kind", ["random", "large", "tiny"])
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_triton_decode_adds_the_sink_once_over_its_splits(v, kind):
    """40 keys split three ways (the interpreter's 16-token splits): the merge adds the sink once."""
    kv_lens, hq, hkv = [1, 9, 40], 4, 2
    q = torch.randn(len(kv_lens), hq, 16, dtype=DTYPE)
    _, k, vv = _qkv(1, sum(kv_lens), hq, hkv, 16)
    p = _params(v, hq, len(kv_lens), kind, window=30)
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=4)
    out, lse = v.decode(q, cache, indptr, indices, last, backend="triton", return_lse=True, **p)
    ref = _ragged_reference(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, p)
    if kind == "large":  # the sink takes nearly all the weight: outputs near zero, within fp16's rounding of them
        torch.testing.assert_close(out.double(), ref.double(), atol=1e-6, rtol=2 ** -10)
    else:
        _check(v.name, f"decode {kind}", out, ref)
    want, off = [], 0
    for b, n in enumerate(kv_lens):
        want.append(v.reference(q[b:b + 1], k[off:off + n], vv[off:off + n], batch_idx=b, batch_size=3,
                                return_lse=True, **p)[1])
        off += n
    _check_lse(lse, torch.cat(want))


def test_gpt_oss_example_draws_realistic_sinks():
    p = GPT_OSS.example(num_qo_heads=64, num_kv_heads=8, batch_size=2, max_len=300, device="cpu")
    assert p["window"] == 128 and p["sinks"].dtype == torch.float32 and p["sinks"].shape == (64,)
    s = p["sinks"]
    assert -8 < float(s.min()) and float(s.max()) < 20  # a few units, as the logits
    assert float(s.topk(8).values.mean() - s.median()) > 3  # an eighth of the heads far above the rest
    other = GPT_OSS.example(num_qo_heads=64, num_kv_heads=8, batch_size=2, max_len=300, device="cpu")
    assert not torch.equal(other["sinks"], p["sinks"])  # fresh on every call


def test_triton_twin_shows_the_sink():
    from fivar.codegen.triton import render_attention
    src = render_attention(PER_REQUEST)
    assert "def variant_sink(batch, qo_head," in src and "#   sink:" in src
    assert src.count("variant_sink(batch, qo_head,") == 3  # defined, then called by prefill and the decode merge
    assert "variant_sink" not in render_attention(fivar.load("sliding_window"))


# --- spec errors ---------------------------------------------------------------------------------------------------

def _sigmoid_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return fivar.sigmoid(score)


def _sink_reads_a_position(qo_head, params):
    return params.sinks[q_idx]  # noqa: F821 # BAD


def _sink_is_a_condition(batch, qo_head, params):
    return qo_head > 2  # BAD


def _sink_with_three_heads(qo_head, kv_head, q_idx, params):  # BAD
    return 0.0


def test_a_sink_on_a_no_softmax_variant_is_refused_at_its_line():
    line = _sink_is_a_condition.__code__.co_firstlineno
    with pytest.raises(FivarSpecError) as info:
        AttentionVariant(name="sigmoid_sink", logits=_sigmoid_logits, softmax=False, sink=_sink_is_a_condition)
    err = info.value
    assert err.filename == __file__ and err.line == line
    assert "variant 'sigmoid_sink'" in str(err) and "softmax=False" in str(err) and f":{line}" in str(err)
    with pytest.raises(FivarSpecError, match="softmax=False"):  # a lambda points at its own line too
        AttentionVariant(name="sigmoid_sink", logits=_sigmoid_logits, softmax=False, sink=lambda h, p: 1.0)


def _bad_line(fn):
    import inspect
    lines, start = inspect.getsourcelines(fn)
    return next(start + i for i, text in enumerate(lines) if "# BAD" in text)


@pytest.mark.parametrize("fn,match", [
    (_sink_reads_a_position, "name `q_idx` is not defined"),
    (_sink_is_a_condition, "`sink` must return a number"),
    (_sink_with_three_heads, r"exactly 3 positional arguments \(batch, qo_head, params\) or \(qo_head, params\)"),
])
def test_sink_spec_errors_name_file_and_line(fn, match):
    with pytest.raises(FivarSpecError, match=match) as info:
        AttentionVariant(name="badsink", sink=fn, params={"sinks": Tensor("float32", ("qo_head",))}).ir
    assert info.value.filename == __file__ and info.value.line == _bad_line(fn)
    assert "variant 'badsink'" in str(info.value) and "`sink`" in str(info.value)


def test_a_lambda_sink_is_read_from_its_file():
    bad = AttentionVariant(name="lambda_sink", params={"w": Scalar(float, default=1.0)},
                           sink=lambda qo_head, params: params.nope)  # BAD
    with pytest.raises(FivarSpecError, match="unknown parameter `nope`") as info:
        bad.ir
    line = test_a_lambda_sink_is_read_from_its_file.__code__.co_firstlineno + 2
    assert info.value.filename == __file__ and info.value.line == line
    two = [lambda qo_head, params: 1.0, lambda qo_head, params: 2.0]  # same line, same arguments: ambiguous
    with pytest.raises(FivarSpecError, match="cannot tell which lambda"):
        AttentionVariant(name="ambiguous", sink=two[0]).ir


# --- FA2 / FA3 structs ---------------------------------------------------------------------------------------------

def test_fa2_struct_adds_the_sink_once_per_row_in_the_first_kv_chunk():
    from fivar.codegen import fa2
    src = fa2.variant_decl(PER_REQUEST).source
    assert "REGISTER_M_D_UPDATE(params, kv_tile_idx, qo_head_idx, m, d, scale" in src
    assert "if (kv_tile_idx == 0)" in src and "fv_sink_batch = int32_t(batch_idx);" in src
    assert "params.fvp_per_request[fivar::clamp_index(fv_batch, params.fvsize0_per_request)]" in src
    assert "return output * scale * d_rcp * get_v_scale(params);" in src
    assert "M_D_UPDATE" not in fa2.variant_decl(fivar.load("softcap")).source


def test_fa3_struct_wraps_every_updater_with_the_sink():
    from fivar.codegen import fa3
    plain = fa3.variant_decl(GPT_OSS).source
    assert '#include "fivar_sink.cuh"' in plain and "fv_log2_sink = float(" in plain
    assert "return fivar::WithSink(flashinfer::OnlineSoftmax<" in plain
    # the soft-capped transform takes fivar's own updaters (emulated exp2, bounded max): wrapped as well
    emulated = fa3.variant_decl(PER_REQUEST, exp2_emulated_of_8=2).source
    assert "return fivar::WithSink(fivar::Fa3OnlineSoftmax<NUM_ROWS_PER_THREAD, 2>(sm_scale_log2), fv_log2_sink)" \
        in emulated and "fv_batch_idx = int32_t(batch_idx);" in emulated
    bounded = fa3.variant_decl(PER_REQUEST, logits_range=(-20.0, 20.0)).source
    assert "fivar::WithSink(fivar::Fa3OnlineSoftmax<" in bounded and "/*BOUNDED=*/true>" in bounded


def test_fa3_module_carries_the_sink_header():
    from fivar.jit.build import gen_module
    m = gen_module(GPT_OSS, op="single_prefill", target="fa3")
    assert any(name.endswith("fivar_sink.cuh") for name in m.sources)


def test_decode_never_builds_the_kernel_without_a_row_hook():
    """FlashInfer's CUDA-core decode kernel calls no per-row hook that knows its KV chunk: a sink variant's decode
    runs on FA2 batch prefill (as without softmax), and no batch_decode module is built for it."""
    from fivar.jit.build import gen_module, serving_modules
    assert [m.op for m in serving_modules(GPT_OSS, "batch_decode", "fa2")] == ["batch_prefill"]
    with pytest.raises(FivarError, match="no batch_decode module"):
        gen_module(GPT_OSS, op="batch_decode")


def test_wave_split_and_flex_leave_sinks_alone():
    from fivar.runtime import wave_split
    assert not wave_split.applies(SINK_ONLY, causal=False, window_left=-1)
    from fivar.flex import flex_mods
    with pytest.raises(FivarError, match="no Flex equivalent"):
        flex_mods(SINK_ONLY, {"sinks": torch.zeros(2)}, qo_len=4, kv_len=4, num_qo_heads=2, num_kv_heads=2,
                  sm_scale=1.0, causal=False, device="cpu")


NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")


@pytest.mark.nvcc
@pytest.mark.skipif(not (os.path.exists(NVCC) or shutil.which("nvcc")), reason="nvcc not installed")
def test_fa2_sink_module_compiles():
    """The smallest FA2 module (single prefill of a masked variant: one mask mode) with a per-request sink."""
    from fivar.jit.build import build_many, gen_module
    v = AttentionVariant(name="sink_compiled", mask=_window, sink=_request_sink,
                         params={"sinks": Tensor("float32", ("qo_head",)), "per_request": Tensor("float32", ("batch",)),
                                 "window": Scalar(int, default=64)})
    m = gen_module(v, op="single_prefill", dtype="fp16", head_dim=64)
    build_many([m])
    assert m.library_path.exists()


def _window(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window


# --- a gpt-oss model through transformers -------------------------------------------------------------------------

def _gpt_oss_model(attn_implementation, zero_sinks=False):
    """Every token goes to every expert: a top-k router turns an attention rounding into a jump in the logits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, num_local_experts=4, num_experts_per_tok=4,
        max_position_embeddings=131072, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(DTYPE).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # sinks of the size trained ones have, or none
            layer.self_attn.sinks.copy_(torch.zeros(4) if zero_sinks else torch.tensor([4.0, 0.4, 1.1, -0.6]))
    model.set_attn_implementation(attn_implementation)
    return model


def test_generation_mismatch_allows_only_near_ties_and_rounding():
    """Random generations: equal ones pass, a logit moved past the tolerance fails, a token changed at a near tie
    passes (later steps then unchecked) and one changed elsewhere fails."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    steps, vocab, tol = 6, 50, 1e-2
    want = torch.randn(2, steps, vocab, generator=g)
    want_tokens = torch.cat([torch.randint(0, vocab, (2, 3), generator=g), want.argmax(-1)], 1)
    assert generation_mismatch(want_tokens, want + tol / 4, want_tokens, want, tol) is None
    moved = want.clone()
    moved[1, int(torch.randint(0, steps, (1,), generator=g)), 7] += 2 * tol
    assert "logits differ" in generation_mismatch(want_tokens, moved, want_tokens, want, tol)
    step = int(torch.randint(0, steps - 1, (1,), generator=g))
    tied, tokens = want.clone(), want_tokens.clone()
    other = int(want[0, step].argsort()[-2])
    tied[0, step, other] = want[0, step].max() - tol / 2  # the reference's runner-up within tol of its choice
    tokens[0, 3 + step] = other
    later = tokens.clone()
    later[0, 3 + step + 1:] = (later[0, 3 + step + 1:] + 1) % vocab  # a different continuation after the split
    assert generation_mismatch(later, tied, want_tokens, tied, tol) is None
    # unless the draw itself put the runner-up within tol (then a near tie, which passes)
    near = float(want[0, step].max() - want[0, step, other]) < tol
    assert near or "below the reference's choice" in generation_mismatch(tokens, want, want_tokens, want, tol)


def _generate(model, ids):
    with torch.no_grad():
        r = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
                           pad_token_id=0)
    return r.sequences, torch.stack(r.logits, 1).float()


def test_gpt_oss_generate_matches_eager_with_the_sinks_in_the_kernel():
    """A tiny random gpt-oss (a sliding-window layer, a full one, both with sinks) generates eager attention's greedy
    tokens with close logits through the Triton twin; its sinks are the variants' own (gpt_oss, attention_sink).
    In a process of its own: transformers' attention registry and generation state are process-wide, and other test
    files in the same worker register and compile through them."""
    import subprocess
    import sys
    from pathlib import Path
    here = Path(__file__).parent
    code = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent.parent)!r}]; "
            f"import {Path(__file__).stem} as t; t._generate_matches_eager()")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def _generate_matches_eager():
    import fivar.integrations.transformers as fivar_hf
    from fivar.runtime import attention as triton_attention  # where the entry point calls it
    calls = []
    run = triton_attention.triton_batch_prefill_ragged
    triton_attention.triton_batch_prefill_ragged = \
        lambda v, *a, **kw: calls.append((v.name, kw["return_lse"])) or run(v, *a, **kw)
    name = fivar_hf.register("fivar_triton", backend="triton")
    ids = torch.randint(1, 256, (1, 9))
    tokens, logits = _generate(_gpt_oss_model(name), ids)
    assert set(calls) == {("gpt_oss", False), ("attention_sink", False)} and len(calls) == 2 * 6
    want_tokens, want_logits = _generate(_gpt_oss_model("eager"), ids)
    tol = 2e-2 * max(1.0, want_logits.abs().max().item())
    assert (why := generation_mismatch(tokens, logits, want_tokens, want_logits, tol)) is None, why
    # the sinks matter at this tolerance: without them the logits move well beyond it
    _, unsunk = _generate(_gpt_oss_model("eager", zero_sinks=True), ids)
    assert (unsunk[:, 0] - want_logits[:, 0]).abs().max() > 5 * (logits - want_logits).abs().max()
