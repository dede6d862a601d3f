"""An auto plan of a paged batch mixing short requests (decodes, drafts) and long ones (prefill chunks) runs the short
ones as an FA2 plan and the rest as an FA3 plan, each over its own rows (fivar.runtime.mixed), end to end on the CPU
through the stand-ins of FlashInfer's wrappers (test_fa2_block_form): the whole batch must equal the float64
reference, output and LSE, whatever the order of its requests."""
import random

import pytest
import torch

from fivar import AttentionVariant, Scalar, Tensor, tanh
from fivar.codegen.torch_ref import reference_attention
from fivar.runtime import attention, mixed, plans
from fivar.testing import _ragged_reference, _to_paged

from test_fa2_block_form import cpu_fa2, interpret  # noqa: F401  (fixtures: the wrappers' stand-ins)


def _softcap(score, b, h, kh, q, kv, p):
    return p.cap * tanh(score / p.cap)


def _sinks_window(b, h, kh, q, kv, p):
    return (kv < p.n_sink or q - kv < p.w) and kv <= q


def _head_window(b, h, kh, q, kv, p):
    return q - kv < p.hw[h]


def _batch_scaled(score, b, h, kh, q, kv, p):
    return score * (1.0 + 0.25 * b)


def _documents(b, h, kh, q, kv, p):
    return p.doc[b, q] == p.doc[b, kv]


def _per_request_temperature(score, b, h, kh, q, kv, p):
    return score * p.temp[b]


def _first_request_documents(b, h, kh, q, kv, p):
    return p.doc[0, q] == p.doc[0, kv]


VARIANTS = {
    "softcap": lambda: AttentionVariant(name="mx_softcap", logits=_softcap, params={"cap": Scalar(float, default=3.0)}),
    "sinks_window": lambda: AttentionVariant(name="mx_sinks_window", mask=_sinks_window,
                                             params={"n_sink": Scalar(int, default=3), "w": Scalar(int, default=9)}),
    "head_window_softcap": lambda: AttentionVariant(
        name="mx_head_window", mask=_head_window, logits=_softcap,
        params={"hw": Tensor("int32", ("qo_head",)), "cap": Scalar(float, default=3.0)}),
    # `batch` read only as the row of batch-sized tensors: each part takes its requests' rows
    "documents_temperature": lambda: AttentionVariant(
        name="mx_documents", mask=_documents, logits=_per_request_temperature,
        params={"doc": Tensor("int32", ("batch", "position")), "temp": Tensor("float32", ("batch",))}),
}


@pytest.fixture
def by_backend(cpu_fa2, monkeypatch):
    """cpu_fa2's stand-ins, each plan on the target its backend names (auto: FA3, as on a Hopper GPU)."""
    def plan_setup(plan, variant, qo_indptr, kv_indptr, hq, hkv, d, dtype, backend, device):
        plan.variant, plan.device, plan.batch = variant, torch.device("cpu"), qo_indptr.numel() - 1
        plan.target = "fa2" if backend == "fa2" else "fa3"
        return dtype, qo_indptr, kv_indptr
    monkeypatch.setattr(plans, "_plan_setup", plan_setup)
    return cpu_fa2


def _step(rng: random.Random, order: str):
    """(qo_lens, kv_lens) of an engine step: decodes and drafts (1-32 queries) beside chunks (33-90 queries), at
    head_dim 16 FA3's query tile is 128 rows, so a request of <= 32 is short."""
    short = [rng.choice([1, 1, 1, 2, 5, 32]) for _ in range(rng.randint(1, 5))]
    long = [rng.randint(33, 90) for _ in range(rng.randint(1, 3))]
    kinds = [("s", n) for n in short] + [("l", n) for n in long]
    if order == "decodes first":
        kinds.sort(key=lambda x: x[0] == "l")
    elif order == "chunks first":
        kinds.sort(key=lambda x: x[0] == "s")
    else:  # a short request on each side of a long one, the rest shuffled: the short rows are not consecutive
        rng.shuffle(kinds)
        kinds = [("s", 1), ("l", 40), ("s", 2)] + kinds
    qo_lens = [n for _, n in kinds]
    return qo_lens, [n + rng.randint(0, 60) for n in qo_lens]


