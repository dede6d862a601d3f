"""`AttentionVariant`: the object a file in `variants/` defines.

Semantics every target implements (and the README repeats):

* `logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params) -> float`
  - `score` is q.k **already multiplied by sm_scale** (default 1/sqrt(head_dim)), as in FlexAttention's
    score_mod.
  - `q_idx` is the query's position in the KV sequence: the i-th of `qo_len` query rows has
    `q_idx = i + kv_len - qo_len` (bottom-right aligned, the same alignment as FlashInfer's causal
    mask). For prefill with qo_len == kv_len that is just i; for decode it is kv_len - 1.
  - `kv_idx` is the key's position in its request, 0..kv_len-1. `batch` is the request index (0 for
    single prefill). `kv_head = qo_head // (num_qo_heads // num_kv_heads)`.
  - With `softmax=True` the result is a logit: out = softmax(logits) @ V. With `softmax=False`
    (sigmoid attention) the result is the weight itself: out = sum_j logits_j * V_j.
* `mask(batch, qo_head, kv_head, q_idx, kv_idx, params) -> bool`: False removes the pair. The mask is
  applied on every KV tile. `causal=True` at call time is applied in addition to it.
* `sink(batch, qo_head, params) -> float` (or `sink(qo_head, params)`, a per-head sink): an attention sink, a
  logit that joins the softmax denominator with no value row (StreamingLLM's learned sinks, gpt-oss's `s_aux`):
  out_i = sum_j exp(l_ij) v_j / (exp(sink) + sum_j exp(l_ij)), in the same units as `logits`' result. It is
  counted once per query row, whatever the mask keeps (a row that keeps no key is zeros). The log-sum-exp that
  `return_lse=True` gives includes it, as FlashInfer's own sink kernels write it: log2(exp(sink) + sum_j
  exp(l_ij)) (base 2, fivar.runtime.lse). A `def` or a lambda; softmax variants only.
"""
from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from ..errors import FivarSpecError
from . import live
from .names import why_param_name_is_taken
from .params import Scalar, Tensor, call_site, out_of_range, shown


