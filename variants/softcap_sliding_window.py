"""Gemma 2's local layers: soft-capped logits inside a sliding window."""
from fivar import AttentionVariant, Scalar, tanh


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.softcap * tanh(score / params.softcap)


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window


variant = AttentionVariant(name="softcap_sliding_window", logits=logits, mask=mask, params={
    "softcap": Scalar(float, default=30.0),
    "window": Scalar(int, default=128),
})
