"""Fusion kernels vs the torch reference on a GPU: odd token counts, packed QKV views, fp8 by dequantizing."""
import pytest
import torch

import fivar
from fivar.fusion import reference as R
from fivar.fusion.check import check_fusion, compare_fp8, random_inputs
from fivar.testing import compare

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BUNDLED_FUSIONS = ["qwen3_qk_norm_rope", "llama_add_rmsnorm", "add_rmsnorm_fp8", "partial_rope_gptj"]


@pytest.mark.parametrize("name", BUNDLED_FUSIONS)
@pytest.mark.parametrize("tokens", [1, 7, 4097])
def test_bundled_fusion_matches_reference(name, tokens):
    v = fivar.load(name)
    for packed in ((False, True) if v.is_head else (False,)):
        for r in check_fusion(v, tokens=tokens, packed=packed):
            assert r.passed, r


@pytest.mark.parametrize("hidden", [8, 1000, 4096, 8192, 16384, 65536])
def test_row_fusion_hidden_sizes(hidden):
    for name in ("llama_add_rmsnorm", "add_rmsnorm_fp8"):
        for r in check_fusion(fivar.load(name), tokens=7, hidden=hidden):
            assert r.passed, r


def test_row_fusion_many_rows():
    # more rows than two per SM: hidden 8192 takes the 512-thread, two-vectors-per-thread instance
    # (few rows take one vector per thread, up to 1024 threads)
    for name in ("llama_add_rmsnorm", "add_rmsnorm_fp8"):
        for r in check_fusion(fivar.load(name), tokens=1000, hidden=8192):
            assert r.passed, r


@pytest.mark.parametrize("norm, rope, rd, out", [("layernorm", "neox", 64, "same"), ("gemma", "gptj", 64, "same"),
                                                 ("rmsnorm", "neox", 128, "fp8_e4m3")])
def test_head_fusion_two_heads_per_lane(norm, rope, rd, out):
    # enough tokens for the two-heads-per-lane instance; with 5 + 3 heads at head_dim 128 (8 per warp) some
    # lanes hold a q head and a k head, so they need both weights
    v = fivar.FusionVariant(name=f"u2_{norm}_{rope}_{rd}_{out}", norm=norm, norm_scope="head", rope=rope,
                            head_dim=128, rotary_dim=rd, out_dtype=out)
    for r in check_fusion(v, tokens=4099, packed=True, num_q_heads=5, num_kv_heads=3):
        assert r.passed, r


def test_qwen3_int32_positions_and_in_place_on_packed_qkv():
    v = fivar.load("qwen3_qk_norm_rope")
    a = random_inputs(v, tokens=33, packed=True, num_q_heads=32, num_kv_heads=8, pos_dtype=torch.int32)
    q_ref, k_ref = v.reference(**a)
    q, k = v(**a)
    assert q.data_ptr() == a["qkv"].data_ptr()  # in place
    assert compare(v.name, "q", q, q_ref, torch.bfloat16).passed
    assert compare(v.name, "k", k, k_ref, torch.bfloat16).passed


@pytest.mark.parametrize("norm, rope, hd, rd", [("gemma", "gptj", 64, 32), ("layernorm", "neox", 256, 128),
                                                ("rmsnorm", "neox", 512, 512), ("rmsnorm", "neox", 192, 96),
                                                (None, "neox", 128, 64), ("rmsnorm", None, 80, None)])
def test_other_family_members(norm, rope, hd, rd):
    v = fivar.FusionVariant(name=f"fam_{norm}_{rope}_{hd}", norm=norm, norm_scope="head", rope=rope, head_dim=hd,
                            rotary_dim=rd)
    for tokens in (1, 7, 300):
        for r in check_fusion(v, tokens=tokens, packed=tokens == 7, num_q_heads=5, num_kv_heads=3):
            assert r.passed, r


