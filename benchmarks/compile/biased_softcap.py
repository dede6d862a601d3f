"""A logits-only transform a new user might write: a learned-style bias before Gemma-style soft-capping. Not
bundled, so the compile suite times its first build from nothing."""
from fivar import AttentionVariant, Scalar, tanh


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.cap * tanh((score + params.bias) / params.cap)


variant = AttentionVariant(name="biased_softcap", logits=logits,
                           params={"cap": Scalar(float, default=50.0), "bias": Scalar(float, default=0.5)})
