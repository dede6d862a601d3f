"""Fusions on the CPU: spec validation, the torch reference against hand-written math, argument checks,
registry and CLI. The hand-written side loops over elements in float64 and never calls fivar.fusion.reference.
"""
import math

import pytest
import torch
from click.testing import CliRunner

import fivar
from fivar.cli import main
from fivar.fusion import reference as R
from fivar.fusion.check import random_inputs

BUNDLED_FUSIONS = ["add_rmsnorm_fp8", "llama_add_rmsnorm", "partial_rope_gptj", "qwen3_qk_norm_rope"]


# ---------------------------------------------------------------------------------------------- spec
@pytest.mark.parametrize("kwargs, field, text", [
    (dict(norm="rms"), "norm", "is not one of"),
    (dict(norm_scope="token"), "norm_scope", "is not one of"),
    (dict(rope="yarn", head_dim=128), "rope", "is not one of"),
    (dict(dtype="fp32"), "dtype", "is not one of"),
    (dict(out_dtype="int8"), "out_dtype", "is not one of"),
    (dict(norm=None), "norm", "needs a norm, a rope, or both"),
    (dict(residual=True, norm_scope="head", head_dim=128), "residual", "per-row norm"),
    (dict(rope="neox", norm_scope="row", head_dim=128), "rope", "norm_scope='head'"),
    (dict(norm_scope="head"), "head_dim", "need head_dim"),
    (dict(norm_scope="head", head_dim=1024), "head_dim", "multiple of 16 in [64, 512]"),
    (dict(norm_scope="head", head_dim=100), "head_dim", "multiple of 16"),
    (dict(head_dim=128), "head_dim", "only per-head fusions"),
    (dict(rope="neox", norm_scope="head", head_dim=128, rotary_dim=256), "rotary_dim", "in [16, head_dim=128]"),
    (dict(rope="gptj", norm=None, head_dim=128, rotary_dim=40), "rotary_dim", "multiple of 16"),
    (dict(rotary_dim=64), "rotary_dim", "needs rope="),
    (dict(eps=0.0), "eps", "in (0, 1)"),
    (dict(residual="yes"), "residual", "True or False"),
])
def test_bad_specs_name_the_fusion_and_the_field(kwargs, field, text):
    with pytest.raises(fivar.FivarSpecError) as info:
        fivar.FusionVariant(name="bad_fusion", **kwargs)
    msg = str(info.value)
    assert f"fusion 'bad_fusion': field '{field}'" in msg and text in msg, msg
    assert "test_fusion_spec.py:" in msg  # points at the constructor call


def test_bad_name():
    with pytest.raises(fivar.FivarSpecError, match="field 'name'"):
        fivar.FusionVariant(name="not valid")


def test_rotary_dim_defaults_to_head_dim_and_describe():
    v = fivar.FusionVariant(name="f", norm="gemma", norm_scope="head", rope="gptj", head_dim=64)
    assert v.rotary_dim == 64 and v.is_head and not v.fp8
    assert "gemma per head" in v.describe() and "gptj rope" in v.describe()


def test_registry_finds_bundled_fusions_and_attention_variants():
    from fivar.registry import variant_files
    names = set(variant_files())
    assert set(BUNDLED_FUSIONS) <= names
    for n in BUNDLED_FUSIONS:
        v = fivar.load(n)
        assert isinstance(v, fivar.FusionVariant) and v.name == n and v.doc
    assert isinstance(fivar.load("softcap"), fivar.AttentionVariant)
    q = fivar.load("qwen3_qk_norm_rope")
    assert (q.norm, q.norm_scope, q.rope, q.head_dim, q.rotary_dim) == ("rmsnorm", "head", "neox", 128, 128)
    p = fivar.load("partial_rope_gptj")
    assert (p.norm, p.rope, p.head_dim, p.rotary_dim) == (None, "gptj", 128, 64)
    assert fivar.load("add_rmsnorm_fp8").fp8 and fivar.load("llama_add_rmsnorm").residual


