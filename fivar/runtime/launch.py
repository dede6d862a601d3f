"""What every entry point shares: argument checks, param binding, module lookup, FlashInfer wrappers (taken and
given back; attached to fivar's modules by fivar.flashinfer_compat.wrappers, the one place that touches their
private attributes).

Below the entry points (fivar.runtime.attention, .fa3_tile_list, .triton_attention), importing none of them, so
the runtime's modules import one way: launch <- fa3_tile_list, triton_attention <- attention.
"""
from __future__ import annotations

import math

import torch

from ..codegen import fa3
from ..errors import FivarError
from ..flashinfer_compat.wrappers import DirectPagedRun, attach, direct_paged_run  # noqa: F401 (re-exported)
from ..jit.build import DTYPES, HEAD_DIMS, KV_DTYPES, module_for
from ..jit.module_key import ModuleKey
from ..spec import ir
from ..spec.evaluate import eval_scalar
from ..spec.inputs import PAGED_KV_LAYOUT, PAGED_KV_NAMES, same_device, check_qkv_layout, check_sm_scale
from .params import bind_params


def _check_qkv(variant, q, k, v, *, paged: bool = False, allow_cpu: bool = False, head_dims=HEAD_DIMS):
    """fivar.spec.inputs' shape checks, then what the kernels support: CUDA (or the CPU where allowed),
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
    fp8_cache = paged and k.dtype == v.dtype and k.dtype in KV_DTYPES.values()  # fivar.runtime.fp8_kv
    if q.dtype not in DTYPES.values() or ((k.dtype != q.dtype or v.dtype != q.dtype) and not fp8_cache):
        raise FivarError(f"variant '{name}': q, k, v must all be float16 or all bfloat16"
                         f"{' (or a float8_e4m3fn paged cache)' if paged else ''}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_cuda and q.dtype == torch.bfloat16:
        raise FivarError(f"variant '{name}': bfloat16 on the CPU: the Triton interpreter (TRITON_INTERPRET=1) has no "
                         "bfloat16 arithmetic and would return wrong numbers; use float16 CPU tensors")
    d = q.shape[-1]
    if d not in head_dims:
        raise FivarError(f"variant '{name}': head_dim {d} is not supported (use one of {tuple(head_dims)})")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise FivarError(f"variant '{name}': the last dimension of q, k, v must be contiguous")


_invariants: dict = {}


def _invariant(variant, expr, scalars: dict, sm_scale: float = 1.0) -> float:
    """Value of an invariant IR expression for these scalar params, evaluated once per distinct values
    (not on every launch)."""
    key = (id(variant), id(expr), tuple(sorted(scalars.items())), sm_scale)
    value = _invariants.get(key)
    if value is None:
        if len(_invariants) > 4096:
            _invariants.clear()
        value = _invariants[key] = eval_scalar(expr, scalars, sm_scale, variant.lowered.hoisted)
    return value


def _expanded(variant, e: ir.Expr) -> ir.Expr:
    """`e` with the lowered programs' hoisted names put back, for messages."""
    return ir.substitute(e, lambda n: _expanded(variant, variant.lowered.hoisted[n.name])
                         if isinstance(n, ir.Hoisted) else None)


def _check_output_scale(variant, bound, sm_scale):
    """The folded logits factor goes into the softmax exponent scale: it must be positive."""
    scale = variant.lowered.output_scale
    if scale is None:
        return
    factor = _invariant(variant, scale, bound.scalars, sm_scale)
    if not (factor > 0 and math.isfinite(factor)):
        text = ir.format_expr(_expanded(variant, scale)).replace("params.sm_scale", "sm_scale")
        raise FivarError(f"variant '{variant.name}': the logits factor `{text}` evaluates to {factor} for these "
                         f"params; it must be a positive finite number (fivar folds it into the softmax scale)")


