"""Qwen3 attention input: per-head RMSNorm of q and k (separate q_norm / k_norm weights), then NeoX RoPE.

One kernel, in place on the q and k parts of the packed QKV projection output:
    q, k = v(qkv=qkv, num_q_heads=32, num_kv_heads=8, positions=pos, cos_sin_cache=cs,
             q_weight=q_norm_w, k_weight=k_norm_w)
"""
from fivar import FusionVariant

variant = FusionVariant(name="qwen3_qk_norm_rope", norm="rmsnorm", norm_scope="head", rope="neox",
                        head_dim=128, rotary_dim=128, dtype="bf16", eps=1e-6)
