"""Running a variant's kernels: argument checks, module lookup, launch.

Every entry point validates shapes, dtypes, devices and params *before* touching a module, so a mistake
is a one-line `FivarError` naming the variant, never a CUDA error from inside a kernel.
"""
from __future__ import annotations

import math

import torch

from ..codegen import fa2, fa3
from ..codegen.torch_ref import eval_scalar
from ..errors import FivarError
from ..jit.build import DTYPES, HEAD_DIMS, dtype_name, module_for
from ..spec import ir
from .inputs import PAGED_KV_LAYOUT, PAGED_KV_NAMES, check_qkv_layout
from .lse import check_lse
from . import wave_split
from .params import bind_params, kernel_args


BACKENDS = ("auto", "fa2", "fa3")
ALL_BACKENDS = (*BACKENDS, "triton")  # with the Triton twin, which fivar.runtime.triton_attention runs


def choose_target(variant, backend: str, op: str, device=None, capability=None) -> tuple[str, str]:
    """(target, reason): which generated kernel runs this op, and why. `capability` (major, minor): as if the GPU
    were that (`fivar show --explain --arch` on a machine without one)."""
    if backend not in BACKENDS:
        raise FivarError(f"variant '{variant.name}': backend '{backend}' is not available "
                         f"(choose from {', '.join(BACKENDS)})")
    if op == "batch_decode":
        if backend == "fa3":
            raise FivarError(f"variant '{variant.name}': FlashInfer has no FA3 decode kernel; use backend "
                             "'fa2' or 'auto' for decode")
        return "fa2", ("decode runs on FA2 (FlashInfer has no FA3 decode): the tensor-core paged kernel when a "
                       "KV head serves >= 4 query heads (measured faster), else the CUDA-core decode kernel")
    if backend != "auto":
        return backend, f"backend='{backend}' was requested"
    if capability is not None:
        major, minor = capability
    elif device is not None and torch.device(device).type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
    elif torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
    else:
        return "fa2", "no GPU visible: FA2 (FA3 needs sm90)"
    if (major, minor) == (9, 0):
        return "fa3", ("sm90 GPU and every construct of this variant is expressible in FA3 "
                       "(masks fold into LogitsTransform)")
    return "fa2", f"sm{major}{minor} GPU: FA3 kernels are built for sm90a only"


def _check_backend(variant, backend: str, op: str = "single_prefill", device=None) -> str:
    return choose_target(variant, backend, op, device)[0]


def _codegen(target: str):
    return fa3 if target == "fa3" else fa2


def _causal_flag(variant, target: str, causal: bool):
    """FA2 runs masked variants in kCustom mode and applies `causal` inside the mask: a runtime flag."""
    return bool(causal) if (variant.mask and target == "fa2") else None


def _kv_range_prefill(variant, q, k, qo_indptr, kv_indptr, causal, bound, sm_scale):
    from .kv_ranges import KvRangePrefill
    return KvRangePrefill(variant, qo_indptr, kv_indptr, num_qo_heads=q.shape[1], num_kv_heads=k.shape[1],
                          head_dim=q.shape[-1], dtype=q.dtype, causal=causal, bound=bound, sm_scale=sm_scale,
                          device=q.device, shared=True)


def _paged_args(variant, target, bound, sm_scale, causal, qo_indptr, kv_indptr, kv_last_page_len, page_size):
    """Run arguments of a paged batch. FA3's batch module of a mask that is more than a band is the KV-range
    form (fivar.runtime.kv_ranges); paged batches run it unsplit, one block per request, with FA3's own
    causal mode (so no runtime flag) and each request's q_idx offset kv_len - qo_len in `fv_blocks`."""
    if not (target == "fa3" and variant.scans_mask):
        return kernel_args(variant, bound, sm_scale, _causal_flag(variant, target, causal))
    from ..codegen.fa3 import BLOCKS
    qo_h, kv_h, last_h = qo_indptr.cpu().long(), kv_indptr.cpu().long(), kv_last_page_len.cpu().long()
    kv_lens = (kv_h.diff() - 1).clamp(min=0) * page_size + torch.where(kv_h.diff() > 0, last_h, 0)
    batch = qo_h.numel() - 1
    zeros = torch.zeros(batch, dtype=torch.long)  # no full range: the mask runs on every pair
    blocks = torch.stack([torch.arange(batch), kv_lens - qo_h.diff(), zeros, zeros, zeros], 1)
    return kernel_args(variant, bound, sm_scale, False,
                       tables={BLOCKS: blocks.to(device=qo_indptr.device, dtype=torch.int32)})


