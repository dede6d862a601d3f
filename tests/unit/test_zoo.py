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
    buckets = torch.tensor([[bucket(j - i) for j in range(n)] for i in range(n)])  # the formula, once per pair
    for b in range(32):
        table = torch.full((1, 32), -1e4)
        table[0, b] = 0.0
        weights = v.reference(q, k, torch.eye(n).unsqueeze(1), table=table, num_buckets=32)[:, 0, :]  # V = I
        expect = (buckets == b).float()
        expect = expect / expect.sum(1, keepdim=True).clamp_min(1)
        rows = expect.sum(1) > 0
        torch.testing.assert_close(weights[rows], expect[rows], atol=1e-4, rtol=0)
