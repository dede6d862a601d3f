"""A window per head (local heads next to global ones, as in hybrid long-context models): head h sees the
previous windows[h] keys (run causal)."""
import torch

from fivar import AttentionVariant, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.windows[qo_head]


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # a quarter of the heads global, the rest local windows of 512 to 4096
    local = torch.tensor([512, 1024, 2048, 4096], dtype=torch.int32)[torch.randint(0, 4, (num_qo_heads,))]
    glob = torch.rand(num_qo_heads) < 0.25
    return {"windows": torch.where(glob, torch.full_like(local, 1 << 30), local).to(device)}


variant = AttentionVariant(name="per_head_window", mask=mask, example=example,
                           params={"windows": Tensor("int32", ("qo_head",))})
