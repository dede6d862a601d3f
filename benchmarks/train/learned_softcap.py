"""Soft-capped logits with a learnable cap per head: cap * tanh(score / cap) (Gemma 2 fixes the cap at 50; here
each head learns its own, kept positive by the training loop)."""
import torch

from fivar import AttentionVariant, Tensor, tanh


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    cap = params.cap[qo_head]
    return cap * tanh(score / cap)


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # small enough that the tanh bends at unit-variance scores, so the cap's gradient is not negligible
    return {"cap": (1.0 + 4.0 * torch.rand(num_qo_heads)).to(device)}


variant = AttentionVariant(name="learned_softcap", logits=logits, example=example, params={
    "cap": Tensor("float32", ("qo_head",), learnable=True),
})