def runs_bounded_softmax(variant, dtype: str, scalars: dict, sm_scale: float) -> bool:
    """Whether a launch of FA3 in `dtype` with these scalar params runs the bounded softmax's module: the variant's
    transform is bounded (fa3.softmax_range, the config allowing) and the range times the folded factor is narrow
    enough (fa3.bounded_softmax_applies)."""
    rng = fa3.softmax_range(variant, dtype)
    if rng is None:
        return False
    scale = variant.lowered.output_scale
    return fa3.bounded_softmax_applies(rng, 1.0 if scale is None else _invariant(variant, scale, scalars, sm_scale))


def _module(variant, key: ModuleKey, bound, sm_scale):
    """The module a launch runs: module_for, except that an FA3 module built with the bounded softmax is swapped
    for the one with the running max when these params make the range too wide (runs_bounded_softmax)."""
    if key.kernels.bounds_softmax and fa3.softmax_range(variant, key.dtype) is not None \
            and not runs_bounded_softmax(variant, key.dtype, bound.scalars, sm_scale):
        return module_for(variant, key.replace(bounded_softmax=False))
    return module_for(variant, key)


def _prepare(variant, params, q, num_kv_heads, batch_size, sm_scale):
    bound = bind_params(variant, params, num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads,
                        batch_size=batch_size, device=q.device)
    sm_scale = check_sm_scale(variant.name, sm_scale, q.shape[-1])
    _check_output_scale(variant, bound, sm_scale)
    return bound, sm_scale


def _check_out(variant, out, q):
    """`out=` of a single prefill: written in place, so it must be q's shape, dtype and device."""
    if out is not None and not (isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
                                and out.device == q.device):
        got = f"{out.dtype} {list(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise FivarError(f"variant '{variant.name}': out must be like q ({q.dtype} {list(q.shape)} on {q.device}), "
                         f"got {got}")


_WORKSPACE_BYTES = 128 << 20


_workspaces: dict = {}


def _workspace(device, target: str):
    """The float workspace (split-KV partial outputs) of FlashInfer wrappers running `target` on `device`: one per
    backend, since the two parts of a mixed batch (FA2 and FA3, fivar.runtime.mixed) run at once on two streams."""
    key = (str(torch.device(device)), target)
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws


#: Wrappers of plans the one-shot cache dropped, per (kind, module, device), for the next plans of that module: a new
#: wrapper allocates pinned host and device workspaces (milliseconds), a re-plan of a kept one does not.
_free_wrappers: dict = {}
_FREE_WRAPPERS_PER_MODULE = 4


def take_wrapper(kind: str, fmod, device, owns_mask: bool):
    """A FlashInfer wrapper of `kind` ("ragged", "paged", "decode") running fivar's module `fmod`: a released one
    if there is one, else a new one."""
    free = _free_wrappers.get((kind, fmod.uri, str(device)))
    if free:
        w = free.pop()
    else:
        import flashinfer
        ws = _workspace(device, fmod.target)
        if kind == "ragged":
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", backend=fmod.target)
        elif kind == "paged":
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend=fmod.target)
        else:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD", use_tensor_cores=False,
                                                              backend="fa2")
    return attach(w, fmod.load(), fmod, owns_mask)


def release_wrapper(kind: str, fmod, device, wrapper) -> None:
    """Give a wrapper whose plan is no longer used back for take_wrapper (its next plan re-plans it)."""
    free = _free_wrappers.setdefault((kind, fmod.uri, str(device)), [])
    if len(free) < _FREE_WRAPPERS_PER_MODULE:
        free.append(wrapper)


_INT32_MAX = 2**31 - 1


