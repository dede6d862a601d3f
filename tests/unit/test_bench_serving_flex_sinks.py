"""The serving suite's Flex contenders for a variant with a sink (fivar.bench.suites.serving: verify's batch gathered
dense, the mixed step packed into one sequence): Flex of the variant without its sink, the sink joined after from
Flex's log-sum-exp (fivar.flex.join_sink), computes the variant. Eager Flex on the CPU at small fp32 shapes against
the float64 reference, for gpt-oss (a sink per head) and a sink that is an expression of the request and the head."""
import pytest
import torch

import fivar
from fivar import AttentionVariant, Scalar, Tensor
from fivar.bench.suites import serving
from fivar.codegen.torch_ref import reference_attention
from fivar.flex import without_sink

HEADS, HEAD_DIM = (4, 2), 16


def _window(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window


def _expression_sink(batch, qo_head, params):
    return params.sinks[qo_head] * 0.5 + 1.0 + 0.75 * batch


EXPRESSION = AttentionVariant(name="expression_sinks", mask=_window, sink=_expression_sink,
                              params={"sinks": Tensor("float32", ("qo_head",)), "window": Scalar(int, default=9)})
VARIANTS = {"gpt_oss": lambda: fivar.load("gpt_oss"), "expression": lambda: EXPRESSION}
SMALL = dict(heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float32)


def _eager_flex(run):
    try:
        return run()
    except Exception as e:  # flex's eager CPU path is not available in every torch build
        pytest.skip(f"FlexAttention eager on CPU unavailable: {type(e).__name__}: {e}")


def _verify_reference(v, t, params, batch):
    n, kv = t["drafts"], t["kv"]
    refs = []
    for b in range(batch):
        qs, ks = slice(b * n, (b + 1) * n), slice(b * kv, (b + 1) * kv)
        refs.append(reference_attention(v, t["q"][qs].double(), t["k"][ks].double(), t["v"][ks].double(),
                                        causal=True, params=params, batch_idx=b, batch_size=batch,
                                        custom_mask=t["rows"][b], float_dtype=torch.float64))
    return torch.cat(refs)


def _mixed_reference(v, t, params):
    qo, hkv = t["step"].qo_indptr.tolist(), HEADS[1]
    refs = []
    for b, n in enumerate(t["kv"]):
        pages = t["table"][b, :-(-n // serving.PAGE)].long()
        k, vv = (x[pages].reshape(-1, hkv, HEAD_DIM)[:n].double() for x in t["cache"])
        refs.append(reference_attention(v, t["q"][qo[b]:qo[b + 1]].double(), k, vv, causal=True, params=params,
                                        batch_idx=b, batch_size=t["batch"], float_dtype=torch.float64))
    return torch.cat(refs)


def _sink_matters(v, ref, reference):
    """The sink takes a good part of the rows here: Flex without the join (or with it reversed) is far off."""
    assert (ref - reference(without_sink(v))).abs().max() > 0.05


@pytest.mark.parametrize("form", ["tree", "chain"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_verify_flex_with_a_sink_computes_the_variant(name, form):
    torch.manual_seed(0)
    batch = 3
    v, t, params = serving._problem(VARIANTS[name](), 5, form, {"window": 9}, batch=batch, context=20,
                                    device="cpu", **SMALL)
    got = _eager_flex(serving._flex(v, t, params, compiled=False))
    ref = _verify_reference(v, t, params, batch)
    _sink_matters(v, ref, lambda u: _verify_reference(u, t, params, batch))
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_mixed_flex_with_a_sink_computes_the_variant(name):
    """Decodes and chunks (one after a cached prefix) packed into one sequence: each row gets its own request's
    sink."""
    torch.manual_seed(1)
    v, t, params = serving._mixed_problem(VARIANTS[name](), ((0, 20), (7, 13)), 3, {"window": 9}, "cpu",
                                          context=40, **SMALL)
    got = _eager_flex(serving._mixed_flex(v, t, params, compiled=False))
    ref = _mixed_reference(v, t, params)
    _sink_matters(v, ref, lambda u: _mixed_reference(u, t, params))
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_the_sink_is_evaluated_per_request_and_head():
    from fivar.flex import flex_sink
    sinks = torch.randn(HEADS[0])
    got = flex_sink(EXPRESSION, {"sinks": sinks, "window": 9}, num_qo_heads=HEADS[0], num_kv_heads=HEADS[1],
                    device="cpu", batch_size=3)
    want = sinks[None, :] * 0.5 + 1.0 + 0.75 * torch.arange(3.0)[:, None]
    torch.testing.assert_close(got, want)
