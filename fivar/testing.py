"""Checking a variant's kernels against its torch reference (used by `fivar check` and the test suite)."""
from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass

import torch

from . import config
from .errors import FivarError
from .spec import Scalar, Tensor
from .spec.inputs import check_head_dims

#: ||out - ref|| / ||ref|| and max |out - ref| / max(1, max |ref|) allowed, by dtype of q/k/v.
TOLERANCE = {torch.float16: (5e-3, 2e-2), torch.bfloat16: (1.5e-2, 6e-2)}


def _kernels_asked_for(check):
    """A check runs the kernels it names: a default call waits for its modules to build instead of running the Triton
    twin meanwhile (fivar.runtime.cold_start)."""
    @functools.wraps(check)
    def wrapped(*args, **kwargs):
        with config.override(cold_start="wait"):
            return check(*args, **kwargs)
    return wrapped


def example_params(variant, *, num_qo_heads: int, num_kv_heads: int, batch_size: int, max_len: int,
                   device, generator: torch.Generator | None = None) -> dict:
    """Fresh random params: the variant's own `example` if it has one, else drawn from the declarations."""
    if variant.example is not None:
        return _checked_example(variant, variant.example(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                                         batch_size=batch_size, max_len=max_len, device=device))
    sizes = {"qo_head": num_qo_heads, "kv_head": num_kv_heads, "batch": batch_size}
    out = {}
    for name, p in variant.params.items():
        if isinstance(p, Scalar):
            if p.default is not None:
                out[name] = p.default
            else:
                out[name] = int(torch.randint(1, max(2, max_len), (1,))) if p.dtype is int else \
                    float(torch.rand(1) * 2 + 0.5)
        elif isinstance(p, Tensor):
            shape = [sizes.get(d, max_len) for d in p.dims]
            dt = getattr(torch, p.dtype)
            if dt.is_floating_point:
                t = torch.randn(shape)
            elif dt == torch.bool:
                t = torch.rand(shape) > 0.3
            else:
                t = torch.randint(0, 4, shape)
            out[name] = t.to(dt).to(device)
    return out


def _checked_example(variant, params):
    """The params a variant's `example` returned, refused naming the example's file and line where their names, dtypes
    or ranks are not the declarations' (the kernels' own checks would name only the parameter, and a reader looks
    for it in the spec, not in the example)."""
    from .spec.inputs import checked_scalar
    code = getattr(variant.example, "__code__", None)
    where = f"{code.co_filename}:{code.co_firstlineno}: " if code is not None else ""
    head = f"{where}variant '{variant.name}': its example() returned"
    if not isinstance(params, dict):
        raise FivarError(f"{head} a {type(params).__name__}, not a dict of params")
    unknown = sorted(set(params) - set(variant.params))
    if unknown:
        raise FivarError(f"{head} unknown parameter(s) {', '.join(unknown)} (declared: {', '.join(variant.params)})")
    for name, p in variant.params.items():
        value = params.get(name)
        if value is None:
            if isinstance(p, Tensor) or p.default is None:
                raise FivarError(f"{head} no '{name}', which has no default")
        elif isinstance(p, Scalar):
            try:
                checked_scalar(variant, name, value)
            except FivarError as e:
                why = str(e).split(f"variant '{variant.name}': ", 1)[-1]  # after where the param was declared
                raise FivarError(f"{head} {value!r} for '{name}' ({why})") from None
        elif not isinstance(value, torch.Tensor) or value.dtype != getattr(torch, p.dtype) or value.dim() != p.ndim:
            got = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
                type(value).__name__
            raise FivarError(f"{head} '{name}' as {got}; it is declared torch.{p.dtype} with dims {p.dims}")
    return params


@dataclass
class CheckResult:
    variant: str
    case: str
    rel_err: float
    max_err: float
    passed: bool

    def __str__(self):
        return (f"{'PASS' if self.passed else 'FAIL'} {self.variant} {self.case}: rel {self.rel_err:.2e}, "
                f"max {self.max_err:.2e}")


def document_ids(lengths) -> torch.Tensor:
    """int32 [sum(lengths)]: document i's id for each of its positions, documents packed back to back in order (a
    document mask's `doc_ids` row)."""
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))


