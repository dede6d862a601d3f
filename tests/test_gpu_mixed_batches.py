"""Mixed steps on the GPU (marked `gpu`): prefill chunks and decodes of one variant in one paged batch
(`fivar.integrations.serving.mixed_step`), FA3, FA2 and the Triton twin against the torch reference with the LSE,
bf16 hd128 GQA 32/8, pages of 16 and 1, and one-shot calls equal to their plan."""
import random

import pytest
import torch

import fivar
from fivar.codegen.torch_ref import reference_attention
from fivar.integrations.serving import mixed_step
from fivar.testing import compare, example_params

from test_gpu_engine import _check_lse

pytestmark = pytest.mark.gpu
DTYPE, HQ, HKV, D = torch.bfloat16, 32, 8, 128


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _step(page: int, engine_order: bool = False):
    """Three chunks (one continuing a cached prefix, two from scratch), five decodes over contexts up to 2000 keys,
    shuffled (engine_order: the decodes first, as engines order a step); a shuffled page pool and a padded block
    table."""
    reqs = [(random.randint(1, 900), random.randint(100, 600)), (0, random.randint(130, 500)), (0, 77)]
    reqs += [(random.randint(1, 2000), 1) for _ in range(5)]
    random.shuffle(reqs)
    if engine_order:
        reqs.sort(key=lambda r: r[1] > 1)
    cached, new = [c for c, _ in reqs], [n for _, n in reqs]
    kv = [c + n for c, n in zip(cached, new)]
    n_pages = [-(-n // page) for n in kv]
    perm = torch.randperm(sum(n_pages), device="cuda")
    table = torch.zeros(len(kv), max(n_pages) + 1, dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[at:at + n]
        at += n
    cache = tuple(torch.randn(sum(n_pages), page, HKV, D, dtype=DTYPE, device="cuda") for _ in range(2))
    return cached, new, kv, table, cache


def _reference(v, q, cache, table, new, kv, page, params):
    outs, lses, a = [], [], 0
    for b, (lq, lk) in enumerate(zip(new, kv)):
        pages = table[b, :-(-lk // page)].long()
        k, vv = (c[pages].reshape(-1, HKV, D)[:lk] for c in cache)
        o, lse = reference_attention(v, q[a:a + lq], k, vv, causal=True, params=params, batch_idx=b,
                                     batch_size=len(new), return_lse=True)
        outs.append(o), lses.append(lse)
        a += lq
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("backend", ["auto", "fa3", "fa2", "triton", "auto-engine-order"])
@pytest.mark.parametrize("name", ["softcap", "sliding_window", "gpt_oss", "document_mask"])
@pytest.mark.parametrize("page", [16, 1])
def test_mixed_step_matches_the_reference_and_its_plan(backend, name, page):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if backend == "fa3" and not _sm90():
        pytest.skip("FA3 needs an sm90 GPU")
    # auto on sm90: the decodes as an FA2 plan, the chunks as an FA3 plan (fivar.runtime.mixed); document_mask's
    # parts each take their requests' rows of doc_ids
    # auto-engine-order: the decodes' rows before the chunks', so the two parts run at once on two streams
    engine_order = backend == "auto-engine-order"
    backend = "auto" if engine_order else backend
    v = fivar.load(name)
    cached, new, kv, table, cache = _step(page, engine_order)
    params = example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=len(new), max_len=max(kv),
                            device="cuda")
    step = mixed_step(cached, new, table, page, device="cuda")
    q = torch.randn(sum(new), HQ, D, dtype=DTYPE, device="cuda")
    out, lse = v.batch_prefill_paged(q, cache, *step, causal=True, backend=backend, return_lse=True, **params)
    ref, ref_lse = _reference(v, q, cache, table, new, kv, page, params)
    r = compare(v.name, f"mixed step page {page} [{backend}]", out, ref, DTYPE)
    assert r.passed, r
    _check_lse(f"{name} mixed step [{backend}]", lse, ref_lse)
    if backend != "triton":
        plan = v.plan_paged(*step, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=page, dtype=DTYPE,
                            causal=True, backend=backend, **params)
        planned, planned_lse = plan.run(q, cache, return_lse=True)
        assert torch.equal(planned, out) and torch.equal(planned_lse, lse)
        if backend == "auto" and _sm90():
            assert plan._mixed is not None
