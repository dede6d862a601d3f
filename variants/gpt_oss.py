"""gpt-oss's sliding-window layers: a learned attention sink per query head (a logit in the softmax denominator
with no value row) inside a 128-token window."""
import torch

from fivar import AttentionVariant, Scalar, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # Trained sinks sit among the layer's logits: mostly a few units, a few heads far above the rest (those heads
    # park most of their attention on the sink). Fresh values on every call.
    sinks = torch.randn(num_qo_heads) * 1.5 + 1.0
    sinks[torch.randperm(num_qo_heads)[: max(1, num_qo_heads // 8)]] += 6.0
    return {"sinks": sinks.to(device), "window": 128}


variant = AttentionVariant(name="gpt_oss", mask=mask, example=example,
                           sink=lambda qo_head, params: params.sinks[qo_head],
                           params={"sinks": Tensor("float32", ("qo_head",)), "window": Scalar(int, default=128)})
