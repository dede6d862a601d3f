"""A dilated causal window (LongNet's and the dilated sliding window of Longformer's upper layers): every query sees
every `dilation`-th key behind it, up to `window` keys back (run causal)."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window and (q_idx - kv_idx) % params.dilation == 0


variant = AttentionVariant(name="dilated_window", mask=mask, params={
    "window": Scalar(int, default=2048),
    "dilation": Scalar(int, default=4),
})