def _check_qkv(variant, q, k, v, *, paged: bool = False, allow_cpu: bool = False, head_dims=HEAD_DIMS):
    """fivar.runtime.inputs' shape checks, then what the kernels support: CUDA (or the CPU where allowed),
    float16/bfloat16, `head_dims`, a contiguous last dimension. paged: k and v are the paged caches."""
    name = variant.name
    if paged:
        check_qkv_layout(name, q, k, v, kv_layout=PAGED_KV_LAYOUT, kv_names=PAGED_KV_NAMES)
    else:
        check_qkv_layout(name, q, k, v)
    if not q.is_cuda and not allow_cpu:
        raise FivarError(f"variant '{name}': inputs must be CUDA tensors (got {q.device}); on the CPU use "
                         f"variant.reference(...), or backend='triton' with TRITON_INTERPRET=1 set before Triton is "
                         f"imported (float16)")
    if q.dtype not in DTYPES.values() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise FivarError(f"variant '{name}': q, k, v must all be float16 or all bfloat16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_cuda and q.dtype == torch.bfloat16:
        raise FivarError(f"variant '{name}': bfloat16 on the CPU: the Triton interpreter (TRITON_INTERPRET=1) has no "
                         "bfloat16 arithmetic and would return wrong numbers; use float16 CPU tensors")
    d = q.shape[-1]
    if d not in head_dims:
        raise FivarError(f"variant '{name}': head_dim {d} is not supported (use one of {tuple(head_dims)})")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise FivarError(f"variant '{name}': the last dimension of q, k, v must be contiguous")


_invariants: dict = {}


def _invariant(variant, expr, bound, sm_scale: float = 1.0) -> float:
    """Value of an invariant IR expression for these scalar params, evaluated once per distinct values
    (not on every launch)."""
    key = (id(variant), id(expr), tuple(sorted(bound.scalars.items())), sm_scale)
    value = _invariants.get(key)
    if value is None:
        if len(_invariants) > 4096:
            _invariants.clear()
        value = _invariants[key] = eval_scalar(expr, bound.scalars, sm_scale, variant.lowered.hoisted)
    return value


def _expanded(variant, e: ir.Expr) -> ir.Expr:
    """`e` with the lowered programs' hoisted names put back, for messages."""
    if isinstance(e, ir.Hoisted):
        return _expanded(variant, variant.lowered.hoisted[e.name])
    kids = tuple(_expanded(variant, c) for c in e.children())
    return ir.rebuild(e, kids) if kids != e.children() else e


def _check_output_scale(variant, bound, sm_scale):
    """The folded logits factor goes into the softmax exponent scale: it must be positive."""
    scale = variant.lowered.output_scale
    if scale is None:
        return
    factor = _invariant(variant, scale, bound, sm_scale)
    if not (factor > 0 and math.isfinite(factor)):
        text = ir.format_expr(_expanded(variant, scale)).replace("params.sm_scale", "sm_scale")
        raise FivarError(f"variant '{variant.name}': the logits factor `{text}` evaluates to {factor} for these "
                         f"params; it must be a positive finite number (fivar folds it into the softmax scale)")


def _module(variant, op, target, dtype, head_dim, bound, sm_scale, row_runs: bool = False):
    """The module a launch runs: module_for, except that an FA3 module built with the bounded softmax is swapped
    for the one with the running max when these params make the range too wide (fa3.bounded_softmax_applies)."""
    dt = dtype_name(dtype)
    if target == "fa3":
        rng = fa3.softmax_range(variant, dt)
        if rng is not None:
            scale = variant.lowered.output_scale
            factor = 1.0 if scale is None else _invariant(variant, scale, bound, sm_scale)
            if not fa3.bounded_softmax_applies(rng, factor):
                return module_for(variant, op, target, dt, head_dim, row_runs=row_runs, bounded_softmax=False)
    return module_for(variant, op, target, dt, head_dim, row_runs=row_runs)


def _window_left(variant, target: str, bound) -> int:
    """FlashInfer's `window_left` for a kernel fivar built with FA3's sliding-window schedule, else -1.

    A mask that is exactly the window is FA3's own to apply (fa3.runs_as_window): window_left is then the
    band's left edge exactly, negative ones included (keys right of the diagonal only; FlashInfer's -1 means
    "no window" only to its Python wrappers, the kernel built with the window applies it as given). Otherwise
    the mask still runs on every visited tile, so the window only has to be no tighter than the mask: a band
    reaching right of the diagonal is clamped to 0. Keys and rows stay below 2**30, so clamping there is exact.
    """
    left = variant.kv_band.left
    if target != "fa3" or left is None or variant.scans_mask:  # the KV-range form skips through its ranges
        return -1
    lowest = -(1 << 30) if fa3.runs_as_window(variant) else 0
    return min(max(int(_invariant(variant, left, bound)), lowest), 1 << 30)


def _prepare(variant, params, q, num_kv_heads, batch_size, sm_scale):
    bound = bind_params(variant, params, num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads,
                        batch_size=batch_size, device=q.device)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    try:
        finite = math.isfinite(float(sm_scale))
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
        finite = False
    if not finite:
        raise FivarError(f"variant '{variant.name}': sm_scale must be a finite number, got {sm_scale!r}")
    _check_output_scale(variant, bound, sm_scale)
    return bound, float(sm_scale)


def _check_out(variant, out, q):
    """`out=` of a single prefill: written in place, so it must be q's shape, dtype and device."""
    if out is not None and not (isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
                                and out.device == q.device):
        got = f"{out.dtype} {list(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise FivarError(f"variant '{variant.name}': out must be like q ({q.dtype} {list(q.shape)} on {q.device}), "
                         f"got {got}")


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
    if backend == "triton":
        from .triton_attention import triton_prefill
        return triton_prefill(variant, q, k, v, causal=causal, sm_scale=sm_scale, out=out, params=params,
                              return_lse=return_lse)
    return_lse = check_lse(variant, return_lse)
    _check_qkv(variant, q, k, v)
    _check_out(variant, out, q)
    target = _check_backend(variant, backend, "single_prefill", q.device)
    if causal and q.shape[0] > k.shape[0]:
        raise FivarError(f"variant '{variant.name}': causal attention with qo_len ({q.shape[0]}) > kv_len "
                         f"({k.shape[0]}) is not supported by FlashInfer's kernels (the first rows would see no "
                         "key); use backend='triton', which returns zeros for those rows like the reference")
    bound, sm_scale = _prepare(variant, params or {}, q, k.shape[1], 1, sm_scale)
    if target == "fa3" and variant.scans_mask:  # a batch of one in FA3's KV-range form
        indptr = lambda n: torch.tensor([0, n], dtype=torch.int32)  # noqa: E731
        o = _kv_range_prefill(variant, q, k, indptr(q.shape[0]), indptr(k.shape[0]), causal, bound,
                              sm_scale).run(q, k, v, return_lse=return_lse)
        return _into(out, o, return_lse)
    fmod = _module(variant, "single_prefill", target, q.dtype, q.shape[-1], bound, sm_scale)
    module = fmod.load()
    args = kernel_args(variant, bound, sm_scale, _causal_flag(variant, target, causal))
    mask_mode, window_left = _codegen(target).runtime_mask_code(variant, causal), _window_left(variant, target, bound)
    non_causal_schedule = fmod.options.get("schedule", "grid").split(",")[0]
    if target == "fa3" and not return_lse and wave_split.applies(variant, causal, window_left, non_causal_schedule):
        tile = fa3.non_causal_tile(fmod.options.get("cta_tile"), q.shape[-1], q.shape[0])
        split = wave_split.plan_for(variant, q, k, tile)
        if split is not None:
            from flashinfer.utils import SINGLE_KERNEL_TMP_SIZE, TensorLayout

            # one workspace for every launch: FlashInfer 0.7's sm90 single prefill never touches it
            tmp = torch.empty(SINGLE_KERNEL_TMP_SIZE, dtype=torch.uint8, device=q.device)

            def launch(q_, k_, v_, o_, lse_):
                module.run(q_, k_, v_, tmp, o_, lse_, mask_mode, TensorLayout.NHD.value, window_left, *args)
            return wave_split.run(launch, q, k, v, out if out is not None else torch.empty_like(q), split, tile[1])
    from flashinfer.prefill import single_prefill_with_kv_cache_with_jit_module
    o = single_prefill_with_kv_cache_with_jit_module(module, q, k, v, *args, kv_layout="NHD", mask_mode=mask_mode,
                                                     window_left=window_left, return_lse=return_lse)
    return _into(out, o, return_lse)


