"""Learned relative-position bias (T5-style): a per-head table indexed by the clamped key-query offset."""
from fivar import AttentionVariant, Scalar, Tensor, clamp


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    r = params.max_distance
    offset = clamp(kv_idx - q_idx, -r, r) + r
    return score + params.bias[qo_head, offset]


variant = AttentionVariant(name="relative_bias", logits=logits, params={
    "bias": Tensor("float32", ("qo_head", "2*max_distance+1")),
    "max_distance": Scalar(int, default=128),
})
