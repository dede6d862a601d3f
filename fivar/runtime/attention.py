"""Running a variant's kernels: argument checks, module lookup, launch.

Every entry point validates shapes, dtypes, devices and params *before* touching a module, so a mistake
is a one-line `FivarError` naming the variant, never a CUDA error from inside a kernel. Which target and form a
call runs is fivar.runtime.forms'; the plans (one-shot calls keep theirs here, in `_one_shot`) are
fivar.runtime.plans', both re-exported here.
"""
from __future__ import annotations

import math

import torch

from .. import config
from ..codegen import fa2, fa3
from ..errors import FivarError
from ..jit.module_key import ModuleKey
from ..jit.targets import runs_twin, target_of
from ..spec.inputs import check_lse
from .fp8_kv import check_q_dtype, check_scale, fp8_backend, kv_dtype_of, scaled_output
from . import cold_start, wave_split
from .launch import (_check_decode_indptr, _check_indptr, _check_out, _check_pages, _check_qkv, _check_ragged_indptr,
                     _module, _paged_kv, _prepare)
from .params import kernel_args
from .plan_cache import Hashed, PlanCache
from .triton_attention import triton_batch_prefill_paged, triton_batch_prefill_ragged, triton_decode, triton_prefill
from .forms import (BACKENDS, ALL_BACKENDS, choose_target, _check_backend, _codegen, _causal_flag, _paged_args,
                    _window_left, _owns_mask, _kernel_causal, _plan_causal, _split_kwargs, _decode_on_tensor_cores,
                    trims_decode_pages, _trimmed_decode_pages)
from .plans import (_OwnsWrapper, explicit_plan, _launch_one, DecodePlan, _no_scales_compiled, _run_scales,
                    decode_plan, _plan_setup, PagedAttentionPlan, RaggedAttentionPlan)


def _meanwhile(run):
    """The Triton twin's result while the call's modules build (fivar.runtime.cold_start), or None where the twin
    refuses the call (a shape or feature it lacks): the call then waits for its modules. The stand-in compiles one
    launch config per kernel (cold_start.STAND_IN)."""
    try:
        with config.override(**cold_start.STAND_IN):
            return run()
    except FivarError:
        return None


def _into(out, result, return_lse: bool):
    """`result` (an output, or (output, lse) with return_lse) with its output copied into `out` if given."""
    if out is None:
        return result
    out.copy_(result[0] if return_lse else result)
    return (out, result[1]) if return_lse else out