# --- batch entry points: FlashInfer's own wrappers plan and launch, running fivar's module -------------

_WORKSPACE_BYTES = 128 << 20
_workspaces: dict = {}
_wrappers: dict = {}


def _workspace(device):
    ws = _workspaces.get(device)
    if ws is None:
        ws = _workspaces[device] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws


def _attach(wrapper, module, fmod, owns_mask: bool):
    """Point a FlashInfer wrapper at a module fivar built (FlashInfer would otherwise build its own).

    Touches the private attributes FlashInfer's `jit_args` path sets (checked: fivar.flashinfer_compat.wrappers).
    """
    from ..flashinfer_compat import problem
    why = problem("wrapper_jit_module")
    if why:
        raise FivarError(f"fivar cannot run its modules through this FlashInfer's wrappers: {why}")
    from flashinfer.decode import get_batch_decode_jit_module
    from flashinfer.prefill import get_batch_prefill_jit_module
    t_names, _, s_names, _ = fmod.additional
    make = get_batch_decode_jit_module if fmod.op == "batch_decode" else get_batch_prefill_jit_module
    wrapper._jit_module = make(fmod.uri, module)
    wrapper._jit_additional_tensor_names = list(t_names)
    if hasattr(wrapper, "_jit_additional_scalar_names"):
        wrapper._jit_additional_scalar_names = list(s_names)
    if hasattr(wrapper, "_variant_owns_mask"):
        wrapper._variant_owns_mask = owns_mask
    return wrapper


