"""The tile-list form's tables and the part of its variant struct both targets share (fivar.runtime.fa3_tile_list
plans it; fivar.codegen.fa3 and fivar.codegen.fa2 render the struct around these lines).

Each request of the paged batch-prefill kernel is one query tile over the list of its non-empty key tiles of
TILE_WIDTH keys (the device block map's), whole tiles first. FlashInfer calls the struct's hooks with the request's
local row and key; the struct maps them back through its tables. BLOCKS: int32 [requests, TILE_FIELDS] = (batch,
q_idx of row 0, the request's first entry in TILE_KEYS, the keys of its whole tiles, every row keeping every one of
them (-1: the request keeps no key at all), the request's first word in CUT_BITS, the words' row stride, the words
between two query heads' bits (0: one set for every head, a mask not reading the head)); TILE_KEYS[entry] is the
kv_idx of the listed tile's first key; CUT_BITS holds, per head, per tile after the whole ones and per row, the
tile's kept keys as one 32-bit word. The kernel evaluates no mask, whatever it is: the device block map and the bits
are the mask, so the struct is rendered from the mask-free bits_kernel.
"""
from __future__ import annotations

import copy
import dataclasses

from ..spec import ir
from .cuda import CppEmitter, Member

BLOCKS, TILE_FIELDS, TILE_KEYS, CUT_BITS, TILE_WIDTH = "fv_blocks", 7, "fv_tile_keys", "fv_cut_bits", 32


def mask_reads_head(variant) -> bool:
    """The mask may keep different keys per head (a window per head)."""
    mask = variant.ir.mask
    return mask is not None and bool({"qo_head", "kv_head"} & ir.uses(mask))


#: the name of the variant a bits-reading tile-list module is rendered from (bits_kernel): the module every variant
#: with the same logits and sink shares, whatever its mask
BITS_KERNEL = "any_mask"


def bits_kernel(variant):
    """What a tile-list module that reads its cut tiles as bits is rendered from: `variant` without its mask and
    with only the params its logits and sink read, named BITS_KERNEL. Such a kernel never evaluates the mask (the
    device block map and CUT_BITS are the mask), so every variant with these logits and sink renders the same
    sources, one URI: a new mask builds no kernel once one of them is built, only its block map (Triton)."""
    kernel = variant.__dict__.get("_bits_kernel")
    if kernel is not None:
        return kernel
    vir = variant.ir
    read = {n.removeprefix("params.") for prog in (vir.logits, vir.sink) if prog is not None
            for n in ir.uses(prog) if n.startswith("params.")}
    kernel = copy.copy(variant)  # shares the functions; the caches below are the mask-free variant's own
    for cached in ("_lowered", "kv_band", "logits_range", "_bits_kernel"):
        kernel.__dict__.pop(cached, None)
    kernel.name, kernel.mask, kernel.doc = BITS_KERNEL, None, ""
    kernel.params = {n: p for n, p in variant.params.items() if n in read}
    kernel.__dict__["ir"] = dataclasses.replace(vir, mask=None, divisor_scalars={
        n: w for n, w in vir.divisor_scalars.items() if n in read})
    kernel.__dict__["source_label"] = "any mask, read as bits"  # not the user's file: the text is shared
    variant.__dict__["_bits_kernel"] = kernel
    return kernel


def runs_unmapped(variant) -> bool:
    """Whether a causal batch that the mask cuts into segments (documents, chunks) may run bits_kernel(variant) as a
    request per segment in the kernel's causal mode with nothing mapping a request back to its positions (FA3, whose
    struct has no key-segments table; fivar.runtime.segments): its logits and sink read no position and no batch
    entry, and its mask keeps the same keys for every head (a segment is the batch's, not a head's)."""
    return not mask_reads_head(variant) and not any(
        p is not None and {"q_idx", "kv_idx", "batch"} & ir.uses(p) for p in (variant.lowered.logits, variant.ir.sink))


def reads_heads(variant) -> bool:
    """Whether the kernel's struct reads the query or KV head (its logits or sink): the tile list's request per head
    (fivar.runtime.fa3_tile_list.HeadRequests) runs every head as head 0, so such a variant keeps the union."""
    return any(p is not None and {"qo_head", "kv_head"} & ir.uses(p)
               for p in (variant.lowered.logits, variant.ir.sink))