def compare(variant_name: str, case: str, out: torch.Tensor, ref: torch.Tensor, dtype) -> CheckResult:
    rel_tol, abs_tol = TOLERANCE[dtype]
    out, ref = out.double(), ref.double().to(out.device)
    if not torch.isfinite(out).all():
        return CheckResult(variant_name, case, math.inf, math.inf, False)
    diff = (out - ref)
    rel = float(diff.norm() / ref.norm().clamp_min(1e-12))
    mx = float(diff.abs().max()) if diff.numel() else 0.0
    scale = max(1.0, float(ref.abs().max()) if ref.numel() else 1.0)  # no-softmax outputs are not O(1)
    return CheckResult(variant_name, case, rel, mx, rel <= rel_tol and mx <= abs_tol * scale)


def generation_mismatch(tokens, logits, want_tokens, want_logits, tol: float) -> str | None:
    """Why a greedy generation (`tokens` [batch, prompt + steps], `logits` [batch, steps, vocab]) is not the reference
    one up to rounding, or None. Logits must agree within `tol` up to the first step whose token differs (later steps
    continue different sequences), and that token may differ only where the reference's own top two are within `tol`
    (a near tie rounding may break either way)."""
    steps = logits.shape[1]
    prompt = tokens.shape[1] - steps
    for row in range(tokens.shape[0]):
        differ = (tokens[row, prompt:] != want_tokens[row, prompt:]).nonzero()
        last = int(differ[0]) if len(differ) else steps - 1
        err = float((logits[row, :last + 1] - want_logits[row, :last + 1]).abs().max())
        if err >= tol:
            return f"row {row}: logits differ by {err:.4g} (allowed {tol:.4g}) within the first {last + 1} step(s)"
        if len(differ):
            ref = want_logits[row, last]
            gap = float(ref.max() - ref[tokens[row, prompt + last]])
            if gap >= tol:
                return (f"row {row}: step {last} chose token {int(tokens[row, prompt + last])}, "
                        f"{gap:.4g} below the reference's choice (a tie is within {tol:.4g})")
    return None


def _qkv(lq, lk, hq, hkv, d, dtype, device):
    return (torch.randn(lq, hq, d, dtype=dtype, device=device), torch.randn(lk, hkv, d, dtype=dtype, device=device),
            torch.randn(lk, hkv, d, dtype=dtype, device=device))


@_kernels_asked_for
def check_single_prefill(variant, *, qo_len, kv_len, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                         dtype=torch.bfloat16, causal=False, device="cuda", backend="auto",
                         params: dict | None = None) -> CheckResult:
    """`params` override the random example params by name."""
    q, k, v = _qkv(qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim, dtype, device)
    params = {**example_params(variant, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, batch_size=1,
                               max_len=kv_len, device=device), **(params or {})}
    out = variant.prefill(q, k, v, causal=causal, backend=backend, **params)
    ref = variant.reference(q, k, v, causal=causal, **params)
    return compare(variant.name, f"single_prefill[{backend}] {dtype} hd{head_dim} {num_qo_heads}/{num_kv_heads} "
                   f"qo{qo_len} kv{kv_len}{' causal' if causal else ''}{_shown(params)}", out, ref, dtype)


def _shown(params: dict) -> str:
    scalars = {n: p for n, p in params.items() if not isinstance(p, torch.Tensor)}
    return f" {scalars}" if scalars else ""


def _ragged_reference(variant, q, k, v, qo_lens, kv_lens, causal, params, float_dtype=torch.float32,
                      return_lse: bool = False):
    """The reference of a ragged batch, request by request (with return_lse: (out, lse))."""
    from .codegen.torch_ref import reference_attention
    outs, lses, qo, ko = [], [], 0, 0
    for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens)):
        got = reference_attention(variant, q[qo:qo + lq], k[ko:ko + lk], v[ko:ko + lk], causal=causal,
                                  params=params, batch_idx=b, batch_size=len(qo_lens), float_dtype=float_dtype,
                                  return_lse=return_lse)
        outs.append(got[0] if return_lse else got)
        if return_lse:
            lses.append(got[1])
        qo, ko = qo + lq, ko + lk
    return (torch.cat(outs), torch.cat(lses)) if return_lse else torch.cat(outs)


