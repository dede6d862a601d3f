"""Causal attention with a learned sink per head (gpt-oss's full-attention layers, StreamingLLM's trained sink): a
logit that joins each row's softmax denominator with no value row, so a head can attend to nothing."""
import torch

from fivar import AttentionVariant, Tensor


def sink(qo_head, params):
    return params.sinks[qo_head]


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # a few units, a few heads far above the rest (those park most of their attention on the sink)
    sinks = torch.randn(num_qo_heads) * 1.5 + 1.0
    sinks[torch.randperm(num_qo_heads)[: max(1, num_qo_heads // 8)]] += 6.0
    return {"sinks": sinks.to(device)}


variant = AttentionVariant(name="learned_sinks", sink=sink, example=example, params={
    "sinks": Tensor("float32", ("qo_head",), learnable=True),
})
