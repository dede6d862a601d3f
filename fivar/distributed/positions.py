"""Global positions for a (query run, key run) pair of shards.

Every entry point places positions by its own call: key j is at kv_idx = j and query row i at
q_idx = i + kv_len - qo_len (bottom-right aligned). A shard pair needs q_idx = q_start + i and kv_idx = kv_start + j
instead. `global_variant` derives, once per variant, a variant whose programs read `q_idx + Q_SHIFT` and
`kv_idx + KV_SHIFT` wherever the user's read `q_idx` and `kv_idx` (an IR rewrite of the parsed programs, so the
templates and code generators are untouched), the shifts being two int Scalar params passed per call: one compiled
module serves every pair. The sink is left out (it is merged once per row, `sink_state`).

Causal on global positions is the kernels' own causal mode wherever it can be (`pair_causality`): a pair whose keys
all precede its queries is not causal at all, and a pair whose query and key runs end at the same position is the
kernels' bottom-right aligned causal square (kCausal, which skips the tiles above the diagonal). The runs of one
sharding are disjoint, so every pair is one of those two or lies wholly after the diagonal (skipped). A pair
straddling it any other way would run the variant derived with causal as part of its mask
(`global_variant(variant, True)`, also the reference's form), on every tile its kernel visits.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch

from ..errors import FivarError
from ..spec import Scalar, ir
from ..spec.ir import BOOL, I32
from ..spec.inputs import LOG2E
from ..spec.positions import is_distance

Q_SHIFT, KV_SHIFT = "fv_cp_q_shift", "fv_cp_kv_shift"

_derived: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _shifted(program: ir.Program | None) -> ir.Program | None:
    """`program` reading q_idx + Q_SHIFT and kv_idx + KV_SHIFT. A distance `kv_idx - q_idx` stays one, plus the
    shifts' difference, so the compiled targets' passes still see it (position tables, fivar.spec.positions)."""
    if program is None:
        return None
    shift = {"q_idx": ir.ScalarParam(I32, Q_SHIFT), "kv_idx": ir.ScalarParam(I32, KV_SHIFT)}

    def shifted(e: ir.Expr) -> ir.Expr | None:
        if is_distance(e):
            return ir.Binary(I32, "add", e, ir.Binary(I32, "sub", shift[e.a.name], shift[e.b.name]))
        if isinstance(e, ir.Index) and e.name in shift:
            return ir.Binary(I32, "add", e, shift[e.name])
        return None

    def walk(e: ir.Expr) -> ir.Expr:
        return ir.substitute(e, shifted)
    return ir.Program([(n, walk(e)) for n, e in program.lets], walk(program.result), dict(program.hoisted))


def global_variant(variant, causal: bool):
    """The derived variant reading global positions (module docstring); kept per (variant, causal)."""
    from ..spec.variant import AttentionVariant
    kept = _derived.setdefault(variant, {})
    if causal in kept:
        return kept[causal]
    taken = {Q_SHIFT, KV_SHIFT} & set(variant.params)
    if taken:
        raise FivarError(f"variant '{variant.name}': parameter name(s) {', '.join(sorted(taken))} are "
                         "fivar.distributed's own; rename them")
    vir = variant.ir
    mask = _shifted(vir.mask)
    if causal:  # kv_idx <= q_idx on global positions, in addition to the mask
        kv = ir.Binary(I32, "add", ir.Index(I32, "kv_idx"), ir.ScalarParam(I32, KV_SHIFT))
        q = ir.Binary(I32, "add", ir.Index(I32, "q_idx"), ir.ScalarParam(I32, Q_SHIFT))
        term = ir.Binary(BOOL, "le", kv, q)
        mask = ir.Program([], term) if mask is None else \
            ir.Program(mask.lets, ir.Binary(BOOL, "and", term, mask.result), mask.hoisted)
    derived = AttentionVariant(
        name=f"{variant.name}_cp{'_causal' if causal else ''}", logits=variant.logits, mask=variant.mask,
        sink=variant.sink, softmax=variant.softmax, doc=variant.doc,
        params={**variant.params, Q_SHIFT: Scalar(int, default=0), KV_SHIFT: Scalar(int, default=0)})
    derived.sink = None  # merged once per row by the caller, not once per pair
    derived.__dict__["ir"] = dataclasses.replace(vir, logits=_shifted(vir.logits), mask=mask, sink=None)
    kept[causal] = derived
    return derived


#: How a pair's causal constraint runs (pair_causality)
NOT_CAUSAL, KERNEL_CAUSAL, MASK_CAUSAL = "not causal", "kernel causal", "mask causal"


def pair_causality(causal: bool, q_start: int, qo_len: int, kv_start: int, kv_len: int) -> str:
    """How the pair of query rows q_start.. and keys kv_start.. applies `causal` on global positions: NOT_CAUSAL
    (no constraint, or every key at or before every query), KERNEL_CAUSAL (the runs end together, so kv <= q
    globally is the kernels' bottom-right aligned causal: key j at kv_start + j, query i at the same position as
    local kv_len - qo_len + i), else MASK_CAUSAL (global_variant(variant, True), causal=False)."""
    if not causal or kv_start + kv_len - 1 <= q_start:
        return NOT_CAUSAL
    if q_start + qo_len == kv_start + kv_len and qo_len <= kv_len:
        return KERNEL_CAUSAL
    return MASK_CAUSAL


def shifts(q_start: int, qo_len: int, kv_start: int, kv_len: int) -> dict:
    """The shift params that put a call's query rows at q_start.. and its keys at kv_start.."""
    return {Q_SHIFT: q_start - (kv_len - qo_len), KV_SHIFT: kv_start}


def sink_state(variant, bound_values: dict, rows: int, num_qo_heads: int, num_kv_heads: int, like: torch.Tensor):
    """(out, lse) of the sink alone for `rows` query rows: zeros and log2(exp(sink)); merged once into each row's
    state it adds exp(sink) to the denominator exactly once. None without a sink. Differentiable in the params."""
    if variant.ir.sink is None:
        return None
    from ..spec.evaluate import TorchEvaluator
    dev = like.device
    heads = torch.arange(num_qo_heads, device=dev)
    env = {"batch": torch.tensor(0, device=dev), "qo_head": heads,
           "kv_head": heads // (num_qo_heads // num_kv_heads)}
    sink = TorchEvaluator(env, bound_values, torch.float32, dev).run(variant.ir.sink)
    lse = (sink.float() * LOG2E).expand(num_qo_heads).unsqueeze(0).expand(rows, num_qo_heads)
    return torch.zeros(rows, num_qo_heads, like.shape[-1], dtype=like.dtype, device=dev), lse
