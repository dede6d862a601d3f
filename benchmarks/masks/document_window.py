"""Packed documents with a causal sliding window inside each (pre-training a local-attention model on packed
sequences): a query sees the previous `window` keys of its own document only (run causal)."""
import torch

from fivar import AttentionVariant, Scalar, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.doc_ids[batch, q_idx] == params.doc_ids[batch, kv_idx] and q_idx - kv_idx < params.window


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # about eight documents per sequence, lengths drawn log-uniformly (a few long ones, many short)
    ids = torch.empty(batch_size, max_len, dtype=torch.int32)
    for b in range(batch_size):
        cuts = torch.exp(torch.rand(7) * torch.log(torch.tensor(float(max(max_len, 2)))))
        starts = torch.zeros(max_len, dtype=torch.int32)
        starts[torch.unique(cuts.long().clamp(1, max_len - 1))] = 1
        ids[b] = starts.cumsum(0).to(torch.int32)
    return {"doc_ids": ids.to(device)}


variant = AttentionVariant(name="document_window", mask=mask, example=example, params={
    "window": Scalar(int, default=256),
    "doc_ids": Tensor("int32", ("batch", "position")),
})
