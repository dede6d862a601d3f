"""What a call passes a variant, checked before anything runs: q/k/v shapes, the params against the variant's
declarations, and `return_lse`. The torch reference (fivar.codegen.torch_ref) and every runtime entry point
(fivar.runtime) check with these, so a bad call gets the same error everywhere; they need only torch and the
spec, so the reference uses them without loading the runtime."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..errors import FivarError
from .params import FLOAT32_MAX, Scalar

Q_LAYOUT = ("tokens", "num_qo_heads", "head_dim")
KV_LAYOUT = ("tokens", "num_kv_heads", "head_dim")
PAGED_KV_LAYOUT = ("num_pages", "page_size", "num_kv_heads", "head_dim")
PAGED_KV_NAMES = ("k_cache", "v_cache")


def check_qkv_layout(name: str, q, k, v, *, prefix: str = "", q_layout=Q_LAYOUT, kv_layout=KV_LAYOUT,
                     kv_names=("k", "v")) -> None:
    """q, k, v are tensors on one device, q [*q_layout], k and v [*kv_layout] of one shape (the last two dims
    num_kv_heads, head_dim), q's head_dim k's, num_qo_heads a multiple of num_kv_heads. A mismatch is a
    FivarError "variant '<name>': <prefix>..." naming the tensor and its shape. Dtypes, devices and sizes each
    caller supports are its own checks."""
    pre = f"variant '{name}': {prefix}"
    kn, vn = kv_names
    for t, tn in ((q, "q"), (k, kn), (v, vn)):
        if not isinstance(t, torch.Tensor):
            raise FivarError(f"{pre}{tn} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != len(q_layout):
        raise FivarError(f"{pre}q must be [{', '.join(q_layout)}], got shape {tuple(q.shape)}")
    if k.dim() != len(kv_layout) or k.shape != v.shape:
        raise FivarError(f"{pre}{kn} and {vn} must be [{', '.join(kv_layout)}] of one shape, got {kn} "
                         f"{tuple(k.shape)} and {vn} {tuple(v.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise FivarError(f"{pre}q {tuple(q.shape)} and {kn} {tuple(k.shape)} need the same head_dim, got "
                         f"{q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-1] == 0:  # 1/sqrt(head_dim) is the default scale: nothing to attend with
        raise FivarError(f"{pre}head_dim must be positive, got q {tuple(q.shape)}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv:
        raise FivarError(f"{pre}num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv}), got q "
                         f"{tuple(q.shape)} and {kn} {tuple(k.shape)}")
    if k.device != q.device or v.device != q.device:
        raise FivarError(f"{pre}q, {kn}, {vn} must be on one device, got {q.device}, {k.device}, {v.device}")


def check_sm_scale(name: str, sm_scale, head_dim: int) -> float:
    """The softmax scale a call passes (None: 1/sqrt(head_dim)) as a float: a real number, finite and within the
    kernels' float32 (a larger one would arrive as inf), else a FivarError naming sm_scale."""
    if sm_scale is None:
        if head_dim <= 0:
            raise FivarError(f"variant '{name}': head_dim must be positive, got {head_dim}")
        return 1.0 / math.sqrt(head_dim)
    value = sm_scale.item() if isinstance(sm_scale, torch.Tensor) and sm_scale.numel() == 1 else sm_scale
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FivarError(f"variant '{name}': sm_scale must be a finite number, got {sm_scale!r} (a "
                         f"{type(sm_scale).__name__})")
    try:
        x = float(value)
    except OverflowError:  # an int beyond any float
        x = math.inf if value > 0 else -math.inf
    if math.isnan(x) or (math.isinf(x) and isinstance(value, float)):
        raise FivarError(f"variant '{name}': sm_scale must be a finite number, got {sm_scale!r}")
    if abs(x) > FLOAT32_MAX:
        shown = repr(value) if len(repr(value)) <= 40 else f"an integer of {len(str(abs(value)))} digits"
        raise FivarError(f"variant '{name}': sm_scale = {shown} does not fit the kernels' 32-bit floats "
                         f"(|x| <= {FLOAT32_MAX!r})")
    return x


def check_head_dims(head_dims, what: str) -> list[int]:
    """Head dims asked for by a command or a check run: positive ints, else one line naming `what`."""
    dims = list(head_dims)
    bad = [d for d in dims if isinstance(d, bool) or not isinstance(d, int) or d <= 0]
    if bad:
        raise FivarError(f"{what}: a head dim must be a positive integer, got {', '.join(map(repr, bad))}")
    return dims


#: log2(e): fivar's LSE is in base 2 (fivar.runtime.lse says why and how outputs merge).
LOG2E = 1.4426950408889634


def check_lse(variant, return_lse: bool) -> bool:
    """`return_lse` as a bool, refused for a variant without softmax (its weights have no log-sum-exp)."""
    if return_lse and not variant.softmax:
        raise FivarError(f"variant '{variant.name}': return_lse=True needs a softmax variant; '{variant.name}' has "
                         "softmax=False, whose weights multiply V as they are, so there is no log-sum-exp to return "
                         "and its partial outputs over split KV simply add up")
    return bool(return_lse)


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