def single_prefill(variant, q, k, v, *, causal=False, sm_scale=None, backend="fa2", out=None, params=None,
                   return_lse=False):
    if torch.compiler.is_compiling():  # host checks cannot be traced: one custom op (fivar.runtime.ops)
        from . import ops
        return _into(out, ops.prefill(variant, q, k, v, causal=causal, sm_scale=sm_scale, backend=backend,
                                      params=params or {}, return_lse=return_lse), return_lse)
    if runs_twin(backend):
        return triton_prefill(variant, q, k, v, causal=causal, sm_scale=sm_scale, out=out, params=params,
                              return_lse=return_lse)
    return_lse = check_lse(variant, return_lse)
    parts = ("single", variant, backend, bool(causal), sm_scale, params or {}, _shapes(q, k, v))
    plan = _one_shot.lookup(parts)
    if plan is not None:  # a batch of one, planned by an earlier call with the same key
        _check_out(variant, out, q)
        return _into(out, plan.run(q, k, v, return_lse=return_lse), return_lse)
    _check_qkv(variant, q, k, v)
    _check_out(variant, out, q)
    target = _check_backend(variant, backend, "single_prefill", q.device)
    if causal and q.shape[0] > k.shape[0]:
        raise FivarError(f"variant '{variant.name}': causal attention with qo_len ({q.shape[0]}) > kv_len "
                         f"({k.shape[0]}) is not supported by FlashInfer's kernels (the first rows would see no "
                         "key); use backend='triton', which returns zeros for those rows like the reference")
    if cold_start.runs_triton(variant, "single_prefill", target, backend, q, params, sm_scale, causal):
        done = _meanwhile(lambda: triton_prefill(variant, q, k, v, causal=causal, sm_scale=sm_scale, out=out,
                                                 params=params, return_lse=return_lse))
        if done is not None:
            return done
    causal = _kernel_causal(variant, causal)
    given_scale = sm_scale
    bound, sm_scale = _prepare(variant, params or {}, q, k.shape[1], 1, sm_scale)
    window_left = _window_left(variant, target, bound)
    if variant.scans_mask or (target_of(target).windows_as_batch and window_left >= 0):
        # A batch of one: FA3's tile-list form, FA2's block form (fivar.runtime.fa2_blocks); for a window, FA2's
        # batch kernel, which starts each query tile's KV loop at the window where the single-prefill kernel
        # visits every tile left of it. Planned once per key.
        indptr = lambda n: torch.tensor([0, n], dtype=torch.int32, device=q.device)  # noqa: E731
        plan = _one_shot.get(parts, lambda: RaggedAttentionPlan(
            variant, indptr(q.shape[0]), indptr(k.shape[0]), num_qo_heads=q.shape[1], num_kv_heads=k.shape[1],
            head_dim=q.shape[-1], dtype=q.dtype, causal=causal, sm_scale=given_scale, backend=target,
            device=q.device, params=params or {}))
        return _into(out, plan.run(q, k, v, return_lse=return_lse), return_lse)
    fmod = _module(variant, ModuleKey("single_prefill", target, q.dtype, q.shape[-1]), bound, sm_scale)
    module = fmod.load()
    args = kernel_args(variant, bound, sm_scale, _causal_flag(variant, target, causal),
                       lengths=(q.shape[0], k.shape[0]))
    mask_mode = _codegen(target).runtime_mask_code(variant, causal)
    non_causal_schedule = fmod.options.get("schedule", "grid").split(",")[0]
    from ..flashinfer_compat import active
    if not active("single_prefill_run"):  # FlashInfer changed the run's arguments: its own helper, and a copy
        from flashinfer.prefill import single_prefill_with_kv_cache_with_jit_module
        return _into(out, single_prefill_with_kv_cache_with_jit_module(
            module, q, k, v, *args, kv_layout="NHD", mask_mode=mask_mode, window_left=window_left,
            return_lse=return_lse), return_lse)
    from flashinfer.utils import SINGLE_KERNEL_TMP_SIZE, TensorLayout

    # the module's run as FlashInfer's helper calls it, into `out` itself where it can take it (no copy of the
    # output); one workspace for every launch of a wave split (FlashInfer 0.7's sm90 single prefill never touches it)
    tmp = torch.empty(SINGLE_KERNEL_TMP_SIZE, dtype=torch.uint8, device=q.device)

    def launch(q_, k_, v_, o_, lse_):
        module.run(q_, k_, v_, tmp, o_, lse_, mask_mode, TensorLayout.NHD.value, window_left, *args)
    if target_of(target).splits_waves and not return_lse and \
            wave_split.applies(variant, causal, window_left, non_causal_schedule):
        tile = fa3.non_causal_tile(fmod.options.get("cta_tile"), q.shape[-1], q.shape[0])
        split = wave_split.plan_for(variant, q, k, tile)
        if split is not None:
            return wave_split.run(launch, q, k, v, out if out is not None else torch.empty_like(q), split, tile[1])
    shape = q.shape[:-1] + v.shape[-1:]
    # an `out` sharing memory with q, k or v is written after the kernel, which reads them all the while
    direct = out is not None and out.shape == shape and out.dtype == q.dtype and out.device == q.device and \
        out.is_contiguous() and not _shares_storage(out, q, k, v)
    o = out if direct else torch.empty(shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    launch(q, k, v, o, lse)
    if direct:
        torch.autograd.graph.increment_version(out)  # written through its pointer: autograd must see it
    return _into(None if direct else out, (o, lse) if return_lse else o, return_lse)


def _shares_storage(out: torch.Tensor, *tensors) -> bool:
    storage = out.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == storage for t in tensors)


# --- batch entry points: FlashInfer's own wrappers plan and launch, running fivar's module -------------

_one_shot = PlanCache(on_evict=lambda plan: plan.release())  # the one-shot calls' plans (fivar.runtime.plan_cache)


def _cache_backend(variant, backend: str, q, k_cache, v_cache) -> str:
    """The backend that reads this paged cache (fivar.runtime.fp8_kv.fp8_backend: FA2 for an FP8 one, which other
    backends refuse); inputs that are not tensors are left for the checks to name."""
    if isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor):
        return fp8_backend(variant, backend, kv_dtype_of(variant, q.dtype, k_cache, v_cache))
    return backend


def _shapes(q, k, v) -> Hashed:
    """What a cached plan assumes of the data tensors (not their contents): a hit skips the checks of these."""
    if type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:  # no generator: every call
        return Hashed(((q.shape, q.stride(), q.dtype, q.device), (k.shape, k.stride(), k.dtype, k.device),
                       (v.shape, v.stride(), v.dtype, v.device)))
    return Hashed((t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t)
                  for t in (q, k, v))


