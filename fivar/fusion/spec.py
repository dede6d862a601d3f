"""`FusionSpec`: the declaration of a fused norm / residual / RoPE / FP8 kernel, checked field by field.

Calling one (`v(...)`, `v.bind(...)`, `v.reference(...)`) is `fivar.FusionVariant`, its subclass in
fivar.fusion.variant, the layer above the runtime: this module imports nothing above it and not torch.

A fusion is one pass over each token (or each token x head) that does, in order:

1. optional residual add (``norm_scope="row"`` only): ``s = x + residual``; ``residual <- s``;
2. a norm of ``s`` (or of ``x``) in fp32: ``rmsnorm`` (``y * rsqrt(mean(y^2) + eps) * w``), ``gemma``
   (weight stored as ``w - 1``: ``... * (1 + w)``) or ``layernorm`` (mean/variance, weight and bias),
   over the whole row (``norm_scope="row"``) or over each head of q and k separately
   (``norm_scope="head"``, Qwen3's q_norm / k_norm, separate q and k weights);
3. optional rotary embedding (``norm_scope="head"`` or no norm) on the first ``rotary_dim`` features of
   every q and k head: ``rope="neox"`` rotates the halves ``(x[:r/2], x[r/2:r])``, ``rope="gptj"`` the
   interleaved pairs ``(x[2i], x[2i+1])``; with ``cos_sin="cache"`` cos/sin come from a float32
   ``cos_sin_cache [max_pos, rotary_dim]`` (cos in the first half, sin in the second, FlashInfer's
   layout) at each token's position; with ``cos_sin="computed"`` the kernel computes them from the
   position and ``inv_freq [rotary_dim / 2]`` (``fivar.fusion.rope_inv_freq`` builds it, with Llama-3.1
   or YaRN frequency scaling), times ``attention_factor`` (YaRN's mscale; 1 otherwise);
4. output in the input dtype (in place by default for q/k), or FP8 e4m3 as ``clamp(y / scale, +-448)``.

Everything marked compile-time (head_dim, rotary_dim, the styles, norm kind, residual, fp8, dtype) is
rendered into the CUDA source, so each fusion gets its own specialised kernel under a content-hashed URI.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field

from ..errors import FivarSpecError

NORMS = ("rmsnorm", "gemma", "layernorm")
SCOPES = ("row", "head")
ROPES = ("neox", "gptj")
COS_SIN = ("cache", "computed")
DTYPES = ("bf16", "fp16")
OUT_DTYPES = ("same", "fp8_e4m3")
MIN_HEAD_DIM, MAX_HEAD_DIM = 64, 512


def _caller() -> dict:
    """file:line of the `FusionVariant(...)` call (the first frame outside fivar.fusion.spec)."""
    here = os.path.abspath(__file__)
    for fr in inspect.stack()[2:]:
        if os.path.abspath(fr.filename) != here and "dataclasses" not in fr.filename \
                and not fr.filename.startswith("<string>"):
            return {"filename": fr.filename, "line": fr.lineno, "col": 0}
    return {}


def eps_problem(eps) -> str | None:
    """Why `eps` (a declaration's or a call's) is not a norm epsilon, or None."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        return f"must be a number in (0, 1), got {eps!r}"
    return None


