"""Packed pre-training sequences: documents of mixed lengths back to back, each token attending causally within
its own document (run causal)."""
import torch

from fivar import AttentionVariant, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.doc_ids[batch, q_idx] == params.doc_ids[batch, kv_idx]


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    # about eight documents per sequence, lengths drawn log-uniformly (a few long ones, many short)
    ids = torch.empty(batch_size, max_len, dtype=torch.int32)
    for b in range(batch_size):
        cuts = torch.exp(torch.rand(7) * torch.log(torch.tensor(float(max(max_len, 2)))))
        bounds = torch.unique(cuts.long().clamp(1, max_len - 1))
        starts = torch.zeros(max_len, dtype=torch.int32)
        starts[bounds] = 1
        ids[b] = starts.cumsum(0).to(torch.int32)
    return {"doc_ids": ids.to(device)}


variant = AttentionVariant(name="packed_documents", mask=mask, example=example,
                           params={"doc_ids": Tensor("int32", ("batch", "position"))})
