"""KERPLE, power variant (Chi et al. 2022): each head subtracts r1 * |kv - q| ** r2 from the score, r1 > 0 and
r2 in (0, 2] learnable per head. d ** r2 written out as exp(r2 * log(d)), the distance 0 (where d ** r2 is 0) a
branch of its own so that no log(0) reaches the gradient (`d ** r2` computes the same for r2 > 0)."""
import torch

from fivar import AttentionVariant, Tensor, exp, log, maximum, where


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    d = abs(kv_idx - q_idx)
    power = exp(params.r2[qo_head] * log(float(maximum(d, 1))))  # d ** r2
    return score - params.r1[qo_head] * where(d == 0, 0.0, power)


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    r1 = torch.exp(torch.empty(num_qo_heads).uniform_(-3.0, 0.0))
    r2 = torch.empty(num_qo_heads).uniform_(0.05, 2.0)
    return {"r1": r1.to(device), "r2": r2.to(device)}


variant = AttentionVariant(name="kerple_power", logits=logits, example=example, params={
    "r1": Tensor("float32", ("qo_head",), learnable=True),
    "r2": Tensor("float32", ("qo_head",), learnable=True),
})
