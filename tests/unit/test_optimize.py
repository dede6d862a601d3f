"""The compiled targets' passes (score-scale folding, hoisting, output-scale split) keep the meaning.

The kernels hand a variant the unscaled q.k and multiply its result by sm_scale_log2 = log2(e) * factor;
for every bundled variant, that lowered form must equal the original logits on random inputs.
"""
import pytest
import torch

import fivar
from fivar.codegen.torch_ref import TorchEvaluator, eval_scalar
from fivar.spec import optimize
from fivar.testing import example_params
from logit_factors import FACTORS

BUNDLED = ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask", "relative_bias",
           "softcap_sliding_window"]


@pytest.mark.parametrize("name", BUNDLED)
def test_lowered_logits_times_factor_equal_the_original(name):
    _check_lowering(fivar.load(name))


@pytest.mark.parametrize("v", FACTORS, ids=lambda v: v.name)
def test_signs_stay_in_the_logits_and_the_factor_is_positive(v):
    """split_output_scale takes the sign the spec fixes out of the factor (the runtime refuses a non-positive
    one), keeps a zero factor in the logits, and the lowered form still equals the original."""
    low = optimize.lower(v.ir, v.softmax)
    assert (low.output_scale is None) == (v.name == "zeroed")
    if low.output_scale is not None:
        assert eval_scalar(low.output_scale, {"temp": 0.7}, 0.125, low.hoisted) > 0
    _check_lowering(v)


def _check_lowering(v):
    hq, hkv, lq, lk = 8, 2, 9, 33
    params = example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=2, max_len=lk, device="cpu")
    from fivar.runtime.params import bind_params
    b = bind_params(v, params, num_qo_heads=hq, num_kv_heads=hkv, batch_size=2, device="cpu")
    values = {**b.scalars, **b.tensors}
    sm_scale = float(torch.empty(()).uniform_(0.05, 0.3))
    raw = torch.randn(hq, lq, lk, dtype=torch.float64) * 8
    head = torch.arange(hq).view(hq, 1, 1)
    env = {"raw": raw, "score": raw * sm_scale, "sm_scale": sm_scale, "batch": torch.tensor(1),
           "qo_head": head, "kv_head": head // (hq // hkv),
           "q_idx": torch.arange(lq).view(1, lq, 1) + (lk - lq), "kv_idx": torch.arange(lk).view(1, 1, lk)}
    original = TorchEvaluator(env, values, torch.float64).run(v.ir.logits) if v.ir.logits else env["score"]
    low = optimize.lower(v.ir, v.softmax)
    ev = TorchEvaluator(env, values, torch.float64, hoisted=low.hoisted)
    lowered = ev.run(low.logits)
    factor = ev.eval(low.output_scale) if low.output_scale is not None else 1.0
    torch.testing.assert_close((lowered * factor).expand_as(original), original.expand_as(lowered * factor))
    if v.ir.mask:
        m0 = TorchEvaluator(env, values, torch.float64).run(v.ir.mask)
        assert torch.equal(ev.run(low.mask), m0)
