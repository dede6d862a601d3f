"""What runs a variant where: the backend a call gets (choose_target), and the forms each target runs a mask in
(FA3's own window or causal mode, FA2's kCausal window form and trimmed decode pages, which mask mode a module's
launch owns). The entry points (fivar.runtime.attention) and the plans (fivar.runtime.plans) both read it."""
from __future__ import annotations

import torch

from ..codegen import fa2
from ..codegen.fa2 import trims_decode_pages  # noqa: F401 (the forms' one list)
from ..errors import FivarError
from ..jit.targets import AUTO, FLASHINFER_TARGETS, target_of
from ..spec import ir
from ..spec.sparsity import classify_decode
from .decode_pages import trim_pages
from .launch import _invariant
from .params import kernel_args
from .position_tables import max_lengths


BACKENDS = (AUTO, *FLASHINFER_TARGETS)


ALL_BACKENDS = (*BACKENDS, "triton")  # with the Triton twin, which fivar.runtime.triton_attention runs


def choose_target(variant, backend: str, op: str, device=None, capability=None) -> tuple[str, str]:
    """(target, reason): which generated kernel runs this op, and why. `capability` (major, minor): as if the GPU
    were that (`fivar show --explain --arch` on a machine without one)."""
    if backend not in BACKENDS:
        raise FivarError(f"variant '{variant.name}': backend '{backend}' is not available "
                         f"(choose from {', '.join(BACKENDS)})")
    if op == "batch_decode":
        if backend != AUTO and not target_of(backend).decodes:
            raise FivarError(f"variant '{variant.name}': FlashInfer has no FA3 decode kernel; use backend "
                             "'fa2' or 'auto' for decode")
        return "fa2", ("decode runs on FA2 (FlashInfer has no FA3 decode): the tensor-core paged kernel when a "
                       "KV head serves >= 4 query heads (measured faster), else the CUDA-core decode kernel")
    if backend != AUTO:
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
    return target_of(target).emitter


def _causal_flag(variant, target: str, causal: bool):
    """FA2 runs masked variants in kCustom mode and applies `causal` inside the mask: a runtime flag (also set in the
    window form's kCausal mode, where the kernel applies causal as well)."""
    return bool(causal) if (variant.mask and target_of(target).folds_causal_into_mask) else None


def _paged_args(variant, target, bound, sm_scale, causal, qo_indptr, kv_indptr, kv_last_page_len, page_size):
    """Run arguments of a paged batch (the indptrs are the batch's own: the position tables' lengths)."""
    lengths = lambda: max_lengths(qo_indptr, kv_indptr, kv_last_page_len, page_size)  # noqa: E731
    return kernel_args(variant, bound, sm_scale, _causal_flag(variant, target, causal), lengths=lengths)


def _window_left(variant, target: str, bound) -> int:
    """FlashInfer's `window_left` for this launch: the left edge of the band the mask implies, else -1.

    FA3: a mask that is exactly the window is FA3's own to apply (fa3.runs_as_window): window_left is then the
    band's left edge exactly, negative ones included (keys right of the diagonal only; FlashInfer's -1 means
    "no window" only to its Python wrappers, the kernel built with the window applies it as given). Otherwise
    the mask still runs on every visited tile, so the window only has to be no tighter than the mask: a band
    reaching right of the diagonal is clamped to 0. Keys and rows stay below 2**30, so clamping there is exact.

    FA2 (prefill and decode): the batch kernels start each query tile's KV loop at its first row's q_idx -
    window_left, so the window only has to be no tighter than the mask there too (clamped to 0: the kernel's
    window_left is unsigned). In the window form's kCausal mode (fa2.window_form) a tile the window and the
    diagonal leave whole is not masked: with a clamped edge no tile is left whole, so that stays exact.
    """
    left = variant.kv_band.left
    if left is None:
        return -1
    lowest = target_of(target).window_floor(variant)  # None: FA3's tile-list form skips through its block map
    if lowest is None:
        return -1
    return min(max(int(_invariant(variant, left, bound.scalars)), lowest), 1 << 30)


def _owns_mask(variant, target: str, causal: bool, window_left: int) -> bool:
    """FA2 runs a masked variant in kCustom mode (its wrappers call that the variant owning the mask), except
    the window form called causally, which runs in kCausal mode (fa2.window_form)."""
    return bool(variant.mask) and target_of(target).folds_causal_into_mask and \
        not fa2.runs_window_mode(variant, causal, window_left)


def _kernel_causal(variant, causal: bool) -> bool:
    """The causal flag FlashInfer's kernels run with: the call's, or True where the mask keeps no key right of the
    diagonal anyway (a band whose right edge is the diagonal or left of it, as a causal window's), so that the
    kernels' causal mode skips those tiles and a window form runs as the kernels' own window."""
    right = variant.kv_band.right
    return bool(causal) or (isinstance(right, ir.Const) and right.value <= 0)


def _plan_causal(variant, target: str, causal: bool, window_left: int = -1) -> bool:
    # FA2 masked variants fold causal into their kCustom mask; everything else uses the kernel's causal mode
    return bool(causal) and not _owns_mask(variant, target, causal, window_left)


def _split_kwargs(variant, target: str, causal: bool = True, window_left: int = -1) -> dict:
    """FA2 plan options. Split-KV partials are merged through their log-sum-exp, which a no-softmax variant does not
    have. And FlashInfer's FA2 scheduler sizes a window's KV chunks as window_left + one query tile, a causal window's
    reach: a call keeping keys right of the diagonal (`causal` False; a decode query has none) runs unsplit, each
    query tile from its window's left edge to its last key."""
    if target_of(target).splits_kv and (not variant.softmax or (window_left >= 0 and not causal)):
        return {"disable_split_kv": True}
    return {}


def _decode_on_tensor_cores(variant, num_qo_heads: int, num_kv_heads: int) -> bool:
    """One-token paged prefill on the tensor-core FA2 kernel instead of the CUDA-core decode kernel: faster once a
    KV head serves >= 4 query heads (H200, batch 128 x 8192, GQA 32/8: 3.80 vs 2.60 TB/s of KV read); the only
    correct path without softmax (FlashInfer merges split-KV partials through their log-sum-exp, which a
    no-softmax variant does not have); and the only one that skips keys left of a window (the prefill kernel
    starts its KV loop at q_idx - window_left, the decode kernel reads every page); and with a sink (the decode
    kernel has no per-row hook that knows its KV chunk: fivar.codegen.fa2)."""
    return (not variant.softmax or variant.sink is not None or num_qo_heads // num_kv_heads >= 4
            or variant.kv_band.left is not None)


def _trimmed_decode_pages(variant, bound, kv_indptr, kv_indices, kv_last_page_len, page_size, num_qo_heads,
                          num_kv_heads):
    n_pages = kv_indptr.long().diff()
    kv_lens = (n_pages - 1).clamp(min=0) * page_size + torch.where(n_pages > 0, kv_last_page_len.long(), 0)
    kinds = classify_decode(variant.ir.mask, kv_lens, page_size=page_size, scalars=bound.scalars,
                            tensors=bound.tensors, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads)
    return trim_pages(kinds, kv_indptr, kv_indices, kv_last_page_len, page_size)
