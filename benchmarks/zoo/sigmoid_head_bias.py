"""Sigmoid attention (Ramapuram et al. 2024) with a learned bias per head: weights sigmoid(score + b_h), no
softmax normalisation; b_h starts near -log(sequence length)."""
import math

import torch

from fivar import AttentionVariant, Tensor, sigmoid


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return sigmoid(score + params.bias[qo_head])


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    return {"bias": (-math.log(max(max_len, 2)) + 0.5 * torch.randn(num_qo_heads)).to(device)}


variant = AttentionVariant(name="sigmoid_head_bias", logits=logits, softmax=False, example=example,
                           params={"bias": Tensor("float32", ("qo_head",))})
