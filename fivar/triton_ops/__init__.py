"""Triton baselines for the norm/RoPE family: the yardstick fivar's CUDA fusions (`fivar.fusion`) are
measured against, written the way Triton's tutorials write them (one program per row or token, a block
covering the row, float32 math).

- `rmsnorm(x, weight, eps, gemma=False)` and `fused_add_rmsnorm(x, residual, weight, eps)` (rmsnorm.py)
- `apply_rope(q, k, positions, cos_sin_cache, rotary_dim, style)`, in place (rope.py)
- `qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin_cache, rotary_dim, eps, style)`, in place
  (qk_norm_rope.py)

All work on strided views (e.g. q/k heads inside a packed QKV buffer) as long as the last dim is
contiguous. The torch references are `fivar.fusion.reference`; `python -m fivar.bench --suite triton-ops` times these
against stock FlashInfer.
"""
from .qk_norm_rope import qk_norm_rope
from .rmsnorm import fused_add_rmsnorm, rmsnorm
from .rope import apply_rope

__all__ = ["rmsnorm", "fused_add_rmsnorm", "apply_rope", "qk_norm_rope"]
