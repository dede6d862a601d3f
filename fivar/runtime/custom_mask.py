"""An engine's custom mask over a batch (speculative verify: a tree of draft tokens per request), in FlashInfer's
convention: per request i a boolean matrix [qo_len_i, kv_len_i] (row = query, column = key), flattened row-major
and concatenated (`custom_mask`, bool), or the same bits packed little-endian per request, each request starting
on a byte (`packed_custom_mask` uint8 with `mask_indptr`, its requests' first bytes, as
`flashinfer.quantization.segment_packbits(..., bitorder="little")` writes them).

A pair is kept iff the variant's mask keeps it, causal (if asked) keeps it, and its bit is set. Every kernel reads
the packed form: bit `mask_indptr[b] * 8 + i * kv_len_b + j` of request b's pair (row i, key j).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import FivarError
from ..spec.inputs import same_device


class CustomMask(NamedTuple):
    """A checked custom mask on the inputs' device."""
    packed: torch.Tensor  # uint8 [bytes]: the bits, little-endian, each request from its first byte
    indptr: torch.Tensor  # int32 [batch + 1]: each request's first byte in `packed`

    def request(self, b: int, qo_len: int, kv_len: int) -> torch.Tensor:
        """bool [qo_len, kv_len]: request b's matrix."""
        start = int(self.indptr[b])
        n_bytes = (qo_len * kv_len + 7) // 8
        return unpack(self.packed[start:start + n_bytes])[:qo_len * kv_len].view(qo_len, kv_len)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """bool [8 * bytes]: the bits of `packed`, little-endian (bit 0 of byte 0 first)."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    return ((packed.to(torch.int32)[:, None] >> shifts) & 1).bool().view(-1)


def mask_indptr_for(qo_lens: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
    """int64 [batch + 1] host: each request's first byte of the packed mask (a byte boundary per request)."""
    n_bytes = (qo_lens.long() * kv_lens.long() + 7) // 8
    return torch.cat([torch.zeros(1, dtype=torch.long), n_bytes.cumsum(0)])


def pack(custom_mask: torch.Tensor, qo_lens: torch.Tensor, kv_lens: torch.Tensor) -> CustomMask:
    """The flat bool mask of a batch, packed per request (segment_packbits' layout, little-endian), on its device."""
    dev = custom_mask.device
    bit_indptr = torch.cat([torch.zeros(1, dtype=torch.long), (qo_lens.long() * kv_lens.long()).cumsum(0)])
    byte_indptr = mask_indptr_for(qo_lens, kv_lens)
    counts = bit_indptr.diff()
    # each element's bit in the packed form: its request's first byte * 8 + its place in the request
    shift = torch.repeat_interleave(byte_indptr[:-1] * 8 - bit_indptr[:-1], counts).to(dev)
    pos = torch.arange(int(bit_indptr[-1]), device=dev) + shift
    words = torch.zeros(int(byte_indptr[-1]), dtype=torch.int32, device=dev)
    words.index_add_(0, pos >> 3, custom_mask.view(-1).to(torch.int32) << (pos & 7).to(torch.int32))
    return CustomMask(words.to(torch.uint8), byte_indptr.to(device=dev, dtype=torch.int32))


# bits checked per device pass against the causal region (bounds its int64 index tensors: tens of bytes a bit)
_IMPLIED_CHUNK = 1 << 22


def causal_implied(mask: CustomMask, qo_lens: torch.Tensor, kv_lens: torch.Tensor, causal: bool) -> bool | None:
    """The causal flag that keeps exactly what `mask` and `causal` keep together, where the mask's bits add nothing
    to it (a chain of drafts: its bits are the causal triangle), else None. A kernel given that flag and no bits
    runs the band form instead of reading bits. True: the bits keep the whole causal region (row i of a request of
    qo_len queries over kv_len keys keeps keys j <= kv_len - qo_len + i) and, without causal, nothing else; False:
    no causal and every bit set. One device pass over the bits (a host read per 4M bits past the first)."""
    dev = mask.packed.device
    qo_lens, kv_lens = qo_lens.long().cpu(), kv_lens.long().cpu()
    sizes = qo_lens * kv_lens
    bit_start = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    total = int(bit_start[-1])
    starts, kv_of, qo_of = bit_start.to(dev), kv_lens.to(dev), qo_lens.to(dev)
    first_bit = mask.indptr.long()[:-1] * 8
    missing, kept, dropped = (torch.zeros((), dtype=torch.bool, device=dev) for _ in range(3))
    for lo in range(0, total, _IMPLIED_CHUNK):
        flat = torch.arange(lo, min(total, lo + _IMPLIED_CHUNK), device=dev)
        req = torch.searchsorted(starts, flat, right=True) - 1  # each bit's request (none of no bits)
        local = flat - starts[req]
        kv = kv_of[req]
        row, col = local // kv, local % kv
        pos = first_bit[req] + local
        bit = ((mask.packed[pos >> 3].long() >> (pos & 7)) & 1).bool()
        inside = col <= kv - qo_of[req] + row
        missing |= (inside & ~bit).any()  # a clear bit on or left of the diagonal
        kept |= (~inside & bit).any()  # a set bit right of it
        dropped |= (~inside & ~bit).any()  # a clear bit right of it
        if lo + _IMPLIED_CHUNK < total and bool(missing | (kept & dropped & (not causal))):
            return None  # decided (a long mask: one host read a chunk to stop early)
    missing, kept, dropped = (bool(x) for x in torch.stack([missing, kept, dropped]).cpu())
    if missing:
        return None
    if causal or not kept:
        return True
    return False if not dropped else None


