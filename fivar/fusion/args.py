"""The arguments of a fusion call: their names, unpacking (`qkv=`, 2-D q/k) and validation.

Shared by the kernel call (fivar.fusion.runtime, which validates everything) and the torch reference
(fivar.fusion.reference, which checks the shapes only, on any device and float dtype). Depends on the
declaration (fivar.fusion.spec) and nothing above it.

Per-row fusions take `x [tokens, hidden]` (last dim contiguous), `weight [hidden]`, and `residual`,
`bias` (layernorm), `scale` (fp8), `out` as the spec needs; `out` defaults to a new tensor (pass
`out=x` for in place). Per-head fusions take `q [tokens, Hq, D]` and `k [tokens, Hk, D]` (or 2-D
`[tokens, H*D]`, or `qkv=` a packed `[tokens, (Hq + 2 Hk) * D]` buffer with `num_q_heads=`,
`num_kv_heads=`), `positions [tokens]` (int32/int64, clamped to the cache), `cos_sin_cache
[max_pos, rotary_dim]` float32 (or, for `cos_sin="computed"`, `inv_freq [rotary_dim / 2]` float32 and an
optional `attention_factor=1.0`), `q_weight`/`k_weight [D]` (+ `q_bias`/`k_bias` for layernorm), `scale`
(fp8). Same-dtype per-head fusions work in place unless `q_out`/`k_out` are given; fp8 ones allocate
their outputs. Every problem is a FivarError naming the fusion and the argument.
"""
from __future__ import annotations

import torch

from ..errors import FivarError
from .spec import eps_problem

ROW_ARGS = ("x", "weight", "residual", "bias", "scale", "eps", "out")
HEAD_ARGS = ("q", "k", "qkv", "num_q_heads", "num_kv_heads", "positions", "cos_sin_cache", "inv_freq",
             "attention_factor", "q_weight", "k_weight", "q_bias", "k_bias", "scale", "eps", "q_out", "k_out")
FP8 = torch.float8_e4m3fn
_scale_cache: dict[tuple, torch.Tensor] = {}


def arg_error(v, arg, msg) -> FivarError:
    return FivarError(f"fusion '{v.name}': argument '{arg}': {msg}")


def required_args(v) -> list[str]:
    if not v.is_head:
        req = ["x", "weight"]
        req += ["residual"] if v.residual else []
        req += ["bias"] if v.norm == "layernorm" else []
    else:
        req = ["q", "k"]
        if v.rope:
            req += ["positions", "inv_freq" if v.cos_sin == "computed" else "cos_sin_cache"]
        req += ["q_weight", "k_weight"] if v.norm else []
        req += ["q_bias", "k_bias"] if v.norm == "layernorm" else []
    return req + (["scale"] if v.fp8 else [])