@_kernels_asked_for
def check_batch_prefill(variant, *, qo_lens, kv_lens, paged: bool, page_size=16, num_qo_heads=32,
                        num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, causal=False,
                        device="cuda", backend="auto", params: dict | None = None, kv_dtype=None) -> CheckResult:
    """kv_dtype=torch.float8_e4m3fn (paged only): an FP8 cache with per-tensor scales, against the dequantized
    reference."""
    batch = len(qo_lens)
    q, k, v = _qkv(sum(qo_lens), sum(kv_lens), num_qo_heads, num_kv_heads, head_dim, dtype, device)
    if kv_dtype is not None and not paged:
        raise ValueError("kv_dtype is a paged cache's dtype (paged=True)")
    k_held, v_held, k, v, scales = _kv_case(k, v, kv_dtype)
    params = {**example_params(variant, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, batch_size=batch,
                               max_len=max(kv_lens), device=device), **(params or {})}
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0)), dtype=torch.int32, device=device)
    if paged:
        paged_args = _to_paged(k_held, v_held, kv_lens, page_size)
        out = variant.batch_prefill_paged(q, paged_args[0], qo_indptr, *paged_args[1:], causal=causal,
                                          backend=backend, **scales, **params)
    else:
        kv_indptr = torch.tensor([0] + list(torch.tensor(kv_lens).cumsum(0)), dtype=torch.int32, device=device)
        out = variant.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, causal=causal, backend=backend, **params)
    ref = _ragged_reference(variant, q, k, v, qo_lens, kv_lens, causal, params)
    kind = "paged" if paged else "ragged"
    return compare(variant.name, f"batch_prefill_{kind}[{backend}] {dtype}{f' kv {kv_dtype}' if kv_dtype else ''} "
                   f"hd{head_dim} {num_qo_heads}/{num_kv_heads} "
                   f"qo{list(qo_lens)} kv{list(kv_lens)}{' causal' if causal else ''}", out, ref, dtype)


def _poisoned(t: torch.Tensor, length: int, width: int, row: int, start: int, dtype) -> torch.Tensor:
    """t's values at [row, start:start + n] of the transpose of a [length, width] tensor of poison (-5): a view of
    stride `width` with a storage offset, which read as raw memory gives -5s."""
    buf = torch.full((length, width), -5, dtype=dtype, device=t.device)
    view = buf.t()[row, start:start + t.numel()]
    view.copy_(t)
    return view


#: Index tensors (indptrs, page tables, last-page lengths) as callers pass them, each with t's values: strided views
#: of larger tensors, int64, on the host while the data is on a GPU, broadcast. The entry points read them as values
#: (fivar.runtime.launch._as_index), never as raw int32 memory.
INDEX_LAYOUTS = {
    "every_other": lambda t: torch.stack([t, torch.full_like(t, 7)], 1).reshape(-1)[::2],
    "transposed_sliced": lambda t: _poisoned(t, t.numel() + 3, 4, 2, 1, t.dtype),
    "int64": lambda t: t.long(),
    "int64_transposed_sliced": lambda t: _poisoned(t, t.numel() + 2, 3, 1, 2, torch.int64),
    "host_int64_strided": lambda t: _poisoned(t.cpu(), t.numel() + 1, 2, 1, 1, torch.int64),
    # stride 0 where every entry is the same (all last pages full), else a strided int16 view
    "broadcast": lambda t: (t[:1].expand(t.numel()) if bool((t == t[0]).all())
                            else _poisoned(t, t.numel() + 1, 2, 0, 1, torch.int16)),
}


