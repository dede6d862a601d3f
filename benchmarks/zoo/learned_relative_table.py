"""A decoder's learned relative-position table: each head adds bias[h, d] for the distance d = q - kv to a
past key, distances past the table sharing its last entry (run causal)."""
import torch

from fivar import AttentionVariant, Scalar, Tensor, clamp


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.bias[qo_head, clamp(q_idx - kv_idx, 0, params.max_distance)]


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    r = 256
    return {"bias": torch.randn(num_qo_heads, r + 1).to(device), "max_distance": r}


variant = AttentionVariant(name="learned_relative_table", logits=logits, example=example, params={
    "bias": Tensor("float32", ("qo_head", "max_distance+1")),
    "max_distance": Scalar(int, default=256),
})