def reads_bits(variant, custom_mask: bool = False) -> bool:
    """A tile-list module of `variant` reads its cut tiles as bits (so is bits_kernel's): any mask, per head where it
    reads the head, or an engine's custom mask."""
    return custom_mask or variant.mask is not None


def struct_parts(variant, param_ref, *, per_tile: bool = False) -> tuple[CppEmitter, list[Member], list[str], str]:
    """(emitter, members, lines, keep_cut) of the tile-list struct of bits_kernel(...) (no mask of its own): the
    request's local key k is kv_idx TILE_KEYS[first + k / 32] + k % 32; a key of a whole tile (k < the whole keys) is
    kept with one compare, a key of a cut tile reads its bit in CUT_BITS, at the query head's bits. The members read
    the tables of the hook's request `batch_idx`; `param_ref(name)` is how the target's struct reads a param. Sink
    members are the target's. `per_tile` (FA3, csrc/fivar_tile_mask.cuh): the lines only record the thread's last
    score's indices and `keep_cut` is the body of fv_cut_word(qo_idx, word), which the updater reads once per KV tile
    (a CTA serves one query head: its bits are found in the constructor); else the lines set fv_keep per score and
    keep_cut is empty."""
    block = lambda i: f"{param_ref(BLOCKS)}[{TILE_FIELDS} * batch_idx + {i}]"  # noqa: E731
    shift = TILE_WIDTH.bit_length() - 1
    kv = f"(__ldg(fv_tiles + (int32_t(kv_idx) >> {shift})) + (int32_t(kv_idx) & {TILE_WIDTH - 1}))"
    emit = CppEmitter(variant, param_ref, index_init={"batch": "fv_batch_idx", "kv_idx": kv})
    lowered = variant.lowered
    if lowered.mask is not None:
        raise ValueError(f"variant '{variant.name}': the tile-list struct is rendered from bits_kernel (no mask)")
    extra = [lowered.output_scale] if lowered.output_scale is not None else []
    sink = variant.ir.sink
    members = [m for m in emit.members(lowered, extra + (list(sink.exprs()) if sink is not None else []))
               if m.name != "fv_q_offset"]
    members[:0] = [Member("int32_t", "fv_batch_idx", block(0)), Member("int32_t", "fv_q_offset", block(1)),
                   Member("const int32_t*", "fv_tiles", f"{param_ref(TILE_KEYS)} + {block(2)}"),
                   Member("int32_t", "fv_whole", block(3))]
    lines = list(emit.prologue(lowered.logits))
    if per_tile:  # FA3's block coordinate names the CTA's query head
        members += [Member("const int32_t*", "fv_bits",
                           f"{param_ref(CUT_BITS)} + {block(4)} + int32_t(qo_head_idx) * {block(6)}"),
                    Member("int32_t", "fv_rows", block(5))]
        # the updater applies the bits once a KV tile: LogitsTransform only leaves the thread's last score's
        # indices; a word of a whole tile (word < 0) keeps all, a request keeping no key (fv_whole -1) none
        lines += ["fv_kv_last = int32_t(kv_idx);", "fv_q_last = int32_t(qo_idx);"]
        return emit, members, lines, "\n    ".join([
            "if (word < 0) return ~0u;", "if (fv_whole < 0) return 0u;",
            "return uint32_t(__ldg(fv_bits + word * fv_rows + qo_idx));"])
    members += [Member("const int32_t*", "fv_bits", f"{param_ref(CUT_BITS)} + {block(4)}"),
                Member("int32_t", "fv_rows", block(5)), Member("int32_t", "fv_head_words", block(6))]
    # whole tiles come first in the list: a warp's keys are all below fv_whole or all above (one branch a tile);
    # a cut tile's pairs are bits (causal folded in), one word a row, tile and head
    lines += ["bool fv_keep = int32_t(kv_idx) < fv_whole;", "if (!fv_keep && fv_whole >= 0) {",
              "  const int32_t fv_c = int32_t(kv_idx) - fv_whole;",
              f"  fv_keep = (__ldg(fv_bits + int32_t(qo_head_idx) * fv_head_words + (fv_c >> {shift}) * fv_rows + "
              f"int32_t(qo_idx)) >> (fv_c & {TILE_WIDTH - 1})) & 1;", "}"]
    return emit, members, lines, ""


def tables() -> list[str]:
    """The form's tables, FlashInfer's additional tensors ahead of the variant's own."""
    return [BLOCKS, TILE_KEYS, CUT_BITS]
