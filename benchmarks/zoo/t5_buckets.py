"""T5 encoder relative attention bias: the key-query offset falls into one of 32 log-spaced buckets (16 per
direction, exact below 8, logarithmic up to 128), each head adds its learned bias for that bucket."""
import torch

from fivar import AttentionVariant, Scalar, Tensor, log, maximum, minimum, where


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    rel = kv_idx - q_idx
    n = abs(rel)
    far = 8 + int(log(float(maximum(n, 1)) / 8.0) / log(128.0 / 8.0) * 8.0)
    bucket = where(rel > 0, 16, 0) + where(n < 8, n, minimum(far, 15))
    return score + params.table[qo_head, bucket]


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    return {"table": (torch.randn(num_qo_heads, 32) * 2.0).to(device), "num_buckets": 32}


variant = AttentionVariant(name="t5_buckets", logits=logits, example=example, params={
    "table": Tensor("float32", ("qo_head", "num_buckets")),
    "num_buckets": Scalar(int, default=32),
})
