"""IR -> torch: the reference every kernel is checked against.

The variant's programs are evaluated on broadcast index tensors (the way FlexAttention defines a
score_mod), with the same semantics the compiled targets implement: Python's // and %, int() truncating
toward zero, tensor-parameter indices clamped to the tensor's bounds. Attention itself is plain float32
(or float64) math: no tiling, no online softmax.
"""
from __future__ import annotations

import math
import operator

import torch

from ..errors import FivarError
from ..runtime.inputs import check_qkv_layout
from ..spec import ir
from ..spec.ir import BOOL, F32, I32

_UNARY = {"tanh": torch.tanh, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
          "sigmoid": torch.sigmoid, "sqrt": torch.sqrt, "floor": torch.floor, "abs": torch.abs}


#: Integers are 32-bit in every target (int32_t in the CUDA structs, tl.int32 in the Triton twin): the reference
#: computes in int32 as well, so an overflow wraps the same way everywhere and an int64 tensor param is read as its
#: low 32 bits, as the kernels read it.
INT = torch.int32


class TorchEvaluator:
    """`check_divisors`: track where an integer // or % divided by zero (the kernels leave the result undefined) and
    which values that reaches, through the branch a select takes and the operand `and`/`or` evaluates
    (`poison_of`); `zero_division_error` then names the spec's file:line when such a value is used. Off where the
    programs are traced (FlexAttention's score_mod/mask_mod), which cannot branch on data."""

    def __init__(self, env: dict, params: dict, float_dtype=torch.float32, device=None, hoisted=None,
                 check_divisors=False):
        self.env, self.params, self.fdt = env, params, float_dtype
        self.check_divisors = check_divisors
        self.hoisted = hoisted or {}  # lowered programs: per-block invariants by name
        self.device = device
        self.locals: dict[str, torch.Tensor] = {}
        self._poison: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(value) -> (value, where it is undefined)
        self.zero_divisions: list[tuple[str, torch.Tensor]] = []  # (where, divisor == 0) per division evaluated

    def tensor(self, value, t: str):
        dt = {F32: self.fdt, I32: INT, BOOL: torch.bool}[t]
        return torch.tensor(value, dtype=dt, device=self.device)

    def run(self, program: ir.Program) -> torch.Tensor:
        self.locals = {}
        for name, e in program.lets:
            self.locals[name] = self.eval(e)
        return self.eval(program.result)

    def poison_of(self, value: torch.Tensor) -> torch.Tensor | None:
        hit = self._poison.get(id(value))
        return hit[1] if hit is not None and hit[0] is value else None

    def _with_poison(self, value: torch.Tensor, *masks) -> torch.Tensor:
        masks = [m for m in masks if m is not None]
        if masks:
            poison = masks[0]
            for m in masks[1:]:
                poison = poison | m
            self._poison[id(value)] = (value, poison)
        return value

    def zero_division_error(self, used: torch.Tensor, value: torch.Tensor) -> FivarError | None:
        """The error for a division by zero whose result reaches `value` where `used` holds, else None."""
        poison = self.poison_of(value)
        bad = None if poison is None else poison & used
        if bad is None or not bool(bad.any()):
            return None
        where = next((w for w, zero in self.zero_divisions if w and bool((zero & bad).any())), "an integer division")
        return FivarError(f"{where}: the divisor is 0 at positions whose result is used; "
                          "the kernels leave that undefined, so keep it non-zero there (e.g. maximum(d, 1), or "
                          "`... if d != 0 else ...`)")

    def eval(self, e: ir.Expr) -> torch.Tensor:
        P = self.poison_of if self.check_divisors else (lambda _: None)
        if isinstance(e, ir.Const):
            return self.tensor(e.value, e.type)
        if isinstance(e, ir.Score):
            return self.env["score"]
        if isinstance(e, ir.RawScore):
            return self.env["raw"]
        if isinstance(e, ir.Hoisted):
            return self.eval(self.hoisted[e.name])
        if isinstance(e, ir.Index):
            x = self.env[e.name]
            return x.to(INT) if isinstance(x, torch.Tensor) and not x.is_floating_point() else x
        if isinstance(e, ir.ScalarParam):
            v = self.env["sm_scale"] if e.name == "sm_scale" else self.params[e.name]
            return self.tensor(v, e.type)
        if isinstance(e, ir.Local):
            return self.locals[e.name]
        if isinstance(e, ir.Load):
            table = self.params[e.param]
            idx, masks = [], []
            for d, i in enumerate(e.indices):
                x = self.eval(i)
                masks.append(P(x))
                idx.append(x.clamp(0, table.shape[d] - 1))
            idx = torch.broadcast_tensors(*idx)
            out = table[tuple(idx)]
            out = out.to({F32: self.fdt, I32: INT, BOOL: torch.bool}[e.type])
            return self._with_poison(out, *masks)
        if isinstance(e, ir.Unary):
            x = self.eval(e.x)
            return self._with_poison(-x if e.op == "neg" else ~x, P(x))
        if isinstance(e, ir.Binary):
            a, b = self.eval(e.a), self.eval(e.b)
            op = e.op
            pa, pb = P(a), P(b)
            if e.type == I32 and op in ("floordiv", "mod"):
                zero = None
                if self.check_divisors and bool((b == 0).any()):
                    zero = b == 0
                    self.zero_divisions.append((e.where, zero))
                    b = torch.where(zero, torch.ones_like(b), b)  # any value: the result is undefined there
                out = torch.div(a, b, rounding_mode="floor") if op == "floordiv" else torch.remainder(a, b)
                return self._with_poison(out, pa, pb, zero)
            if op in ("and", "or"):  # the compiled targets evaluate b only where a does not decide
                if pb is not None:
                    pb = pb & (a if op == "and" else ~a)
                return self._with_poison((a & b) if op == "and" else (a | b), pa, pb)
            if op == "add":
                out = a + b
            elif op == "sub":
                out = a - b
            elif op == "mul":
                out = a * b
            elif op == "div":
                out = a / b
            elif op == "floordiv":
                out = torch.floor(a / b)
            elif op == "mod":
                out = a - b * torch.floor(a / b)
            else:
                out = {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq,
                       "ne": torch.ne}[op](a, b)
            return self._with_poison(out, pa, pb)
        if isinstance(e, ir.Select):
            c, x, y = self.eval(e.cond), self.eval(e.a), self.eval(e.b)
            px, py = P(x), P(y)
            taken = None if px is None and py is None else torch.where(
                c, px if px is not None else torch.zeros((), dtype=torch.bool, device=c.device),
                py if py is not None else torch.zeros((), dtype=torch.bool, device=c.device))
            return self._with_poison(torch.where(c, x, y), P(c), taken)
        if isinstance(e, ir.Call):
            args = [self.eval(a) for a in e.args]
            if e.fn in _UNARY:
                out = _UNARY[e.fn](args[0])
            else:
                out = (torch.minimum if e.fn == "minimum" else torch.maximum)(*args)
            return self._with_poison(out, *(P(a) for a in args))
        if isinstance(e, ir.Cast):
            x = self.eval(e.x)
            if e.type == F32:
                out = x.to(self.fdt)
            else:
                out = torch.trunc(x).to(INT) if x.is_floating_point() else x.to(INT)
            return self._with_poison(out, P(x))
        raise TypeError(f"cannot evaluate {e!r}")