def batch_prefill_ragged(variant, q, k, v, qo_indptr, kv_indptr, *, causal=False, sm_scale=None,
                         backend="fa2", params=None, return_lse=False):
    if torch.compiler.is_compiling():
        from . import ops
        return ops.ragged(variant, q, k, v, qo_indptr, kv_indptr, causal=causal, sm_scale=sm_scale, backend=backend,
                          params=params or {}, return_lse=return_lse)
    if runs_twin(backend):
        return triton_batch_prefill_ragged(variant, q, k, v, qo_indptr, kv_indptr, causal=causal,
                                           sm_scale=sm_scale, params=params, return_lse=return_lse)
    parts = ("ragged", variant, backend, bool(causal), sm_scale, params or {}, qo_indptr, kv_indptr, _shapes(q, k, v))
    plan = _one_shot.lookup(parts)
    if plan is None:
        _check_qkv(variant, q, k, v)
        target = _check_backend(variant, backend, "batch_prefill", q.device)
        if cold_start.runs_triton(variant, "batch_prefill", target, backend, q, params, sm_scale, causal):
            done = _meanwhile(lambda: triton_batch_prefill_ragged(variant, q, k, v, qo_indptr, kv_indptr, causal=causal,
                                                                  sm_scale=sm_scale, params=params,
                                                                  return_lse=return_lse))
            if done is not None:
                return done
        qo_indptr, kv_indptr, _ = _check_ragged_indptr(variant, q, k, qo_indptr, kv_indptr)
        plan = _one_shot.get(parts, lambda: RaggedAttentionPlan(
            variant, qo_indptr, kv_indptr, num_qo_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[-1],
            dtype=q.dtype, causal=causal, sm_scale=sm_scale, backend=backend, device=q.device, params=params or {}))
    return plan.run(q, k, v, return_lse=return_lse)


def _k_scaled(sm_scale, q, k_scale: float):
    """sm_scale with k_scale folded in (fivar.runtime.fp8_kv); an invalid sm_scale is left for _prepare to name."""
    if k_scale == 1.0:
        return sm_scale
    try:
        return (1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)) * k_scale
    except (TypeError, ValueError, RuntimeError):
        return sm_scale


def batch_prefill_paged(variant, q, paged_kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *,
                        causal=False, sm_scale=None, backend="fa2", params=None, return_lse=False, k_scale=None,
                        v_scale=None, custom_mask=None, packed_custom_mask=None, mask_indptr=None):
    """k_scale/v_scale: the cache holds k / k_scale and v / v_scale (an FP8 cache: fivar.runtime.fp8_kv).
    custom_mask / packed_custom_mask / mask_indptr: an engine's custom mask (fivar.runtime.custom_mask)."""
    check_q_dtype(variant, q)
    k_scale, v_scale = check_scale(variant, "k_scale", k_scale), check_scale(variant, "v_scale", v_scale)
    sm_scale = _k_scaled(sm_scale, q, k_scale)
    masks = (custom_mask, packed_custom_mask, mask_indptr)
    if torch.compiler.is_compiling():
        from . import ops
        return scaled_output(ops.paged(variant, q, *_paged_kv(variant, paged_kv_cache), qo_indptr, kv_indptr,
                                       kv_indices, kv_last_page_len, causal=causal, sm_scale=sm_scale, backend=backend,
                                       params=params or {}, return_lse=return_lse, masks=masks), v_scale, return_lse)
    k_cache, v_cache = _paged_kv(variant, paged_kv_cache)
    backend = _cache_backend(variant, backend, q, k_cache, v_cache)
    if runs_twin(backend):
        return scaled_output(triton_batch_prefill_paged(
            variant, q, (k_cache, v_cache), qo_indptr, kv_indptr, kv_indices, kv_last_page_len, causal=causal,
            sm_scale=sm_scale, params=params, return_lse=return_lse, custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask, mask_indptr=mask_indptr), v_scale, return_lse)
    return_lse = check_lse(variant, return_lse)
    parts = ("paged", variant, backend, bool(causal), sm_scale, params or {}, qo_indptr, kv_indptr, kv_indices,
             kv_last_page_len, _shapes(q, k_cache, v_cache), *masks)
    plan = _one_shot.lookup(parts)
    if plan is None:
        _check_qkv(variant, q, k_cache, v_cache, paged=True)
        _check_backend(variant, backend, "batch_prefill", q.device)
        qo_indptr = _check_indptr(variant, "qo_indptr", qo_indptr, q.device)
        kv_indptr = _check_indptr(variant, "kv_indptr", kv_indptr, q.device)
        if kv_indptr.numel() != qo_indptr.numel() or int(qo_indptr[-1]) != q.shape[0]:
            raise FivarError(f"variant '{variant.name}': qo_indptr and kv_indptr must have the same length, and "
                             f"qo_indptr[-1] ({int(qo_indptr[-1])}) must equal q's token count ({q.shape[0]})")
        kv_indices, kv_last_page_len = _check_pages(variant, kv_indptr, kv_indices, kv_last_page_len,
                                                    k_cache.shape[0], k_cache.shape[1], q.device)
        plan = _one_shot.get(parts, lambda: _paged_plan(variant, backend, q, k_cache, qo_indptr, kv_indptr, kv_indices,
                                                        kv_last_page_len, causal, sm_scale, params, masks))
    # the key holds the shapes and dtypes the plan was made for, and the scales are folded into sm_scale
    return scaled_output(plan._launch(q, k_cache, v_cache, 1.0, return_lse), v_scale, return_lse)