def test_registry_still_rejects_other_objects(tmp_path):
    f = tmp_path / "nothing.py"
    f.write_text("variant = 3\n")
    with pytest.raises(fivar.FivarSpecError, match="must define `variant = fivar.AttentionVariant"):
        fivar.load(str(f))


# ---------------------------------------------------------------------- hand-written independent math
def _hand_norm(row, w, b, kind, eps):
    row = [float(x) for x in row]
    n = len(row)
    if kind == "layernorm":
        mean = sum(row) / n
        var = sum((x - mean) ** 2 for x in row) / n
        r = 1 / math.sqrt(var + eps)
        return [(x - mean) * r * float(w[i]) + float(b[i]) for i, x in enumerate(row)]
    r = 1 / math.sqrt(sum(x * x for x in row) / n + eps)
    return [x * r * ((1.0 + float(w[i])) if kind == "gemma" else float(w[i])) for i, x in enumerate(row)]


def _hand_rope(vec, pos, base, rd, style):
    out = list(vec)
    for i in range(rd // 2):
        theta = pos * base ** (-2.0 * i / rd)
        c, s = math.cos(theta), math.sin(theta)
        a, b = (i, i + rd // 2) if style == "neox" else (2 * i, 2 * i + 1)
        out[a] = vec[a] * c - vec[b] * s
        out[b] = vec[b] * c + vec[a] * s
    return out


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("kind", ["rmsnorm", "gemma", "layernorm"])
@pytest.mark.parametrize("residual", [False, True])
def test_row_reference_matches_hand_math(tokens, kind, residual):
    v = fivar.FusionVariant(name="row", norm=kind, residual=residual, eps=1e-5)
    a = random_inputs(v, tokens=tokens, device="cpu", hidden=40, dtype=torch.float32)
    ref = v.reference(**a)
    out, new_res = ref if residual else (ref, None)
    for t in range(tokens):
        row = [float(a["x"][t, i]) + (float(a["residual"][t, i]) if residual else 0.0) for i in range(40)]
        exp = _hand_norm(row, a["weight"], a.get("bias"), kind, 1e-5)
        assert torch.allclose(out[t].double(), torch.tensor(exp, dtype=torch.float64), rtol=1e-5, atol=1e-5)
        if residual:
            assert torch.allclose(new_res[t].double(), torch.tensor(row, dtype=torch.float64), atol=1e-6)
    x0 = a["x"].clone()
    v.reference(**a)
    assert torch.equal(a["x"], x0)


def test_cos_sin_cache_layout():
    cs = R.cos_sin_cache(50, 32, base=500.0)
    assert cs.shape == (50, 32) and cs.dtype == torch.float32
    for p in (0, 1, 17, 49):
        for i in (0, 5, 15):
            th = p * 500.0 ** (-2 * i / 32)
            assert abs(float(cs[p, i]) - math.cos(th)) < 1e-6 and abs(float(cs[p, 16 + i]) - math.sin(th)) < 1e-6


def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    sc = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position": 8192}
    plain, scaled = R.cos_sin_cache(2, 128, 500000.0), R.cos_sin_cache(2, 128, 500000.0, sc)
    ang = lambda c: torch.atan2(c[1, 64:].double(), c[1, :64].double())  # noqa: E731 - angle at position 1
    a, b = ang(plain), ang(scaled)
    assert torch.allclose(a[:4], b[:4])  # short wavelengths: unchanged
    assert torch.allclose(b[-4:], a[-4:] / 8.0, rtol=1e-4)  # long wavelengths: divided by the factor


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("norm, rope, rd", [("rmsnorm", "neox", 64), ("rmsnorm", "neox", 32),
                                            ("gemma", "gptj", 64), ("layernorm", "neox", 48),
                                            (None, "gptj", 32), ("rmsnorm", None, None)])
@pytest.mark.parametrize("packed", [False, True])
def test_head_reference_matches_hand_math(tokens, norm, rope, rd, packed):
    v = fivar.FusionVariant(name="head", norm=norm, norm_scope="head", rope=rope, head_dim=64,
                            rotary_dim=rd, eps=1e-6)
    hq, hk, d, base = 3, 2, 64, 10000.0
    a = random_inputs(v, tokens=tokens, device="cpu", dtype=torch.float32, num_q_heads=hq, num_kv_heads=hk,
                      packed=packed, max_pos=300)
    if packed:  # the q/k views of the packed buffer are strided; V must not matter
        qkv = a["qkv"]
        q_src, k_src = qkv[:, :hq * d].reshape(tokens, hq, d), qkv[:, hq * d:(hq + hk) * d].reshape(tokens, hk, d)
    else:
        q_src, k_src = a["q"], a["k"]
    q_ref, k_ref = v.reference(**a)
    for src, ref, p in ((q_src, q_ref, "q_"), (k_src, k_ref, "k_")):
        for t in range(tokens):
            for h in range(src.shape[1]):
                vec = [float(x) for x in src[t, h]]
                if norm:
                    vec = _hand_norm(vec, a[p + "weight"], a.get(p + "bias"), norm, 1e-6)
                if rope:
                    vec = _hand_rope(vec, int(a["positions"][t]), base, rd, rope)
                torch.testing.assert_close(ref[t, h].double(), torch.tensor(vec, dtype=torch.float64),
                                           rtol=2e-5, atol=2e-5)


def test_packed_qkv_views_are_strided_and_match_separate_tensors():
    v = fivar.load("qwen3_qk_norm_rope")
    a = random_inputs(v, tokens=7, device="cpu", packed=True)
    from fivar.fusion.args import split_args
    s = split_args(v, dict(a), validate=False)
    assert s["q"].shape == (7, 8, 128) and s["k"].shape == (7, 2, 128)
    assert s["q"].stride() == ((8 + 4) * 128, 128, 1) and not s["q"].is_contiguous()
    assert s["k"].data_ptr() == a["qkv"].data_ptr() + 8 * 128 * a["qkv"].element_size()
    sep = {k: val for k, val in a.items() if k not in ("qkv", "num_q_heads", "num_kv_heads")}
    q2, k2 = v.reference(q=s["q"].contiguous(), k=s["k"].contiguous(), **sep)
    q1, k1 = v.reference(**a)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)


def test_fp8_reference_dequantizes_to_the_normed_values():
    v = fivar.load("add_rmsnorm_fp8")
    a = random_inputs(v, tokens=7, device="cpu", hidden=64)
    scale = float(a["scale"])
    out, res = v.reference(**a)
    assert out.dtype == torch.float8_e4m3fn
    x = [[float(a["x"][t, i]) + float(a["residual"][t, i]) for i in range(64)] for t in range(7)]
    exp = torch.tensor([_hand_norm(r, a["weight"], None, "rmsnorm", v.eps) for r in x], dtype=torch.float64)
    deq = out.double() * scale
    clipped = exp.clamp(-448 * scale, 448 * scale)
    assert ((deq - clipped).abs() <= clipped.abs() * 2 ** -4 + 2 ** -9 * scale).all()  # half an e4m3 step
    # saturation: values beyond the e4m3 range clamp to +-448 * scale
    big = R.quant_fp8(torch.tensor([1e6, -1e6, 0.0]), 1.0).float()
    assert big.tolist() == [448.0, -448.0, 0.0]


# ------------------------------------------------------------------------------ runtime argument checks
def test_call_arguments_are_checked_before_launch():
    v = fivar.load("qwen3_qk_norm_rope")
    a = random_inputs(v, tokens=3, device="cpu")
    with pytest.raises(fivar.FivarError, match="fusion 'qwen3_qk_norm_rope': argument 'q': must be a CUDA tensor"):
        v(**a)
    with pytest.raises(fivar.FivarError, match="argument 'cos_sin_cache': is required"):
        v(**{k: val for k, val in a.items() if k != "cos_sin_cache"})
    with pytest.raises(fivar.FivarError, match="argument 'softcap': unknown argument"):
        v(softcap=1.0, **a)
    with pytest.raises(fivar.FivarError, match="argument 'qkv': must be a \\[tokens"):
        v(qkv=torch.zeros(3, 100), num_q_heads=8, num_kv_heads=2, **{k: x for k, x in a.items() if k not in "qk"})
    with pytest.raises(fivar.FivarError, match="argument 'num_kv_heads': a positive int"):
        v(qkv=torch.zeros(3, 1536), num_q_heads=8)
    packed = torch.randn(3, (8 + 2 * 2) * 128)  # a packed CPU buffer is named as passed, not as its q view
    with pytest.raises(fivar.FivarError, match="argument 'qkv': must be a CUDA tensor.*v.reference"):
        v(qkv=packed, num_q_heads=8, num_kv_heads=2, **{k: x for k, x in a.items() if k not in "qk"})
    r = fivar.load("llama_add_rmsnorm")
    with pytest.raises(fivar.FivarError, match="fusion 'llama_add_rmsnorm': argument 'residual': is required"):
        r(x=torch.zeros(2, 64), weight=torch.ones(64))
    for eps in ("x", -10.0, 0.0):  # the declaration's eps is checked to be in (0, 1); a call's is too
        with pytest.raises(fivar.FivarError, match=f"argument 'eps': must be a number in \\(0, 1\\), got {eps!r}"):
            v(eps=eps, **a)


def test_rope_reference_clamps_positions_like_the_kernel():
    """csrc/fusion/fivar_fusion.cuh clamps a position to the cache's rows; the reference must agree."""
    cs = R.cos_sin_cache(16, 32)
    x = torch.randn(3, 2, 32)
    clamped = R.apply_rope(x, torch.tensor([0, 15, 15]), cs, 32, "neox")
    torch.testing.assert_close(R.apply_rope(x, torch.tensor([-1, 15, 200]), cs, 32, "neox"), clamped)


# -------------------------------------------------------------------------------------------------- CLI
def test_cli_new_variant_kind_fusion_show_and_list(tmp_path, monkeypatch):
    runner = CliRunner()
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(main, ["new-variant", "my_fusion", "--kind", "fusion"])
    assert r.exit_code == 0, r.output
    vfile, tfile = tmp_path / "variants/my_fusion.py", tmp_path / "tests/variants/test_my_fusion.py"
    assert vfile.exists() and tfile.exists() and "FusionVariant" in vfile.read_text()
    v = fivar.load(str(vfile))
    assert isinstance(v, fivar.FusionVariant) and v.name == "my_fusion"
    r = runner.invoke(main, ["show", "my_fusion"])
    assert r.exit_code == 0, r.output
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(fusion_run, run)" in r.output and "constexpr int kHeadDim = 128;" in r.output
    r = runner.invoke(main, ["show", "my_fusion", "--sources"])
    assert "===== fivar_fusion.cuh =====" in r.output and "head_kernel" in r.output
    r = runner.invoke(main, ["list"])
    assert r.exit_code == 0 and "my_fusion" in r.output and "fusion" in r.output


def test_scaffolded_fusion_test_runs(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(main, ["new-variant", "scaffolded", "--kind", "fusion"]).exit_code == 0
    env = {**os.environ, "PYTHONPATH": str(repo)}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/variants/test_scaffolded.py"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 passed" in p.stdout


def test_cli_show_row_fusion():
    r = CliRunner().invoke(main, ["show", "add_rmsnorm_fp8"])
    assert r.exit_code == 0, r.output
    assert "constexpr bool kFp8 = true;" in r.output and "constexpr bool kResidual = true;" in r.output


def test_yarn_keeps_high_interpolates_low_frequencies_and_scales_attention():
    sc = {"type": "yarn", "factor": 4.0, "original_max_position": 32768, "beta_fast": 32, "beta_slow": 1}
    plain, scaled = R.rope_inv_freq(128, 1e6).double(), R.rope_inv_freq(128, 1e6, sc).double()
    assert torch.allclose(scaled[:4], plain[:4])  # many rotations over the original context: extrapolated
    assert torch.allclose(scaled[-4:], plain[-4:] / 4.0)  # few rotations: interpolated (divided by factor)
    assert ((scaled <= plain * (1 + 1e-6)) & (scaled >= plain / 4.0 * (1 - 1e-6))).all()  # a blend between
    assert R.rope_attention_factor(sc) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert R.rope_attention_factor(None) == 1.0
    cs = R.cos_sin_cache(3, 128, 1e6, sc)
    th = 2 * float(scaled[70 - 64])
    assert abs(float(cs[2, 6]) - R.rope_attention_factor(sc) * math.cos(th)) < 1e-6


@pytest.mark.parametrize("rope", ["neox", "gptj"])
def test_computed_cos_sin_reference_equals_the_cached_one(rope):
    sc = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position": 8192}
    computed = fivar.FusionVariant(name="computed_probe", norm="rmsnorm", norm_scope="head", rope=rope, head_dim=64,
                                   rotary_dim=32, cos_sin="computed")
    cached = fivar.FusionVariant(name="cached_probe", norm="rmsnorm", norm_scope="head", rope=rope, head_dim=64,
                                 rotary_dim=32)
    a = random_inputs(computed, tokens=9, device="cpu", max_pos=3000, rope_scaling=sc)
    b = {k: v for k, v in a.items() if k not in ("inv_freq", "attention_factor")}
    b["cos_sin_cache"] = R.cos_sin_cache(3000, 32, scaling=sc)
    for x, y in zip(computed.reference(**a), cached.reference(**b)):
        assert torch.allclose(x, y, atol=1e-5)
    assert "cos/sin computed" in computed.describe()


def test_computed_cos_sin_arguments_are_checked():
    v = fivar.FusionVariant(name="computed_args", norm=None, norm_scope="head", rope="neox", head_dim=64,
                            cos_sin="computed")
    with pytest.raises(fivar.FivarSpecError, match="cos_sin"):
        fivar.FusionVariant(name="bad", norm="rmsnorm", cos_sin="computed")
    with pytest.raises(fivar.FivarSpecError, match="cos_sin"):
        fivar.FusionVariant(name="bad", norm=None, norm_scope="head", rope="neox", head_dim=64, cos_sin="table")
    a = random_inputs(v, tokens=3, device="cpu")
    assert "cos_sin_cache" not in a and a["inv_freq"].shape == (32,)
    with pytest.raises(fivar.FivarError, match="argument 'inv_freq': is required"):
        v(**{k: x for k, x in a.items() if k != "inv_freq"})  # (the GPU tests check values and devices)


@pytest.mark.parametrize("arg,value,match", [
    ("weight", torch.randn(39), r"argument 'weight': must have shape \(40,\), got \(39,\)"),
    ("residual", torch.randn(5, 40), r"argument 'residual': must have shape \(3, 40\)"),
    ("x", torch.randn(3, 4, 40), "argument 'x': must have 2 dims"),
    ("weight", [1.0] * 40, "argument 'weight': must be a torch.Tensor, got list"),
])
def test_row_reference_names_a_misshapen_argument(arg, value, match):
    v = fivar.FusionVariant(name="row", norm="layernorm", residual=True, eps=1e-5)
    a = random_inputs(v, tokens=3, device="cpu", hidden=40, dtype=torch.float32)
    with pytest.raises(fivar.FivarError, match=f"fusion 'row': {match}"):
        v.reference(**{**a, arg: value})


@pytest.mark.parametrize("arg,shape,match", [
    ("q_weight", (32,), r"argument 'q_weight': must have shape \(64,\)"),
    ("positions", (4,), r"argument 'positions': must have shape \(3,\)"),
    ("k", (2, 2, 64), "argument 'k': has 2 tokens but q has 3"),
    ("cos_sin_cache", (100, 16), r"argument 'cos_sin_cache': must be \[max_pos, rotary_dim=32\]"),
])
def test_head_reference_names_a_misshapen_argument(arg, shape, match):
    v = fivar.FusionVariant(name="head", norm="rmsnorm", norm_scope="head", rope="neox", head_dim=64,
                            rotary_dim=32, eps=1e-6)
    a = random_inputs(v, tokens=3, device="cpu", dtype=torch.float32, num_q_heads=2, num_kv_heads=1)
    bad = torch.randint(0, 50, shape) if arg == "positions" else torch.randn(shape)
    with pytest.raises(fivar.FivarError, match=f"fusion 'head': {match}"):
        v.reference(**{**a, arg: bad})
