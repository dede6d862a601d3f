"""KERPLE, logarithmic variant (Chi et al. 2022): each head subtracts r1 * log(1 + r2 * |kv - q|) from the score,
r1 and r2 learnable per head and positive (the training loop keeps them so, as the paper clamps them)."""
import torch

from fivar import AttentionVariant, Tensor, log


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    distance = float(abs(kv_idx - q_idx))
    return score - params.r1[qo_head] * log(1.0 + params.r2[qo_head] * distance)


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # positive, spread over a decade: some heads nearly flat, some sharply local
    r1 = torch.exp(torch.empty(num_qo_heads).uniform_(-1.5, 1.0))
    r2 = torch.exp(torch.empty(num_qo_heads).uniform_(-2.0, 0.5))
    return {"r1": r1.to(device), "r2": r2.to(device)}


variant = AttentionVariant(name="kerple_log", logits=logits, example=example, params={
    "r1": Tensor("float32", ("qo_head",), learnable=True),
    "r2": Tensor("float32", ("qo_head",), learnable=True),
})
