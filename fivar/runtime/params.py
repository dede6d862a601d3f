"""Checking the params a caller passes against what the variant declares, before anything launches."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import FivarError
from ..spec import Scalar
from ..spec.params import FLOAT32_MAX


@dataclass
class BoundParams:
    scalars: dict[str, float | int]
    tensors: dict[str, torch.Tensor]
    #: what the lowering's position tables are sized and placed by (fivar.runtime.position_tables)
    num_qo_heads: int = 0
    num_kv_heads: int = 0
    device: object = None


def _describe(p) -> str:
    if isinstance(p, Scalar):
        return f"Scalar({p.dtype.__name__})"
    return f"Tensor({p.dtype}, dims={p.dims})"


def _same_device(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None) != (b.index is None):  # "cuda" means the current device
        cur = torch.cuda.current_device()
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
    return a.index == b.index


def checked_scalar(variant, pname: str, value) -> float | int:
    """`value` for the variant's Scalar `pname`, as its declared type, or a FivarError naming both."""
    name, p = variant.name, variant.params[pname]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FivarError(f"variant '{name}': parameter '{pname}' must be a Python "
                         f"{p.dtype.__name__}, got {type(value).__name__}")
    if not math.isfinite(value):  # the kernels would turn every score it touches into NaN
        raise FivarError(f"variant '{name}': parameter '{pname}' must be finite, got {value!r}")
    if p.dtype is float and abs(value) > FLOAT32_MAX:  # float in the kernels: it would arrive as inf
        raise FivarError(f"variant '{name}': parameter '{pname}' = {value!r} does not fit the kernels' 32-bit "
                         f"floats (|x| <= {FLOAT32_MAX!r})")
    if p.dtype is int and not float(value).is_integer():
        raise FivarError(f"variant '{name}': parameter '{pname}' is an int parameter, got {value!r}")
    if p.dtype is int and not -2**31 <= value < 2**31:  # int32_t in the kernels
        raise FivarError(f"variant '{name}': parameter '{pname}' = {value} does not fit the kernels' 32-bit "
                         f"integers [-2**31, 2**31)")
    if value == 0 and pname in variant.ir.divisor_scalars:
        raise FivarError(f"{variant.ir.divisor_scalars[pname]}: parameter '{pname}' is 0 and divides "
                         "there; pass a non-zero value")
    return p.dtype(value)


def bind_params(variant, given: dict, *, num_qo_heads: int, num_kv_heads: int, batch_size: int,
                device) -> BoundParams:
    name = variant.name
    unknown = sorted(set(given) - set(variant.params))
    if unknown:
        declared = ", ".join(f"{k}: {_describe(p)}" for k, p in variant.params.items()) or "none"
        raise FivarError(f"variant '{name}': unknown parameter(s) {', '.join(unknown)} (declared: {declared})")
    scalars, tensors = {}, {}
    known = {"qo_head": num_qo_heads, "kv_head": num_kv_heads, "batch": batch_size}
    for pname, p in variant.params.items():
        if pname not in given or given[pname] is None:
            if isinstance(p, Scalar) and p.default is not None:
                scalars[pname] = p.default
                continue
            raise FivarError(f"variant '{name}': missing parameter '{pname}' ({_describe(p)}); pass it as "
                             f"{pname}=...")
        value = given[pname]
        if isinstance(p, Scalar):
            scalars[pname] = checked_scalar(variant, pname, value)
            continue
        if not isinstance(value, torch.Tensor):
            raise FivarError(f"variant '{name}': parameter '{pname}' must be a torch.Tensor "
                             f"({_describe(p)}), got {type(value).__name__}")
        want = getattr(torch, p.dtype)
        if value.dtype != want:
            raise FivarError(f"variant '{name}': parameter '{pname}' must have dtype torch.{p.dtype}, "
                             f"got {value.dtype}")
        if value.dim() != p.ndim:
            raise FivarError(f"variant '{name}': parameter '{pname}' must have {p.ndim} dimension(s) "
                             f"{p.dims}, got shape {tuple(value.shape)}")
        for d, dim in enumerate(p.dims):
            if dim in known and value.shape[d] != known[dim]:
                raise FivarError(f"variant '{name}': parameter '{pname}' dimension {d} ('{dim}') must be "
                                 f"{known[dim]}, got {value.shape[d]}")
            if value.shape[d] == 0:
                raise FivarError(f"variant '{name}': parameter '{pname}' has an empty dimension {d}")
        if _same_device(device, value.device) is False:
            raise FivarError(f"variant '{name}': parameter '{pname}' is on {value.device}, the inputs are "
                             f"on {device}")
        tensors[pname] = value.contiguous()
    return BoundParams(scalars, tensors, num_qo_heads, num_kv_heads, device)


def kernel_args(variant, bound: BoundParams, sm_scale: float, causal: bool | None, tables=None,
                lengths=None) -> list:
    """The FlashInfer `additional` arguments in declaration order: tensors, then scalars. `tables` are
    fivar's own int32 tensors by name (FA3's KV-range form: fv_blocks), declared before the variant's. `lengths`:
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
