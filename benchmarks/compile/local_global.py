"""A mask a new user might write: a sliding window plus a few global tokens every query sees (Longformer-like),
causal. Not bundled, so the compile suite times its first build from nothing."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return (kv_idx < params.num_global or q_idx - kv_idx < params.window) and kv_idx <= q_idx


variant = AttentionVariant(name="local_global", mask=mask,
                           params={"window": Scalar(int, default=1024), "num_global": Scalar(int, default=64)})
