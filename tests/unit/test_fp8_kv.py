"""FP8 (e4m3) KV caches: module rendering per KV dtype, the scales' folding (checked on the CPU through the Triton
twin with scaled 16-bit caches), the dequantizing reference, and the argument checks. The kernels themselves:
tests/test_gpu_fp8.py."""
import math

import pytest
import torch

import fivar
from fivar.errors import FivarError
from fivar.jit.build import gen_module
from fivar.testing import _ragged_reference, _to_paged, compare, quantize_kv

FP8 = torch.float8_e4m3fn


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("op", ["batch_decode", "batch_prefill"])
def test_kv_dtype_is_its_own_module(op):
    v = fivar.load("softcap")
    plain, fp8 = gen_module(v, op, "fa2", "bf16", 128), gen_module(v, op, "fa2", "bf16", 128, kv_dtype="fp8e4m3")
    assert "_kvfp8e4m3_" in fp8.uri and "_kvfp8e4m3_" not in plain.uri and fp8.uri != plain.uri
    config = next(n for n in fp8.sources if n.endswith("_config.inc"))
    assert "using DTypeKV = __nv_fp8_e4m3;" in fp8.sources[config]
    assert "using DTypeQ = nv_bfloat16;" in fp8.sources[config] and "using DTypeO = nv_bfloat16;" in fp8.sources[config]
    assert "using DTypeKV = nv_bfloat16;" in plain.sources[config]
    assert fp8.options["kv_dtype"] == "fp8e4m3" and "kv_dtype" not in plain.options
    # the manifest's options render the same module again (what `fivar cache` checks staleness with)
    assert gen_module(v, op, "fa2", "bf16", 128, **fp8.options).uri == fp8.uri


@pytest.mark.parametrize("kwargs,match", [
    (dict(op="batch_prefill", target="fa3"), "FA2's paged kernels"),
    (dict(op="single_prefill", target="fa2"), "FA2's paged kernels"),
    (dict(op="batch_decode", target="fa2", kv_dtype="fp8e5m2"), "kv_dtype 'fp8e5m2' is not supported"),
])
def test_gen_module_refuses_kv_dtypes_it_cannot_build(kwargs, match):
    kwargs = {"kv_dtype": "fp8e4m3", **kwargs}
    with pytest.raises(FivarError, match=match):
        gen_module(fivar.load("softcap"), dtype="bf16", head_dim=128, **kwargs)


def _paged_case(hq=4, hkv=2, d=16, kv_lens=(1, 9, 40), dtype=torch.float16, page_size=4):
    q = torch.randn(len(kv_lens), hq, d, dtype=dtype)
    k, v = (torch.randn(sum(kv_lens), hkv, d, dtype=dtype) for _ in range(2))
    return q, k, v, list(kv_lens), page_size


@pytest.mark.parametrize("name", ["softcap", "sliding_window"])
def test_scales_fold_exactly_into_decode(name, interpret):
    """A cache holding k / k_scale and v / v_scale, run with the scales, is attention over k and v: k_scale goes into
    sm_scale (a variant sees sm_scale only through `score`), v_scale onto the output."""
    var = fivar.load(name)
    q, k, v, kv_lens, page = _paged_case()
    k_scale, v_scale = 0.37, 2.5
    params = {"window": 7} if "window" in var.params else {}
    cache, indptr, indices, last = _to_paged(k / k_scale, v / v_scale, kv_lens, page)
    out, lse = var.decode(q, cache, indptr, indices, last, backend="triton", k_scale=k_scale, v_scale=v_scale,
                          return_lse=True, **params)
    ref, ref_lse = zip(*[var.reference(q[b:b + 1], k[o:o + n], v[o:o + n], batch_idx=b, batch_size=len(kv_lens),
                                       return_lse=True, **params)
                         for b, (o, n) in enumerate(zip([0, 1, 10], kv_lens))])
    r = compare(name, "scaled decode", out, torch.cat(ref), torch.float16)
    assert r.passed, r
    assert torch.allclose(lse.float(), torch.cat(ref_lse).float(), atol=2e-2)  # the LSE does not see v_scale