def eval_scalar(expr: ir.Expr, scalars: dict, sm_scale: float, hoisted: dict | None = None) -> float:
    """Value of an invariant expression (e.g. the folded output scale) for concrete scalar params; `hoisted`: the
    lowered programs' invariants by name, which such an expression may refer to."""
    ev = TorchEvaluator({"sm_scale": sm_scale}, scalars, torch.float64, "cpu", hoisted=hoisted)
    return float(ev.eval(expr))


def _check_reference_inputs(variant, q, k, v, batch_idx, batch_size) -> int:
    """The shapes `prefill` takes, said in fivar's terms (else einsum or indexing fails in torch's); returns
    batch_idx as a Python int."""
    name = variant.name
    for t, tn in ((q, "q"), (k, "k"), (v, "v")):
        if isinstance(t, torch.Tensor) and not t.is_floating_point():
            raise FivarError(f"variant '{name}': reference: {tn} must be a floating-point torch.Tensor, got "
                             f"{t.dtype}")
    check_qkv_layout(name, q, k, v, prefix="reference: ", q_layout=("qo_len", "num_qo_heads", "head_dim"),
                     kv_layout=("kv_len", "num_kv_heads", "head_dim"))
    try:
        index = None if isinstance(batch_idx, bool) else operator.index(batch_idx)  # numpy / torch ints too
    except TypeError:
        index = None
    if index is None or index < 0 or (batch_size is not None and index >= batch_size):
        raise FivarError(f"variant '{name}': reference: batch_idx={batch_idx!r} must be an int in "
                         f"[0, batch_size={batch_size})")
    return index