def same_device(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None) != (b.index is None):  # "cuda" means the current device
        cur = torch.cuda.current_device()
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
    return a.index == b.index


def declared(variant, pname: str) -> str:
    """How an error about a parameter's value starts: where it was declared, the variant and the parameter."""
    return f"{_at(getattr(variant.params.get(pname), 'where', None))}variant '{variant.name}': parameter '{pname}'"


def _at(where: dict | None) -> str:
    """`file:line: ` of a recorded source location, or nothing."""
    where = where or {}
    return f"{where['filename']}:{where['line']}: " if where.get("filename") and where.get("line") else ""


def checked_scalar(variant, pname: str, value) -> float | int:
    """`value` for the variant's Scalar `pname`, as its declared type, or a FivarError naming both."""
    p = variant.params[pname]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FivarError(f"{declared(variant, pname)} must be a Python "
                         f"{p.dtype.__name__}, got {type(value).__name__}")
    if not math.isfinite(value):  # the kernels would turn every score it touches into NaN
        raise FivarError(f"{declared(variant, pname)} must be finite, got {value!r}")
    if p.dtype is float and abs(value) > FLOAT32_MAX:  # float in the kernels: it would arrive as inf
        raise FivarError(f"{declared(variant, pname)} = {value!r} does not fit the kernels' 32-bit "
                         f"floats (|x| <= {FLOAT32_MAX!r})")
    if p.dtype is int and not float(value).is_integer():
        raise FivarError(f"{declared(variant, pname)} is an int parameter, got {value!r}")
    if p.dtype is int and not -2**31 <= value < 2**31:  # int32_t in the kernels
        raise FivarError(f"{declared(variant, pname)} = {value} does not fit the kernels' 32-bit "
                         f"integers [-2**31, 2**31)")
    if value == 0 and pname in variant.ir.divisor_scalars:
        raise FivarError(f"{variant.ir.divisor_scalars[pname]}: parameter '{pname}' is 0 and divides "
                         "there; pass a non-zero value")
    return p.dtype(value)


def check_known_params(variant, given: dict) -> None:
    """Refuse a param the variant does not declare (a misspelt name), at the variant's code, listing those it does."""
    unknown = sorted(set(given) - set(variant.params))
    if unknown:
        listed = ", ".join(f"{k}: {_describe(p)}" for k, p in variant.params.items()) or "none"
        fn = variant.logits or variant.mask or variant.sink  # the variant's own code: where its params are read
        raise FivarError(f"{_at(variant._where(fn))}variant '{variant.name}': unknown parameter(s) "
                         f"{', '.join(unknown)} (declared: {listed})")


def bind_params(variant, given: dict, *, num_qo_heads: int, num_kv_heads: int, batch_size: int,
                device) -> BoundParams:
    name = variant.name
    check_known_params(variant, given)
    scalars, tensors = {}, {}
    known = {"qo_head": num_qo_heads, "kv_head": num_kv_heads, "batch": batch_size}
    for pname, p in variant.params.items():
        if pname not in given or given[pname] is None:
            if isinstance(p, Scalar) and p.default is not None:
                scalars[pname] = p.default
                continue
            raise FivarError(f"{_at(p.where)}variant '{name}': missing parameter '{pname}' ({_describe(p)}); pass "
                             f"it as {pname}=...")
        value = given[pname]
        if isinstance(p, Scalar):
            scalars[pname] = checked_scalar(variant, pname, value)
            continue
        if not isinstance(value, torch.Tensor):
            raise FivarError(f"{declared(variant, pname)} must be a torch.Tensor "
                             f"({_describe(p)}), got {type(value).__name__}")
        want = getattr(torch, p.dtype)
        if value.dtype != want:
            raise FivarError(f"{declared(variant, pname)} must have dtype torch.{p.dtype}, "
                             f"got {value.dtype}")
        if value.dim() != p.ndim:
            raise FivarError(f"{declared(variant, pname)} must have {p.ndim} dimension(s) "
                             f"{p.dims}, got shape {tuple(value.shape)}")
        for d, dim in enumerate(p.dims):
            if dim in known and value.shape[d] != known[dim]:
                raise FivarError(f"{declared(variant, pname)} dimension {d} ('{dim}') must be "
                                 f"{known[dim]}, got {value.shape[d]}")
            if value.shape[d] == 0:
                raise FivarError(f"{declared(variant, pname)} has an empty dimension {d}")
        if same_device(device, value.device) is False:
            raise FivarError(f"{declared(variant, pname)} is on {value.device}, the inputs are "
                             f"on {device}")
        tensors[pname] = value.contiguous()
    return BoundParams(scalars, tensors, num_qo_heads, num_kv_heads, device)
