"""A variant's bound params as the arguments its FlashInfer module takes. Binding them (checking what a caller passes
against the declarations) is fivar.spec.inputs', which the reference shares; re-exported here for its callers."""
from __future__ import annotations

from ..spec.inputs import BoundParams, bind_params, checked_scalar  # noqa: F401


def kernel_args(variant, bound: BoundParams, sm_scale: float, causal: bool | None, tables=None,
                lengths=None) -> list:
    """The FlashInfer `additional` arguments in declaration order: tensors, then scalars. `tables` are
    fivar's own int32 tensors by name (FA3's tile-list form: fv_blocks, ...), declared before the variant's. `lengths`:
    the call's longest (query, key) runs, or a function giving them, for the position tables
    (fivar.runtime.position_tables)."""
    from ..codegen.cuda import additional_args
    from .position_tables import bind
    bound = bind(variant, bound, lengths)
    tables = tables or {}
    args: list = []
    for a in additional_args(variant, with_causal_flag=causal is not None, extra_tensors=list(tables)):
        if a.source == "table":
            args.append(tables[a.param])
        elif a.source == "tensor":
            args.append(bound.tensors[a.param])
        elif a.source == "sm_scale":
            args.append(float(sm_scale))
        elif a.source == "causal":
            args.append(int(bool(causal)))
        elif a.source == "scalar":
            p = variant.compiled_params[a.param]
            args.append(float(bound.scalars[a.param]) if p.dtype is float else int(bound.scalars[a.param]))
        else:  # the size or stride of a tensor param's dimension
            t = bound.tensors[a.param]
            args.append(int(t.shape[a.dim]) if a.source == "size" else int(t.stride(a.dim)))
    return args