def test_reference_dequantizes():
    var = fivar.load("softcap")
    q, k, v = torch.randn(3, 4, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    k8, v8, k_scale, v_scale = quantize_kv(k, v, FP8)
    assert k8.dtype == FP8 and 0 < k_scale and 0 < v_scale
    assert (k8.float() * k_scale - k).abs().max() <= 0.07 * k.abs().max()  # e4m3: 3 mantissa bits
    got = var.reference(q, k8, v8, k_scale=k_scale, v_scale=v_scale)
    want = var.reference(q, k8.float() * k_scale, v8.float() * v_scale)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, var.reference(q, k8.float(), v8.float()))


def _fp8_cache(kv_lens, page, hkv=2, d=16):
    k, v = torch.randn(sum(kv_lens), hkv, d), torch.randn(sum(kv_lens), hkv, d)
    k8, v8, _, _ = quantize_kv(k, v, FP8)
    return _to_paged(k8, v8, kv_lens, page)


def test_fp8_cache_is_refused_where_no_kernel_reads_it():
    var = fivar.load("softcap")
    q, _, _, kv_lens, page = _paged_case(dtype=torch.bfloat16)
    cache, indptr, indices, last = _fp8_cache(kv_lens, page)
    with pytest.raises(FivarError, match="FP8 KV cache runs on FA2's paged kernels only; backend 'triton'"):
        var.decode(q, cache, indptr, indices, last, backend="triton")
    with pytest.raises(FivarError, match="backend 'fa3'"):
        var.decode(q, cache, indptr, indices, last, backend="fa3")
    qo_indptr = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
    with pytest.raises(FivarError, match="backend 'fa3'"):
        var.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, backend="fa3")
    with pytest.raises(FivarError, match="backend 'fa3'"):
        var.plan_paged(qo_indptr, indptr, indices, last, num_qo_heads=4, num_kv_heads=2, head_dim=128, page_size=page,
                       kv_dtype=FP8, backend="fa3")
    with pytest.raises(FivarError, match="backend 'triton'"):
        var.plan_decode(indptr, indices, last, num_qo_heads=4, num_kv_heads=2, head_dim=128, page_size=page,
                        kv_dtype=FP8, backend="triton")


def test_fp8_queries_and_bad_scales_are_named():
    var = fivar.load("softcap")
    q, _, _, kv_lens, page = _paged_case(dtype=torch.bfloat16)
    cache, indptr, indices, last = _fp8_cache(kv_lens, page)
    with pytest.raises(FivarError, match="variant 'softcap': q is torch.float8_e4m3fn: FP8 queries are not supported"):
        var.decode(q.to(FP8), cache, indptr, indices, last)
    for bad in (0.0, -1.0, math.nan, math.inf, "x"):
        with pytest.raises(FivarError, match="k_scale must be a positive finite float"):
            var.decode(q, cache, indptr, indices, last, k_scale=bad)
    with pytest.raises(FivarError, match="v_scale must be a positive finite float"):
        var.batch_prefill_paged(q, cache, torch.arange(4, dtype=torch.int32), indptr, indices, last, v_scale=-2.0)
    mixed = (cache[0], cache[1].to(torch.bfloat16))
    with pytest.raises(FivarError, match="k_cache and v_cache must have one dtype"):
        var.decode(q, mixed, indptr, indices, last)
    with pytest.raises(FivarError, match="KV-cache dtype torch.float32 is not supported"):
        var.plan_decode(indptr, indices, last, num_qo_heads=4, num_kv_heads=2, head_dim=128, page_size=page,
                        dtype=torch.bfloat16, kv_dtype=torch.float32)


def test_fp8_cache_on_the_cpu_is_named_before_any_kernel():
    """The FA2 path's own checks: a CPU fp8 cache reaches the device check, not a dtype error."""
    var = fivar.load("softcap")
    q, _, _, kv_lens, page = _paged_case(dtype=torch.bfloat16)
    cache, indptr, indices, last = _fp8_cache(kv_lens, page)
    with pytest.raises(FivarError, match="inputs must be CUDA tensors"):
        var.decode(q, cache, indptr, indices, last, k_scale=0.5, v_scale=0.5)


@pytest.mark.nvcc
def test_fa2_decode_module_with_fp8_kv_compiles_for_sm90a(monkeypatch):
    import os
    import shutil
    if not (os.path.exists(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"))
            or shutil.which("nvcc")):
        pytest.skip("nvcc not installed: cannot compile CUDA here")
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    m = gen_module(fivar.load("softcap_sliding_window"), "batch_decode", "fa2", "bf16", 128, kv_dtype="fp8e4m3")
    assert m.build() in ("cold", "disk", "memory") and m.library_path.exists()
