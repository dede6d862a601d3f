"""A causal window plus keys picked per key from a tensor (the retrieved or top-k-scored tokens of
retrieval-augmented and learned-sparsity models, kept for every later query): a query sees the previous `window`
keys and every earlier key whose flag is set in the `[position]` table (run causal)."""
import torch

from fivar import AttentionVariant, Scalar, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window or params.picked[kv_idx] != 0


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # about one key in 32, scattered
    return {"picked": (torch.rand(max_len) < 1 / 32).to(torch.int32).to(device)}


variant = AttentionVariant(name="random_keys", mask=mask, example=example, params={
    "window": Scalar(int, default=128),
    "picked": Tensor("int32", ("position",)),
})
