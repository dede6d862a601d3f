"""FlashInfer FA2 target: render the variant struct and the module sources for each entry point.

fivar reuses FlashInfer's host code and kernel-instantiation templates (they define the Params structs
FlashInfer's kernels expect) and owns the parts that carry the variant: the struct itself and a mask-mode
dispatch that instantiates only the modes this variant can use (half the kernels of FlashInfer's path).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jinja2

from ..paths import templates_dir
from ..spec import ir, optimize
from .cuda import CppEmitter, Member, additional_params, comment_text, source_label
from .tile_list import struct_parts as tile_list_struct_parts, tables as tile_list_tables

MASK_NONE, MASK_CAUSAL, MASK_CUSTOM = "MaskMode::kNone", "MaskMode::kCausal", "MaskMode::kCustom"
MASK_CODES = {MASK_NONE: 0, MASK_CAUSAL: 1, MASK_CUSTOM: 2}
#: FlashInfer's causal rule (bottom-right aligned), in the hook's raw indices.
CAUSAL_GUARD = "(!fv_causal || kv_idx + qo_len <= qo_idx + kv_len)"


@functools.lru_cache(maxsize=None)
def _env(directory: str) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(directory), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    env.filters["comment"] = comment_text  # user text (file, variant names, docs) inside a one-line comment
    return env


def render(relpath: str, **kwargs) -> str:
    return _env(str(templates_dir())).get_template(relpath).render(**kwargs)


def struct_name(variant) -> str:
    return "Fivar_" + variant.name


def window_form(variant) -> bool:
    """The mask is exactly a sliding window, `kv_idx >= q_idx - left` (and `kv_idx <= q_idx` if it says so: a
    causal window). Called causally with left >= 0 (a causal window: however called), it runs in FlashInfer's
    kCausal mode with `window_left = left`: the kernel skips the tiles right of the diagonal and left of the
    window, and evaluates the mask only on the tiles the window or the diagonal cuts (its
    `window_iteration`/`mask_iteration`), as stock FA2 does with its own window; every other tile is kept whole
    by exactly that mask."""
    return variant.lowered.mask is not None and variant.kv_band.window


def trims_decode_pages(variant) -> bool:
    """Decode reads only the pages holding kept keys, in the key-segments form (fivar.runtime.decode_pages), or
    the tiles holding them in the tile-list form where the mask keeps many runs of them, for a mask that depends on
    the key position and is not exactly a band with a left edge (whose window_left reads exactly the window; a band
    a mask only implies, such as a chunk's, reads more than the kept keys)."""
    mask, band = variant.ir.mask, variant.kv_band
    return mask is not None and "kv_idx" in ir.uses(mask) and not (band.exact and band.left is not None)


def mask_modes(variant, kv_segments: bool = False, mask_free: bool = False) -> list[str]:
    """A variant with a mask owns it on every tile (kCustom) and folds `causal` in itself; a window-form mask
    also gets kCausal (window_form), and so does the key-segments form (its kCausal launch:
    fivar.runtime.fa2_blocks); the mask-free key-segments form runs kCausal only (fivar.runtime.segments)."""
    if kv_segments and mask_free:
        return [MASK_CAUSAL]
    if window_form(variant) or (kv_segments and variant.mask):
        return [MASK_CAUSAL, MASK_CUSTOM]
    return [MASK_CUSTOM] if variant.mask else [MASK_NONE, MASK_CAUSAL]


def runs_window_mode(variant, causal: bool, window_left: int) -> bool:
    """True when this call runs the window form in kCausal mode (window_form): causal (or a causal window), and a
    window the kernel's unsigned window_left can hold. A decode call (one query per request, at its last key)
    passes causal=True: no key lies right of its query, so the causal mode drops nothing there."""
    return (bool(causal) or variant.kv_band.causal_window) and window_left >= 0 and window_form(variant)


def runtime_mask_code(variant, causal: bool, window_left: int = -1) -> int:
    if runs_window_mode(variant, causal, window_left):
        return MASK_CODES[MASK_CAUSAL]
    if variant.mask:
        return MASK_CODES[MASK_CUSTOM]
    return MASK_CODES[MASK_CAUSAL if causal else MASK_NONE]


@dataclass
class VariantDecl:
    source: str
    lowered: optimize.Lowered
    additional: tuple  # (tensor_names, tensor_types, scalar_names, scalar_types)


def softmax_scale_log2(variant, emit: CppEmitter) -> str:
    """The exp2 scale of the kernel's softmax: log2(e) times the logits factor the optimizer folded out."""
    lowered = variant.lowered
    if not variant.softmax:
        return "1.f"
    if lowered.output_scale is not None:
        return f"flashinfer::math::log2e * {emit.expr(lowered.output_scale)}"
    return "flashinfer::math::log2e"


def sink_members_and_body(variant, param_ref, emit: CppEmitter,
                          batch_init: str = "int32_t(batch_idx)") -> tuple[list[Member], str | None]:
    """The sink for FA2's REGISTER_M_D_UPDATE, which runs once per query row (OutputTransform runs per output
    element): qo_head is the hook's, the request index a member (the hook has none; in the key-segments form a
    kernel request is a piece of the batch's request `batch_init` names)."""
    sink = variant.ir.sink
    if sink is None:
        return [], None
    sink_emit = CppEmitter(variant, param_ref, index_init={"batch": "fv_sink_batch"})
    members = [Member("int32_t", "fv_sink_batch", batch_init)] if "batch" in ir.uses(sink) else []
    return members, "\n      ".join(sink_emit.sink_lines(sink))


#: The key-segments form's per-request table: int32 [requests, 9] = (seg, shift_a, shift_b, q_shift, batch, full_lo,
#: full_hi, skip, window_left). Local keys in [full_lo, full_hi) are kept by the mask for every row of the request
#: (FULL blocks of fivar.spec.sparsity), so the struct skips the mask there and checks causal only. A request of
#: the kernel is a piece of one of the batch: decode over pages trimmed to two runs (fivar.runtime.decode_pages), or
#: a query block over the pages of the keys its mask may keep (fivar.runtime.fa2_blocks). The kernel's key kv sits
#: at kv_idx kv + shift_a below local key `seg`, kv + shift_b from it on, and its query qo_idx at q_idx
#: (kv_len - qo_len + qo_idx) + q_shift; causal compares those positions; `batch` is the request of the batch it is
#: a piece of. `skip` != 0: this launch leaves the request to another one (its qo_len and kv_len read as 0, so the
#: kernel neither reads nor writes it); `window_left` >= 0: the kernel's window for this request (it masks the KV
#: tiles left of the rows' diagonal less window_left, skips those left of the first row's).
KV_SEGMENTS, KV_SEGMENT_FIELDS = "fv_kv_segments", 9
#: KV_SEGMENTS' `seg` past every local key: all of them in the first run (one shift for every key).
NO_SECOND_RUN = 1 << 30


def variant_decl(variant, param_ref=lambda n: f"params.{n}", template="fa2/variant.cuh.jinja",
                 kv_segments: bool = False, mask_free: bool = False, tile_list: bool = False) -> VariantDecl:
    """`kv_segments`: the key-segments form of batch prefill (KV_SEGMENTS: trimmed decode pages, the block form).
    `mask_free` (with it): the struct without the mask, for segments whose rows keep exactly their keys up to their
    own position (fivar.runtime.segments: FlashInfer's kCausal mode is the whole mask there). Even never called,
    the mask's code in the kCausal tiles costs the kernel registers: FA2's 128-row tile spilled 288 bytes with it
    and 12 without (stock's), 0.88x stock's time on packed documents (H200). `tile_list`: the tile-list form of a
    bits_kernel (fivar.codegen.tile_list), its cut tiles read from CUT_BITS."""
    if mask_free and not kv_segments:
        raise ValueError("the mask-free form is a key-segments form")
    if tile_list:
        return _tile_list_decl(variant, param_ref, template)
    lowered = variant.lowered
    if mask_free:
        lowered = dataclasses.replace(lowered, mask=None)
    seg = lambda i: f"{param_ref(KV_SEGMENTS)}[{KV_SEGMENT_FIELDS} * batch_idx + {i}]"  # noqa: E731
    index_init = ({"kv_idx": "(int32_t(kv_idx) < fv_seg ? int32_t(kv_idx) + fv_shift_a : int32_t(kv_idx) + fv_shift_b)",
                   "batch": "fv_piece_batch"} if kv_segments else None)
    emit = CppEmitter(variant, param_ref, index_init=index_init)
    sink_exprs = list(variant.ir.sink.exprs()) if variant.ir.sink is not None else []
    members = emit.members(lowered, ([lowered.output_scale] if lowered.output_scale is not None else []) + sink_exprs)
    sink_members, sink_body = sink_members_and_body(variant, param_ref, emit,
                                                    seg(4) if kv_segments else "int32_t(batch_idx)")
    members += sink_members
    guard = CAUSAL_GUARD
    if kv_segments:
        q_offset = f"int32_t(kv_len) - int32_t(qo_len) + {seg(3)}"
        if not any(m.name == "fv_q_offset" for m in members):
            members.append(Member("int32_t", "fv_q_offset", q_offset))
        for m in members:
            if m.name == "fv_q_offset":
                m.init = q_offset
        members[:0] = [Member("int32_t", "fv_seg", seg(0)), Member("int32_t", "fv_shift_a", seg(1)),
                       Member("int32_t", "fv_shift_b", seg(2)), Member("int32_t", "fv_piece_batch", seg(4))] + (
            [] if mask_free else [Member("int32_t", "fv_full_lo", seg(5)), Member("int32_t", "fv_full_hi", seg(6))])
        # causal on the positions the keys and queries stand for (a request here is a piece of one)
        guard = f"(!fv_causal || {index_init['kv_idx']} <= int32_t(qo_idx) + fv_q_offset)"
    scale = softmax_scale_log2(variant, emit)
    request_lines = []
    if kv_segments:
        request_lines = [f"if ({seg(7)} != 0) {{ qo_len = 0; kv_len = 0; }}",
                         f"if ({seg(8)} >= 0) window_left = uint32_t({seg(8)});"]
    mask_body = None
    if lowered.mask:
        # Masked variants run in kCustom mode (mask on every tile), so `causal` is a runtime flag here.
        members.append(Member("bool", "fv_causal", f"{param_ref('fv_causal')} != 0"))
        mask_body = emit.body(lowered.mask, guard=guard)
        if kv_segments:  # keys every row keeps: causal only (FlashInfer calls the mask on every element in kCustom)
            mask_body = (f"if (int32_t(kv_idx) >= fv_full_lo && int32_t(kv_idx) < fv_full_hi) return {guard};\n    "
                         + mask_body)
    source = render(template, name=variant.name, source=source_label(variant), struct_name=struct_name(variant),
                    softmax=variant.softmax, members=members, sm_scale_log2=scale,
                    logits_body=emit.body(lowered.logits) if lowered.logits else None, mask_body=mask_body,
                    sink_body=sink_body, request_lines=request_lines, tile_list=False)
    return VariantDecl(source, lowered, additional_params(
        variant, with_causal_flag=bool(variant.mask) and not mask_free,
        extra_tensors=[KV_SEGMENTS] if kv_segments else []))


def _tile_list_decl(variant, param_ref, template) -> VariantDecl:
    """The tile-list form of batch prefill (fivar.codegen.tile_list, planned by fivar.runtime.fa3_tile_list), rendered
    from a bits_kernel: the struct FA3's form has, run in kNone mode with the cut tiles' bits read per score in
    LogitsTransform (FA2 has no per-tile hook; FlashInfer's FA2 calls LogitsMask in kNone only on a request's last,
    partial KV tile, for its bound). The hooks' qo_idx and kv_idx are local to the request (a query tile), as FA3's
    are; causal is in the bits."""
    emit, members, lines, _ = tile_list_struct_parts(variant, param_ref)
    lowered = variant.lowered
    sink_members, sink_body = sink_members_and_body(variant, param_ref, emit, "fv_batch_idx")
    logit_lines, value = emit.statements(lowered.logits) if lowered.logits else ([], "logits")
    value = f"fv_keep ? {value} : {'-INFINITY' if variant.softmax else '0.f'}"
    source = render(template, name=variant.name, source=source_label(variant),
                    struct_name=struct_name(variant), softmax=variant.softmax, members=members + sink_members,
                    sm_scale_log2=softmax_scale_log2(variant, emit),
                    logits_body="\n    ".join(lines + logit_lines + [f"return {value};"]), mask_body=None,
                    sink_body=sink_body, request_lines=[], tile_list=True)
    return VariantDecl(source, lowered, additional_params(variant, with_causal_flag=False,
                                                          extra_tensors=tile_list_tables()))