def _to_paged(k, v, kv_lens, page_size):
    """Scatter contiguous per-request K/V into a shuffled page pool: (cache, indptr, indices, last_len)."""
    device = k.device
    pages_per = [max(1, math.ceil(n / page_size)) for n in kv_lens]
    total = sum(pages_per)
    perm = torch.randperm(total, device=device)
    hkv, d = k.shape[1], k.shape[2]
    # randn in float32 then cast: torch has no randn for float8 (an FP8 cache)
    k_cache = torch.randn(total, page_size, hkv, d, device=device).to(k.dtype)
    v_cache = torch.randn(total, page_size, hkv, d, device=device).to(k.dtype)
    indices, off, p = [], 0, 0
    for n, np_ in zip(kv_lens, pages_per):
        ids = perm[p:p + np_]
        for j in range(np_):
            lo, hi = off + j * page_size, min(off + (j + 1) * page_size, off + n)
            k_cache[ids[j], : hi - lo] = k[lo:hi]
            v_cache[ids[j], : hi - lo] = v[lo:hi]
        indices.append(ids)
        off, p = off + n, p + np_
    indptr = torch.tensor([0] + list(torch.tensor(pages_per).cumsum(0)), dtype=torch.int32, device=device)
    last = torch.tensor([n - (np_ - 1) * page_size for n, np_ in zip(kv_lens, pages_per)], dtype=torch.int32,
                        device=device)
    return (k_cache, v_cache), indptr, torch.cat(indices).to(torch.int32), last


def quantize_kv(k, v, kv_dtype):
    """(k8, v8, k_scale, v_scale): k and v in kv_dtype (float8_e4m3fn) with per-tensor scales that map their
    largest magnitude to 3/4 of the format's range; k8.float() * k_scale approximates k."""
    limit = 0.75 * torch.finfo(kv_dtype).max
    scales = [max(float(t.abs().max()), 1e-6) / limit for t in (k, v)]
    return (*(((t.float() / s).to(kv_dtype)) for t, s in zip((k, v), scales)), *scales)


def _kv_case(k, v, kv_dtype):
    """K/V as the cache holds them, their dequantized values (what the reference reads) and the run's scales."""
    if kv_dtype is None:
        return k, v, k, v, {}
    k8, v8, k_scale, v_scale = quantize_kv(k, v, kv_dtype)
    from .codegen.torch_ref import dequantize
    return k8, v8, dequantize(k8, k_scale), dequantize(v8, v_scale), {"k_scale": k_scale, "v_scale": v_scale}


@_kernels_asked_for
def check_decode(variant, *, kv_lens, page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                 dtype=torch.bfloat16, device="cuda", backend="auto", kv_dtype=None) -> CheckResult:
    """kv_dtype=torch.float8_e4m3fn: an FP8 cache with per-tensor scales, against the dequantized reference."""
    batch = len(kv_lens)
    q = torch.randn(batch, num_qo_heads, head_dim, dtype=dtype, device=device)
    _, k, v = _qkv(1, sum(kv_lens), num_qo_heads, num_kv_heads, head_dim, dtype, device)
    params = example_params(variant, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, batch_size=batch,
                            max_len=max(kv_lens), device=device)
    k_held, v_held, k_ref, v_ref, scales = _kv_case(k, v, kv_dtype)
    cache, indptr, indices, last = _to_paged(k_held, v_held, kv_lens, page_size)
    out = variant.decode(q, cache, indptr, indices, last, backend=backend, **scales, **params)
    ref = _ragged_reference(variant, q, k_ref, v_ref, [1] * batch, kv_lens, False, params)
    return compare(variant.name, f"batch_decode[{backend}] {dtype}{f' kv {kv_dtype}' if kv_dtype else ''} "
                   f"hd{head_dim} {num_qo_heads}/{num_kv_heads} kv{list(kv_lens)}", out, ref, dtype)


#: Awkward shapes every bundled variant is checked at (lengths not multiples of 16, qo_len != kv_len).
SINGLE_CASES = [(1, 1, False), (37, 129, False), (37, 129, True), (300, 300, True), (257, 1000, False)]
BATCH_CASES = [([17, 1, 40], [17, 70, 300], False), ([17, 1, 40], [17, 70, 300], True)]
DECODE_CASES = [[1, 33, 517, 1000]]


#: The same kinds of shapes, smaller, for the Triton twin under Triton's interpreter on the CPU.
CPU_SINGLE_CASES = [(1, 1, False), (37, 129, False), (37, 129, True), (100, 100, True), (57, 200, False)]
CPU_BATCH_CASES = [([17, 1, 40], [17, 70, 90], False), ([17, 1, 40], [17, 70, 90], True)]
CPU_DECODE_CASES = [[1, 33, 130]]


