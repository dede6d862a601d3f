"""Document masking for packed sequences: tokens attend only within their own document."""
from fivar import AttentionVariant, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.doc_ids[batch, q_idx] == params.doc_ids[batch, kv_idx]


variant = AttentionVariant(name="document_mask", mask=mask,
                           params={"doc_ids": Tensor("int32", ("batch", "position"))})