def dequantize(t, scale, float_dtype=torch.float32):
    """A quantized K or V (an FP8 cache holds k / k_scale) back in float_dtype: t * scale."""
    return t.to(float_dtype) if scale is None else t.to(float_dtype) * float(scale)


def reference_attention(variant, q, k, v, *, causal=False, sm_scale=None, params=None, batch_idx=0,
                        batch_size=None, float_dtype=torch.float32, bound=None, return_lse=False, k_scale=None,
                        v_scale=None):
    """out[i, h] for one request, q: [qo_len, Hq, D], k/v: [kv_len, Hkv, D]; returns float_dtype. return_lse:
    (out, lse), lse [qo_len, Hq] the log2-sum-exp of each row's kept logits (fivar.runtime.lse), -inf if none; with
    a sink, its exp joins the sum (as in FlashInfer's sink kernels), so a row that keeps nothing has lse = sink."""
    from ..runtime.lse import LOG2E, check_lse
    from ..runtime.params import bind_params
    return_lse = check_lse(variant, return_lse)
    batch_idx = _check_reference_inputs(variant, q, k, v, batch_idx, batch_size)
    qo_len, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if bound is None:
        bound = bind_params(variant, params or {}, num_qo_heads=hq, num_kv_heads=hkv, batch_size=batch_size or batch_idx + 1,
                            device=q.device)
    values = {**bound.scalars, **bound.tensors}
    group = hq // hkv
    qf, kf, vf = q.to(float_dtype), dequantize(k, k_scale, float_dtype), dequantize(v, v_scale, float_dtype)
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    score = torch.einsum("qhd,khd->hqk", qf, kf) * sm_scale
    dev = q.device
    qo_head = torch.arange(hq, device=dev).view(hq, 1, 1)
    env = {
        "score": score, "sm_scale": sm_scale,
        "batch": torch.tensor(batch_idx, device=dev),
        "qo_head": qo_head, "kv_head": qo_head // group,
        "q_idx": torch.arange(qo_len, device=dev).view(1, qo_len, 1) + (kv_len - qo_len),
        "kv_idx": torch.arange(kv_len, device=dev).view(1, 1, kv_len),
    }
    ev = TorchEvaluator(env, values, float_dtype, dev, check_divisors=True)
    vir = variant.ir
    keep = torch.ones_like(score, dtype=torch.bool)
    if causal:
        keep = keep & (env["kv_idx"] <= env["q_idx"])
    if vir.mask:  # a division by zero matters where the mask is evaluated (causal skips the rest) ...
        mask = ev.run(vir.mask)
        error = ev.zero_division_error(keep, mask)
        if error:
            raise error
        keep = keep & mask
    logits = score
    if vir.logits:  # ... and in the logits of the pairs that are kept
        logits = ev.run(vir.logits)
        error = ev.zero_division_error(keep, logits)
        if error:
            raise error
        logits = logits.expand_as(score)
    if variant.softmax:
        kept = logits.masked_fill(~keep, -math.inf)
        if vir.sink is not None:  # one more logit per row, with no value row: it only joins the denominator
            sink = ev.run(vir.sink)
            error = ev.zero_division_error(torch.ones_like(sink, dtype=torch.bool), sink)
            if error:
                raise error
            kept = torch.cat([kept, sink.to(float_dtype).expand(hq, qo_len, 1)], dim=-1)
        p = torch.softmax(kept, dim=-1)[..., :kv_len]
        # a row with no key kept is 0/0: FlashInfer writes zeros there; a NaN logit of a kept key stays NaN, as in
        # the kernels
        p = p.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
    else:
        p = torch.where(keep, logits, torch.zeros((), dtype=float_dtype, device=dev))
    out = torch.einsum("hqk,khd->qhd", p, vf)
    if return_lse:  # logsumexp of a row of -inf is -inf
        return out, (torch.logsumexp(kept, dim=-1) * LOG2E).transpose(0, 1)
    return out
