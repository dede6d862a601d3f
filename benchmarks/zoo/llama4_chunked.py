"""Llama 4, local layers: chunked attention, a query sees only the keys of its own 8192-token chunk."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx // params.chunk == kv_idx // params.chunk


variant = AttentionVariant(name="llama4_chunked", mask=mask, params={"chunk": Scalar(int, default=8192)})
