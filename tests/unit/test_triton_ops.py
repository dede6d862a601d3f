"""fivar.triton_ops (the Triton norm/RoPE baselines) run by Triton's interpreter on the CPU (on a GPU host,
compiled), against the torch references in fivar.fusion.reference, at small odd shapes: tokens 1/7/33,
hidden 64/96, head dims 64/128 with partial rotary, q/k as strided views of a packed QKV buffer, NeoX and
GPT-J. fp16 and fp32 only: the interpreter has no bfloat16 arithmetic."""
import pytest
import torch

from fivar.fusion import reference as R
from fivar.triton_ops import apply_rope, fused_add_rmsnorm, qk_norm_rope, rmsnorm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.float32]
TOL = {torch.float16: dict(atol=3e-3, rtol=3e-3), torch.float32: dict(atol=2e-5, rtol=2e-5)}
TOKENS = [1, 7, 33]
MAX_POS = 4096


@pytest.fixture(autouse=True, scope="module")
def interpret():
    """Triton picks interpreted vs compiled when a kernel is defined (conftest sets TRITON_INTERPRET=1 for the
    whole run without a GPU, before anything imports triton); keep it set for this module too."""
    if torch.cuda.is_available():
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _close(got, ref, dtype, what):
    torch.testing.assert_close(got.float(), ref.float().to(got.device), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _weight(n, dtype):
    return (torch.randn(n, device=DEV) * 0.3 + 1.0).to(dtype)


# ----------------------------------------------------------------------------------------------- rmsnorm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm(tokens, hidden, dtype, gemma):
    x = torch.randn(tokens, hidden, device=DEV).to(dtype) * 2
    w = _weight(hidden, dtype)
    x0 = x.clone()
    out = rmsnorm(x, w, 1e-6, gemma=gemma)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(x, x0, atol=0, rtol=0)  # input untouched
    _close(out, R.rms_norm(x, w, 1e-6, gemma=gemma), dtype, "rmsnorm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_strided_rows_out_and_in_place(dtype):
    # Rows of a wider buffer (row stride != hidden), an explicit out, and out=x.
    buf = torch.randn(7, 160, device=DEV).to(dtype)
    x = buf[:, 32:128]
    w = _weight(96, dtype)
    ref = R.rms_norm(x, w, 1e-5)
    out = torch.full((7, 96), float("nan"), device=DEV, dtype=dtype)
    assert rmsnorm(x, w, 1e-5, out=out) is out
    _close(out, ref, dtype, "rmsnorm out=")
    before = buf.clone()
    rmsnorm(x, w, 1e-5, out=x)
    _close(x, ref, dtype, "rmsnorm in place")
    torch.testing.assert_close(buf[:, :32], before[:, :32], atol=0, rtol=0)
    torch.testing.assert_close(buf[:, 128:], before[:, 128:], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_per_head_of_packed_qkv(dtype):
    # [T, H, D] view with token stride = the whole QKV row: per-head norm, like Qwen3's q-norm.
    t, hq, hk, d = 7, 3, 2, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEV).to(dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    w = _weight(d, dtype)
    _close(rmsnorm(q, w, 1e-6), R.rms_norm(q, w, 1e-6), dtype, "per-head rmsnorm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rmsnorm(tokens, hidden, dtype):
    x = torch.randn(tokens, hidden, device=DEV).to(dtype)
    res = torch.randn(tokens, hidden, device=DEV).to(dtype)
    w = _weight(hidden, dtype)
    s = x.float() + res.float()
    ref_out, ref_res = R.rms_norm(s, w, 1e-6), s
    assert fused_add_rmsnorm(x, res, w, 1e-6) is None
    _close(res, ref_res, dtype, "residual")
    _close(x, ref_out, dtype, "normed x")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm_strided(dtype):
    buf = torch.randn(33, 2, 96, device=DEV).to(dtype)
    x, res = buf[:, 0], buf[:, 1]  # interleaved rows: token stride 192
    w = _weight(96, dtype)
    s = x.float() + res.float()
    fused_add_rmsnorm(x, res, w, 1e-5, gemma=True)
    _close(res, s, dtype, "residual")
    _close(x, R.rms_norm(s, w, 1e-5, gemma=True), dtype, "normed x")


def test_rmsnorm_rejects_bad_args():
    x = torch.randn(4, 64, device=DEV)
    with pytest.raises(ValueError):
        rmsnorm(x, torch.ones(63, device=DEV))
    with pytest.raises(ValueError):
        rmsnorm(x.t(), torch.ones(4, device=DEV))  # last dim not contiguous
    with pytest.raises(ValueError):
        fused_add_rmsnorm(x, torch.randn(4, 32, device=DEV), torch.ones(64, device=DEV))


# ------------------------------------------------------------------------------------------ RoPE helpers

def _packed_qkv(tokens, hq, hk, d, dtype):
    """A packed QKV buffer [T, (Hq + 2 Hk) D] and q/k views [T, H, D] into it (token stride = row)."""
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=DEV).to(dtype)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    return qkv, q, k


def _positions(tokens, dtype=torch.int64):
    return torch.randint(0, MAX_POS, (tokens,), device=DEV, dtype=dtype)


ROPE_SHAPES = [  # (Hq, Hk, head_dim, rotary_dim)
    (4, 2, 64, 64),
    (4, 2, 64, 32),
    (3, 1, 128, 128),
    (5, 3, 128, 64),
]


# -------------------------------------------------------------------------------------------------- rope

@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d,rot", ROPE_SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_apply_rope_packed_qkv(tokens, hq, hk, d, rot, dtype, style):
    qkv, q, k = _packed_qkv(tokens, hq, hk, d, dtype)
    before = qkv.clone()
    pos = _positions(tokens, torch.int32 if tokens == 7 else torch.int64)
    cs = R.cos_sin_cache(MAX_POS, rot, base=10000.0, device=DEV)
    q_ref = R.apply_rope(q, pos, cs, rot, style)
    k_ref = R.apply_rope(k, pos, cs, rot, style)
    q_out, k_out = apply_rope(q, k, pos, cs, rot, style=style)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    _close(q, q_ref, dtype, f"q ({style})")
    _close(k, k_ref, dtype, f"k ({style})")
    # The pass-through tail keeps its exact bits, and V is never touched.
    torch.testing.assert_close(q[..., rot:], before[:, :hq * d].view(tokens, hq, d)[..., rot:], atol=0, rtol=0)
    torch.testing.assert_close(qkv[:, (hq + hk) * d:], before[:, (hq + hk) * d:], atol=0, rtol=0)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_apply_rope_contiguous_separate_tensors(style):
    # Separate contiguous q/k (the plain layout), llama3-scaled cache, all tokens at position 0 and max.
    dtype, t, d, rot = torch.float32, 7, 64, 64
    q = torch.randn(t, 5, d, device=DEV)
    k = torch.randn(t, 1, d, device=DEV)
    pos = torch.tensor([0, MAX_POS - 1, 3, 0, 17, 1000, MAX_POS - 1], device=DEV)
    cs = R.cos_sin_cache(MAX_POS, rot, base=500000.0, device=DEV,
                         scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position=1024))
    q_ref, k_ref = R.apply_rope(q, pos, cs, rot, style), R.apply_rope(k, pos, cs, rot, style)
    apply_rope(q, k, pos, cs, rot, style)
    _close(q, q_ref, dtype, "q")
    _close(k, k_ref, dtype, "k")


def test_apply_rope_rejects_bad_args():
    _, q, k = _packed_qkv(3, 2, 1, 64, torch.float32)
    pos = _positions(3)
    cs = R.cos_sin_cache(MAX_POS, 32, device=DEV)
    with pytest.raises(ValueError):
        apply_rope(q, k, pos, cs, 32, style="glm")
    with pytest.raises(ValueError):
        apply_rope(q, k, pos, cs, 64)  # cache is for rotary_dim 32
    with pytest.raises(ValueError):
        apply_rope(q, k, pos[:2], cs, 32)
    with pytest.raises(ValueError):
        apply_rope(q, k, pos.float(), cs, 32)


# ------------------------------------------------------------------------------------------ qk_norm_rope

@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d,rot", ROPE_SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_qk_norm_rope_packed_qkv(tokens, hq, hk, d, rot, dtype, style):
    qkv, q, k = _packed_qkv(tokens, hq, hk, d, dtype)
    before = qkv.clone()
    pos = _positions(tokens)
    cs = R.cos_sin_cache(MAX_POS, rot, base=1000000.0, device=DEV)
    qw, kw = _weight(d, dtype), _weight(d, dtype)  # separate q and k weights
    eps = 1e-6
    q_ref = R.apply_rope(R.rms_norm(q, qw, eps), pos, cs, rot, style)
    k_ref = R.apply_rope(R.rms_norm(k, kw, eps), pos, cs, rot, style)
    q_out, k_out = qk_norm_rope(q, k, qw, kw, pos, cs, rot, eps=eps, style=style)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    _close(q, q_ref, dtype, f"q ({style})")
    _close(k, k_ref, dtype, f"k ({style})")
    torch.testing.assert_close(qkv[:, (hq + hk) * d:], before[:, (hq + hk) * d:], atol=0, rtol=0)


def test_qk_norm_rope_gemma_weights():
    dtype, t, hq, hk, d, rot = torch.float32, 7, 2, 1, 96, 32  # head dim not a power of 2, tail of 64
    qkv, q, k = _packed_qkv(t, hq, hk, d, dtype)
    pos = _positions(t)
    cs = R.cos_sin_cache(MAX_POS, rot, device=DEV)
    qw, kw = torch.randn(d, device=DEV) * 0.1, torch.randn(d, device=DEV) * 0.1
    q_ref = R.apply_rope(R.rms_norm(q, qw, 1e-6, gemma=True), pos, cs, rot, "neox")
    k_ref = R.apply_rope(R.rms_norm(k, kw, 1e-6, gemma=True), pos, cs, rot, "neox")
    qk_norm_rope(q, k, qw, kw, pos, cs, rot, eps=1e-6, gemma=True)
    _close(q, q_ref, dtype, "q")
    _close(k, k_ref, dtype, "k")


def test_qk_norm_rope_rejects_bad_weight():
    _, q, k = _packed_qkv(3, 2, 1, 64, torch.float32)
    cs = R.cos_sin_cache(MAX_POS, 64, device=DEV)
    with pytest.raises(ValueError):
        qk_norm_rope(q, k, torch.ones(64, device=DEV), torch.ones(32, device=DEV), _positions(3), cs, 64)
