"""Sliding-window attention (Mistral, Gemma): each query sees at most `window` keys behind it."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window


variant = AttentionVariant(name="sliding_window", mask=mask, params={"window": Scalar(int, default=128)})
