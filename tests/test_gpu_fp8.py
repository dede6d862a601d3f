"""FP8 (e4m3) KV caches on FA2's paged kernels (marked `gpu`): decode on the CUDA-core decode kernel (GQA 8/8) and
the tensor-core paged kernel (GQA 32/8), the planned runs with per-layer scales, and paged prefill, against the
reference over the dequantized cache; bf16 q, hd128, soft-cap and sliding window."""
import pytest
import torch

import fivar
from fivar.testing import _ragged_reference, _to_paged, check_batch_prefill, check_decode, compare, quantize_kv

pytestmark = pytest.mark.gpu
FP8, DTYPE, D = torch.float8_e4m3fn, torch.bfloat16, 128
VARIANTS = ["softcap", "sliding_window"]


@pytest.mark.parametrize("heads", [(32, 8), (8, 8)])  # tensor-core paged kernel, CUDA-core decode kernel
@pytest.mark.parametrize("name", VARIANTS)
def test_decode(name, heads):
    torch.manual_seed(0)
    r = check_decode(fivar.load(name), kv_lens=[1, 33, 517, 1000], num_qo_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=D, dtype=DTYPE, kv_dtype=FP8)
    assert r.passed, r


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", VARIANTS)
def test_paged_prefill(name, causal):
    torch.manual_seed(0)
    r = check_batch_prefill(fivar.load(name), qo_lens=[17, 1, 40], kv_lens=[17, 70, 300], paged=True,
                            num_qo_heads=32, num_kv_heads=8, head_dim=D, dtype=DTYPE, causal=causal, kv_dtype=FP8)
    assert r.passed, r


@pytest.mark.parametrize("heads", [(32, 8), (8, 8)])
@pytest.mark.parametrize("name", VARIANTS)
def test_planned_decode_takes_each_layers_scales(name, heads):
    """One plan, two layers with their own caches and scales (k_scale folded into the launch per scale)."""
    torch.manual_seed(0)
    var, (hq, hkv), kv_lens = fivar.load(name), heads, [5, 300, 1000]
    params = {"window": 64} if "window" in var.params else {}
    layers = []
    for _ in range(2):
        k, v = torch.randn(sum(kv_lens), hkv, D, device="cuda"), 3 * torch.randn(sum(kv_lens), hkv, D, device="cuda")
        k8, v8, k_scale, v_scale = quantize_kv(k, v, FP8)
        layers.append((k8, v8, k_scale, v_scale))
    pages = _to_paged(layers[0][0], layers[0][1], kv_lens, 16)
    _, indptr, indices, last = pages
    plan = var.plan_decode(indptr, indices, last, num_qo_heads=hq, num_kv_heads=hkv, head_dim=D, page_size=16,
                           dtype=DTYPE, kv_dtype=FP8, **params)
    for k8, v8, k_scale, v_scale in layers:
        cache = torch.zeros(indices.numel(), 16, hkv, D, device="cuda").to(FP8), \
            torch.zeros(indices.numel(), 16, hkv, D, device="cuda").to(FP8)
        off = 0  # the same page layout for every layer
        for b, n in enumerate(kv_lens):
            for j in range((n + 15) // 16):
                lo, hi = off + 16 * j, min(off + 16 * (j + 1), off + n)
                page = int(indices[int(indptr[b]) + j])
                cache[0][page, :hi - lo], cache[1][page, :hi - lo] = k8[lo:hi], v8[lo:hi]
            off += n
        q = torch.randn(len(kv_lens), hq, D, dtype=DTYPE, device="cuda")
        out = plan.run(q, cache, k_scale=k_scale, v_scale=v_scale)
        ref = _ragged_reference(var, q, k8.float() * k_scale, v8.float() * v_scale, [1] * len(kv_lens), kv_lens,
                                False, params)
        r = compare(name, f"planned fp8 decode {hq}/{hkv}", out, ref, DTYPE)
        assert r.passed, r


def test_plan_refuses_a_cache_of_another_dtype():
    var = fivar.load("softcap")
    _, indptr, indices, last = _to_paged(torch.randn(40, 8, D, device="cuda"), torch.randn(40, 8, D, device="cuda"),
                                         [40], 16)
    plan = var.plan_decode(indptr, indices, last, num_qo_heads=32, num_kv_heads=8, head_dim=D, page_size=16,
                           dtype=DTYPE, kv_dtype=FP8)
    cache = torch.randn(indices.numel(), 16, 8, D, device="cuda", dtype=DTYPE)
    with pytest.raises(fivar.FivarError, match="the plan was made for torch.float8_e4m3fn"):
        plan.run(torch.randn(1, 32, D, dtype=DTYPE, device="cuda"), (cache, cache))
