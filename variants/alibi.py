"""ALiBi (Press et al.): a per-head linear bias on the query-key distance."""
from fivar import AttentionVariant, Tensor


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.slopes[qo_head] * float(kv_idx - q_idx)


variant = AttentionVariant(name="alibi", logits=logits, params={"slopes": Tensor("float32", ("qo_head",))})
