"""Running a variant's Triton twin (`backend="triton"`): the same argument conventions and checks as the
FlashInfer entry points in `fivar.runtime.attention`, then a launch of the generated Triton module.

Under TRITON_INTERPRET=1 the twin also runs on CPU tensors (slowly; for tests without a GPU).
"""
from __future__ import annotations

import os

import torch

from ..codegen.fa2 import trims_decode_pages
from ..codegen.triton import kernel_arg_values
from ..jit.triton_module import load_triton_module
from ..spec.inputs import check_lse
from ..spec.sparsity import classify_decode
from ..errors import FivarError
from .custom_mask import check_custom_mask, paged_kv_lens
from .decode_pages import kept_page_list
from .launch import (_check_decode_indptr, _check_indptr, _check_out, _check_pages, _check_qkv, _check_ragged_indptr,
                     _paged_kv, _prepare)
from .rows import indptr
from . import position_tables
from .plan_cache import PlanCache

#: tl.arange and tl.dot want a power of two of at least 16.
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)


def _check_inputs(variant, q, k, v, **kw):
    _check_qkv(variant, q, k, v, allow_cpu=os.environ.get("TRITON_INTERPRET") == "1",
               head_dims=TRITON_HEAD_DIMS, **kw)


_single_indptrs: dict = {}

#: The block maps of the prefill calls (the module's `block_map`), kept like their FlashInfer plans
#: (fivar.runtime.plan_cache: keyed by shapes, params, causal and the indptrs): a layer after
#: the first with the same batch layout and params only launches. Not while a CUDA graph is captured (`recorded`).
_maps = PlanCache(capacity=8, recorded=True)


def kept_block_map(module, parts: tuple, qo_indptr, kv_indptr, max_qo_len: int, max_kv_len: int, num_qo_heads: int,
                   group: int, causal: bool, args: dict):
    """The module's block map for this call, made once per call signature (None: the mask has a band shape, or there
    is no mask, and the prefill needs none)."""
    if not hasattr(module, "block_map"):
        return None
    return _maps.get(parts + (bool(causal), module.MAP_BLOCK), lambda: module.block_map(
        qo_indptr, kv_indptr, max_qo_len, max_kv_len, num_qo_heads, group, causal, args))


def _single_indptr(length: int, device) -> torch.Tensor:
    """[0, length] on the device, kept: a fresh host->device copy on every call would synchronise."""
    key = (length, device)
    t = _single_indptrs.get(key)
    if t is None:
        if len(_single_indptrs) > 256:
            _single_indptrs.clear()
        t = _single_indptrs[key] = torch.tensor([0, length], dtype=torch.int32, device=device)
    return t


