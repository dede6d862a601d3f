"""Sigmoid attention (Ramapuram et al. 2024): weights sigmoid(score + bias), no softmax normalisation."""
from fivar import AttentionVariant, Scalar, sigmoid


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return sigmoid(score + params.bias)


variant = AttentionVariant(name="sigmoid", logits=logits, softmax=False,
                           params={"bias": Scalar(float, default=0.0)})
