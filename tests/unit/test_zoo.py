"""The real-model zoo (benchmarks/zoo/*.py): every variant parses, its torch reference runs, and its Triton twin
matches the reference under Triton's interpreter at one tiny fp16 shape, with windows, chunks and sinks scaled
down so that every mask actually removes keys there."""
import math
from pathlib import Path

import pytest
import torch

from fivar.bench.suites.zoo import ZOO, zoo_dir
from fivar.registry import load_file
from fivar.spec.params import Scalar, Tensor
from fivar.testing import compare, example_params

L, HQ, HKV, D = 40, 4, 2, 16
DTYPE = torch.float16
FILES = sorted(p.stem for p in Path(zoo_dir()).glob("*.py") if not p.name.startswith("_"))


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def test_the_zoo_is_complete():
    assert len(FILES) >= 12 and sorted(ZOO) == FILES


def _tiny_params(v):
    """The example params at L keys, each int scalar that sizes no tensor scaled to a few keys, per-head windows
    drawn small: the masks cut inside this short sequence."""
    p = example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=1, max_len=L, device="cpu")
    sizing = {d for t in v.params.values() if isinstance(t, Tensor) for d in t.dims}
    for name, decl in v.params.items():
        if isinstance(decl, Scalar) and decl.dtype is int and not any(name in d for d in sizing):
            p[name] = int(torch.randint(2, L // 3, ()))
    if "windows" in p:
        p["windows"] = torch.randint(1, L // 2, (HQ,), dtype=torch.int32)
    return p


@pytest.mark.parametrize("name", FILES)
def test_zoo_variant_reference_and_triton_twin(name):
    torch.manual_seed(hash(name) % 1000)
    v = load_file(zoo_dir() / f"{name}.py")
    assert v.name == name
    causal = ZOO[name].causal
    params = _tiny_params(v)
    q, k, vv = (torch.randn(L, h, D, dtype=DTYPE) for h in (HQ, HKV, HKV))
    ref = v.reference(q, k, vv, causal=causal, **params)
    assert ref.shape == (L, HQ, D) and torch.isfinite(ref).all()
    out = v.prefill(q, k, vv, causal=causal, backend="triton", **params)
    r = compare(name, f"triton L={L} causal={causal}", out, ref, DTYPE)
    assert r.passed, r


def test_t5_buckets_match_the_t5_formula():
    """The zoo's T5 bias against T5's bucket function written out in float64 (bidirectional, 32 buckets, max
    distance 128), through the reference with one-hot bias tables."""
    v = load_file(zoo_dir() / "t5_buckets.py")

    def bucket(rel):
        n, out = abs(rel), (16 if rel > 0 else 0)
        if n < 8:
            return out + n
        return out + min(15, 8 + int(math.log(n / 8) / math.log(128 / 8) * 8))
    n = 200  # offsets past 128: the clamped last bucket is reached both ways
    q = k = torch.zeros(n, 1, n)  # every score 0: the output rows are the softmax of the biases alone
    for b in range(32):
        table = torch.full((1, 32), -1e4)
        table[0, b] = 0.0
        weights = v.reference(q, k, torch.eye(n).unsqueeze(1), table=table, num_buckets=32)[:, 0, :]  # V = I
        expect = torch.tensor([[1.0 if bucket(j - i) == b else 0.0 for j in range(n)] for i in range(n)])
        expect = expect / expect.sum(1, keepdim=True).clamp_min(1)
        rows = expect.sum(1) > 0
        torch.testing.assert_close(weights[rows], expect[rows], atol=1e-4, rtol=0)


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
