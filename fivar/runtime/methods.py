"""`AttentionVariant`'s calls: `prefill`, `batch_prefill_*`, `decode`, the plans, `attention`, `reference`.

The declaration (fivar.spec.variant) knows nothing of kernels; this module sits above the runtime and adds the calls
to the class when fivar is imported, so the spec imports only downward (as FusionVariant's calls sit above its
runtime, fivar.fusion.variant). Each call is thin: the work lives in fivar.runtime.attention and its neighbours.
"""
from __future__ import annotations

import functools
import inspect

from ..errors import FivarError
from ..spec.variant import CALL_KWARGS, AttentionVariant


class _Calls:
    """The methods `attach` adds to AttentionVariant (written as a class body so they read as methods)."""

    def _check_backend_name(self, backend: str) -> None:
        """A typo in `backend` is named first, before checks of the inputs could hide it."""
        if backend not in _runtime().ALL_BACKENDS:
            raise FivarError(f"variant '{self.name}': backend {backend!r} is not available (choose from "
                             f"{', '.join(_runtime().ALL_BACKENDS)})")

    def prefill(self, q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                backend: str = "auto", out=None, return_lse: bool = False, **params):
        """Single-request prefill. q: [qo_len, Hq, D], k/v: [kv_len, Hkv, D] (NHD). return_lse: (out, lse), lse
        float32 [qo_len, Hq] in base 2 (fivar.runtime.lse), for `fivar.merge_states`."""
        self._check_backend_name(backend)
        return _runtime().single_prefill(self, q, k, v, causal=causal, sm_scale=sm_scale, backend=backend,
                                         out=out, params=params, return_lse=return_lse)

    def batch_prefill_ragged(self, q, k, v, qo_indptr, kv_indptr, *, causal: bool = False,
                             sm_scale: float | None = None, backend: str = "auto", return_lse: bool = False,
                             **params):
        self._check_backend_name(backend)
        return _runtime().batch_prefill_ragged(self, q, k, v, qo_indptr, kv_indptr, causal=causal,
                                               sm_scale=sm_scale, backend=backend, params=params, return_lse=return_lse)

    def batch_prefill_paged(self, q, paged_kv_cache, qo_indptr, kv_indptr, kv_indices,
                            kv_last_page_len, *, causal: bool = False, sm_scale: float | None = None,
                            backend: str = "auto", return_lse: bool = False, k_scale: float | None = None,
                            v_scale: float | None = None, custom_mask=None, packed_custom_mask=None,
                            mask_indptr=None, **params):
        """k_scale/v_scale: the cache holds k / k_scale, v / v_scale (a float8_e4m3fn cache: fivar.runtime.fp8_kv).
        custom_mask (bool, each request's [qo_len, kv_len] flattened and concatenated) or packed_custom_mask
        (uint8, those bits packed little-endian per request; mask_indptr: each request's first byte): FlashInfer's
        custom mask, ANDed with the variant's mask and causal (fivar.runtime.custom_mask; docs/serving.md)."""
        self._check_backend_name(backend)
        return _runtime().batch_prefill_paged(self, q, paged_kv_cache, qo_indptr, kv_indptr, kv_indices,
                                              kv_last_page_len, causal=causal, sm_scale=sm_scale,
                                              backend=backend, params=params, return_lse=return_lse, k_scale=k_scale,
                                              v_scale=v_scale, custom_mask=custom_mask,
                                              packed_custom_mask=packed_custom_mask, mask_indptr=mask_indptr)

    def decode(self, q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, *,
               sm_scale: float | None = None, backend: str = "auto", return_lse: bool = False,
               k_scale: float | None = None, v_scale: float | None = None, **params):
        """k_scale/v_scale: the cache holds k / k_scale, v / v_scale (a float8_e4m3fn cache: fivar.runtime.fp8_kv)."""
        self._check_backend_name(backend)
        return _runtime().batch_decode(self, q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len,
                                       sm_scale=sm_scale, backend=backend, params=params, return_lse=return_lse,
                                       k_scale=k_scale, v_scale=v_scale)

    def plan_paged(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, num_qo_heads: int,
                   num_kv_heads: int, head_dim: int, page_size: int, dtype=None, causal: bool = False,
                   sm_scale: float | None = None, backend: str = "auto", device="cuda", kv_dtype=None,
                   custom_mask=None, packed_custom_mask=None, mask_indptr=None, cuda_graph: bool = False,
                   max_batch: int | None = None, max_qo_len: int | None = None, max_pages: int | None = None,
                   uniform_qo_len: bool = False, **params):
        """Plan a paged batch once, then `.run(q, paged_kv_cache)` per layer (FlashInfer's plan/run split).
        kv_dtype=torch.float8_e4m3fn: an FP8 cache, run with `.run(q, cache, k_scale=, v_scale=)`. A plan reads its
        index tensors and tensor params when made: after writing one in place, call `.invalidate()`.
        custom_mask / packed_custom_mask / mask_indptr: as batch_prefill_paged's, planned with the batch.
        cuda_graph=True (with max_batch=, max_qo_len=, max_pages=): a verify step's tile list in fixed buffers for
        capture and replay, `.plan(...)` before each replay (fivar.runtime.graph_verify); uniform_qo_len=True promises
        every step's requests max_qo_len queries each (a fixed draft count), which lets FA2 size its query tile
        for them (a step breaking the promise is refused)."""
        self._check_backend_name(backend)
        if cuda_graph:
            from ..jit.targets import runs_twin
            from .graph_verify import GraphVerifyPlan, _check_uniform
            from .graph_verify_twin import TwinGraphVerifyPlan
            _check_uniform(self, uniform_qo_len)  # before a plan's device checks
            plan = TwinGraphVerifyPlan if runs_twin(backend) else functools.partial(GraphVerifyPlan, backend=backend)
            return plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads=num_qo_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, max_batch=max_batch,
                        max_qo_len=max_qo_len, max_pages=max_pages, dtype=dtype, causal=causal, sm_scale=sm_scale,
                        device=device, params=params, kv_dtype=kv_dtype, custom_mask=custom_mask,
                        packed_custom_mask=packed_custom_mask, mask_indptr=mask_indptr, uniform_qo_len=uniform_qo_len)
        if (max_batch, max_qo_len, max_pages) != (None, None, None) or uniform_qo_len is not False:
            raise FivarError(f"variant '{self.name}': max_batch, max_qo_len, max_pages and uniform_qo_len shape a "
                             "cuda_graph=True plan; pass cuda_graph=True with them")
        rt = _runtime()
        return rt.explicit_plan(lambda: rt.PagedAttentionPlan(
            self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype, causal=causal,
            sm_scale=sm_scale, backend=backend, device=device, params=params, kv_dtype=kv_dtype,
            custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, mask_indptr=mask_indptr))

    def plan_ragged(self, qo_indptr, kv_indptr, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                    dtype=None, causal: bool = False, sm_scale: float | None = None, backend: str = "auto",
                    device="cuda", **params):
        """Plan a ragged batch (a single request: indptrs [0, len]) once, then `.run(q, k, v)` per layer; after
        writing an indptr or tensor param in place, `.invalidate()` plans again from the new contents."""
        self._check_backend_name(backend)
        rt = _runtime()
        return rt.explicit_plan(lambda: rt.RaggedAttentionPlan(
            self, qo_indptr, kv_indptr, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            dtype=dtype, causal=causal, sm_scale=sm_scale, backend=backend, device=device, params=params))

    def plan_decode(self, kv_indptr, kv_indices, kv_last_page_len, *, cuda_graph: bool = False, **kwargs):
        """Plan what `decode` runs (FA2: the tensor-core paged kernel or the decode kernel, as `decode` chooses) once
        per batch, then `.run(q, paged_kv_cache)` per layer (`.invalidate()` after writing its tensors in place).
        cuda_graph=True
        (with max_batch=, max_pages=): fixed buffers for capture and replay (fivar.runtime.graph)."""
        if cuda_graph:
            from .graph import GraphDecodePlan
            params = {k: kwargs.pop(k) for k in list(kwargs) if k in self.params}
            return GraphDecodePlan(self, kv_indptr, kv_indices, kv_last_page_len, params=params, **kwargs)
        self._check_backend_name(kwargs.get("backend", "auto"))
        plan_args = {"num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype", "sm_scale", "backend", "device",
                     "kv_dtype"}
        params = {k: kwargs.pop(k) for k in list(kwargs) if k not in plan_args}  # checked against the declaration
        rt = _runtime()
        return rt.explicit_plan(lambda: rt.decode_plan(self, kv_indptr, kv_indices, kv_last_page_len, params=params,
                                                       **kwargs))

    def attention(self, q, k, v, *, causal: bool = False, sm_scale: float | None = None, backend: str = "auto",
                  qo_indptr=None, kv_indptr=None, return_lse: bool = False, **params):
        """Differentiable attention for training (fivar.runtime.autograd): q [qo_len, Hq, D], k/v [kv_len, Hkv, D],
        or a ragged batch with `qo_indptr`/`kv_indptr`. Gradients reach q, k, v and the tensor params declared
        `learnable=True`; works under torch.compile (custom ops with fake implementations)."""
        from .autograd import attention
        return attention(self, q, k, v, causal=causal, sm_scale=sm_scale, backend=backend, qo_indptr=qo_indptr,
                         kv_indptr=kv_indptr, return_lse=return_lse, params=params)

    def reference(self, q, k, v, *, causal: bool = False, sm_scale: float | None = None, batch_idx: int = 0,
                  batch_size: int | None = None, return_lse: bool = False, k_scale: float | None = None,
                  v_scale: float | None = None, custom_mask=None, **params):
        """The torch reference (float32 math) for request `batch_idx` of a batch; same shapes as `prefill`.
        k_scale/v_scale: k and v are quantized (an FP8 cache's contents), dequantized as k.float() * k_scale.
        custom_mask: bool [qo_len, kv_len] of this request, ANDed in (a verify batch's draft tree)."""
        from ..codegen.torch_ref import reference_attention
        return reference_attention(self, q, k, v, causal=causal, sm_scale=sm_scale, params=params,
                                   batch_idx=batch_idx, batch_size=batch_size, return_lse=return_lse,
                                   k_scale=k_scale, v_scale=v_scale, custom_mask=custom_mask)


