"""ALiBi with learnable slopes: a per-head linear bias on the query-key distance, the slopes trained with the
model (initialised at the paper's geometric 2^(-8 i / H))."""
import torch

from fivar import AttentionVariant, Tensor


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.slopes[qo_head] * float(kv_idx - q_idx)


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    i = torch.arange(1, num_qo_heads + 1, dtype=torch.float32)
    slopes = torch.exp2(-8.0 * i / num_qo_heads) * (0.5 + torch.rand(num_qo_heads))
    return {"slopes": slopes.to(device)}


variant = AttentionVariant(name="learned_alibi", logits=logits, example=example, params={
    "slopes": Tensor("float32", ("qo_head",), learnable=True),
})