def _got(t) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_custom_mask(variant, custom_mask, packed_custom_mask, mask_indptr, qo_lens, kv_lens,
                      device) -> CustomMask | None:
    """The call's custom mask (None: none given), checked against the batch's host lengths and moved to `device`.
    A mask on another GPU is refused (a silent copy would hide it); a host mask is copied over."""
    name = variant.name
    if custom_mask is None and packed_custom_mask is None:
        if mask_indptr is not None:
            raise FivarError(f"variant '{name}': mask_indptr is given without packed_custom_mask")
        return None
    if custom_mask is not None and packed_custom_mask is not None:
        raise FivarError(f"variant '{name}': pass custom_mask (bool) or packed_custom_mask (uint8), not both")
    given = custom_mask if custom_mask is not None else packed_custom_mask
    arg = "custom_mask" if custom_mask is not None else "packed_custom_mask"
    if not isinstance(given, torch.Tensor):
        raise FivarError(f"variant '{name}': {arg} must be a tensor, got {_got(given)}")
    if given.device.type != "cpu" and not same_device(given.device, device):  # ("cuda" is the current GPU)
        raise FivarError(f"variant '{name}': {arg} is on {given.device}, the inputs are on {device}")
    qo_lens, kv_lens = qo_lens.long().cpu(), kv_lens.long().cpu()
    if custom_mask is not None:
        n = int((qo_lens * kv_lens).sum())
        if custom_mask.dtype != torch.bool or custom_mask.numel() != n:
            raise FivarError(f"variant '{name}': custom_mask must be a bool tensor of sum(qo_len * kv_len) = {n} "
                             f"elements (each request's [qo_len, kv_len] flattened), got {_got(custom_mask)}")
        return pack(custom_mask.to(device).contiguous(), qo_lens, kv_lens)
    want = mask_indptr_for(qo_lens, kv_lens)
    if packed_custom_mask.dtype != torch.uint8 or packed_custom_mask.dim() != 1 \
            or packed_custom_mask.numel() < int(want[-1]):
        raise FivarError(f"variant '{name}': packed_custom_mask must be a 1-D uint8 tensor of at least {int(want[-1])} "
                         f"bytes (each request's bits packed little-endian from a byte boundary), got "
                         f"{_got(packed_custom_mask)}")
    if mask_indptr is not None:
        if not (isinstance(mask_indptr, torch.Tensor) and not mask_indptr.is_floating_point()
                and mask_indptr.dtype != torch.bool and mask_indptr.dim() == 1):
            raise FivarError(f"variant '{name}': mask_indptr must be a 1-D integer tensor, got {_got(mask_indptr)}")
        if mask_indptr.device.type != "cpu" and not same_device(mask_indptr.device, device):
            raise FivarError(f"variant '{name}': mask_indptr is on {mask_indptr.device}, the inputs are on {device}")
        if mask_indptr.numel() != want.numel() or not torch.equal(mask_indptr.long().cpu(), want):
            raise FivarError(f"variant '{name}': mask_indptr must be each request's first byte, ceil(qo_len * kv_len "
                             f"/ 8) apart: expected {want[:8].tolist()}{' ...' if want.numel() > 8 else ''}, got "
                             f"{mask_indptr[:8].tolist()}{' ...' if mask_indptr.numel() > 8 else ''}")
    return CustomMask(packed_custom_mask.to(device).contiguous(), want.to(device=device, dtype=torch.int32))


def paged_kv_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """int64 host [batch]: each request's keys in a paged batch."""
    n_pages = kv_indptr.long().cpu().diff()
    last = kv_last_page_len.long().cpu()
    return (n_pages - 1).clamp(min=0) * page_size + torch.where(n_pages > 0, last, 0)


def mask_key(mask: CustomMask | None):
    """What a kept plan's key holds of a mask: its tensors (by identity and version, fivar.runtime.plan_cache)."""
    return None if mask is None else (mask.packed, mask.indptr)