def _reference(v, q, k, vv, qo_lens, kv_lens, params, sm_scale):
    """float64 reference of the whole batch, request by request, causal: (out, log2 lse)."""
    outs, lses, a, b0 = [], [], 0, 0
    for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens)):
        o, lse = reference_attention(v, q[a:a + lq].double(), k[b0:b0 + lk].double(), vv[b0:b0 + lk].double(),
                                     causal=True, sm_scale=sm_scale, params=params, batch_idx=b,
                                     batch_size=len(qo_lens), float_dtype=torch.float64, return_lse=True)
        outs.append(o), lses.append(lse)
        a, b0 = a + lq, b0 + lk
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("order", ["decodes first", "chunks first", "interleaved"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_a_mixed_step_runs_in_two_parts_equal_to_the_reference(by_backend, name, order, seed):
    current, made = by_backend
    rng = random.Random(seed * 101 + len(name) + len(order))
    gen = torch.Generator().manual_seed(seed)
    v = VARIANTS[name]()
    current[0] = v
    qo_lens, kv_lens = _step(rng, order)
    params = {"hw": torch.randint(1, 40, (4,), generator=gen, dtype=torch.int32)} if "hw" in v.params else {}
    if "doc" in v.params:  # each request's own documents (ids rising along its positions) and temperature
        steps = torch.rand(len(qo_lens), max(kv_lens), generator=gen) < 0.04
        params["doc"] = steps.to(torch.int32).cumsum(1).to(torch.int32)
        params["temp"] = torch.rand(len(qo_lens), generator=gen) + 0.5
    if "cap" in v.params:  # not the default: each part must get the call's params and scale
        params["cap"] = rng.choice([1.5, 6.0])
    sm_scale = rng.choice([0.11, 0.4])
    q = torch.randn(sum(qo_lens), 4, 16, generator=gen).half()
    k = torch.randn(sum(kv_lens), 2, 16, generator=gen).half()
    vv = torch.randn(sum(kv_lens), 2, 16, generator=gen).half()
    page = rng.choice([1, 4, 16])
    (k_cache, v_cache), kv_indptr, kv_indices, last = _to_paged(k, vv, kv_lens, page)  # a shuffled page pool
    qo_indptr = torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32)
    plan = attention.PagedAttentionPlan(v, qo_indptr, kv_indptr, kv_indices, last, num_qo_heads=4, num_kv_heads=2,
                                        head_dim=16, page_size=page, dtype=torch.float16, causal=True,
                                        sm_scale=sm_scale, backend="auto", device="cpu", params=params)
    assert plan._mixed is not None
    (short_plan, short_rows), (long_plan, long_rows) = plan._mixed.parts
    assert short_plan.target == "fa2" and long_plan.target == "fa3"
    assert short_plan.batch + long_plan.batch == len(qo_lens)
    assert isinstance(short_rows, slice) == (order != "interleaved")
    ref, ref_lse = _reference(v, q, k, vv, qo_lens, kv_lens, params, sm_scale)
    out, lse = plan.run(q, (k_cache, v_cache), return_lse=True)
    assert torch.allclose(out.double(), ref.double(), atol=2e-3), (out.double() - ref.double()).abs().max()
    assert torch.allclose(lse.double(), ref_lse.double(), atol=1e-3)
    assert torch.equal(plan.run(q, (k_cache, v_cache)), out)


def test_what_splits_and_what_does_not(by_backend):
    softcap = VARIANTS["softcap"]()
    lens = lambda *xs: torch.tensor(xs)  # noqa: E731
    # head_dim 128: FA3's tile is 128 rows, short is <= 32 queries
    assert mixed.splits(softcap, "auto", "fa3", lens(1, 32, 33), 128)
    assert not mixed.splits(softcap, "auto", "fa3", lens(1, 32, 8), 128)  # all short: FA2 alone
    assert not mixed.splits(softcap, "auto", "fa3", lens(33, 2048), 128)  # all long
    assert not mixed.splits(softcap, "fa3", "fa3", lens(1, 2048), 128)  # FA3 asked for: FA3 it is
    assert not mixed.splits(softcap, "auto", "fa2", lens(1, 2048), 128)  # FA2 packs heads: nothing to gain
    # head_dim 64: FA3's tile is 192 rows, short is <= 48 queries
    assert mixed.splits(softcap, "auto", "fa3", lens(48, 49), 64)
    assert not mixed.splits(softcap, "auto", "fa3", lens(49, 60), 64)
    reads = AttentionVariant(name="mx_batch_scaled", logits=_batch_scaled)
    assert not mixed.splits(reads, "auto", "fa3", lens(1, 2048), 128)  # a part would renumber its requests
    rows = VARIANTS["documents_temperature"]()  # `batch` only as the row of batch-sized tensors: the parts take theirs
    assert mixed.splits(rows, "auto", "fa3", lens(1, 2048), 128)
    assert mixed.batch_dims(rows) == {"doc": (0,), "temp": (0,)}
    first = AttentionVariant(name="mx_first_documents", mask=_first_request_documents,
                             params={"doc": Tensor("int32", ("batch", "position"))})
    assert not mixed.splits(first, "auto", "fa3", lens(1, 2048), 128)  # request 0's row: not a part's own


def test_short_requests_alone_plan_on_fa2_and_a_batch_read_keeps_one_plan(by_backend):
    current, _ = by_backend
    gen = torch.Generator().manual_seed(3)
    for v, qo_lens, split, target in ((VARIANTS["softcap"](), [1, 3, 1], False, "fa2"),
                                      (AttentionVariant(name="mx_batch_scaled", logits=_batch_scaled), [1, 50], False,
                                       "fa3")):
        current[0] = v
        kv_lens = [n + 7 for n in qo_lens]
        q = torch.randn(sum(qo_lens), 4, 16, generator=gen).half()
        k = torch.randn(sum(kv_lens), 2, 16, generator=gen).half()
        vv = torch.randn(sum(kv_lens), 2, 16, generator=gen).half()
        cache, kv_indptr, kv_indices, last = _to_paged(k, vv, kv_lens, 4)
        plan = attention.PagedAttentionPlan(v, torch.tensor([0] + qo_lens).cumsum(0).to(torch.int32), kv_indptr,
                                            kv_indices, last, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                                            dtype=torch.float16, causal=True, backend="auto", device="cpu")
        assert (plan._mixed is not None) == split and plan.target == target
        ref = _ragged_reference(v, q.float(), k.float(), vv.float(), qo_lens, kv_lens, True, {})
        assert torch.allclose(plan.run(q, cache).double(), ref.double(), atol=2e-3)
