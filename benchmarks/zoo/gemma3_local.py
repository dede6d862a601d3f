"""Gemma 3, local layers: a causal sliding window of 1024 keys (no soft-cap)."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window


variant = AttentionVariant(name="gemma3_local", mask=mask, params={"window": Scalar(int, default=1024)})