def triton_prefill(variant, q, k, v, *, causal=False, sm_scale=None, out=None, params=None, return_lse=False):
    """Single-request prefill: q [qo_len, Hq, D], k/v [kv_len, Hkv, D]."""
    return_lse = check_lse(variant, return_lse)
    _check_inputs(variant, q, k, v)
    _check_out(variant, out, q)
    bound, sm_scale = _prepare(variant, params or {}, q, k.shape[1], 1, sm_scale)
    bound = position_tables.bind(variant, bound, (q.shape[0], k.shape[0]))
    module, args = load_triton_module(variant), kernel_arg_values(variant, bound, sm_scale)
    qo_indptr, kv_indptr = _single_indptr(q.shape[0], q.device), _single_indptr(k.shape[0], q.device)
    plan = kept_block_map(module, ("single", variant, sm_scale, params or {}, q.shape, k.shape, q.device), qo_indptr,
                          kv_indptr, q.shape[0], k.shape[0], q.shape[1], q.shape[1] // k.shape[1], causal, args)
    o = module.prefill(q, k, v, qo_indptr, kv_indptr, q.shape[0], causal, args, return_lse, plan=plan)
    if out is not None:
        out.copy_(o[0] if return_lse else o)
        return (out, o[1]) if return_lse else out
    return o


def triton_batch_prefill_ragged(variant, q, k, v, qo_indptr, kv_indptr, *, causal=False, sm_scale=None,
                                params=None, return_lse=False):
    """Requests packed back to back: request b owns q[qo_indptr[b]:qo_indptr[b+1]] and likewise k/v."""
    return_lse = check_lse(variant, return_lse)
    _check_inputs(variant, q, k, v)
    given = (qo_indptr, kv_indptr)  # the key's: a normalised copy (_check_ragged_indptr) is a new tensor every call
    qo_indptr, kv_indptr, batch = _check_ragged_indptr(variant, q, k, qo_indptr, kv_indptr)
    bound, sm_scale = _prepare(variant, params or {}, q, k.shape[1], batch, sm_scale)
    max_qo_len, max_kv_len = position_tables.max_lengths(qo_indptr, kv_indptr)
    bound = position_tables.bind(variant, bound, (max_qo_len, max_kv_len))
    module, args = load_triton_module(variant), kernel_arg_values(variant, bound, sm_scale)
    plan = kept_block_map(module, ("ragged", variant, sm_scale, params or {}, *given, q.shape[1:], k.shape[1:],
                                   q.device), qo_indptr, kv_indptr, max_qo_len, max_kv_len, q.shape[1],
                          q.shape[1] // k.shape[1], causal, args)
    return module.prefill(q, k, v, qo_indptr, kv_indptr, max_qo_len, causal, args, return_lse, plan=plan)


def triton_batch_prefill_paged(variant, q, paged_kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *,
                               causal=False, sm_scale=None, params=None, return_lse=False, custom_mask=None,
                               packed_custom_mask=None, mask_indptr=None):
    """Several queries per request over a paged cache (a verify batch), with an optional custom mask
    (fivar.runtime.custom_mask): the prefill kernel reading each key tile's rows through the page table."""
    return_lse = check_lse(variant, return_lse)
    k_cache, v_cache = _paged_kv(variant, paged_kv_cache)
    _check_inputs(variant, q, k_cache, v_cache, paged=True)
    qo_indptr = _check_indptr(variant, "qo_indptr", qo_indptr, q.device)
    kv_indptr = _check_indptr(variant, "kv_indptr", kv_indptr, q.device)
    if kv_indptr.numel() != qo_indptr.numel() or int(qo_indptr[-1]) != q.shape[0]:
        raise FivarError(f"variant '{variant.name}': qo_indptr and kv_indptr must have the same length, and "
                         f"qo_indptr[-1] ({int(qo_indptr[-1])}) must equal q's token count ({q.shape[0]})")
    page_size = k_cache.shape[1]
    kv_indices, kv_last_page_len = _check_pages(variant, kv_indptr, kv_indices, kv_last_page_len, k_cache.shape[0],
                                                page_size, q.device)
    kv_lens = paged_kv_lens(kv_indptr, kv_last_page_len, page_size)
    custom = check_custom_mask(variant, custom_mask, packed_custom_mask, mask_indptr, qo_indptr.cpu().diff(), kv_lens,
                               q.device)
    batch = qo_indptr.numel() - 1
    bound, sm_scale = _prepare(variant, params or {}, q, k_cache.shape[2], batch, sm_scale)
    token_indptr = indptr(kv_lens).to(q.device)  # the requests' key counts: the kernel's lengths
    max_qo_len, max_kv_len = position_tables.max_lengths(qo_indptr, token_indptr)
    bound = position_tables.bind(variant, bound, (max_qo_len, max_kv_len))
    module, args = load_triton_module(variant), kernel_arg_values(variant, bound, sm_scale)
    return module.prefill(q, k_cache, v_cache, qo_indptr, token_indptr, max_qo_len, causal, args, return_lse,
                          custom=None if custom is None else (custom.packed, custom.indptr),
                          pages=(kv_indices, kv_indptr, max_kv_len))


def triton_decode(variant, q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, *, sm_scale=None,
                  params=None, return_lse=False):
    """One query token per request over a paged KV cache: q [batch, Hq, D]; q_idx is kv_len - 1."""
    return_lse = check_lse(variant, return_lse)
    k_cache, v_cache = _paged_kv(variant, paged_kv_cache)
    _check_inputs(variant, q, k_cache, v_cache, paged=True)
    given = (kv_indptr, kv_last_page_len)  # the key's: the checked copies may be new tensors every call
    kv_indptr, batch = _check_decode_indptr(variant, q, kv_indptr)
    kv_indices, kv_last_page_len = _check_pages(variant, kv_indptr, kv_indices, kv_last_page_len, k_cache.shape[0],
                                                k_cache.shape[1], q.device)
    bound, sm_scale = _prepare(variant, params or {}, q, k_cache.shape[2], batch, sm_scale)
    page_size = k_cache.shape[1]

    def lengths_and_kept():  # kept like the prefill's block maps: a later step of the same batch only launches
        kv_lens = (kv_indptr[1:] - kv_indptr[:-1] - 1) * page_size + kv_last_page_len
        max_kv_len = int(kv_lens.max())
        if not trims_decode_pages(variant):
            return max_kv_len, None
        # only the pages that may hold kept keys, as many runs of them as there are
        scanned = position_tables.bind(variant, bound, (1, max_kv_len))
        kinds = classify_decode(variant.ir.mask, kv_lens, page_size=page_size, scalars=scanned.scalars,
                                tensors=scanned.tensors, num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[2])
        return max_kv_len, kept_page_list(kinds, kv_indptr, page_size)
    max_kv_len, kept = _maps.get(("decode", variant, sm_scale, params or {}, *given, q.shape[1:], k_cache.shape,
                                  q.device), lengths_and_kept)
    bound = position_tables.bind(variant, bound, (1, max_kv_len))
    return load_triton_module(variant).decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len,
                                              max_kv_len, kernel_arg_values(variant, bound, sm_scale),
                                              return_lse, kept=kept)
