"""Packed documents with a causal window inside each (pre-training a local-attention model on packed sequences):
a query sees the previous `window` keys of its own document only (run causal). The document ids are data, not
learned."""
import torch

from fivar import AttentionVariant, Scalar, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.doc_ids[batch, q_idx] == params.doc_ids[batch, kv_idx] and q_idx - kv_idx < params.window


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # about eight documents per sequence, boundaries drawn uniformly
    ids = torch.empty(batch_size, max_len, dtype=torch.int32)
    for b in range(batch_size):
        starts = torch.zeros(max_len, dtype=torch.int32)
        starts[torch.randint(1, max(max_len, 2), (7,))] = 1
        ids[b] = starts.cumsum(0).to(torch.int32)
    return {"doc_ids": ids.to(device), "window": 1024}


variant = AttentionVariant(name="doc_causal_window", mask=mask, example=example, params={
    "window": Scalar(int, default=1024),
    "doc_ids": Tensor("int32", ("batch", "position")),
})
