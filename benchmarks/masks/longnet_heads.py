"""LongNet's dilated attention (Ding et al. 2023), one segment length and dilation rate with the head-dependent
offset: inside each `segment`-token segment, head h keeps the keys at positions congruent to h modulo `dilation`
(and each query its own key), so the heads together cover the segment (run causal)."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    same = q_idx // params.segment == kv_idx // params.segment
    return same and ((kv_idx - qo_head) % params.dilation == 0 or q_idx == kv_idx)


variant = AttentionVariant(name="longnet_heads", mask=mask, params={
    "segment": Scalar(int, default=2048),
    "dilation": Scalar(int, default=4),
})