def call_kwargs(cls=_Calls) -> frozenset[str]:
    """The argument names of the calls that take a variant's params as `**params`: a param of one of these names
    would be taken for the call's own argument."""
    names = set()
    for fn in vars(cls).values():
        if not callable(fn) or fn.__name__.startswith("_"):
            continue
        sig = inspect.signature(fn).parameters.values()
        if any(a.kind is inspect.Parameter.VAR_KEYWORD for a in sig):
            names |= {a.name for a in sig if a.kind is not inspect.Parameter.VAR_KEYWORD}
    return frozenset(names)


def attach() -> None:
    """Add the calls to AttentionVariant (every variant, `fivar.load`'s too, shares the class). The spec rejects
    params named like a call's arguments from its own list, CALL_KWARGS: it has to be this module's."""
    if call_kwargs() != CALL_KWARGS:
        raise RuntimeError(f"fivar.spec.variant.CALL_KWARGS differs from the calls' arguments: missing "
                           f"{sorted(call_kwargs() - CALL_KWARGS)}, extra {sorted(CALL_KWARGS - call_kwargs())}")
    for name, fn in vars(_Calls).items():
        if callable(fn) and not name.startswith("__"):
            fn.__qualname__ = f"{AttentionVariant.__name__}.{name}"
            setattr(AttentionVariant, name, fn)


_RUNTIME = None


def _runtime():
    """fivar.runtime.attention, imported on the first call (`import fivar` does not load FlashInfer) and kept: an
    import statement per call cost about 0.7 us of a decode step's host time."""
    global _RUNTIME
    if _RUNTIME is None:
        from . import attention
        _RUNTIME = attention
    return _RUNTIME


attach()
