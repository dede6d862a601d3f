"""The mask battery (benchmarks/masks/*.py) and seeded random masks from the spec grammar, on every prefill entry point
and backend and on decode, against the float64 torch reference (marked `gpu`).

None of these masks has a form fivar recognises: on FA3 and FA2 they run the tile-list form over the device block map
(fivar.runtime.fa3_tile_list; on FA2 a causal batch the mask cuts into documents runs as segments), on Triton the
block map. Shapes are awkward (lengths off every
tile, more keys than queries, a request of one query, GQA 32/8 and 4/4, page 16); the random masks' seed is fresh
for each run and printed with any failure. Planned calls must agree with one-shot ones.
"""
import os
import random

import pytest
import torch

from fivar.bench.suites import masks as battery, random_masks
from fivar.testing import (_ragged_reference, _to_paged, check_batch_prefill, check_single_prefill, compare,
                           example_params)

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("FIVAR_TEST_MASK_SEED") or random.randrange(1 << 20))  # set: rerun a failing seed
SIZE = 1024  # random masks are drawn for sequences of this many tokens
N_RANDOM = 8
CASES = [(name, entry.causal) for name, entry in battery.BATTERY.items()] + [
    (f"random:{i}", None) for i in range(N_RANDOM)]


def _variant(name: str):
    """(variant, causal) of a battery mask or of the seed's i-th random mask."""
    if name.startswith("random:"):
        m = random_masks.generate(SEED, N_RANDOM, SIZE)[int(name.split(":")[1])]
        return random_masks.load(m), m.causal
    return battery.load(name), battery.BATTERY[name].causal


def _ok(result):
    assert result.passed, f"{result} (random masks: seed {SEED}, size {SIZE})"


@pytest.mark.parametrize("backend", ["fa3", "fa2", "triton"])
@pytest.mark.parametrize("name,_", CASES)
def test_single_prefill(name, _, backend):
    v, causal = _variant(name)
    for qo_len, kv_len in ((1000, 1000), (333, 1111)):
        _ok(check_single_prefill(v, qo_len=qo_len, kv_len=kv_len, causal=causal, backend=backend))


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("heads", [(32, 8), (4, 4)])
@pytest.mark.parametrize("name,_", CASES)
def test_batch_prefill(name, _, heads, paged, backend):
    v, causal = _variant(name)
    qo = [1, 517, 200, 129]
    kv = [300, 700, 1023, 129]
    _ok(check_batch_prefill(v, qo_lens=qo, kv_lens=kv, paged=paged, causal=causal, backend=backend,
                            num_qo_heads=heads[0], num_kv_heads=heads[1]))


@pytest.mark.parametrize("heads", [(32, 8), (4, 4)])
@pytest.mark.parametrize("name,_", CASES)
def test_decode_one_shot_and_planned(name, _, heads):
    """Decode reads the trimmed pages, or the tile list where the mask keeps many runs of them (global keys, dilated
    and strided keys): one-shot and planned against the reference, and the planned run is the one-shot's."""
    v, _ = _variant(name)
    kv_lens = [1, 300, 777, SIZE]
    hq, hkv = heads
    q = torch.randn(len(kv_lens), hq, 128, dtype=torch.bfloat16, device="cuda")
    k, vv = (torch.randn(sum(kv_lens), hkv, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    params = example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=len(kv_lens), max_len=SIZE,
                            device="cuda")
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, 16)
    ref = _ragged_reference(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params)
    one = v.decode(q, cache, indptr, indices, last, **params)
    _ok(compare(v.name, f"decode {hq}/{hkv}", one, ref, torch.bfloat16))
    plan = v.plan_decode(indptr, indices, last, num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, page_size=16,
                         dtype=torch.bfloat16, **params)
    _ok(compare(v.name, f"planned decode {hq}/{hkv}", plan.run(q, cache), one, torch.bfloat16))


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
@pytest.mark.parametrize("name,_", CASES[:4] + CASES[-2:])
def test_planned_matches_one_shot(name, _, backend):
    v, causal = _variant(name)
    qo, kv = [400, 77], [900, 500]
    q = torch.randn(sum(qo), 32, 128, dtype=torch.bfloat16, device="cuda")
    k, vv = (torch.randn(sum(kv), 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    params = example_params(v, num_qo_heads=32, num_kv_heads=8, batch_size=2, max_len=max(kv), device="cuda")
    ind = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,  # noqa: E731
                                    device="cuda")
    one = v.batch_prefill_ragged(q, k, vv, ind(qo), ind(kv), causal=causal, backend=backend, **params)
    plan = v.plan_ragged(ind(qo), ind(kv), num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                         causal=causal, backend=backend, **params)
    assert plan._tile_list is not None or plan.segments is not None  # the tile-list form (FA2: or documents)
    _ok(compare(v.name, "planned vs one-shot", plan.run(q, k, vv), one, torch.bfloat16))