@dataclass(eq=False)
class FusionSpec:
    name: str
    norm: str | None = "rmsnorm"
    norm_scope: str = "row"
    residual: bool = False
    rope: str | None = None
    head_dim: int | None = None
    rotary_dim: int | None = None
    cos_sin: str = "cache"
    dtype: str = "bf16"
    out_dtype: str = "same"
    eps: float = 1e-6
    doc: str = ""
    source_file: str | None = field(default=None, repr=False)
    source_line: int | None = field(default=None, repr=False)

    kind = "fusion"

    def __post_init__(self):
        where = _caller()
        if self.source_file is None:
            self.source_file, self.source_line = where.get("filename"), where.get("line")

        def bad(field_name, msg):
            return FivarSpecError(f"fusion '{self.name}': field '{field_name}': {msg}", **where)

        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise FivarSpecError(f"fusion: field 'name': must be a Python identifier, got {self.name!r}", **where)
        if self.norm is not None and self.norm not in NORMS:
            raise bad("norm", f"{self.norm!r} is not one of {NORMS} or None")
        if self.norm_scope not in SCOPES:
            raise bad("norm_scope", f"{self.norm_scope!r} is not one of {SCOPES}")
        if self.rope is not None and self.rope not in ROPES:
            raise bad("rope", f"{self.rope!r} is not one of {ROPES} or None")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"{self.dtype!r} is not one of {DTYPES}")
        if self.out_dtype not in OUT_DTYPES:
            raise bad("out_dtype", f"{self.out_dtype!r} is not one of {OUT_DTYPES}")
        if not isinstance(self.residual, bool):
            raise bad("residual", f"must be True or False, got {self.residual!r}")
        if eps_problem(self.eps):
            raise bad("eps", eps_problem(self.eps))
        if self.norm is None and self.rope is None:
            raise bad("norm", "a fusion needs a norm, a rope, or both (norm=None and rope=None does nothing)")
        if self.residual and (self.norm is None or self.norm_scope != "row"):
            raise bad("residual", "a residual add needs a per-row norm (norm_scope='row' and a norm)")
        if self.rope is not None and self.norm is not None and self.norm_scope != "head":
            raise bad("rope", "RoPE is applied per head: combine it with norm_scope='head' (or norm=None)")
        if self.is_head:
            if self.head_dim is None:
                raise bad("head_dim", "per-head fusions (per-head norm or RoPE) need head_dim")
            if not isinstance(self.head_dim, int) or not MIN_HEAD_DIM <= self.head_dim <= MAX_HEAD_DIM \
                    or self.head_dim % 16:
                raise bad("head_dim", f"must be a multiple of 16 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], "
                          f"got {self.head_dim!r}")
        elif self.head_dim is not None:
            raise bad("head_dim", "only per-head fusions take head_dim (the row length is a runtime size)")
        if self.cos_sin not in COS_SIN:
            raise bad("cos_sin", f"{self.cos_sin!r} is not one of {COS_SIN}")
        if self.rope is None:
            if self.rotary_dim is not None:
                raise bad("rotary_dim", "rotary_dim needs rope='neox' or rope='gptj'")
            if self.cos_sin != "cache":
                raise bad("cos_sin", "cos_sin='computed' needs rope='neox' or rope='gptj'")
        else:
            if self.rotary_dim is None:
                self.rotary_dim = self.head_dim
            if not isinstance(self.rotary_dim, int) or not 16 <= self.rotary_dim <= self.head_dim \
                    or self.rotary_dim % 16:
                raise bad("rotary_dim", f"must be a multiple of 16 in [16, head_dim={self.head_dim}], "
                          f"got {self.rotary_dim!r}")
        if not self.doc and self.source_file and os.path.exists(self.source_file):
            import ast
            try:
                self.doc = ast.get_docstring(ast.parse(open(self.source_file).read())) or ""
            except (SyntaxError, OSError, ValueError):
                self.doc = ""

    # --- derived -------------------------------------------------------------------------------
    @property
    def is_head(self) -> bool:
        """Per-head kernel (q/k heads): per-head norm and/or RoPE. Otherwise per-row."""
        return self.rope is not None or self.norm_scope == "head"

    @property
    def fp8(self) -> bool:
        return self.out_dtype == "fp8_e4m3"

    def describe(self) -> str:
        parts = []
        if self.residual:
            parts.append("residual add")
        if self.norm:
            parts.append(f"{self.norm} per {self.norm_scope}")
        if self.rope:
            parts.append(f"{self.rope} rope (rotary_dim {self.rotary_dim} of {self.head_dim}"
                         f"{', cos/sin computed' if self.cos_sin == 'computed' else ''})")
        if self.fp8:
            parts.append("fp8 e4m3 out")
        return " + ".join(parts)
