"""GPT-J / ChatGLM-style partial rotary embedding: interleaved pairs on the first 64 of 128 features.

    q, k = v(q=q, k=k, positions=pos, cos_sin_cache=cs)   # in place; cs: [max_pos, 64] float32
"""
from fivar import FusionVariant

variant = FusionVariant(name="partial_rope_gptj", norm=None, rope="gptj", head_dim=128, rotary_dim=64,
                        dtype="bf16")
