"""The real-model zoo (benchmarks/zoo/*.py) on the GPU: each variant's compiled prefill (FA3, FA2) and paged decode
against its reference at awkward shapes. Kept apart from tests/unit/test_zoo.py, whose CPU tests run Triton's
interpreter for the whole module."""
from pathlib import Path

import pytest
import torch

from fivar.bench.suites.zoo import ZOO, zoo_dir
from fivar.registry import load_file
from fivar.spec.params import Scalar, Tensor
from fivar.testing import compare, example_params

FILES = sorted(p.stem for p in Path(zoo_dir()).glob("*.py") if not p.name.startswith("_"))


def _gpu_params(v, L, hq, batch):
    p = example_params(v, num_qo_heads=hq, num_kv_heads=2, batch_size=batch, max_len=L, device="cuda")
    sizing = {d for t in v.params.values() if isinstance(t, Tensor) for d in t.dims}
    for name, decl in v.params.items():  # windows, chunks and sinks that cut inside these lengths
        if isinstance(decl, Scalar) and decl.dtype is int and not any(name in d for d in sizing):
            p[name] = int(torch.randint(3, L // 3, ()))
    if "windows" in p:
        p["windows"] = torch.randint(1, L // 2, (hq,), dtype=torch.int32, device="cuda")
    return p


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fa3", "fa2"])
@pytest.mark.parametrize("name", FILES)
def test_zoo_prefill_on_the_gpu(name, backend):
    """Each zoo variant's compiled prefill against its reference at an awkward shape (qo 333 rows over 517 keys)."""
    if backend == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FA3 needs Hopper")
    torch.manual_seed(1)
    v = load_file(zoo_dir() / f"{name}.py")
    lq, lk, hq = 333, 517, 8
    params = _gpu_params(v, lk, hq, 1)
    q = torch.randn(lq, hq, 128, dtype=torch.bfloat16, device="cuda")
    k, vv = (torch.randn(lk, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    out = v.prefill(q, k, vv, causal=ZOO[name].causal, backend=backend, **params)
    ref = v.reference(q, k, vv, causal=ZOO[name].causal, **params)
    r = compare(name, f"{backend} qo{lq} kv{lk}", out, ref, torch.bfloat16)
    assert r.passed, r


@pytest.mark.gpu
@pytest.mark.parametrize("name", FILES)
def test_zoo_decode_on_the_gpu(name):
    """Paged decode (page 16, ragged lengths) of each zoo variant against its reference, request by request."""
    from fivar.testing import _to_paged
    torch.manual_seed(2)
    v = load_file(zoo_dir() / f"{name}.py")
    lens, hq = [77, 300, 1], 8
    params = _gpu_params(v, max(lens), hq, len(lens))
    k, vv = (torch.randn(sum(lens), 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    q = torch.randn(len(lens), hq, 128, dtype=torch.bfloat16, device="cuda")
    cache, indptr, indices, last = _to_paged(k, vv, lens, 16)
    out = v.decode(q, cache, indptr, indices, last, **params)
    starts = [sum(lens[:b]) for b in range(len(lens))]
    for b, (s, n) in enumerate(zip(starts, lens)):
        ref = v.reference(q[b:b + 1], k[s:s + n], vv[s:s + n], batch_idx=b, batch_size=len(lens), **params)
        r = compare(name, f"decode request {b} of {n} keys", out[b:b + 1], ref, torch.bfloat16)
        assert r.passed, r


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_zoo_per_head_windows_on_fa3(causal):
    """A window per head with one head global: FA3's tile list over the union of the heads' maps, the mask evaluated
    per head on cut tiles; ragged batch of three, output and LSE against the reference."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FA3 needs Hopper")
    torch.manual_seed(3)
    v = load_file(zoo_dir() / "per_head_window.py")
    hq, qo_lens, kv_lens = 8, [700, 3, 290], [900, 3, 290]
    params = {"windows": torch.tensor([40, 1 << 30, 7, 300, 129, 64, 1, 500], dtype=torch.int32, device="cuda")}
    qo = torch.tensor([0] + qo_lens, device="cuda").cumsum(0).to(torch.int32)
    kv = torch.tensor([0] + kv_lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(qo_lens), hq, 128, dtype=torch.bfloat16, device="cuda")
    k, vv = (torch.randn(sum(kv_lens), 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    plan = v.plan_ragged(qo, kv, num_qo_heads=hq, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                         causal=causal, backend="fa3", **params)
    out, lse = plan.run(q, k, vv, return_lse=True)
    for b in range(3):
        s, e, ks, ke = (int(x) for x in (qo[b], qo[b + 1], kv[b], kv[b + 1]))
        ref, ref_lse = v.reference(q[s:e], k[ks:ke], vv[ks:ke], causal=causal, batch_idx=b, batch_size=3,
                                   return_lse=True, **params)
        r = compare("per_head_window", f"per-head windows, request {b}", out[s:e], ref, torch.bfloat16)
        assert r.passed, r
        assert torch.allclose(lse[s:e].float(), ref_lse.float(), atol=2e-2, rtol=1e-3)


@pytest.mark.gpu
def test_zoo_prefix_lm_batch_on_fa3():
    """A non-causal prefix-LM batch on FA3 (the tile list): prefixes of no key, one key, past every key and inside;
    requests of one row and with more keys than rows; output and LSE against the reference, planned and one-shot."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FA3 needs Hopper")
    from fivar.testing import _ragged_reference
    torch.manual_seed(4)
    v = load_file(zoo_dir() / "prefix_lm.py")
    hq, qo_lens, kv_lens = 8, [300, 1, 129, 77, 500], [300, 40, 260, 77, 700]
    params = {"prefix_len": torch.tensor([0, 1, 999, 30, 333], dtype=torch.int32, device="cuda")}
    qo = torch.tensor([0] + qo_lens, device="cuda").cumsum(0).to(torch.int32)
    kv = torch.tensor([0] + kv_lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(qo_lens), hq, 128, dtype=torch.bfloat16, device="cuda")
    k, vv = (torch.randn(sum(kv_lens), 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    ref, ref_lse = _ragged_reference(v, q, k, vv, qo_lens, kv_lens, False, params, return_lse=True)
    plan = v.plan_ragged(qo, kv, num_qo_heads=hq, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                         backend="fa3", **params)
    assert plan.segments is None and plan._tile_list is not None
    for out, lse in (plan.run(q, k, vv, return_lse=True),
                     v.batch_prefill_ragged(q, k, vv, qo, kv, backend="fa3", return_lse=True, **params)):
        r = compare("prefix_lm", "fa3 non-causal batch", out, ref, torch.bfloat16)
        assert r.passed, r
        assert torch.allclose(lse.float(), ref_lse.float(), atol=2e-2, rtol=0)
