"""Mistral 7B: every layer attends to the previous 4096 keys (sliding-window attention)."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return (q_idx - kv_idx < params.window) and (kv_idx <= q_idx)


variant = AttentionVariant(name="mistral_window", mask=mask, params={"window": Scalar(int, default=4096)})