def test_fp8_head_fusion_and_layernorm_row():
    v = fivar.FusionVariant(name="qk_fp8", norm="rmsnorm", norm_scope="head", rope="neox", head_dim=128,
                            out_dtype="fp8_e4m3")
    a = random_inputs(v, tokens=7, packed=True)
    q8, k8 = v(**a)
    q_ref, k_ref = v.reference(**a)
    assert q8.dtype == torch.float8_e4m3fn
    assert compare_fp8(v.name, "q", q8, q_ref, a["scale"]).passed and compare_fp8(v.name, "k", k8, k_ref, a["scale"]).passed
    ln = fivar.FusionVariant(name="ln_row", norm="layernorm", residual=True)
    for r in check_fusion(ln, tokens=7, hidden=2048):
        assert r.passed, r
    # a Python float scale works like the tensor one
    f = fivar.load("add_rmsnorm_fp8")
    b = random_inputs(f, tokens=4, hidden=256)
    ref, _ = f.reference(**b)
    b["scale"] = float(b["scale"])
    assert compare_fp8(f.name, "float scale", f(**b), ref, b["scale"]).passed


def test_runtime_rejects_bad_gpu_arguments():
    v = fivar.load("qwen3_qk_norm_rope")
    a = random_inputs(v, tokens=4)
    with pytest.raises(fivar.FivarError, match="argument 'cos_sin_cache': must be torch.float32"):
        v(**{**a, "cos_sin_cache": a["cos_sin_cache"].half()})
    with pytest.raises(fivar.FivarError, match="argument 'q_weight': shape must be"):
        v(**{**a, "q_weight": a["q_weight"][:64]})
    with pytest.raises(fivar.FivarError, match="argument 'q': data pointer and leading strides"):
        buf = torch.randn(4, 8 * 128 + 4, dtype=torch.bfloat16, device="cuda")
        v(**{**a, "q": buf[:, 4:].unflatten(1, (8, 128))})
    with pytest.raises(fivar.FivarError, match="argument 'k': has 3 tokens"):
        v(**{**a, "k": a["k"][:3]})


def test_llama3_cache_on_gpu_matches_cpu():
    sc = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position": 8192}
    assert torch.allclose(R.cos_sin_cache(64, 128, 500000.0, sc, device="cuda").cpu(),
                          R.cos_sin_cache(64, 128, 500000.0, sc))


@pytest.mark.parametrize("scaling", [None, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position": 8192},
                                     {"type": "yarn", "factor": 4.0, "original_max_position": 32768}])
@pytest.mark.parametrize("norm, rope, rd", [("rmsnorm", "neox", 128), ("gemma", "gptj", 64), (None, "neox", 64)])
def test_computed_cos_sin(norm, rope, rd, scaling):
    """cos/sin from the position and inv_freq in the kernel (Llama-3.1 and YaRN scaling), positions up to 32k."""
    v = fivar.FusionVariant(name=f"computed_{norm}_{rope}_{rd}", norm=norm, norm_scope="head", rope=rope,
                            head_dim=128, rotary_dim=rd, cos_sin="computed")
    for tokens in (1, 7, 4099):
        for r in check_fusion(v, tokens=tokens, packed=tokens == 7, num_q_heads=5, num_kv_heads=3,
                              max_pos=32768, rope_scaling=scaling):
            assert r.passed, r


def test_computed_cos_sin_arguments_on_gpu():
    v = fivar.FusionVariant(name="computed_args_gpu", norm=None, norm_scope="head", rope="neox", head_dim=64,
                            cos_sin="computed")
    a = random_inputs(v, tokens=3)
    with pytest.raises(fivar.FivarError, match="argument 'inv_freq': shape must be"):
        v(**{**a, "inv_freq": a["inv_freq"][:8]})
    with pytest.raises(fivar.FivarError, match="argument 'attention_factor'"):
        v(**{**a, "attention_factor": -1.0})
    with pytest.raises(fivar.FivarError, match="argument 'cos_sin_cache'"):
        v(**{**a, "cos_sin_cache": R.cos_sin_cache(8, 64, device="cuda")})
