"""The strided pattern of the Sparse Transformer (Child et al. 2019), its two heads merged into one mask: a query
sees the previous `stride` keys (the local head) and every key a multiple of `stride` behind it (the strided
head), stride ~ sqrt(S) (run causal)."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.stride or (q_idx - kv_idx) % params.stride == 0


variant = AttentionVariant(name="strided_sparse", mask=mask, params={
    "stride": Scalar(int, default=128),
})
