"""FA3's softmax with part of its exp2s on the FMA pipe (csrc/fivar_fa3_softmax.cuh, fivar.codegen.fa3):
fivar::exp2_fma against float64 exp2 (compiled for the host with g++), and which variants get it."""
import math
import random
import re
import shutil
import struct
import subprocess

import pytest

import fivar
from fivar import AttentionVariant, Scalar, tanh
from fivar.codegen import fa3
from fivar.paths import csrc_dir

HARNESS = r"""
#include <cstdio>
#include "fivar_ops.cuh"
int main() {
  float x;
  while (std::scanf("%f", &x) == 1) std::printf("%.9g\n", fivar::exp2_fma(x));
}
"""


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.fixture(scope="module")
def exp2_fma(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    d = tmp_path_factory.mktemp("exp2")
    (d / "h.cpp").write_text(HARNESS)
    subprocess.run(["g++", "-std=c++17", "-O2", "-I", str(csrc_dir()), "-o", str(d / "h"), str(d / "h.cpp")],
                   check=True, capture_output=True, text=True)

    def run(xs):
        out = subprocess.run([str(d / "h")], input="\n".join(repr(float(x)) for x in xs), check=True,
                             capture_output=True, text=True).stdout
        return [float(v) for v in out.split()]
    return run


def test_exp2_fma_relative_error_over_the_softmax_range(exp2_fma):
    r = random.Random()
    xs = [-r.uniform(0, 126) for _ in range(20000)]
    xs += [-r.uniform(0, 1e-3) for _ in range(200)]                       # next to the row max
    xs += [h - 0.5 + d for h in range(-125, 1) for d in (-1e-5, 0.0, 1e-5)]  # where round(x) steps
    xs += [0.0, -0.0]
    for x, y in zip(xs, exp2_fma(xs)):
        want = 2.0 ** _f32(x)  # the harness reads x as a float
        assert abs(y - want) <= 1.05e-4 * want, (x, y, want)


def test_exp2_fma_underflows_to_exactly_zero(exp2_fma):
    """x <= -127 (a masked score: -inf minus the row max) and NaN give 0, so a fully masked row sums to 0;
    between -127 and -126 the result is below the smallest normal float (flushed to zero by the kernel's fast
    math)."""
    xs = [-math.inf, -1e30, -1000.0, -127.0, -127.0 - 1e-4, math.nan] + [-r for r in (126.01, 126.5, 126.99)]
    ys = exp2_fma(xs)
    assert ys[:6] == [0.0] * 6, ys
    assert all(0.0 <= y < 2.0 ** -126 for y in ys[5:]), ys


def _struct(v):
    return fa3.variant_decl(v).source


def test_softmax_variants_with_mufu_in_their_transform_split_the_exp2(monkeypatch):
    monkeypatch.delenv(fa3.EXP2_EMULATION_ENV, raising=False)
    softcap = fivar.load("softcap")
    assert fa3.mufu_ops_per_score(softcap) == 1
    k = fa3.EXP2_EMULATED_OF_8
    assert 0 < k <= 8
    src = _struct(softcap)
    assert f"fivar::Fa3OnlineSoftmax<NUM_ROWS_PER_THREAD, {k}>(sm_scale_log2)" in src
    assert '#include "fivar_fa3_softmax.cuh"' in src
    for name in ("alibi", "relative_bias", "sliding_window"):  # no MUFU op per score: FlashInfer's own softmax
        v = fivar.load(name)
        assert fa3.mufu_ops_per_score(v) == 0, name
        src = _struct(v)
        assert "flashinfer::OnlineSoftmax<NUM_ROWS_PER_THREAD, /*WITH_SCALE=*/true>" in src, name
        assert "fivar_fa3_softmax.cuh" not in src, name
    sigmoid = fivar.load("sigmoid")  # no softmax at all
    assert fa3.exp2_emulated_of_8(sigmoid) == 0 and "DefaultUpdater" in _struct(sigmoid)


def test_mufu_count_sees_divisions_and_transcendentals_per_score_only(monkeypatch):
    monkeypatch.delenv(fa3.EXP2_EMULATION_ENV, raising=False)
    def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
        # a division by the per-score value costs a reciprocal; the per-block tanh(params.a) is hoisted
        return tanh(params.a) * score / (1.0 + kv_idx * params.a)
    v = AttentionVariant(name="div_by_key", logits=logits, params={"a": Scalar(float, default=0.5)})
    assert fa3.mufu_ops_per_score(v) == 1
    assert fa3.exp2_emulated_of_8(v) == fa3.EXP2_EMULATED_OF_8


def test_exp2_split_override_changes_the_source_and_rejects_bad_values(monkeypatch):
    softcap = fivar.load("softcap")
    monkeypatch.setenv(fa3.EXP2_EMULATION_ENV, "0")
    assert "flashinfer::OnlineSoftmax<" in _struct(softcap)
    monkeypatch.setenv(fa3.EXP2_EMULATION_ENV, "6")
    assert "Fa3OnlineSoftmax<NUM_ROWS_PER_THREAD, 6>" in _struct(softcap)
    assert "Fa3OnlineSoftmax<NUM_ROWS_PER_THREAD, 6>" in _struct(fivar.load("alibi"))  # forced on any softmax
    for bad in ("9", "half", "-1", "\u00b2", "12"):
        monkeypatch.setenv(fa3.EXP2_EMULATION_ENV, bad)
        with pytest.raises(fivar.FivarError, match=f"variant 'softcap': {fa3.EXP2_EMULATION_ENV}=.*0 to 8"):
            _struct(softcap)


def test_modules_of_different_splits_differ_and_carry_the_header_only_when_they_include_it(monkeypatch):
    from fivar.jit.build import gen_module, module_for
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv(fa3.EXP2_EMULATION_ENV, raising=False)
    monkeypatch.setenv(fa3.BOUNDED_SOFTMAX_ENV, "0")  # the split alone decides fivar's softmax struct here
    softcap, alibi = fivar.load("softcap"), fivar.load("alibi")
    uris = {}
    for k in (0, 2, 8):
        with fa3.exp2_split(k):
            m = module_for(softcap, "single_prefill", "fa3", "bf16", 128)
            assert m is module_for(softcap, "single_prefill", "fa3", "bf16", 128)  # memo, per split
        uris[k] = m.uri
        assert m.options["exp2_emulated_of_8"] == k
        assert ("fivar_fa3_softmax.cuh" in m.sources) == (k > 0), (k, sorted(m.sources))
        assert ("fivar_ops.cuh" in m.sources)
    assert len(set(uris.values())) == 3
    # the default is the split fivar picks, the same module as asking for it
    assert module_for(softcap, "single_prefill", "fa3", "bf16", 128).uri == uris[fa3.EXP2_EMULATED_OF_8]
    assert gen_module(softcap, "single_prefill", "fa3", exp2_emulated_of_8=8).uri == uris[8]
    # a variant without a MUFU op per score neither includes nor carries the softmax header
    assert "fivar_fa3_softmax.cuh" not in gen_module(alibi, "single_prefill", "fa3").sources


def test_flashinfer_online_softmax_update_is_the_one_fivar_mirrors():
    """Fa3OnlineSoftmax::update repeats FlashInfer's OnlineSoftmax::update around its own exp2 step. A FlashInfer
    whose update differs must be read again before fivar's copy is trusted: re-check csrc/fivar_fa3_softmax.cuh
    against it, then add its fingerprint here."""
    import hashlib
    from flashinfer.jit import env as jit_env
    text = (jit_env.FLASHINFER_INCLUDE_DIR / "flashinfer/attention/hopper/attention_updater.cuh").read_text()
    start = text.index("void update(", text.index("struct OnlineSoftmax"))
    body = " ".join(text[start:text.index("void finalize(", start)].split())
    known = {"a50beb469a2c53f7"}  # flashinfer-python 0.7.2 and 0.7.2.post1
    assert hashlib.sha256(body.encode()).hexdigest()[:16] in known


def test_bounded_softmax_runs_only_where_every_probability_stays_a_normal_float():
    """The host launches the bounded module only while the range times the softmax scale (log2(e) times the
    folded logits factor) spans at most 96 powers of two, so 2^(x - max) >= 2^-96 for every unmasked logit."""
    log2e = 1.0 / math.log(2.0)
    assert [fa3.bounded_softmax_applies((-1.0, 1.0), cap) for cap in (1.0, 30.0, 33.0, 33.3, 50.0)] == \
        [True, True, True, False, False]  # soft-caps: 2 * cap * log2(e) against 96
    r = random.Random()
    for _ in range(500):
        lo, hi, f = r.uniform(-5, 0), r.uniform(0, 5), r.uniform(0.01, 30)
        assert fa3.bounded_softmax_applies((lo, hi), f) == ((hi - lo) * f * log2e <= 96.0)
    assert not fa3.bounded_softmax_applies((-1.0, 1.0), 0.0)
    assert not fa3.bounded_softmax_applies((-1.0, 1.0), -3.0)
    assert not fa3.bounded_softmax_applies((-1.0, 1.0), math.nan)


def test_bounded_softmax_is_the_default_bf16_and_only_for_bounded_softmax_variants(monkeypatch):
    from fivar.jit.build import gen_module, module_for
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv(fa3.EXP2_EMULATION_ENV, raising=False)
    monkeypatch.delenv(fa3.BOUNDED_SOFTMAX_ENV, raising=False)
    softcap = fivar.load("softcap")
    k = fa3.EXP2_EMULATED_OF_8
    with fa3.bounded_softmax(False):
        off = module_for(softcap, "single_prefill", "fa3", "bf16", 128)
    assert off.options["bounded_softmax"] is False and "BOUNDED" not in off.sources["single_prefill_sm90_config.inc"]
    assert module_for(softcap, "single_prefill", "fa3", "bf16", 128).options["bounded_softmax"] is True  # default
    with fa3.bounded_softmax():
        on = module_for(softcap, "single_prefill", "fa3", "bf16", 128)
        assert on is module_for(softcap, "single_prefill", "fa3", "bf16", 128)  # memo, per setting
        assert on.uri != off.uri and on.options["bounded_softmax"] is True
        assert "/*BOUNDED=*/true" in on.sources["single_prefill_sm90_config.inc"]
        src = fa3.variant_decl(softcap, logits_range=fa3.softmax_range(softcap, "bf16")).source
        assert (f"fivar::Fa3OnlineSoftmax<NUM_ROWS_PER_THREAD, {k}, /*BOUNDED=*/true>(\n"
                "        sm_scale_log2, 1.0f);") in src
        # fp16 probabilities underflow at 2^-24: the running max stays
        assert gen_module(softcap, "single_prefill", "fa3", "fp16").options["bounded_softmax"] is False
        for name in ("alibi", "sliding_window", "sigmoid"):  # unbounded transform, or no softmax
            assert gen_module(fivar.load(name), "single_prefill", "fa3").options["bounded_softmax"] is False, name
        # every FA3 op takes it, and FA2 knows nothing of it
        assert gen_module(softcap, "batch_prefill", "fa3").options["bounded_softmax"] is True
        assert "bounded_softmax" not in gen_module(softcap, "single_prefill", "fa2").options
    # with no exp2 split the bounded softmax is still fivar's struct
    src = fa3.variant_decl(softcap, exp2_emulated_of_8=0, logits_range=(-1.0, 1.0)).source
    assert "Fa3OnlineSoftmax<NUM_ROWS_PER_THREAD, 0, /*BOUNDED=*/true>" in src and "fivar_fa3_softmax.cuh" in src
    assert gen_module(softcap, "single_prefill", "fa3", bounded_softmax=True).uri == on.uri
    monkeypatch.setenv(fa3.BOUNDED_SOFTMAX_ENV, "maybe")
    with pytest.raises(fivar.FivarError, match=f"variant 'softcap': {fa3.BOUNDED_SOFTMAX_ENV}='maybe': expected "
                                               "1/true/yes/on"):
        gen_module(softcap, "single_prefill", "fa3")
    for word, uri in (("yes", on.uri), ("Off", gen_module(softcap, "single_prefill", "fa3", bounded_softmax=False).uri)):
        monkeypatch.setenv(fa3.BOUNDED_SOFTMAX_ENV, word)
        assert gen_module(softcap, "single_prefill", "fa3").uri == uri, word


def test_flashinfer_finalize_and_rescale_are_the_ones_the_bounded_softmax_relies_on():
    """With the fixed max, Fa3OnlineSoftmax skips the mainloop's per-tile rescale_o and relies on FlashInfer's
    finalize setting scores_scale to 1/sum (and the LSE from row_max), then one more rescale_o: the mainloop's
    last updater calls. A FlashInfer that changed either must be read again (csrc/fivar_fa3_softmax.cuh)."""
    import hashlib
    from flashinfer.jit import env as jit_env
    hopper = jit_env.FLASHINFER_INCLUDE_DIR / "flashinfer/attention/hopper"
    text = (hopper / "attention_updater.cuh").read_text()
    start = text.index("void finalize(", text.index("struct OnlineSoftmax"))
    body = " ".join(text[start:text.index("};", text.index("void rescale_o(", start))].split())
    assert hashlib.sha256(body.encode()).hexdigest()[:16] in {"567740bfa5f2eacb"}  # 0.7.2 and 0.7.2.post1
    calls = re.findall(r"attention_updater\.(\w+)", (hopper / "mainloop_mma.cuh").read_text())
    assert calls[-2:] == ["finalize", "rescale_o"], calls


def test_a_launch_whose_params_make_the_range_too_wide_runs_the_running_max_module(monkeypatch):
    import torch

    from fivar.jit.module_key import ModuleKey
    from fivar.runtime.attention import _module
    from fivar.runtime.params import bind_params
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    softcap = fivar.load("softcap")
    with fa3.bounded_softmax():
        for cap, bounded in ((30.0, True), (33.0, True), (33.3, False), (50.0, False)):
            b = bind_params(softcap, {"softcap": cap}, num_qo_heads=8, num_kv_heads=8, batch_size=1, device="cpu")
            for op in ("single_prefill", "batch_prefill"):
                m = _module(softcap, ModuleKey(op, "fa3", torch.bfloat16, 128), b, 0.088)
                assert m.options["bounded_softmax"] is bounded, (cap, op)
            # the swap keeps the rest of the form
            m = _module(softcap, ModuleKey("batch_prefill", "fa3", torch.bfloat16, 128, custom_mask=True), b, 0.088)
            assert m.options["bounded_softmax"] is bounded and m.options["custom_mask"] is True, cap
            assert m.kernel_variant.name == "any_mask"  # the bits-reading tile list every mask of softcap's shares
            # fp16 never builds it, so never needs the swap
            assert _module(softcap, ModuleKey("single_prefill", "fa3", torch.float16, 128), b, 0.088).options[
                "bounded_softmax"] is False
    b = bind_params(softcap, {"softcap": 30.0}, num_qo_heads=8, num_kv_heads=8, batch_size=1, device="cpu")
    with fa3.bounded_softmax(False):
        assert _module(softcap, ModuleKey("single_prefill", "fa3", torch.bfloat16, 128), b, 0.088).options[
            "bounded_softmax"] is False


def test_a_bounded_build_also_builds_the_running_max_modules_a_wide_range_runs(monkeypatch):
    """So a serving process that prewarmed never compiles on its first launch with a cap of 50."""
    from fivar.jit.build import serving_modules
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    softcap = fivar.load("softcap")
    with fa3.bounded_softmax(False):
        assert [m.options["bounded_softmax"] for m in serving_modules(softcap, "single_prefill", "fa3")] == [False]
    with fa3.bounded_softmax():
        for op in ("single_prefill", "batch_prefill"):
            assert [m.options["bounded_softmax"] for m in serving_modules(softcap, op, "fa3")] == [True, False]
        alibi = fivar.load("alibi")  # unbounded: one module, as before
        assert len(serving_modules(alibi, "single_prefill", "fa3")) == 1


def test_a_mask_the_module_never_evaluates_per_score_costs_no_mufu(monkeypatch):
    """A chunked mask divides per score (two reciprocals), but FA3's tile-list form reads its cut tiles' bits and
    never evaluates it: the module keeps FlashInfer's softmax. So does a mask reading the head (its bits are per
    head): the same module."""
    from fivar.jit.build import gen_module
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv(fa3.EXP2_EMULATION_ENV, raising=False)

    def chunks(batch, qo_head, kv_head, q_idx, kv_idx, params):
        return q_idx // params.chunk == kv_idx // params.chunk

    def head_chunks(batch, qo_head, kv_head, q_idx, kv_idx, params):
        return q_idx // (params.chunk + qo_head) == kv_idx // (params.chunk + qo_head)
    v = AttentionVariant(name="softmax_chunks", mask=chunks, params={"chunk": Scalar(int, default=64)})
    assert fa3.mufu_ops_per_score(v) == 2 and fa3.mufu_ops_per_score(v, mask=False) == 0
    m = gen_module(v, "batch_prefill", "fa3")
    assert m.options["tile_list"] and m.options["exp2_emulated_of_8"] == 0 and "fivar_fa3_softmax.cuh" not in m.sources
    per_head = AttentionVariant(name="softmax_head_chunks", mask=head_chunks, params={"chunk": Scalar(int, default=64)})
    assert fa3.mufu_ops_per_score(per_head) > 0
    assert gen_module(per_head, "batch_prefill", "fa3").uri == m.uri


def test_a_cold_call_builds_only_the_softmax_form_its_params_run(monkeypatch):
    """A cold one-shot call's background build (fivar.runtime.cold_start) takes the softmax form its params and
    sm_scale select, the one launch's _module would pick; `fivar build` still builds both (above). Params that
    cannot tell (a bad value, checked by the call itself) and one-form variants build what a build would."""
    import types

    import torch

    from fivar.jit.build import serving_modules
    from fivar.jit.module_key import ModuleKey
    from fivar.runtime import cold_start
    from fivar.runtime.attention import _module
    from fivar.runtime.params import bind_params
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    softcap = fivar.load("softcap")
    q = types.SimpleNamespace(dtype=torch.bfloat16, shape=(9, 8, 128))
    with fa3.bounded_softmax():
        for cap in (float(torch.empty(()).uniform_(5.0, 33.0)), float(torch.empty(()).uniform_(33.4, 80.0))):
            for sm_scale in (None, float(torch.empty(()).uniform_(0.02, 0.2))):
                form = cold_start.softmax_form(softcap, q, {"softcap": cap}, sm_scale)
                b = bind_params(softcap, {"softcap": cap}, num_qo_heads=8, num_kv_heads=8, batch_size=1, device="cpu")
                launched = _module(softcap, ModuleKey("single_prefill", "fa3", torch.bfloat16, 128), b,
                                   sm_scale or 128 ** -0.5)
                assert form is launched.options["bounded_softmax"], (cap, sm_scale)
                for op in ("single_prefill", "batch_prefill"):
                    mods = cold_start.call_modules(softcap, op, "fa3", q, form)
                    assert [m.options["bounded_softmax"] for m in mods] == [form], (cap, sm_scale, op)
                assert launched.uri in {m.uri for m in cold_start.call_modules(softcap, "single_prefill", "fa3", q,
                                                                                 form)}
        assert cold_start.softmax_form(softcap, q, {"softcap": "wide"}) is None
        assert len(cold_start.call_modules(softcap, "single_prefill", "fa3", q, None)) == 2
        assert cold_start.softmax_form(softcap, types.SimpleNamespace(dtype=torch.float16, shape=(9, 8, 128))) is None
        alibi = fivar.load("alibi")
        assert cold_start.softmax_form(alibi, q) is None
        assert [m.uri for m in cold_start.call_modules(alibi, "single_prefill", "fa3", q, None)] == \
            [m.uri for m in serving_modules(alibi, "single_prefill", "fa3")]
        decode = cold_start.call_modules(softcap, "batch_decode", "fa2", q, True)  # FA2 modules have one form
        assert [m.uri for m in decode] == [m.uri for m in serving_modules(softcap, "batch_decode", "fa2")]
