"""The entry points as torch.library custom ops: torch.compile(fullgraph=True) of code calling fivar traces with no
graph break and matches eager (Triton twin under the interpreter), fake shapes and dtypes, one op family per
variant."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fivar
from fivar import AttentionVariant, Scalar, Tensor
from fivar.runtime import ops
from fivar.testing import _to_paged

DTYPE = torch.float16


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _scaled(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.temp * score + params.bias[qo_head] * float(kv_idx - q_idx)


SCALED = AttentionVariant(name="ops_scaled", logits=_scaled, params={
    "temp": Scalar(float, default=1.0), "bias": Tensor("float32", ("qo_head",))})


def _qkv(lq, lk, hq, hkv, d):
    return (torch.randn(lq, hq, d, dtype=DTYPE), torch.randn(lk, hkv, d, dtype=DTYPE),
            torch.randn(lk, hkv, d, dtype=DTYPE))


def _close(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert (a.float() - b.float()).abs().max() < 2e-3


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_compiled_prefill_with_params_matches_eager(compiler):
    q, k, v = _qkv(13, 29, 4, 2, 16)
    bias = torch.rand(4) * 0.1

    def layer(q, k, v, bias, temp):
        out, lse = SCALED.prefill(q * 1.0, k, v, causal=True, backend="triton", return_lse=True, temp=temp, bias=bias)
        return out.float().sum(-1) + lse, out

    compiled = torch.compile(layer, fullgraph=True, backend=compiler)
    got = compiled(q, k, v, bias, 0.7)
    want = layer(q, k, v, bias, 0.7)
    _close(got[0], want[0])
    _close(got[1], want[1])
    ref = SCALED.reference(q, k, v, causal=True, temp=0.7, bias=bias)
    assert (got[1].float() - ref).abs().max() < 2e-2


def test_compiled_ragged_and_decode_without_lse():
    variant = fivar.load("relative_bias")
    hq, hkv, d = 4, 2, 16
    q, k, v = _qkv(23, 43, hq, hkv, d)
    qo_indptr = torch.tensor([0, 5, 6, 23], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 19, 26, 43], dtype=torch.int32)
    params = {"bias": torch.randn(hq, 13), "max_distance": 6}
    kv_lens = [19, 7, 17]
    cache, indptr, indices, last = _to_paged(k, v, kv_lens, page_size=4)
    qd = torch.randn(3, hq, d, dtype=DTYPE)

    def step(q, k, v, qd, cache_k, cache_v, bias):
        a = variant.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, causal=True, backend="triton",
                                         bias=bias, max_distance=6)
        b = variant.decode(qd, (cache_k, cache_v), indptr, indices, last, backend="triton", bias=bias,
                           max_distance=6)
        return a * 2, b + 1

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, qd, *cache, params["bias"])
    want = step(q, k, v, qd, *cache, params["bias"])
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_one_graph_no_break():
    q, k, v = _qkv(8, 16, 2, 2, 16)
    variant = fivar.load("softcap")

    def f(q, k, v):
        return variant.prefill(q, k, v, backend="triton", softcap=20.0).sum()

    explanation = torch._dynamo.explain(f)(q, k, v)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    ns = ops.ops_namespace(variant)
    assert any(f"{ns}.prefill" in str(n.target) for g in explanation.graphs for n in g.graph.nodes)


def test_fake_shapes_and_dtypes_of_every_op():
    variant = SCALED
    torch_ops = ops.ops_of(variant)
    with FakeTensorMode():
        q = torch.empty(37, 8, 64, dtype=torch.bfloat16, device="cpu")
        k = torch.empty(100, 2, 64, dtype=torch.bfloat16)
        kc = torch.empty(9, 16, 2, 64, dtype=torch.bfloat16)
        ind = torch.empty(4, dtype=torch.int32)
        bias = torch.empty(8)
        for return_lse in (False, True):
            lse_shape = (37, 8) if return_lse else (0,)
            outs = [torch_ops.prefill(q, k, k, True, None, "fa2", return_lse, 0.5, bias),
                    torch_ops.ragged(q, k, k, ind, ind, False, 0.1, "fa3", return_lse, None, bias),
                    torch_ops.paged(q, kc, kc, ind, ind, ind, ind, None, ind, ind, False, None, "auto", return_lse,
                                    1.0, bias),
                    torch_ops.plan_run(q, 7, kc, kc, return_lse)]
            qd = q[:3]
            outs.append(torch_ops.decode(qd, kc, kc, ind, ind, ind, None, "fa2", return_lse, None, bias))
            for i, (o, lse) in enumerate(outs):
                tokens = 3 if i == 4 else 37
                assert o.shape == (tokens, 8, 64) and o.dtype == torch.bfloat16
                want = (tokens, 8) if return_lse else (0,)
                assert tuple(lse.shape) == want and lse.dtype == torch.float32, (i, lse.shape, lse_shape)


def test_opcheck_prefill():
    q, k, v = _qkv(9, 21, 2, 1, 16)
    bias = torch.rand(2)
    for return_lse in (False, True):
        torch.library.opcheck(ops.ops_of(SCALED).prefill, (q, k, v, False, None, "triton", return_lse, 0.5, bias),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def _halved(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score * 0.5


def test_one_family_per_variant():
    a = fivar.load("softcap")
    b = AttentionVariant(name="softcap", logits=a.logits, params=a.params)
    assert ops.ops_namespace(a) == ops.ops_namespace(b)  # another object, same code: the ops are shared
    other = AttentionVariant(name="softcap", logits=_halved)
    assert ops.ops_namespace(other) != ops.ops_namespace(a)  # same name, other code: its own ops
    assert ops.ops_namespace(a).startswith("fivar_softcap_")


def test_no_softmax_lse_is_refused_when_traced():
    variant = fivar.load("sigmoid")
    q, k, v = _qkv(4, 8, 2, 2, 16)

    def f(q, k, v):
        return variant.prefill(q, k, v, backend="triton", return_lse=True, bias=-1.0)

    with pytest.raises(Exception, match="variant 'sigmoid': return_lse=True needs a softmax variant"):
        torch.compile(f, fullgraph=True, backend="eager")(q, k, v)


def test_unknown_param_is_named_when_traced():
    variant = fivar.load("softcap")
    q, k, v = _qkv(4, 8, 2, 2, 16)

    def f(q, k, v):
        return variant.prefill(q, k, v, backend="triton", soft_cap=3.0)

    with pytest.raises(Exception, match="variant 'softcap': unknown parameter.*soft_cap"):
        torch.compile(f, fullgraph=True, backend="eager")(q, k, v)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_graph_plan_needs_a_gpu():
    variant = fivar.load("softcap")
    indptr, indices, last = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                             torch.tensor([5], dtype=torch.int32))
    with pytest.raises(fivar.FivarError, match="variant 'softcap': a CUDA-graph decode plan needs a CUDA GPU"):
        variant.plan_decode(indptr, indices, last, cuda_graph=True, max_batch=4, max_pages=16, num_qo_heads=8,
                            num_kv_heads=2, head_dim=128, page_size=16, device="cpu", softcap=20.0)


def test_a_compiled_verify_step_keeps_its_custom_mask_and_graph_plan_in_one_graph():
    """The verify entry points under torch.compile(fullgraph=True): the one-shot paged call with a packed draft-tree
    mask (its mask tensors are the op's arguments, checked when the graph runs) and a CUDA-graph verify plan's run
    (the twin's plan here), each equal to the eager call, with no graph break."""
    from fivar.integrations.serving import tree_mask
    variant = fivar.load("softcap")
    hq, hkv, d, page = 4, 2, 16, 4
    drafts, prefixes = [3, 5], [6, 9]
    parents = [[-1, 0, 0], [-1, 0, 1, 1, 3]]
    kv_lens = [p + n for p, n in zip(prefixes, drafts)]
    q, k, v = _qkv(sum(drafts), sum(kv_lens), hq, hkv, d)
    cache, indptr, indices, last = _to_paged(k, v, kv_lens, page_size=page)
    qo_indptr = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed, mask_indptr = tree_mask(prefixes, parents)

    def step(q, cache_k, cache_v, packed, mask_indptr):
        return variant.batch_prefill_paged(q, (cache_k, cache_v), qo_indptr, indptr, indices, last, causal=True,
                                           backend="triton", packed_custom_mask=packed, mask_indptr=mask_indptr,
                                           softcap=20.0) * 2

    explanation = torch._dynamo.explain(step)(q, *cache, packed, mask_indptr)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *cache, packed, mask_indptr)
    want = step(q, *cache, packed, mask_indptr)
    _close(got, want)
    unmasked = variant.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, causal=True, backend="triton",
                                           softcap=20.0) * 2
    assert (got.float() - unmasked.float()).abs().max() > 1e-2  # the trees drop pairs causal keeps: the mask ran

    plan = variant.plan_paged(qo_indptr, indptr, indices, last, cuda_graph=True, backend="triton", device="cpu",
                              max_batch=2, max_qo_len=5, max_pages=int(indptr[-1]), num_qo_heads=hq,
                              num_kv_heads=hkv, head_dim=d, page_size=page, dtype=DTYPE, causal=True,
                              packed_custom_mask=packed, mask_indptr=mask_indptr, softcap=20.0)
    q_static = torch.zeros(10, hq, d, dtype=DTYPE)
    q_static[:8] = q
    replay = lambda q, c0, c1: plan.run(q, (c0, c1)) + 1  # noqa: E731
    explanation = torch._dynamo.explain(replay)(q_static, *cache)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    got = torch.compile(replay, fullgraph=True, backend="aot_eager")(q_static, *cache)
    _close(got[:8], want / 2 + 1)
