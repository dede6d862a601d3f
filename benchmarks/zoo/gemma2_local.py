"""Gemma 2, local layers: logits soft-capped at 50, keys inside a causal window of 4096."""
from fivar import AttentionVariant, Scalar, tanh


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.softcap * tanh(score / params.softcap)


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window


variant = AttentionVariant(name="gemma2_local", logits=logits, mask=mask, params={
    "softcap": Scalar(float, default=50.0),
    "window": Scalar(int, default=4096),
})
