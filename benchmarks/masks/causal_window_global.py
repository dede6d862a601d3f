"""A causal window with a few global keys (Longformer's global attention on a decoder, the "attention sink"
tokens of hybrid long-context models at arbitrary places): every query sees the previous `window` keys and the keys
flagged global in its sequence's `[batch, position]` table (run causal)."""
import torch

from fivar import AttentionVariant, Scalar, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window or params.is_global[batch, kv_idx] == 1


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # the first token and about seven more at random places (a document title, section starts)
    flags = torch.zeros(batch_size, max_len, dtype=torch.int32)
    for b in range(batch_size):
        flags[b, torch.randint(0, max_len, (7,))] = 1
    flags[:, 0] = 1
    return {"is_global": flags.to(device)}


variant = AttentionVariant(name="causal_window_global", mask=mask, example=example, params={
    "window": Scalar(int, default=256),
    "is_global": Tensor("int32", ("batch", "position")),
})
