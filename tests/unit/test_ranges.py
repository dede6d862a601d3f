"""The range read off a logits transform must hold for every score: checked against the torch IR evaluator in
float64 on random scores over many orders of magnitude, random params and indices, for transforms written the
ways users write them; and transforms that are unbounded (at either end) must get no range."""
import math

import pytest
import torch

import fivar
from fivar import AttentionVariant, Scalar, Tensor, abs, clamp, exp, maximum, minimum, sigmoid, tanh, where
from fivar.codegen.torch_ref import TorchEvaluator
from fivar.spec.ranges import program_range

PARAMS = {"cap": Scalar(float, default=30.0), "bias": Scalar(float, default=0.5),
          "slopes": Tensor("float32", ("num_qo_heads",))}


def _variant(logits):
    return AttentionVariant(name="range_probe", logits=logits, params=PARAMS)


def l_softcap(s, b, h, kh, q, kv, p):
    return p.cap * tanh(s / p.cap)


def l_two_caps(s, b, h, kh, q, kv, p):
    return 0.5 * tanh(s / p.cap) + 0.25 * tanh(s * p.bias)


def l_shifted_sigmoid(s, b, h, kh, q, kv, p):
    return 3.0 * sigmoid(s + p.bias) - 1.0


def l_clamp(s, b, h, kh, q, kv, p):
    return clamp(s, -5.0, 5.0)


def l_min_max(s, b, h, kh, q, kv, p):
    return minimum(maximum(s * p.bias, -2.0), 7.0)


def l_select(s, b, h, kh, q, kv, p):
    return where(kv > q, tanh(s), 0.5 * tanh(s) - 1.0)


def l_abs_exp(s, b, h, kh, q, kv, p):
    return exp(-abs(tanh(s)))


def l_divided(s, b, h, kh, q, kv, p):
    return tanh(s) / (2.0 + tanh(s * p.bias))


def l_exp_of_capped(s, b, h, kh, q, kv, p):
    return exp(minimum(s, 3.0))  # (0, e^3]: the lower end is exp's limit


def l_truncated(s, b, h, kh, q, kv, p):
    return float(int(tanh(s) * 0.01 - 1.995))  # int() truncates toward zero: -1 or -2, not (-2.005, -1.985)


BOUNDED = {l_softcap: (-1.0, 1.0), l_two_caps: (-0.75, 0.75), l_shifted_sigmoid: (-1.0, 2.0), l_clamp: (-5.0, 5.0),
           l_min_max: (-2.0, 7.0), l_select: (-1.5, 1.0), l_abs_exp: (math.exp(-1.0), 1.0),
           l_divided: (-1.0, 1.0), l_exp_of_capped: (0.0, math.exp(3.0)), l_truncated: (-2.0, -1.0)}


@pytest.mark.parametrize("logits", list(BOUNDED), ids=lambda f: f.__name__)
def test_every_value_of_a_bounded_transform_lies_in_its_range(logits):
    v = _variant(logits)
    low = v.lowered
    rng = program_range(low.logits)
    assert rng is not None
    lo, hi = rng
    # the range is never looser than the hand-derived one (the analysis is allowed to be exact or tighter)
    assert BOUNDED[logits][0] - 1e-12 <= lo and hi <= BOUNDED[logits][1] + 1e-12, (rng, BOUNDED[logits])
    g = torch.Generator().manual_seed(torch.seed())
    n = 4096
    mag = torch.pow(10.0, torch.empty(n, dtype=torch.float64).uniform_(-3, 4, generator=g))
    raw = mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    for cap, bias, sm_scale in ((30.0, 0.5, 0.088), (3.0, -2.0, 1.0), (0.1, 7.0, 0.5)):
        env = {"raw": raw, "score": raw * sm_scale, "sm_scale": sm_scale,
               "q_idx": torch.randint(0, 64, (n,), generator=g), "kv_idx": torch.randint(0, 64, (n,), generator=g),
               "batch": torch.zeros(n, dtype=torch.int64), "qo_head": torch.zeros(n, dtype=torch.int64),
               "kv_head": torch.zeros(n, dtype=torch.int64)}
        params = {"cap": cap, "bias": bias, "slopes": torch.rand(4, dtype=torch.float64)}
        out = TorchEvaluator(env, params, torch.float64, hoisted=low.hoisted).run(low.logits)
        assert torch.isfinite(out).all()
        assert out.min() >= lo - 1e-9 and out.max() <= hi + 1e-9, (cap, out.min().item(), out.max().item(), rng)


def l_plain(s, b, h, kh, q, kv, p):
    return s


def l_alibi(s, b, h, kh, q, kv, p):
    return s + p.slopes[h] * (kv - q)


def l_half_clamp(s, b, h, kh, q, kv, p):
    return maximum(s, -5.0)


def l_param_scaled_tanh(s, b, h, kh, q, kv, p):
    return tanh(s) + p.bias  # a param is unbounded as far as the analysis goes


def l_divided_by_zero_crossing(s, b, h, kh, q, kv, p):
    return 1.0 / tanh(s)


def l_exp_of_score(s, b, h, kh, q, kv, p):
    return exp(s)


def l_exp_overflowing(s, b, h, kh, q, kv, p):
    return exp(tanh(s) + 712.0)  # beyond float64: unbounded, not an OverflowError


@pytest.mark.parametrize("logits", [l_plain, l_alibi, l_half_clamp, l_param_scaled_tanh,
                                    l_divided_by_zero_crossing, l_exp_of_score, l_exp_overflowing],
                         ids=lambda f: f.__name__)
def test_a_transform_unbounded_at_either_end_has_no_range(logits):
    assert program_range(_variant(logits).lowered.logits) is None


def test_bundled_variants():
    """Soft-capping's cap is folded into the softmax scale, which leaves tanh: [-1, 1]."""
    for name in ("softcap", "softcap_sliding_window"):
        assert program_range(fivar.load(name).lowered.logits) == (-1.0, 1.0), name
    for name in ("alibi", "relative_bias", "sliding_window", "document_mask"):
        low = fivar.load(name).lowered
        assert low.logits is None or program_range(low.logits) is None, name
