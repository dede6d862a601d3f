"""FlashInfer FA3 (Hopper, sm90a) target: the variant struct for the warp-specialized TMA/wgmma kernels.

Same IR, same emitter as FA2. Differences the FA3 interface imposes: the constructor takes the mainloop
params and the block coordinate (lengths and the request index come from there: the hook's batch_idx is
always 0), params live under `params.additional_params`, the softmax scale goes to the updater
(`OnlineSoftmax`, or `DefaultUpdater` without softmax), and a mask becomes part of LogitsTransform.
"""
from __future__ import annotations

import os

from .cuda import CppEmitter, Member, additional_params
from .fa2 import MASK_CAUSAL, MASK_NONE, VariantDecl, render, softmax_scale_log2, struct_name



def mask_modes(variant) -> list[str]:
    return [MASK_NONE, MASK_CAUSAL]


def runtime_mask_code(variant, causal: bool) -> int:
    return 1 if causal else 0


def variant_decl(variant) -> VariantDecl:
    param_ref = lambda n: f"params.additional_params.{n}"  # noqa: E731
    lowered = variant.lowered
    emit = CppEmitter(variant, param_ref, index_init={"batch": "fv_batch_idx"})
    extra = [lowered.output_scale] if lowered.output_scale is not None else []
    members = emit.members(lowered, extra)
    # FA3 reads the request's lengths from the block coordinate; q_offset needs them in scope
    for m in members:
        if m.name == "fv_q_offset":
            m.init = "int32_t(kv_len) - int32_t(qo_len)"
    if any("fv_batch" in line for line in emit.prologue(lowered.logits, lowered.mask)):
        members.insert(0, Member("int32_t", "fv_batch_idx", "int32_t(batch_idx)"))
    scale = softmax_scale_log2(variant, emit)
    lines = emit.prologue(lowered.logits, lowered.mask)
    if lowered.mask:
        mask_lines, keep = emit.statements(lowered.mask)
        lines += ["bool fv_keep;", "{"] + ["  " + ln for ln in mask_lines] + [f"  fv_keep = {keep};", "}"]
    logit_lines, value = emit.statements(lowered.logits)
    lines += logit_lines
    if lowered.mask:
        fill = "-INFINITY" if variant.softmax else "0.f"
        value = f"fv_keep ? {value} : {fill}"
    lines.append(f"return {value};")
    source = render("fa3/variant.cuh.jinja", name=variant.name, struct_name=struct_name(variant),
                    source=os.path.basename(variant.source_file or "<unknown>"), softmax=variant.softmax,
                    members=members, sm_scale_log2=scale, body="\n    ".join(lines))
    return VariantDecl(source, lowered, additional_params(variant, with_causal_flag=False))
