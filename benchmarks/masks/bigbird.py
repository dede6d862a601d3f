"""BigBird (Zaheer et al. 2020) block-sparse attention over 64-token blocks: each query block sees its own block
and its two neighbours (the window), the `num_global` global tokens at the start (global rows and columns), and
three random key blocks drawn per query block, from a `[q_block, kv_block]` table. Run non-causal."""
import torch

from fivar import AttentionVariant, Scalar, Tensor

BLOCK = 64


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    qb = q_idx // BLOCK
    kb = kv_idx // BLOCK
    return (abs(qb - kb) <= 1 or q_idx < params.num_global or kv_idx < params.num_global
            or params.random_blocks[qb, kb] == 1)


def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
    n = (max_len + BLOCK - 1) // BLOCK
    table = torch.zeros(n, n, dtype=torch.int32)
    for i in range(n):
        table[i, torch.randint(0, n, (3,))] = 1
    return {"random_blocks": table.to(device)}


variant = AttentionVariant(name="bigbird", mask=mask, example=example, params={
    "num_global": Scalar(int, default=128),
    "random_blocks": Tensor("int32", ("q_block", "kv_block")),
})
