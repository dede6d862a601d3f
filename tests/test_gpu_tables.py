"""Position-only logits terms as per-call tables on the GPU (marked `gpu`): FA2, FA3 and the Triton twin with the
tables against the reference, which evaluates the user's expression per element."""
import importlib.util
from pathlib import Path

import pytest
import torch

from fivar.config import override
from fivar.testing import check_batch_prefill, check_decode, check_single_prefill

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def _zoo(name):
    spec = importlib.util.spec_from_file_location(f"zoo_{name}", ROOT / "benchmarks" / "zoo" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.variant


VARIANTS = [("t5_buckets", "costly"), ("learned_relative_table", "all")]


@pytest.mark.parametrize("backend", ["fa2", "fa3", "triton"])
@pytest.mark.parametrize("name,mode", VARIANTS)
@pytest.mark.parametrize("qo_len,kv_len,causal", [(1, 1, False), (37, 129, False), (300, 300, True),
                                                  (257, 1000, False), (129, 1000, True)])
def test_single_prefill(name, mode, backend, qo_len, kv_len, causal):
    v = _zoo(name)
    with override(position_tables=mode):
        assert v.lowered.position_tables
        r = check_single_prefill(v, qo_len=qo_len, kv_len=kv_len, causal=causal, head_dim=128,
                                 dtype=torch.bfloat16, backend=backend)
    assert r.passed, r


@pytest.mark.parametrize("backend", ["fa2", "fa3", "triton"])
@pytest.mark.parametrize("name,mode", VARIANTS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_batch_prefill(name, mode, backend, paged, causal):
    v = _zoo(name)
    with override(position_tables=mode):
        r = check_batch_prefill(v, qo_lens=[17, 1, 40], kv_lens=[17, 70, 300], paged=paged, causal=causal,
                                head_dim=128, dtype=torch.bfloat16, backend=backend)
    assert r.passed, r


@pytest.mark.parametrize("backend", ["fa2", "triton"])
@pytest.mark.parametrize("name,mode", VARIANTS)
def test_decode(name, mode, backend):
    v = _zoo(name)
    with override(position_tables=mode):
        r = check_decode(v, kv_lens=[1, 33, 517, 1000], head_dim=128, dtype=torch.bfloat16, backend=backend)
    assert r.passed, r


def test_plan_reuses_its_table_and_a_new_plan_sees_a_changed_param():
    """One-shot calls keep plans keyed on the params by identity and version: an in-place write to the bucket
    table is planned again, and so its position table is evaluated again."""
    v = _zoo("t5_buckets")
    q, k, vv = (torch.randn(300, 32, 128, dtype=torch.bfloat16, device="cuda"),
                *(torch.randn(300, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)))
    table = torch.randn(32, 32, device="cuda")
    indptr = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
    for _ in range(2):
        out = v.batch_prefill_ragged(q, k, vv, indptr, indptr, causal=True, backend="fa3", table=table)
        ref = v.reference(q, k, vv, causal=True, table=table)
        assert (out.float() - ref).abs().max() < 6e-2
        table.mul_(-1.5)