@dataclass(eq=False)
class AttentionVariant:
    """An attention variant's declaration (the module docstring says what each part means). Its calls (`prefill`,
    `decode`, the plans, `attention`, `reference`) are added by fivar.runtime.methods when fivar is imported."""
    name: str
    logits: Callable | None = None
    mask: Callable | None = None
    params: dict[str, Scalar | Tensor] = field(default_factory=dict)
    softmax: bool = True
    doc: str = ""
    #: Optional `example(num_qo_heads=, num_kv_heads=, batch_size=, max_len=, device=) -> dict` giving
    #: realistic random params for checks and benchmarks (fivar draws from the declarations otherwise).
    example: Callable | None = None
    #: Optional `sink(batch, qo_head, params)` or `sink(qo_head, params)`: the attention sink (module docstring).
    sink: Callable | None = None

    def __post_init__(self):
        # a string naming this object: what compiled graphs and custom ops carry instead of the object itself
        self.key = live.register(self)
        where = self._where(self.logits or self.mask or self.sink)
        if not where:  # no function to point at: the AttentionVariant(...) call (the dataclass __init__'s caller)
            where = call_site(2)
        if not isinstance(self.name, str) or not self.name.isidentifier() or not self.name.isascii():
            raise FivarSpecError(f"name must be an ASCII Python identifier, got {self.name!r}", **where)
        if self.logits is None and self.mask is None and self.sink is None:
            raise FivarSpecError("a variant needs a `logits` function, a `mask` function, a `sink`, or several",
                                 variant=self.name, **where)
        if self.sink is not None and not self.softmax:
            raise FivarSpecError("a `sink` joins the softmax denominator, and this variant has softmax=False (its "
                                 "weights multiply V as they are): drop the sink, or use softmax",
                                 variant=self.name, **(self._where(self.sink) or where))
        if not isinstance(self.params, dict):
            raise FivarSpecError(f"params must be a dict of name -> fivar.Scalar(...)/fivar.Tensor(...), got "
                                 f"{type(self.params).__name__}", variant=self.name, **where)
        for pname, p in self.params.items():
            # any identifier: generated code spells it its own way (fivar.spec.names.user_ident)
            if not isinstance(pname, str) or not pname.isidentifier():
                raise FivarSpecError(f"parameter name {pname!r} is not allowed: it must be a Python identifier",
                                     variant=self.name, **where)
            if not isinstance(p, (Scalar, Tensor)):
                raise FivarSpecError(f"parameter {pname!r} must be fivar.Scalar(...) or fivar.Tensor(...),"
                                     f" got {type(p).__name__}", variant=self.name, **where)
            at = p.where or where  # the Scalar(...)/Tensor(...) call itself
            taken = why_param_name_is_taken(pname, CALL_KWARGS)
            if taken:
                raise FivarSpecError(f"parameter name {pname!r} cannot be used: {taken}; pick another",
                                     variant=self.name, **at)
            if isinstance(p, Scalar) and p.dtype not in (float, int):
                raise FivarSpecError(f"Scalar parameter {pname!r}: dtype must be float or int, got {p.dtype!r}",
                                     variant=self.name, **at)
            if isinstance(p, Scalar) and p.default is not None and (
                    isinstance(p.default, bool) or not isinstance(p.default, (int, float))
                    or (p.dtype is int and not isinstance(p.default, int))):
                # a Python int or float, as a value passed at call time: a Fraction, Decimal or numpy scalar is
                # not what the kernels, the Triton twin and the reference would all read the same way
                raise FivarSpecError(f"Scalar parameter {pname!r}: default {shown(p.default)} is not "
                                     f"{'an int' if p.dtype is int else 'a float'} (it is a "
                                     f"{type(p.default).__name__}; write a Python "
                                     f"{'int' if p.dtype is int else 'float or int'})", variant=self.name, **at)
            if isinstance(p, Scalar) and p.default is not None and p.dtype in (float, int):
                why = ("it must be finite" if isinstance(p.default, float) and not math.isfinite(p.default)
                       else out_of_range(p.default, p.ir_type))  # what a value passed at call time must be
                if why:
                    raise FivarSpecError(f"Scalar parameter {pname!r}: default {shown(p.default)}: {why}",
                                         variant=self.name, **at)
            if isinstance(p, Tensor):
                from .params import KNOWN_DIMS, TENSOR_DTYPES
                if p.dtype not in TENSOR_DTYPES:
                    raise FivarSpecError(f"Tensor parameter {pname!r}: dtype {p.dtype!r} is not one of "
                                         f"{sorted(TENSOR_DTYPES)}", variant=self.name, **at)
                if isinstance(p.dims, str) or not isinstance(p.dims, (tuple, list)) or not p.dims \
                        or not all(isinstance(d, str) and d.strip() for d in p.dims):
                    raise FivarSpecError(
                        f"Tensor parameter {pname!r}: dims must be a non-empty tuple of dimension names, one per "
                        f"dimension, e.g. (\"qo_head\",) or (\"qo_head\", \"n\"); got {p.dims!r}",
                        variant=self.name, **at)
                if p.learnable and p.ir_type != "f32":
                    raise FivarSpecError(f"Tensor parameter {pname!r}: learnable=True needs a float dtype, got "
                                         f"{p.dtype!r}", variant=self.name, **at)
                for dim in p.dims:  # a near miss of a checked name would silently go unchecked
                    close = difflib.get_close_matches(dim, KNOWN_DIMS, n=1, cutoff=0.8)
                    if close and dim not in KNOWN_DIMS and dim[0] == close[0][0]:  # not `patch` for `batch`
                        raise FivarSpecError(
                            f"Tensor parameter {pname!r}: dimension {dim!r} is close to {close[0]!r}, which fivar "
                            f"checks against the call's shapes; use {close[0]!r}, or a name further from it for a "
                            "free dimension", variant=self.name, **at)
        if not self.doc:
            fn = self.logits or self.mask or self.sink
            module = inspect.getmodule(fn)
            self.doc = inspect.getdoc(module) or "" if module else ""

    @staticmethod
    def _where(fn) -> dict:
        if fn is None or not hasattr(fn, "__code__"):
            return {}
        return {"filename": fn.__code__.co_filename, "line": fn.__code__.co_firstlineno, "col": 0}

    @property
    def source_file(self) -> str | None:
        fn = self.logits or self.mask or self.sink
        return fn.__code__.co_filename if hasattr(fn, "__code__") else None

    @cached_property
    def ir(self):
        """The parsed, type-checked programs: `.logits`, `.mask` and `.sink` (any may be None)."""
        from .parse import parse_variant
        return parse_variant(self)

    @property
    def lowered(self):
        """The IR after the compiled targets' passes (see fivar.spec.optimize), for the lowering config in force."""
        from ..config import lowering_config
        from .optimize import lower
        config = lowering_config()
        memo = self.__dict__.setdefault("_lowered", {})
        if config not in memo:
            memo[config] = lower(self.ir, self.softmax, config.position_tables, tuple(self.params),
                                 self.learnable_params if config.training else None)
        return memo[config]

    @property
    def learnable_params(self) -> dict:
        """The tensor params that get gradients in training: float tensors declared `learnable=True`."""
        from . import ir
        return {n: p for n, p in self.tensor_params.items() if p.learnable and p.ir_type == ir.F32}

    @property
    def compiled_params(self) -> dict:
        """The params the compiled targets read: the variant's own, then those the lowering synthesized."""
        return {**self.params, **self.lowered.params}

    @cached_property
    def kv_band(self):
        """The KV band its mask implies (fivar.spec.bounds): what FA3 and the Triton twin skip."""
        from .bounds import kv_band
        return kv_band(self.ir.mask)

    @cached_property
    def logits_range(self) -> tuple[float, float] | None:
        """[lo, hi] of the lowered logits transform over every score (fivar.spec.ranges), or None if unbounded."""
        from .ranges import program_range
        return program_range(self.lowered.logits) if self.lowered.logits is not None else None

    @property
    def scans_mask(self) -> bool:
        """True when the mask is more than a band (a document mask): a kernel that skips KV tiles has to
        find the kept keys by evaluating the mask first (the device block map of the Triton twin and FA3)."""
        return self.lowered.mask is not None and not self.kv_band.exact

    @property
    def scalar_params(self) -> dict[str, Scalar]:
        return {k: p for k, p in self.params.items() if isinstance(p, Scalar)}

    @property
    def tensor_params(self) -> dict[str, Tensor]:
        return {k: p for k, p in self.params.items() if isinstance(p, Tensor)}


#: Keyword arguments fivar's call methods take besides a variant's `**params` (prefill's `causal`, plan_paged's
#: `dtype` ...): a param of one of these names would be taken for the call's own argument. The methods themselves
#: sit above the runtime (fivar.runtime.methods), which checks this set against their signatures when it adds them.
CALL_KWARGS = frozenset({
    "backend", "batch_idx", "batch_size", "causal", "cuda_graph", "custom_mask", "device", "dtype", "head_dim", "k",
    "k_scale", "kv_dtype", "kv_indices", "kv_indptr", "kv_last_page_len", "mask_indptr", "max_batch", "max_pages",
    "max_qo_len", "num_kv_heads", "num_qo_heads", "out", "packed_custom_mask", "page_size", "paged_kv_cache", "q",
    "qo_indptr", "return_lse", "self", "sm_scale", "uniform_qo_len", "v", "v_scale"})
