"""ALiBi slopes under a logit soft-cap (MPT/Grok-style): the biased score is capped by cap * tanh(x / cap)."""
import torch

from fivar import AttentionVariant, Scalar, Tensor, tanh


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    biased = score + params.slopes[qo_head] * float(kv_idx - q_idx)
    return params.softcap * tanh(biased / params.softcap)


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    i = torch.arange(1, num_qo_heads + 1, dtype=torch.float32)
    return {"slopes": torch.exp2(-8.0 * i / num_qo_heads).to(device)}


variant = AttentionVariant(name="alibi_softcap", logits=logits, example=example, params={
    "slopes": Tensor("float32", ("qo_head",)),
    "softcap": Scalar(float, default=30.0),
})