def _wrapper(kind: str, variant, fmod, device):
    import flashinfer
    key = (kind, fmod.uri, device)
    w = _wrappers.get(key)
    if w is None:
        ws = _workspace(device)
        if kind == "ragged":
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", backend=fmod.target)
        elif kind == "paged":
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend=fmod.target)
        else:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD", use_tensor_cores=False,
                                                              backend="fa2")
        _attach(w, fmod.load(), fmod, owns_mask=bool(variant.mask) and fmod.target == "fa2")
        _wrappers[key] = w
    return w


def _plan_causal(variant, target: str, causal: bool) -> bool:
    # FA2 masked variants fold causal into their kCustom mask; everything else uses the kernel's causal mode
    return bool(causal) and not (variant.mask and target == "fa2")


def _split_kwargs(variant, target: str) -> dict:
    # Split-KV partials are merged through their log-sum-exp, which a no-softmax variant does not have.
    return {"disable_split_kv": True} if (target == "fa2" and not variant.softmax) else {}


def _check_indptr(variant, name, t, device):
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32 or t.numel() < 2:
        raise FivarError(f"variant '{variant.name}': {name} must be a 1-D int32 tensor with batch_size+1 "
                         f"entries")
    # The kernels trust it (a negative or decreasing entry reads or writes outside the tensors). One host copy: the
    # plans copy it to the host anyway.
    host = t.cpu()
    if int(host[0]) != 0 or bool((host[1:] < host[:-1]).any()):
        raise FivarError(f"variant '{variant.name}': {name} must start at 0 and never decrease, got "
                         f"{host[:8].tolist()}{' ...' if t.numel() > 8 else ''}")
    return t.to(device)


def _check_pages(variant, kv_indptr, kv_indices, kv_last_page_len, num_pages: int, page_size: int, device):
    """kv_indices / kv_last_page_len of a paged batch (kv_indptr checked): what the kernels read without a bound
    check, so a bad entry reads another request's page or outside the cache."""
    batch, pages = kv_indptr.numel() - 1, int(kv_indptr[-1])
    for name, t, ok, want in (
            ("kv_indices", kv_indices, lambda n: n >= pages, f"at least {pages} entries (kv_indptr[-1])"),
            ("kv_last_page_len", kv_last_page_len, lambda n: n == batch, f"{batch} entries (one per request)")):
        if not (isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype in (torch.int32, torch.int64)
                and ok(t.numel())):
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise FivarError(f"variant '{variant.name}': {name} must be a 1-D int32 tensor of {want}, got {got}")
    kv_indices = kv_indices.to(device=device, dtype=torch.int32)
    kv_last_page_len = kv_last_page_len.to(device=device, dtype=torch.int32)
    ranges = [t.aminmax() if t.numel() else (t.new_zeros(()),) * 2 for t in (kv_indices[:pages], kv_last_page_len)]
    lo, hi, last_lo, last_hi = torch.stack([x for r in ranges for x in r]).tolist()  # one sync for all four
    if lo < 0 or hi >= num_pages:
        raise FivarError(f"variant '{variant.name}': kv_indices must be page numbers in 0..{num_pages - 1} (the "
                         f"cache's pages), got {lo}..{hi}")
    if last_lo < 0 or last_hi > page_size:
        raise FivarError(f"variant '{variant.name}': kv_last_page_len must be in 0..page_size ({page_size}), got "
                         f"{last_lo}..{last_hi}")
    return kv_indices, kv_last_page_len


