"""Logit soft-capping (Gemma 2, Grok-1): score -> cap * tanh(score / cap)."""
from fivar import AttentionVariant, Scalar, tanh


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.softcap * tanh(score / params.softcap)


variant = AttentionVariant(name="softcap", logits=logits, params={"softcap": Scalar(float, default=30.0)})
