"""Frame-causal (block-causal) attention of video and world models (CausVid, autoregressive video diffusion): the
tokens of one `frame` attend to each other bidirectionally and to every earlier frame. Run non-causal: the mask
carries the frame-level causality."""
from fivar import AttentionVariant, Scalar


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx // params.frame <= q_idx // params.frame


variant = AttentionVariant(name="frame_causal", mask=mask, params={
    "frame": Scalar(int, default=512),
})
