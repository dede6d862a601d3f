"""Longformer / ETC encoder attention: a symmetric window of `window` keys each side, plus `num_global` global tokens
at the start that attend to everything and are attended by everyone (global rows and columns). Run non-causal."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return abs(q_idx - kv_idx) < params.window or q_idx < params.num_global or kv_idx < params.num_global


variant = AttentionVariant(name="longformer_global", mask=mask, params={
    "window": Scalar(int, default=512),
    "num_global": Scalar(int, default=16),
})
