"""Prefix-LM (PaliGemma, T5-style decoders): the prefix of each request is attended bidirectionally, the rest
causally. Run non-causal: the mask carries the causal part."""
import torch

from fivar import AttentionVariant, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < params.prefix_len[batch] or kv_idx <= q_idx


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # an image-plus-prompt prefix of a quarter to a half of the sequence
    lo, hi = max(1, max_len // 4), max(2, max_len // 2)
    return {"prefix_len": torch.randint(lo, hi, (batch_size,), dtype=torch.int32).to(device)}


variant = AttentionVariant(name="prefix_lm", mask=mask, example=example,
                           params={"prefix_len": Tensor("int32", ("batch",))})