def _paged_plan(variant, backend, q, k_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, causal, sm_scale,
                params, masks=(None, None, None)):
    return PagedAttentionPlan(variant, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads=q.shape[1],
                              num_kv_heads=k_cache.shape[2], head_dim=q.shape[-1], page_size=k_cache.shape[1],
                              dtype=q.dtype, kv_dtype=k_cache.dtype, causal=causal, sm_scale=sm_scale,
                              backend=backend, device=q.device, params=params or {}, custom_mask=masks[0],
                              packed_custom_mask=masks[1], mask_indptr=masks[2])


def batch_decode(variant, q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, *, sm_scale=None,
                 backend="fa2", params=None, return_lse=False, k_scale=None, v_scale=None):
    """One query token per request: q [batch, num_qo_heads, head_dim]; q_idx is kv_len - 1. k_scale/v_scale: the
    cache holds k / k_scale and v / v_scale (an FP8 cache: fivar.runtime.fp8_kv)."""
    check_q_dtype(variant, q)
    k_scale, v_scale = check_scale(variant, "k_scale", k_scale), check_scale(variant, "v_scale", v_scale)
    sm_scale = _k_scaled(sm_scale, q, k_scale)
    if torch.compiler.is_compiling():
        from . import ops
        return scaled_output(ops.decode(variant, q, *_paged_kv(variant, paged_kv_cache), kv_indptr, kv_indices,
                                        kv_last_page_len, sm_scale=sm_scale, backend=backend, params=params or {},
                                        return_lse=return_lse), v_scale, return_lse)
    k_cache, v_cache = _paged_kv(variant, paged_kv_cache)
    if runs_twin(backend):
        _cache_backend(variant, backend, q, k_cache, v_cache)  # refuses an FP8 cache
        return scaled_output(triton_decode(variant, q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len,
                                           sm_scale=sm_scale, params=params, return_lse=return_lse),
                             v_scale, return_lse)
    return_lse = check_lse(variant, return_lse)
    # the key holds the backend asked for and the caches' dtypes: a hit skips choosing the backend again (decode is
    # the call whose host time shows: its kernels take tens of microseconds)
    parts = ("decode", variant, backend, sm_scale, params or {}, kv_indptr, kv_indices, kv_last_page_len,
             _shapes(q, k_cache, v_cache))
    plan = _one_shot.lookup(parts)
    if plan is None:
        backend = _cache_backend(variant, backend, q, k_cache, v_cache)
        _check_qkv(variant, q, k_cache, v_cache, paged=True)
        target = _check_backend(variant, backend, "batch_decode", q.device)
        if cold_start.runs_triton(variant, "batch_decode", target, backend, q, params, sm_scale):  # building
            done = _meanwhile(lambda: triton_decode(variant, q, paged_kv_cache, kv_indptr, kv_indices,
                                                    kv_last_page_len, sm_scale=sm_scale, params=params,
                                                    return_lse=return_lse))
            if done is not None:
                return scaled_output(done, v_scale, return_lse)
        kv_indptr, batch = _check_decode_indptr(variant, q, kv_indptr)
        kv_indices, kv_last_page_len = _check_pages(variant, kv_indptr, kv_indices, kv_last_page_len,
                                                    k_cache.shape[0], k_cache.shape[1], q.device)
        if trims_decode_pages(variant) or _decode_on_tensor_cores(variant, q.shape[1], k_cache.shape[2]):
            qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
            make = lambda: _paged_plan(variant, "fa2", q, k_cache, qo_indptr, kv_indptr, kv_indices,  # noqa: E731
                                       kv_last_page_len, False, sm_scale, params)
        else:
            make = lambda: DecodePlan(variant, kv_indptr, kv_indices, kv_last_page_len,  # noqa: E731
                                      num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[2], head_dim=q.shape[-1],
                                      page_size=k_cache.shape[1], dtype=q.dtype, kv_dtype=k_cache.dtype,
                                      sm_scale=sm_scale, device=q.device, params=params or {})
        plan = _one_shot.get(parts, make)
    # the key holds the shapes and dtypes the plan was made for, and the scales are folded into sm_scale
    return scaled_output(plan._launch(q, k_cache, v_cache, 1.0, return_lse), v_scale, return_lse)