def split_args(v, kwargs: dict, validate: bool = True) -> dict:
    """Check names, unpack qkv / 2-D q,k into [T, H, D] views; with validate=True check everything."""
    allowed = HEAD_ARGS if v.is_head else ROW_ARGS
    for name in kwargs:
        if name not in allowed:
            raise arg_error(v, name, f"unknown argument (this fusion takes: {', '.join(allowed)})")
    a = {k: val for k, val in kwargs.items() if val is not None}
    if v.is_head and "qkv" in a:
        if "q" in a or "k" in a:
            raise arg_error(v, "qkv", "pass either qkv= or q=/k=, not both")
        for n in ("num_q_heads", "num_kv_heads"):
            if not isinstance(a.get(n), int) or a[n] <= 0:
                raise arg_error(v, n, "a positive int is needed with qkv=")
        qkv, hq, hk, d = a.pop("qkv"), a.pop("num_q_heads"), a.pop("num_kv_heads"), v.head_dim
        if not isinstance(qkv, torch.Tensor) or qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hk) * d:
            raise arg_error(v, "qkv", f"must be a [tokens, (num_q_heads + 2 * num_kv_heads) * {d}] = "
                       f"[tokens, {(hq + 2 * hk) * d}] tensor, got {_shape(qkv)}")
        if validate:  # named as the caller passed it, before it becomes the q/k views
            _tensor(v, "qkv", qkv)
        a["q"] = qkv[:, :hq * d].unflatten(1, (hq, d))
        a["k"] = qkv[:, hq * d:(hq + hk) * d].unflatten(1, (hk, d))
    elif v.is_head:
        a.pop("num_q_heads", None)
        a.pop("num_kv_heads", None)
    for name in required_args(v):
        if name not in a:
            raise arg_error(v, name, "is required" + (" (or qkv=)" if name in ("q", "k") else ""))
    eps = a.get("eps", v.eps)
    if eps_problem(eps):
        raise arg_error(v, "eps", eps_problem(eps))
    a["eps"] = float(eps)
    if v.is_head:
        for n in ("q", "k", "q_out", "k_out"):
            t = a.get(n)
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] % v.head_dim == 0:
                a[n] = t.unflatten(1, (t.shape[1] // v.head_dim, v.head_dim))
    if validate:
        (validate_head if v.is_head else validate_row)(v, a)
    return a


def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _tensor(v, name, t, device=None, dtype=None, shape=None, dtypes=None):
    if not isinstance(t, torch.Tensor):
        raise arg_error(v, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise arg_error(v, name, f"must be a CUDA tensor, got one on {t.device} (on the CPU: v.reference(...))")
    if device is not None and t.device != device:
        raise arg_error(v, name, f"must be on {device} like the inputs, got {t.device}")
    if dtype is not None and t.dtype != dtype:
        raise arg_error(v, name, f"must be {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise arg_error(v, name, f"dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise arg_error(v, name, f"shape must be {tuple(shape)}, got {tuple(t.shape)}")


def _aligned(v, name, t, align_bytes=16):
    el = t.element_size()
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise arg_error(v, name, f"the last dimension must be contiguous (stride 1), got strides {t.stride()}")
    per = align_bytes // el
    if t.data_ptr() % align_bytes or any(s % per for s in t.stride()[:-1]):
        raise arg_error(v, name, f"data pointer and leading strides must be {align_bytes}-byte aligned "
                   f"(strides {t.stride()} elements of {el} bytes); fivar's kernels use 16-byte vectors")


def _scale(v, a, device):
    s = a["scale"]
    if isinstance(s, torch.Tensor):
        _tensor(v, "scale", s, device=device, dtype=torch.float32)
        if s.numel() != 1:
            raise arg_error(v, "scale", f"must hold one float32 value, got shape {tuple(s.shape)}")
        return
    if not isinstance(s, (int, float)) or not s > 0:
        raise arg_error(v, "scale", f"must be a positive float or a 1-element float32 CUDA tensor, got {s!r}")
    key = (float(s), str(device))
    t = _scale_cache.get(key)
    if t is None:
        t = _scale_cache[key] = torch.tensor([float(s)], dtype=torch.float32, device=device)
    a["scale"] = t


def check_qk(v, q, k):
    """Per-head q and k tensors: [tokens, heads, head_dim], one token count (the reference checks them too)."""
    d = v.head_dim
    for n, t in (("q", q), ("k", k)):
        if t.dim() != 3 or t.shape[2] != d:
            raise arg_error(v, n, f"must be [tokens, heads, {d}] (or [tokens, heads * {d}]), got shape {tuple(t.shape)}")
    if k.shape[0] != q.shape[0]:
        raise arg_error(v, "k", f"has {k.shape[0]} tokens but q has {q.shape[0]}")


def check_cos_sin_cache(v, cs):
    """The cos_sin_cache tensor's shape (the reference checks it too; its dtype, float32 here, is the caller's)."""
    if cs.dim() != 2 or cs.shape[1] != v.rotary_dim or cs.shape[0] < 1:
        raise arg_error(v, "cos_sin_cache", f"must be [max_pos, rotary_dim={v.rotary_dim}] (cos first half, sin second "
                   f"half), got shape {tuple(cs.shape)}")


def validate_row(v, a):
    x = a["x"]
    _tensor(v, "x", x, dtypes=(torch.bfloat16, torch.float16))
    if x.dim() != 2:
        raise arg_error(v, "x", f"must be [tokens, hidden], got shape {tuple(x.shape)}")
    dev, (t, h) = x.device, x.shape
    if h % 8 or not 8 <= h <= 65536:
        raise arg_error(v, "x", f"hidden size must be a multiple of 8 in [8, 65536], got {h}")
    _aligned(v, "x", x)
    _tensor(v, "weight", a["weight"], device=dev, dtype=x.dtype, shape=(h,))
    _aligned(v, "weight", a["weight"])
    if v.norm == "layernorm":
        _tensor(v, "bias", a["bias"], device=dev, dtype=x.dtype, shape=(h,))
        _aligned(v, "bias", a["bias"])
    if v.residual:
        _tensor(v, "residual", a["residual"], device=dev, dtype=x.dtype, shape=(t, h))
        _aligned(v, "residual", a["residual"])
    if v.fp8:
        _scale(v, a, dev)
    odt = FP8 if v.fp8 else x.dtype
    if "out" in a:
        _tensor(v, "out", a["out"], device=dev, dtype=odt, shape=(t, h))
        _aligned(v, "out", a["out"], 8 if v.fp8 else 16)
    else:
        a["out"] = torch.empty(t, h, dtype=odt, device=dev)


def validate_head(v, a):
    q, k, d = a["q"], a["k"], v.head_dim
    _tensor(v, "q", q, dtypes=(torch.bfloat16, torch.float16))
    dev = q.device
    _tensor(v, "k", k, device=dev, dtype=q.dtype)
    check_qk(v, q, k)
    _aligned(v, "q", q)
    _aligned(v, "k", k)
    tokens = q.shape[0]
    if v.rope:
        p = a["positions"]
        _tensor(v, "positions", p, device=dev, dtypes=(torch.int32, torch.int64), shape=(tokens,))
        if p.stride(0) != 1 and tokens > 1:
            raise arg_error(v, "positions", "must be contiguous")
    if v.rope and v.cos_sin == "computed":
        _tensor(v, "inv_freq", a["inv_freq"], device=dev, dtype=torch.float32, shape=(v.rotary_dim // 2,))
        _aligned(v, "inv_freq", a["inv_freq"])
        af = a.setdefault("attention_factor", 1.0)
        if not isinstance(af, (int, float)) or not 0 < float(af) < float("inf"):
            raise arg_error(v, "attention_factor", f"must be a positive finite number, got {af!r}")
        if "cos_sin_cache" in a:
            raise arg_error(v, "cos_sin_cache", "this fusion computes cos/sin (cos_sin='computed'): pass inv_freq=")
    elif v.rope:
        if "inv_freq" in a or "attention_factor" in a:
            raise arg_error(v, "inv_freq" if "inv_freq" in a else "attention_factor",
                       "this fusion reads cos/sin from cos_sin_cache= (declare cos_sin='computed' to pass "
                       "inv_freq)")
        cs = a["cos_sin_cache"]
        _tensor(v, "cos_sin_cache", cs, device=dev, dtype=torch.float32)
        check_cos_sin_cache(v, cs)
        _aligned(v, "cos_sin_cache", cs)
        if cs.shape[0] >= 2 ** 31:
            raise arg_error(v, "cos_sin_cache", "more than 2^31 positions")
    if v.norm:
        for n in ("q_weight", "k_weight") + (("q_bias", "k_bias") if v.norm == "layernorm" else ()):
            _tensor(v, n, a[n], device=dev, dtype=q.dtype, shape=(d,))
            _aligned(v, n, a[n])
    if v.fp8:
        _scale(v, a, dev)
    odt = FP8 if v.fp8 else q.dtype
    for n, src in (("q_out", q), ("k_out", k)):
        if n in a:
            o = a[n]
            _tensor(v, n, o, device=dev, dtype=odt, shape=tuple(src.shape))
            _aligned(v, n, o, 8 if v.fp8 else 16)
        elif v.fp8:
            a[n] = torch.empty(tuple(src.shape), dtype=odt, device=dev)
        else:
            a[n] = src  # in place
