"""Sparse Transformer's strided pattern (Child et al. 2019), causal: a query sees the last `stride` keys and every
key a multiple of `stride` behind it. A mask only: nothing to learn."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.stride or (q_idx - kv_idx) % params.stride == 0


variant = AttentionVariant(name="strided_causal", mask=mask, params={
    "stride": Scalar(int, default=128),
})