@_kernels_asked_for
def run_checks(variant, ops=("single_prefill", "batch_prefill", "batch_decode"), dtypes=(torch.bfloat16,),
               head_dims=(128,), heads=((32, 8),), backends=("auto",), device="cuda") -> list[CheckResult]:
    """Every op at awkward shapes against the reference. device="cpu": the Triton twin only, run by Triton's
    interpreter (TRITON_INTERPRET=1, set here), in float16, at smaller shapes."""
    from .jit.targets import AUTO, named, runs_twin
    single, batch_cases, decode_cases = SINGLE_CASES, BATCH_CASES, DECODE_CASES
    head_dims = check_head_dims(head_dims, f"variant '{variant.name}': head_dims")
    if device == "cpu":
        if not backends or not all(runs_twin(b) for b in backends):
            raise FivarError(f"variant '{variant.name}': on the CPU only the Triton twin runs (backend 'triton', "
                             f"under Triton's interpreter), not {', '.join(b for b in backends if not runs_twin(b))}")
        if torch.bfloat16 in dtypes:
            raise FivarError(f"variant '{variant.name}': bfloat16 on the CPU: Triton's interpreter has no bfloat16 "
                             "arithmetic; check float16")
        if os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
            # Triton picks compiled or interpreted kernels when it is imported (torch may import it first)
            raise FivarError(f"variant '{variant.name}': on the CPU the Triton twin runs under Triton's interpreter, "
                             "which must be chosen before Triton is imported: run with TRITON_INTERPRET=1 set (e.g. "
                             "`TRITON_INTERPRET=1 fivar check NAME --backends triton`)")
        os.environ["TRITON_INTERPRET"] = "1"
        single, batch_cases, decode_cases = CPU_SINGLE_CASES, CPU_BATCH_CASES, CPU_DECODE_CASES
    elif not torch.cuda.is_available():
        raise FivarError("fivar check runs the kernels, so it needs a CUDA GPU; without one, `fivar check NAME "
                         "--backends triton` runs the Triton twin on the CPU, and `fivar build` compiles the rest")
    results = []
    for dtype in dtypes:
        for hd in head_dims:
            for hq, hkv in heads:
                kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=hd, dtype=dtype, device=device)
                for backend in backends:
                    if "single_prefill" in ops:
                        for lq, lk, causal in single:
                            results.append(check_single_prefill(variant, qo_len=lq, kv_len=lk, causal=causal,
                                                                backend=backend, **kw))
                    if "batch_prefill" in ops:
                        for qo_lens, kv_lens, causal in batch_cases:
                            for paged in (False,) if runs_twin(backend) else (False, True):  # no paged twin
                                results.append(check_batch_prefill(variant, qo_lens=qo_lens, kv_lens=kv_lens,
                                                                   paged=paged, causal=causal, backend=backend, **kw))
                if "batch_decode" in ops:  # FA3 has no decode kernel: `auto` runs FA2's for it
                    for backend in dict.fromkeys(AUTO if (t := named(b)) and not t.decodes else b for b in backends):
                        for kv_lens in decode_cases:
                            results.append(check_decode(variant, kv_lens=kv_lens, backend=backend, **kw))
    return results