def _integer(t) -> bool:
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _index_device(variant, name: str, t: torch.Tensor, device) -> None:
    """An index tensor lives on the inputs' device or on the host (copied over, as FlashInfer's plans take host
    indptrs); another GPU (or a meta tensor) is a mistake a silent copy would hide. `device` "cpu": a host copy."""
    if t.device.type == "meta" or (t.device.type != "cpu" and torch.device(device).type != "cpu"
                                   and not same_device(device, t.device)):
        raise FivarError(f"variant '{variant.name}': {name} is on {t.device}, the inputs are on {device}; pass it "
                         f"on {device} or on the CPU")


def _as_index(t: torch.Tensor, device) -> torch.Tensor:
    """What the kernels and FlashInfer's plans read: contiguous int32 on `device`. They take a raw pointer and
    the element count, so a strided view (a column of a 2-D tensor, t[::2]) or int64 would be read as other values."""
    return t.to(device=device, dtype=torch.int32).contiguous()


def _check_indptr(variant, name, t, device):
    """`t` checked and normalised (_as_index): a 1-D integer tensor, starting at 0, never decreasing, within int32."""
    if not (_integer(t) and t.dim() == 1 and t.numel() >= 2):
        got = f", got {t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else f", got {type(t).__name__}"
        raise FivarError(f"variant '{variant.name}': {name} must be a 1-D int32 tensor with batch_size+1 "
                         f"entries{got}")
    _index_device(variant, name, t, device)
    # The kernels trust it (a negative or decreasing entry reads or writes outside the tensors). One host copy: the
    # plans copy it to the host anyway. Checked in its own dtype: an int64 entry past int32 would wrap.
    host = t.cpu()
    if int(host[0]) != 0 or bool((host[1:] < host[:-1]).any()):
        raise FivarError(f"variant '{variant.name}': {name} must start at 0 and never decrease, got "
                         f"{host[:8].tolist()}{' ...' if t.numel() > 8 else ''}")
    if int(host[-1]) > _INT32_MAX:
        raise FivarError(f"variant '{variant.name}': {name} ends at {int(host[-1])}, past the kernels' 32-bit "
                         f"indices")
    return _as_index(t, device)


def _check_pages(variant, kv_indptr, kv_indices, kv_last_page_len, num_pages: int, page_size: int, device):
    """kv_indices / kv_last_page_len of a paged batch (kv_indptr checked), normalised (_as_index): what the
    kernels read without a bound check, so a bad entry reads another request's page or outside the cache."""
    batch, pages = kv_indptr.numel() - 1, int(kv_indptr[-1])
    for name, t, ok, want in (
            ("kv_indices", kv_indices, lambda n: n >= pages, f"at least {pages} entries (kv_indptr[-1])"),
            ("kv_last_page_len", kv_last_page_len, lambda n: n == batch, f"{batch} entries (one per request)")):
        if not (_integer(t) and t.dim() == 1 and ok(t.numel())):
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise FivarError(f"variant '{variant.name}': {name} must be a 1-D int32 tensor of {want}, got {got}")
        _index_device(variant, name, t, device)
    # the ranges in the tensors' own dtypes (an int64 page number past int32 would wrap into range), then int32
    kv_indices, kv_last_page_len = kv_indices.to(device), kv_last_page_len.to(device)
    ranges = [t.aminmax() if t.numel() else (t.new_zeros(()),) * 2 for t in (kv_indices[:pages], kv_last_page_len)]
    lo, hi, last_lo, last_hi = torch.stack([x.long() for r in ranges for x in r]).tolist()  # one sync for all four
    num_pages = min(num_pages, _INT32_MAX + 1)
    if lo < 0 or hi >= num_pages:
        raise FivarError(f"variant '{variant.name}': kv_indices must be page numbers in 0..{num_pages - 1} (the "
                         f"cache's pages), got {lo}..{hi}")
    if last_lo < 0 or last_hi > page_size:
        raise FivarError(f"variant '{variant.name}': kv_last_page_len must be in 0..page_size ({page_size}), got "
                         f"{last_lo}..{last_hi}")
    return _as_index(kv_indices, device), _as_index(kv_last_page_len, device)


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