def _paged_kv(variant, paged_kv_cache):
    if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        k_cache, v_cache = paged_kv_cache
    elif isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2:
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    else:
        raise FivarError(f"variant '{variant.name}': paged_kv_cache must be (k_cache, v_cache), each "
                         "[num_pages, page_size, num_kv_heads, head_dim], or one [num_pages, 2, page_size, "
                         "num_kv_heads, head_dim] tensor")
    return k_cache, v_cache


def _check_ragged_indptr(variant, q, k, qo_indptr, kv_indptr):
    qo_indptr = _check_indptr(variant, "qo_indptr", qo_indptr, q.device)
    kv_indptr = _check_indptr(variant, "kv_indptr", kv_indptr, q.device)
    batch = qo_indptr.numel() - 1
    if kv_indptr.numel() != batch + 1:
        raise FivarError(f"variant '{variant.name}': qo_indptr and kv_indptr must have the same length")
    if int(qo_indptr[-1]) != q.shape[0] or int(kv_indptr[-1]) != k.shape[0]:
        raise FivarError(f"variant '{variant.name}': qo_indptr[-1]/kv_indptr[-1] ({int(qo_indptr[-1])}, "
                         f"{int(kv_indptr[-1])}) must equal the token counts of q and k ({q.shape[0]}, {k.shape[0]})")
    return qo_indptr, kv_indptr, batch


def _check_decode_indptr(variant, q, kv_indptr):
    kv_indptr = _check_indptr(variant, "kv_indptr", kv_indptr, q.device)
    batch = kv_indptr.numel() - 1
    if q.shape[0] != batch:
        raise FivarError(f"variant '{variant.name}': decode takes one query per request: q has {q.shape[0]} rows, "
                         f"kv_indptr describes {batch} requests")
    return kv_indptr, batch


def batch_prefill_ragged(variant, q, k, v, qo_indptr, kv_indptr, *, causal=False, sm_scale=None,
                         backend="fa2", params=None, return_lse=False):
    if torch.compiler.is_compiling():
        from . import ops
        return ops.ragged(variant, q, k, v, qo_indptr, kv_indptr, causal=causal, sm_scale=sm_scale, backend=backend,
                          params=params or {}, return_lse=return_lse)
    if backend == "triton":
        from .triton_attention import triton_batch_prefill_ragged
        return triton_batch_prefill_ragged(variant, q, k, v, qo_indptr, kv_indptr, causal=causal,
                                           sm_scale=sm_scale, params=params, return_lse=return_lse)
    return_lse = check_lse(variant, return_lse)
    _check_qkv(variant, q, k, v)
    target = _check_backend(variant, backend, "batch_prefill", q.device)
    qo_indptr, kv_indptr, batch = _check_ragged_indptr(variant, q, k, qo_indptr, kv_indptr)
    bound, sm_scale = _prepare(variant, params or {}, q, k.shape[1], batch, sm_scale)
    if target == "fa3" and variant.scans_mask:
        return _kv_range_prefill(variant, q, k, qo_indptr, kv_indptr, causal, bound, sm_scale).run(
            q, k, v, return_lse=return_lse)
    fmod = _module(variant, "batch_prefill", target, q.dtype, q.shape[-1], bound, sm_scale)
    w = _wrapper("ragged", variant, fmod, q.device)
    w.plan(qo_indptr, kv_indptr, q.shape[1], k.shape[1], q.shape[-1], causal=_plan_causal(variant, target, causal),
           window_left=_window_left(variant, target, bound), q_data_type=q.dtype, kv_data_type=k.dtype,
           o_data_type=q.dtype, **_split_kwargs(variant, target))
    return w.run(q, k, v, *kernel_args(variant, bound, sm_scale, _causal_flag(variant, target, causal)),
                 return_lse=return_lse)


