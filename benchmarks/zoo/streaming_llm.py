"""StreamingLLM (Xiao et al. 2023): the first `sink` tokens stay visible to every query (attention sinks), the
rest through a causal window."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < params.sink or q_idx - kv_idx < params.window


variant = AttentionVariant(name="streaming_llm", mask=mask, params={
    "sink": Scalar(int, default=4),
    "window": Scalar(int, default=4096),
})
