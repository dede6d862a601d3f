"""FlashInfer FA2 target: render the variant struct and the module sources for each entry point.

fivar reuses FlashInfer's host code and kernel-instantiation templates (they define the Params structs
FlashInfer's kernels expect) and owns the parts that carry the variant: the struct itself and a mask-mode
dispatch that instantiates only the modes this variant can use (half the kernels of FlashInfer's path).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jinja2

from ..paths import templates_dir
from ..spec import ir, optimize
from .cuda import CppEmitter, Member, additional_params, comment_text

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


def mask_modes(variant) -> list[str]:
    """A variant with a mask owns it on every tile (kCustom) and folds `causal` in itself."""
    return [MASK_CUSTOM] if variant.mask else [MASK_NONE, MASK_CAUSAL]


def runtime_mask_code(variant, causal: bool) -> int:
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


def sink_members_and_body(variant, param_ref, emit: CppEmitter) -> tuple[list[Member], str | None]:
    """The sink for FA2's REGISTER_M_D_UPDATE, which runs once per query row (OutputTransform runs per output
    element): qo_head is the hook's, the request index a member (the hook has none)."""
    sink = variant.ir.sink
    if sink is None:
        return [], None
    sink_emit = CppEmitter(variant, param_ref, index_init={"batch": "fv_sink_batch"})
    members = [Member("int32_t", "fv_sink_batch", "int32_t(batch_idx)")] if "batch" in ir.uses(sink) else []
    return members, "\n      ".join(sink_emit.sink_lines(sink))


def variant_decl(variant, param_ref=lambda n: f"params.{n}", template="fa2/variant.cuh.jinja") -> VariantDecl:
    lowered = variant.lowered
    emit = CppEmitter(variant, param_ref)
    sink_exprs = list(variant.ir.sink.exprs()) if variant.ir.sink is not None else []
    members = emit.members(lowered, ([lowered.output_scale] if lowered.output_scale is not None else []) + sink_exprs)
    sink_members, sink_body = sink_members_and_body(variant, param_ref, emit)
    members += sink_members
    scale = softmax_scale_log2(variant, emit)
    mask_body = None
    if lowered.mask:
        # Masked variants run in kCustom mode (mask on every tile), so `causal` is a runtime flag here.
        members.append(Member("bool", "fv_causal", f"{param_ref('fv_causal')} != 0"))
        mask_body = emit.body(lowered.mask, guard=CAUSAL_GUARD)
    source = render(template, name=variant.name, source=os.path.basename(variant.source_file or "<unknown>"), struct_name=struct_name(variant),
                    softmax=variant.softmax, members=members, sm_scale_log2=scale,
                    logits_body=emit.body(lowered.logits) if lowered.logits else None, mask_body=mask_body,
                    sink_body=sink_body)
    return VariantDecl(source, lowered, additional_params(variant, with_causal_flag=bool(variant.mask)))
