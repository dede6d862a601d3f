"""FA3 single prefill: fivar's CTA-tile specialization (templates/fa3/cta_tile_inst.cu.jinja) and persistent
launcher (csrc/fivar_fa3_persistent.cuh) repeat FlashInfer's dispatch and launcher with another tile, scheduler
and grid. They are built only while the installed FlashInfer's functions hash to the ones they were written
against (FlashInfer 0.7.2, include/flashinfer/attention/hopper/prefill_sm90.cuh)."""
from __future__ import annotations

import functools
import hashlib
import re

from ._base import Coupling, include_dir, norm, safe

#: sha256 of FlashInfer 0.7.2's SinglePrefillWithKVCacheDispatched body, whitespace collapsed: the function the
#: CTA-tile specialization repeats with everything but the tile kept.
DISPATCH_SHA256 = "838afb1277820d5e386dedbaf33a5f2960e16a9f13e1eb49a2383e9bc547f436"
#: ... and of SinglePrefillWithKVCacheKernelTraitsDispatched, the launcher the persistent schedule mirrors.
LAUNCHER_SHA256 = "74f4778633778607070f182460914ee924f134174c53ddc5bf98e80a0a31d33b"
_DISPATCH_SIGNATURE = (
    r"template <uint32_t HEAD_DIM_QK, uint32_t HEAD_DIM_VO, MaskMode MASK_MODE, bool LEFT_SLIDING_WINDOW,\s*"
    r"typename AttentionVariant, typename Params>\s*cudaError_t SinglePrefillWithKVCacheDispatched\(Params& "
    r"params, cudaStream_t stream\)")
_LAUNCHER_SIGNATURE = (
    r"template <typename KernelTraits, bool LEFT_SLIDING_WINDOW, bool CAUSAL, typename Params>\s*cudaError_t "
    r"SinglePrefillWithKVCacheKernelTraitsDispatched\(Params& params, cudaStream_t stream\)")

#: FlashInfer 0.7.2's own single-prefill tiles (getCTATileSize): head dim -> ((CTA_Q, CTA_KV) non-causal,
#: (CTA_Q, CTA_KV) causal). fivar's wave split and persistent launcher run on them where fivar keeps FlashInfer's.
SINGLE_PREFILL_TILES = {64: ((192, 128), (192, 128)), 128: ((128, 192), (128, 128)), 256: ((128, 64), (128, 64))}


def _prefill_sm90() -> str:
    return (include_dir() / "flashinfer" / "attention" / "hopper" / "prefill_sm90.cuh").read_text()


def mirrored_function_problem(signature: str, sha256: str, what: str) -> str | None:
    name = re.search(r"(\w+)\\\(Params", signature).group(1)
    m = re.search(signature + r" \{\n(.*?)\n\}\n", _prefill_sm90(), re.S)
    if m is None:
        return f"prefill_sm90.cuh has no {name} of the form fivar's {what} mirrors"
    if hashlib.sha256(norm(m.group(1)).encode()).hexdigest() != sha256:
        return f"FlashInfer's {name} (prefill_sm90.cuh) changed since fivar's {what} was written against 0.7.2"
    return None


@functools.lru_cache(maxsize=None)
@safe
def dispatch_problem() -> str | None:
    """Why the installed FA3 single-prefill dispatch is not the one fivar's tile specialization mirrors, or None."""
    return mirrored_function_problem(_DISPATCH_SIGNATURE, DISPATCH_SHA256, "CTA-tile specialization")


@functools.lru_cache(maxsize=None)
@safe
def launcher_problem() -> str | None:
    """Why the installed FA3 single-prefill launcher is not the one fivar's persistent schedule mirrors, or None."""
    return mirrored_function_problem(_LAUNCHER_SIGNATURE, LAUNCHER_SHA256, "persistent schedule")


def persistent_problem() -> str | None:
    """The persistent launcher is reached through the tile specialization: both must match."""
    return dispatch_problem() or launcher_problem()


@functools.lru_cache(maxsize=None)
@safe
def tiles_problem() -> str | None:
    """Why getCTATileSize no longer returns SINGLE_PREFILL_TILES, or None."""
    m = re.search(r"constexpr auto getCTATileSize\(\) \{(.*?)\n\}\n", _prefill_sm90(), re.S)
    if m is None:
        return "prefill_sm90.cuh has no getCTATileSize"
    body = norm(m.group(1))
    (q64, kv64), _ = SINGLE_PREFILL_TILES[64]
    (q128, kv128), (qc, kvc) = SINGLE_PREFILL_TILES[128]
    (q256, kv256), _ = SINGLE_PREFILL_TILES[256]
    expected = (f"if constexpr (HEAD_DIM_QK == 64) {{ return std::make_tuple({q64}, {kv64}); }} else if constexpr "
                f"(HEAD_DIM_QK == 128) {{ if constexpr (CAUSAL) {{ return std::make_tuple({qc}, {kvc}); }} else {{ "
                f"return std::make_tuple({q128}, {kv128}); }} }} else {{ return std::make_tuple({q256}, {kv256}); }}")
    if expected not in body:
        return "getCTATileSize (prefill_sm90.cuh) returns other tiles than the ones fivar plans with"
    return None


COUPLINGS = [
    Coupling("fa3_cta_tile", "SinglePrefillWithKVCacheDispatched's body (prefill_sm90.cuh), by sha256",
             "FA3 single prefill's own CTA tile (192x64/128x128 for soft-caps)",
             "FlashInfer's tiles; an explicit cta_tile is refused", dispatch_problem),
    Coupling("fa3_persistent_schedule", "SinglePrefillWithKVCacheDispatched and SinglePrefillWithKVCacheKernel"
             "TraitsDispatched's bodies (prefill_sm90.cuh), by sha256",
             "FA3 single prefill's persistent schedule (csrc/fivar_fa3_persistent.cuh)",
             "FlashInfer's grid; an explicit persistent schedule is refused", persistent_problem),
    Coupling("fa3_flashinfer_tiles", "getCTATileSize's tiles (prefill_sm90.cuh)",
             "the FA3 last-wave split and the persistent launcher on FlashInfer's tiles",
             "the last wave runs unsplit", tiles_problem),
]