def batch_prefill_paged(variant, q, paged_kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *,
                        causal=False, sm_scale=None, backend="fa2", params=None, return_lse=False):
    if torch.compiler.is_compiling():
        from . import ops
        return ops.paged(variant, q, *_paged_kv(variant, paged_kv_cache), qo_indptr, kv_indptr, kv_indices,
                         kv_last_page_len, causal=causal, sm_scale=sm_scale, backend=backend, params=params or {},
                         return_lse=return_lse)
    if backend == "triton":
        raise FivarError(f"variant '{variant.name}': the Triton twin has no paged prefill (its paged kernel is "
                         "decode); use backend='fa2'/'fa3'/'auto', or batch_prefill_ragged(..., backend='triton') "
                         "on K/V gathered from the pages")
    return_lse = check_lse(variant, return_lse)
    k_cache, v_cache = _paged_kv(variant, paged_kv_cache)
    _check_qkv(variant, q, k_cache, v_cache, paged=True)
    target = _check_backend(variant, backend, "batch_prefill", q.device)
    qo_indptr = _check_indptr(variant, "qo_indptr", qo_indptr, q.device)
    kv_indptr = _check_indptr(variant, "kv_indptr", kv_indptr, q.device)
    if kv_indptr.numel() != qo_indptr.numel() or int(qo_indptr[-1]) != q.shape[0]:
        raise FivarError(f"variant '{variant.name}': qo_indptr and kv_indptr must have the same length, and "
                         f"qo_indptr[-1] ({int(qo_indptr[-1])}) must equal q's token count ({q.shape[0]})")
    kv_indices, kv_last_page_len = _check_pages(variant, kv_indptr, kv_indices, kv_last_page_len, k_cache.shape[0],
                                                k_cache.shape[1], q.device)
    return _paged_prefill(variant, target, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                          causal, sm_scale, params, return_lse)


def _paged_prefill(variant, target, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, causal,
                   sm_scale, params, return_lse=False):
    """batch_prefill_paged after its checks (batch_decode's tensor-core path comes here with its own)."""
    bound, sm_scale = _prepare(variant, params or {}, q, k_cache.shape[2], qo_indptr.numel() - 1, sm_scale)
    fmod = _module(variant, "batch_prefill", target, q.dtype, q.shape[-1], bound, sm_scale)
    w = _wrapper("paged", variant, fmod, q.device)
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, q.shape[1],
           k_cache.shape[2], q.shape[-1], k_cache.shape[1], causal=_plan_causal(variant, target, causal),
           window_left=_window_left(variant, target, bound), q_data_type=q.dtype, kv_data_type=k_cache.dtype,
           o_data_type=q.dtype, **_split_kwargs(variant, target))
    return w.run(q, (k_cache, v_cache), *_paged_args(variant, target, bound, sm_scale, causal, qo_indptr,
                                                     kv_indptr, kv_last_page_len, k_cache.shape[1]),
                 return_lse=return_lse)


def batch_decode(variant, q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, *, sm_scale=None,
                 backend="fa2", params=None, return_lse=False):
    """One query token per request: q [batch, num_qo_heads, head_dim]; q_idx is kv_len - 1."""
    if torch.compiler.is_compiling():
        from . import ops
        return ops.decode(variant, q, *_paged_kv(variant, paged_kv_cache), kv_indptr, kv_indices, kv_last_page_len,
                          sm_scale=sm_scale, backend=backend, params=params or {}, return_lse=return_lse)
    if backend == "triton":
        from .triton_attention import triton_decode
        return triton_decode(variant, q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len,
                             sm_scale=sm_scale, params=params, return_lse=return_lse)
    return_lse = check_lse(variant, return_lse)
    k_cache, v_cache = _paged_kv(variant, paged_kv_cache)
    _check_qkv(variant, q, k_cache, v_cache, paged=True)
    target = _check_backend(variant, backend, "batch_decode", q.device)
    kv_indptr, batch = _check_decode_indptr(variant, q, kv_indptr)
    kv_indices, kv_last_page_len = _check_pages(variant, kv_indptr, kv_indices, kv_last_page_len, k_cache.shape[0],
                                                k_cache.shape[1], q.device)
    if not variant.softmax or variant.sink is not None or q.shape[1] // k_cache.shape[2] >= 4:
        # One-token paged prefill on the tensor-core FA2 kernel: faster than the CUDA-core decode kernel
        # once a KV head serves >= 4 query heads (H200, batch 128 x 8192, GQA 32/8: 3.80 vs 2.60 TB/s of
        # KV read), and the only correct path without softmax (FlashInfer merges split-KV partials
        # through their log-sum-exp, which a no-softmax variant does not have) or with a sink (the decode
        # kernel has no per-row hook that knows its KV chunk: fivar.codegen.fa2).
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        return _paged_prefill(variant, "fa2", q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                              False, sm_scale, params, return_lse)
    bound, sm_scale = _prepare(variant, params or {}, q, k_cache.shape[2], batch, sm_scale)
    fmod = module_for(variant, "batch_decode", target, dtype_name(q.dtype), q.shape[-1])
    w = _wrapper("decode", variant, fmod, q.device)
    w.plan(kv_indptr, kv_indices, kv_last_page_len, q.shape[1], k_cache.shape[2],
           q.shape[-1], k_cache.shape[1], q_data_type=q.dtype, kv_data_type=k_cache.dtype, o_data_type=q.dtype)
    return w.run(q, (k_cache, v_cache), *kernel_args(variant, bound, sm_scale, False if variant.mask else None),
                 return_lse=return_lse)


