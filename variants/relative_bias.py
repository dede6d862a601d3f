"""Learned relative-position bias (T5-style): a per-head table indexed by the clamped key-query offset."""
import torch

from fivar import AttentionVariant, Scalar, Tensor, clamp


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    r = params.max_distance
    offset = clamp(kv_idx - q_idx, -r, r) + r
    return score + params.bias[qo_head, offset]


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    r = 64
    return {"bias": torch.randn(num_qo_heads, 2 * r + 1, device=device), "max_distance": r}


variant = AttentionVariant(name="relative_bias", logits=logits, example=example, params={
    "bias": Tensor("float32", ("qo_head", "2*max_distance+1")),
    "max_distance": Scalar(int, default=128),
})
