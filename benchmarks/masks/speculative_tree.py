"""Tree attention of speculative decoding's verification step (SpecInfer, Medusa, EAGLE): a prefix attended
causally, then a tree of draft tokens (topologically ordered) where each draft token sees the whole prefix and its
own ancestors in the tree, given as a `[draft, draft]` ancestor-or-self table. The draft tree is the last
`max_len - prefix_len` positions (run causal)."""
import torch

from fivar import AttentionVariant, Scalar, Tensor


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    p = params.prefix_len
    return kv_idx < p or (q_idx >= p and params.ancestors[q_idx - p, kv_idx - p] == 1)


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    draft = min(256, max(2, max_len // 8))
    # each draft token hangs off one of the few tokens drafted just before it: a bushy tree a few levels deep
    anc = torch.eye(draft, dtype=torch.int32)
    for i in range(1, draft):
        parent = int(torch.randint(max(0, i - 8), i, ()))
        anc[i] |= anc[parent]
    return {"prefix_len": max_len - draft, "ancestors": anc.to(device)}


variant = AttentionVariant(name="speculative_tree", mask=mask, example=example, params={
    "prefix_len": Scalar(int, default=7936),
    "ancestors": Tensor("int32", ("draft", "draft")),
})