def _plan_setup(plan, variant, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, dtype, backend,
                device):
    """The planned entry points' shared checks; sets plan.variant, .device, .target and .batch."""
    dtype = dtype or torch.bfloat16
    if dtype not in DTYPES.values():
        raise FivarError(f"variant '{variant.name}': dtype must be float16 or bfloat16, got {dtype}")
    if head_dim not in HEAD_DIMS or num_qo_heads % num_kv_heads:
        raise FivarError(f"variant '{variant.name}': head_dim must be one of {HEAD_DIMS} and num_qo_heads a "
                         f"multiple of num_kv_heads (got {head_dim}, {num_qo_heads}/{num_kv_heads})")
    plan.variant, plan.device = variant, torch.device(device)
    if backend == "triton":
        raise FivarError(f"variant '{variant.name}': a plan holds FlashInfer's planned kernels (fa2, fa3); the Triton "
                         f"twin has no plan step: call batch_prefill_ragged / decode with backend='triton' instead")
    if plan.device.type != "cuda" or not torch.cuda.is_available():
        raise FivarError(f"variant '{variant.name}': a plan runs FlashInfer's kernels on a CUDA GPU (device "
                         f"{str(plan.device)!r}{'' if torch.cuda.is_available() else ', and no GPU is visible'}); on "
                         f"the CPU use variant.reference(...), or the Triton twin (backend='triton') under "
                         f"TRITON_INTERPRET=1")
    plan.target = _check_backend(variant, backend, "batch_prefill", plan.device)
    qo_indptr = _check_indptr(variant, "qo_indptr", qo_indptr, plan.device)
    kv_indptr = _check_indptr(variant, "kv_indptr", kv_indptr, plan.device)
    plan.batch = qo_indptr.numel() - 1
    return dtype, qo_indptr, kv_indptr


class PagedAttentionPlan:
    """A planned paged batch: validate and plan once per batch layout, then `run(q, cache)` per layer.

    This is FlashInfer's plan/run split; the one-shot `batch_prefill_paged` re-plans on every call.
    """

    def __init__(self, variant, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, num_qo_heads,
                 num_kv_heads, head_dim, page_size, dtype=None, causal=False, sm_scale=None, backend="auto",
                 device="cuda", params=None):
        import flashinfer
        dtype, qo_indptr, kv_indptr = _plan_setup(self, variant, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads,
                                                  head_dim, dtype, backend, device)
        probe = torch.empty(1, num_qo_heads, head_dim, dtype=dtype, device=self.device)
        bound, sm_scale = _prepare(variant, params or {}, probe, num_kv_heads, self.batch, sm_scale)
        fmod = _module(variant, "batch_prefill", self.target, dtype, head_dim, bound, sm_scale)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(self.device), kv_layout="NHD",
                                                                       backend=self.target)
        _attach(self._wrapper, fmod.load(), fmod, owns_mask=bool(variant.mask) and self.target == "fa2")
        self._wrapper.plan(qo_indptr, kv_indptr, kv_indices.to(self.device), kv_last_page_len.to(self.device),
                           num_qo_heads, num_kv_heads, head_dim, page_size,
                           causal=_plan_causal(variant, self.target, causal),
                           window_left=_window_left(variant, self.target, bound), q_data_type=dtype,
                           kv_data_type=dtype, o_data_type=dtype, **_split_kwargs(variant, self.target))
        self._args = _paged_args(variant, self.target, bound, sm_scale, causal, qo_indptr, kv_indptr,
                                 kv_last_page_len, page_size)
        self._shape = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype)

    def run(self, q, paged_kv_cache, *, return_lse=False):
        if torch.compiler.is_compiling():
            from . import ops
            return ops.plan_run(self, q, *_paged_kv(self.variant, paged_kv_cache), return_lse)
        return_lse = check_lse(self.variant, return_lse)
        k_cache, v_cache = _paged_kv(self.variant, paged_kv_cache)
        hq, hkv, d, page, dtype = self._shape
        if q.shape[1:] != (hq, d) or k_cache.shape[1:] != (page, hkv, d) or q.dtype != dtype:
            raise FivarError(f"variant '{self.variant.name}': inputs do not match the plan (q [*, {hq}, {d}], "
                             f"cache [*, {page}, {hkv}, {d}], {dtype}); got q {tuple(q.shape)}, cache "
                             f"{tuple(k_cache.shape)}, {q.dtype}")
        return self._wrapper.run(q, (k_cache, v_cache), *self._args, return_lse=return_lse)


