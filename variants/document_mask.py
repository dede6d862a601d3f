"""Document masking for packed sequences: tokens attend only within their own document."""
import torch

from fivar import AttentionVariant, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.doc_ids[batch, q_idx] == params.doc_ids[batch, kv_idx]


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # Documents of random lengths packed back to back: sorted ids with random boundaries.
    starts = torch.rand(batch_size, max_len) < 4.0 / max(max_len, 1)
    return {"doc_ids": starts.to(torch.int32).cumsum(1).to(torch.int32).to(device)}


variant = AttentionVariant(name="document_mask", mask=mask, example=example,
                           params={"doc_ids": Tensor("int32", ("batch", "position"))})
