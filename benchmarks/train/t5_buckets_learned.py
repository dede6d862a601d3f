"""T5 decoder relative attention bias, trained: the distance q - kv (causal, so never negative) falls into one of
32 buckets (exact below 16, logarithmic up to 128, the last bucket beyond), each head adds its learned bias for
that bucket from a [buckets, heads] table, as T5's `relative_attention_bias` embedding stores it."""
import torch

from fivar import AttentionVariant, Tensor, log, maximum, minimum, where


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    n = maximum(q_idx - kv_idx, 0)
    far = 16 + int(log(float(maximum(n, 1)) / 16.0) / log(128.0 / 16.0) * 16.0)
    bucket = where(n < 16, n, minimum(far, 31))
    return score + params.table[bucket, qo_head]


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    return {"table": (torch.randn(32, num_qo_heads) * 2.0).to(device)}


variant = AttentionVariant(name="t5_buckets_learned", logits=logits, example=example, params={
    "table": Tensor("float32", ("bucket", "qo_head"), learnable=True),
})