# --- gradients: `variant.attention`'s backward against float64 autograd of the reference -----------------------
def reference_gradients(variant, q, k, v, do, *, qo_lens, kv_lens, causal, params, sm_scale=None, o_used=None,
                        dlse=None):
    """(o, {"q": dq, "k": dk, "v": dv, param: dparam}) by float64 autograd through the torch reference, request by
    request; gradients of the float tensor params declared learnable=True. `dlse`: the loss also reads the lse
    (its gradient; every row must keep a key or have a sink, where the lse is finite).

    `o_used`: the forward output a kernel's backward reads (a softmax backward's correction term is rowsum(o * do)
    of it). A learnable param's gradient sums dS * d(logit)/d(param) over every pair, and a per-row error e in that
    term shifts each dS by -e * P along its row, which such a sum does not average out (ALiBi's slope: a per-row
    mean distance times e, against a total that cancels). With `o_used`, those param gradients are float64 autograd's
    at the correction term the kernel had: dparam - d/dparam sum_i e_i * LSE_i (dLSE_i/dlogit_ij = P_ij)."""
    from .codegen.torch_ref import reference_attention
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    learn = {n: params[n].detach().float().requires_grad_(True) for n, p in variant.tensor_params.items()
             if p.learnable}
    full = {**params, **learn}
    corrected = o_used is not None and variant.softmax and bool(learn)
    want_lse = corrected or dlse is not None
    outs, lses, qo, ko = [], [], 0, 0
    for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens)):
        got = reference_attention(variant, q64[qo:qo + lq], k64[ko:ko + lk], v64[ko:ko + lk], causal=causal,
                                  sm_scale=sm_scale, params=full, batch_idx=b, batch_size=len(qo_lens),
                                  float_dtype=torch.float64, return_lse=want_lse)
        outs.append(got[0] if want_lse else got)
        if want_lse:
            lses.append(got[1])
        qo, ko = qo + lq, ko + lk
    o = torch.cat(outs)
    do64 = do.double()
    if corrected:
        e = ((o_used.detach().double() - o.detach()) * do64).sum(-1)  # [tokens, heads]
        lse = torch.cat(lses) * math.log(2.0)  # natural log
        shift = torch.autograd.grad((torch.where(torch.isfinite(lse), lse, 0.0) * e).sum(), list(learn.values()),
                                    retain_graph=True, allow_unused=True)
    if dlse is None:
        o.backward(do64)
    else:
        torch.autograd.backward([o, torch.cat(lses)], [do64, dlse.double()])
    grads = {"q": q64.grad, "k": k64.grad, "v": v64.grad}
    grads.update({n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in learn.items()})
    if corrected:
        for (n, _), s in zip(learn.items(), shift):
            if s is not None:
                grads[n] = grads[n] - s
    return o.detach(), grads


@dataclass
class GradCheck:
    results: list[CheckResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def __str__(self):
        return "; ".join(f"{r.case}: rel {r.rel_err:.2e} max {r.max_err:.2e}{'' if r.passed else ' FAIL'}"
                         for r in self.results)


@_kernels_asked_for
def check_gradients(variant, q, k, v, *, qo_lens, kv_lens, causal, params, dtype, sm_scale=None,
                    backend="auto", loss="o") -> GradCheck:
    """Forward + backward through `variant.attention` against `reference_gradients`; `loss`: what it reads, "o",
    "o+lse" or "lse" (fresh random gradients of each; every row must keep a key or have a sink to read the lse)."""
    dev = q.device
    learn = [n for n, p in variant.tensor_params.items() if p.learnable]
    params = {n: (t.detach().clone().requires_grad_(True) if n in learn else t) for n, t in params.items()}
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    kw = {}
    if len(qo_lens) > 1:
        kw = dict(qo_indptr=torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0)), dtype=torch.int32, device=dev),
                  kv_indptr=torch.tensor([0] + list(torch.tensor(kv_lens).cumsum(0)), dtype=torch.int32, device=dev))
    if loss not in ("o", "o+lse", "lse"):
        raise ValueError(f"loss must be 'o', 'o+lse' or 'lse', got {loss!r}")
    o, lse = variant.attention(qg, kg, vg, causal=causal, sm_scale=sm_scale, backend=backend, return_lse=True, **kw,
                               **params)
    do = torch.randn_like(o) if "o" in loss else torch.zeros_like(o)  # zeros: the reference's do for an lse-only loss
    dlse = torch.randn_like(lse) if "lse" in loss else None
    read = [(o, do)] * ("o" in loss) + [(lse, dlse)] * (dlse is not None)  # what the loss reads, with its gradient
    torch.autograd.backward([t for t, _ in read], [g for _, g in read])
    ref_o, ref = reference_gradients(variant, q, k, v, do, qo_lens=qo_lens, kv_lens=kv_lens, causal=causal,
                                     params=params, sm_scale=sm_scale, o_used=o.detach(), dlse=dlse)
    got = {"q": qg.grad, "k": kg.grad, "v": vg.grad, **{n: params[n].grad for n in learn}}
    results = [compare(variant.name, "o", o.detach(), ref_o, dtype)]
    for name, want in ref.items():
        g = got[name]
        if g is None:
            g = torch.zeros_like(want)
        results.append(compare(variant.name, f"d{name}", g.detach(), want, dtype))
    return GradCheck(results)