class RaggedAttentionPlan:
    """A planned ragged batch (`v.plan_ragged`): plan once per batch layout, then `run(q, k, v)` per layer.

    For a mask that is more than a band on FA3, planning is where the KV-range lowering happens (the mask
    pre-pass and FA3's schedule, fivar.runtime.kv_ranges); the one-shot entry points redo it every call.
    """

    def __init__(self, variant, qo_indptr, kv_indptr, *, num_qo_heads, num_kv_heads, head_dim, dtype=None,
                 causal=False, sm_scale=None, backend="auto", device="cuda", params=None):
        dtype, qo_indptr, kv_indptr = _plan_setup(self, variant, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads,
                                                  head_dim, dtype, backend, device)
        if kv_indptr.numel() != qo_indptr.numel():
            raise FivarError(f"variant '{variant.name}': qo_indptr and kv_indptr must have the same length")
        self._tokens = (int(qo_indptr[-1]), int(kv_indptr[-1]))
        probe = torch.empty(1, num_qo_heads, head_dim, dtype=dtype, device=self.device)
        bound, sm_scale = _prepare(variant, params or {}, probe, num_kv_heads, self.batch, sm_scale)
        self._shape = (num_qo_heads, num_kv_heads, head_dim, dtype)
        if self.target == "fa3" and variant.scans_mask:
            from .kv_ranges import KvRangePrefill
            self._kv_ranges = KvRangePrefill(
                variant, qo_indptr, kv_indptr, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, dtype=dtype, causal=causal, bound=bound, sm_scale=sm_scale, device=self.device)
            return
        import flashinfer
        self._kv_ranges = None
        fmod = _module(variant, "batch_prefill", self.target, dtype, head_dim, bound, sm_scale)
        self._wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace(self.device), kv_layout="NHD",
                                                                        backend=self.target)
        _attach(self._wrapper, fmod.load(), fmod, owns_mask=bool(variant.mask) and self.target == "fa2")
        self._wrapper.plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim,
                           causal=_plan_causal(variant, self.target, causal),
                           window_left=_window_left(variant, self.target, bound), q_data_type=dtype,
                           kv_data_type=dtype, o_data_type=dtype, **_split_kwargs(variant, self.target))
        self._args = kernel_args(variant, bound, sm_scale, _causal_flag(variant, self.target, causal))

    def run(self, q, k, v, *, return_lse=False):
        if torch.compiler.is_compiling():
            from . import ops
            return ops.plan_run(self, q, k, v, return_lse)
        return_lse = check_lse(self.variant, return_lse)
        _check_qkv(self.variant, q, k, v)
        hq, hkv, d, dtype = self._shape
        if (q.shape[0], k.shape[0]) != self._tokens or q.shape[1:] != (hq, d) or k.shape[1:] != (hkv, d) \
                or q.dtype != dtype or k.dtype != dtype:
            raise FivarError(f"variant '{self.variant.name}': inputs do not match the plan (q [{self._tokens[0]}, "
                             f"{hq}, {d}], k/v [{self._tokens[1]}, {hkv}, {d}], {dtype}); got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, {q.dtype}")
        if self._kv_ranges is not None:
            return self._kv_ranges.run(q, k, v, return_lse=return_lse)
        return self._wrapper.run(q, k, v, *self._args, return_lse=return_lse)
