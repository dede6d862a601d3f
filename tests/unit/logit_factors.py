"""Variants whose whole logit carries a factor the optimizer folds into the softmax scale
(fivar.spec.optimize.split_output_scale): of params, constant, with a sign the spec fixes, and zero. Shared by
the lowering test and the Triton twin's test."""
from fivar import AttentionVariant, Scalar, tanh


def _halved(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score * 0.5


def _temperature(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score / params.temp


def _negated_temperature(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return -score / params.temp


def _offset_temperature(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return (0.0 + params.temp) * score * -1.0


def _negative_cap(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return -2.0 * tanh(score / 2.0)


def _zeroed(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return 0.0 * score  # no factor to split: the logits stay 0 * raw


TEMP = {"temp": Scalar(float, default=0.7)}
FACTORS = [AttentionVariant(name=f.__name__[1:], logits=f, params=TEMP if "temperature" in f.__name__ else {})
           for f in (_halved, _temperature, _negated_temperature, _offset_temperature, _negative_cap, _zeroed)]
