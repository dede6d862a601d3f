"""Training with a variant: `variant.attention(q, k, v, ...)`, differentiable through a backward generated from the
spec (the Triton twin's); the forward is the variant's FA3 kernel on sm90, the Triton twin's elsewhere.

Two torch.library custom ops carry the work under `torch.compile`, which sees opaque, shape-described calls (an
eager step runs their implementations through a `torch.autograd.Function`, without the ops' dispatch):

* `fivar::attention_fwd` -> (o, lse): the forward, also writing each row's log2-sum-exp (softmax variants; zeros
  without softmax): the variant's FA3 kernel on an sm90 GPU (`backend="auto"`), else the Triton twin;
* `fivar::attention_bwd` -> (dq, dk, dv, [d param]): FlashAttention-2 backward kernels generated from the same
  spec (fivar.codegen.triton_bwd), with float32 gradients of the tensor parameters declared `learnable=True`.

The autograd formula of the forward op (`register_autograd`) calls the backward op. Custom ops take tensors and
numbers only, so the variant travels as its `key` (fivar.spec.live.variant_by_key) and its params as two lists,
tensors then scalars in declaration order. `lse` is an output for callers that merge states (ring or context-parallel
attention); a loss that reads it gets its gradient too (folded into the softmax backward's correction term).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from ..codegen.triton import kernel_arg_values
from ..config import override
from ..errors import FivarError
from ..jit.targets import AUTO, runs_twin, target_of
from ..spec.inputs import LOG2E
from ..spec.live import variant_by_key
from . import cold_start, position_tables
from .params import BoundParams
from .plan_cache import PlanCache, capturing
from .triton_attention import kept_block_map


def _bound(variant, tensors: list, scalars: list, lengths=None, heads=(1, 1), device=None) -> BoundParams:
    """The op's params as bound params; with `lengths` (longest query and key runs), the position tables of the
    lowering in force (fivar.runtime.position_tables) added, evaluated from them: values only, the backward derives
    every gradient from the logits per element (fivar.spec.optimize, training)."""
    tnames, snames = list(variant.tensor_params), list(variant.scalar_params)
    values = {n: (int(x) if variant.params[n].dtype is int else float(x)) for n, x in zip(snames, scalars)}
    bound = BoundParams(values, dict(zip(tnames, tensors)), *heads, device)
    return bound if lengths is None else position_tables.bind(variant, bound, lengths)


def _training(variant):
    """The training lowering (fivar.spec.optimize): the Triton training module's kernels, their arguments and
    tables (the derivatives' own beside the logits'). While the variant's modules build in the background
    (fivar.runtime.cold_start) the step's kernels stand in like an inference call's twin: one launch config each,
    not every autotuning candidate (the first step of a cold start; the steps after the build autotune)."""
    return override(training=True, **(cold_start.STAND_IN if cold_start.building(variant) else {}))


def _module(variant):
    from ..jit.triton_module import load_triton_module
    return load_triton_module(variant, training=True)


#: `attention(backend=...)`: which kernel runs the forward; the backward is always the generated Triton one.
TRAINING_BACKENDS = ("auto", "triton", "fa3", "fa2")


def _attention_fwd(variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor,
                  kv_indptr: torch.Tensor, max_qo_len: int, max_kv_len: int, causal: bool, sm_scale: float,
                  tensors: list[torch.Tensor], scalars: list[float], target: str) -> tuple[torch.Tensor, torch.Tensor]:
    var = variant_by_key(variant)
    # FlashInfer's plans are made on the host and kept by the contents they saw: a CUDA graph replaying a kept plan
    # after new document ids were copied in would attend with the old ones. The target was chosen when the call
    # was traced (torch.compile), so the capture is noticed here: the Triton forward records its pre-pass.
    if target_of(target).is_flashinfer and not capturing():
        return _flashinfer_forward(var, target, q, k, v, qo_indptr, kv_indptr, causal, sm_scale, tensors, scalars)
    with _training(var):
        return _forward(var, q, k, v, qo_indptr, kv_indptr, max_qo_len, max_kv_len, causal, sm_scale, tensors,
                        scalars)


attention_fwd = torch.library.custom_op("fivar::attention_fwd", _attention_fwd, mutates_args=())


def _flashinfer_forward(var, target, q, k, v, qo_indptr, kv_indptr, causal, sm_scale, tensors, scalars):
    """The forward on the variant's FlashInfer kernel (FA3 or FA2: the inference entry points, plans cached), whose
    log2-sum-exp is the Triton forward's (fivar.runtime.lse), so the generated backward recomputes the same P."""
    from .attention import batch_prefill_ragged, single_prefill
    bound = _bound(var, tensors, scalars)
    params = {**bound.scalars, **bound.tensors}
    kw = dict(causal=causal, sm_scale=sm_scale, backend=target, params=params, return_lse=var.softmax)
    if qo_indptr.numel() == 2:  # one request: the single-prefill kernel (no plan for a plain causal variant)
        result = single_prefill(var, q, k, v, **kw)
    else:
        result = batch_prefill_ragged(var, q, k, v, qo_indptr, kv_indptr, **kw)
    return result if var.softmax else (result, _no_lse(q))


def _no_lse(q):
    """The lse output of a variant without softmax: zeros (the backward reads nothing of it)."""
    return torch.zeros(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)


#: The backward's tile lists (the module's bwd_tile_lists: the mask's block map at the backward's tiles), kept across
#: steps with the same batch layout, params and causal flag (fivar.runtime.plan_cache: tensors by identity and
#: version, so a document-id table written in place is classified again). Not while a CUDA graph is captured
#: (`recorded`): a replay after new document ids were copied in then classifies them.
_kept = PlanCache(capacity=8, recorded=True)


def _tile_lists(var, module, q, k, qo_indptr, kv_indptr, max_qo_len, max_kv_len, causal, sm_scale, tensors, scalars,
                args):
    """bwd_tile_lists for this call, or None when the variant's mask needs no block map."""
    if not hasattr(module, "bwd_tile_lists"):
        return None
    parts = (var.key, sm_scale, tensors, scalars, qo_indptr, kv_indptr, max_qo_len, max_kv_len, bool(causal),
             q.shape[1], k.shape[1], q.device)
    return _kept.get(parts, lambda: module.bwd_tile_lists(qo_indptr, kv_indptr, max_qo_len, max_kv_len, q.shape[1],
                                                          q.shape[1] // k.shape[1], causal, args))


def _forward(var, q, k, v, qo_indptr, kv_indptr, max_qo_len, max_kv_len, causal, sm_scale, tensors, scalars):
    bound = _bound(var, tensors, scalars, (max_qo_len, max_kv_len), (q.shape[1], k.shape[1]), q.device)
    args = kernel_arg_values(var, bound, sm_scale)
    module = _module(var)
    plan = kept_block_map(module, (var.key, sm_scale, tensors, scalars, qo_indptr, kv_indptr, q.shape[1], k.shape[1],
                                   q.device), qo_indptr, kv_indptr, max_qo_len, max_kv_len, q.shape[1],
                          q.shape[1] // k.shape[1], causal, args)
    # every row belongs to a request (the indptrs were checked), so softmax's kernel writes each one
    if not var.softmax:
        return module.prefill(q, k, v, qo_indptr, kv_indptr, max_qo_len, causal, args, plan=plan), _no_lse(q)
    return module.prefill(q, k, v, qo_indptr, kv_indptr, max_qo_len, causal, args, return_lse=True, plan=plan)


@attention_fwd.register_fake
def _(variant, q, k, v, qo_indptr, kv_indptr, max_qo_len, max_kv_len, causal, sm_scale, tensors, scalars, target):
    return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


def _attention_bwd(variant: str, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  o: torch.Tensor, lse: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                  max_qo_len: int, max_kv_len: int, causal: bool, sm_scale: float, tensors: list[torch.Tensor],
                  scalars: list[float], dlse: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """dq, dk, dv, and one float32 gradient per learnable tensor parameter (in declaration order); `dlse`: the
    loss's gradient of the forward's lse, None where the loss does not read it."""
    from ..codegen.triton_bwd import learnable_params
    var = variant_by_key(variant)
    with _training(var):
        bound = _bound(var, tensors, scalars, (max_qo_len, max_kv_len), (q.shape[1], k.shape[1]), q.device)
        grads = {n: torch.zeros(bound.tensors[n].shape, dtype=torch.float32, device=q.device)
                 for n in learnable_params(var)}
        module, args = _module(var), kernel_arg_values(var, bound, sm_scale)
        lists = _tile_lists(var, module, q, k, qo_indptr, kv_indptr, max_qo_len, max_kv_len, causal, sm_scale,
                            tensors, scalars, args)
        # without softmax the lse is zeros, a constant: a loss reading it adds nothing
        delta = module.softmax_delta(o, do, dlse) if var.softmax else None
        dq, dk, dv = module.backward(q, k, v, o, lse, do, qo_indptr, kv_indptr, max_qo_len, max_kv_len, causal, args,
                                     grads, tile_lists=lists, delta=delta)
    if var.ir.sink is not None and grads:
        _add_sink_grads(var, bound, lse, delta, qo_indptr, grads)
    return dq, dk, dv, list(grads.values())


attention_bwd = torch.library.custom_op("fivar::attention_bwd", _attention_bwd, mutates_args=())


def _add_sink_grads(var, bound, lse, delta, qo_indptr, grads):
    """Adds the gradients of learnable tensors the sink reads into `grads`. The sink is one logit per (request, query
    head) that joins each row's denominator with no value row: its gradient is a sum over the request's rows of
    -P_sink * delta (softmax_delta's, the lse's gradient in it), carried to each element it reads by the sink
    program's symbolic derivative (fivar.spec.grad; batch x heads values, evaluated in torch: autograd does not run
    inside a custom op)."""
    from ..spec import grad
    from ..spec.evaluate import TorchEvaluator
    loads = grad.learnable_loads(var.ir.sink, var.params, names=set(grads))
    if not loads:
        return
    (tokens, heads), batch, dev = lse.shape, qo_indptr.numel() - 1, lse.device
    env = {"batch": torch.arange(batch, device=dev).view(batch, 1), "qo_head": torch.arange(heads, device=dev)[None]}
    ev = TorchEvaluator(env, {**bound.scalars, **bound.tensors}, torch.float32, dev)
    sink = ev.run(var.ir.sink).float().expand(batch, heads)  # in the logits' units
    request = torch.searchsorted(qo_indptr[1:].long(), torch.arange(tokens, device=dev), right=True)
    p_sink = torch.exp2(sink[request] * LOG2E - lse)
    d_sink = torch.zeros(batch, heads, dtype=torch.float32, device=dev).index_add_(0, request, -p_sink * delta)
    for load in loads:
        d_load = ev.run(grad.derivative(var.ir.sink, load)).float()  # d sink / d the element read; sets the lets
        index = torch.broadcast_tensors(*ev.load_index(load, grads[load.param].shape), d_sink)[:-1]
        grads[load.param].index_put_(index, (d_sink * d_load).expand(batch, heads), accumulate=True)


@attention_bwd.register_fake
def _(variant, do, q, k, v, o, lse, qo_indptr, kv_indptr, max_qo_len, max_kv_len, causal, sm_scale, tensors,
      scalars, dlse=None):
    from ..codegen.triton_bwd import learnable_params
    var = variant_by_key(variant)
    tnames = list(var.tensor_params)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            [tensors[tnames.index(n)].new_empty(tensors[tnames.index(n)].shape, dtype=torch.float32)
             for n in learnable_params(var)])


def _setup(ctx, inputs, output):
    variant, q, k, v, qo_indptr, kv_indptr, max_qo_len, max_kv_len, causal, sm_scale, tensors, scalars, _ = inputs
    o, lse = output
    ctx.set_materialize_grads(False)  # an unread lse's gradient stays None (no zeros written per step)
    ctx.save_for_backward(q, k, v, o, lse, qo_indptr, kv_indptr, *tensors)
    ctx.variant, ctx.causal, ctx.sm_scale, ctx.scalars = variant, causal, sm_scale, scalars
    ctx.max_qo_len, ctx.max_kv_len = max_qo_len, max_kv_len


def _gradients(ctx, do, dlse, run_bwd):
    """dq, dk, dv and the tensor params' gradients (None for those not learnable) from the saved step."""
    from ..codegen.triton_bwd import learnable_params
    q, k, v, o, lse, qo_indptr, kv_indptr, *tensors = ctx.saved_tensors
    var = variant_by_key(ctx.variant)
    if do is None:  # a loss that reads only the lse; the op's schema takes a tensor (and delta is then -dlse log2(e))
        do = torch.zeros_like(o)
    dq, dk, dv, dparams = run_bwd(ctx.variant, do, q, k, v, o, lse, qo_indptr, kv_indptr, ctx.max_qo_len,
                                  ctx.max_kv_len, ctx.causal, ctx.sm_scale, tensors, ctx.scalars, dlse)
    by_name = dict(zip(learnable_params(var), dparams))
    return dq, dk, dv, [by_name[n].to(t.dtype) if n in by_name else None for n, t in zip(var.tensor_params, tensors)]


def _backward(ctx, do, dlse):
    dq, dk, dv, dtensors = _gradients(ctx, do, dlse, attention_bwd)
    # a list of numbers is one leaf of the inputs' structure, an empty list is a list (torch's pytree)
    return None, dq, dk, dv, None, None, None, None, None, None, dtensors, (None if ctx.scalars else []), None


torch.library.register_autograd("fivar::attention_fwd", _backward, setup_context=_setup)


class _EagerStep(torch.autograd.Function):
    """An eager step's forward and backward: the ops' implementations without torch.library's dispatch around them
    (each op call flattens its arguments, checks them against its schema and runs under torch._disable_dynamo,
    whose first call imports Dynamo). torch.compile traces the ops instead (attention)."""

    @staticmethod
    def forward(ctx, variant, target, call, q, k, v, *tensors):
        qo_indptr, kv_indptr, max_qo_len, max_kv_len, causal, sm_scale, _, scalars = call
        o, lse = _attention_fwd(variant, q, k, v, qo_indptr, kv_indptr, max_qo_len, max_kv_len, causal, sm_scale,
                                list(tensors), scalars, target)
        _setup(ctx, (variant, q, k, v, *call[:6], list(tensors), scalars, target), (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        dq, dk, dv, dtensors = _gradients(ctx, do, dlse, _attention_bwd)
        return None, None, None, dq, dk, dv, *dtensors


def forward_target(variant, backend: str, q, k, causal: bool, late_rows: bool) -> tuple[str, str]:
    """(target, reason): the kernel that runs the training forward. `auto` takes the variant's FA3 kernel where it
    can run this call (an sm90 GPU, fp16/bf16, head dim 64/128/256, not while a CUDA graph is captured: its plans
    are made on the host) and the Triton twin otherwise; `late_rows`: a request's causal rows start before its
    first key (qo_len > kv_len), which only the Triton forward takes (those rows are zeros)."""
    if backend not in TRAINING_BACKENDS:
        raise FivarError(f"variant '{variant.name}': attention() backend {backend!r} is not available (choose from "
                         f"{', '.join(TRAINING_BACKENDS)})")
    if runs_twin(backend):
        return backend, "backend='triton' was requested"
    from ..jit.build import DTYPES, HEAD_DIMS
    from .attention import choose_target
    why_not = None
    if q.device.type != "cuda":
        why_not = f"the inputs are on {q.device.type}, FlashInfer's kernels run on a CUDA GPU"
    elif q.dtype not in DTYPES.values():
        why_not = f"FlashInfer's kernels take float16/bfloat16, got {str(q.dtype).removeprefix('torch.')}"
    elif q.shape[-1] not in HEAD_DIMS:
        why_not = f"FlashInfer's kernels are built for head dims {HEAD_DIMS}, got {q.shape[-1]}"
    elif capturing():
        why_not = "a CUDA graph is being captured and FlashInfer plans on the host"
    elif causal and late_rows:
        why_not = "causal with a request's qo_len > kv_len (rows before the first key)"
    elif backend == AUTO or target_of(backend).needs_sm90a:  # what backend="auto" of inference takes FA3 for (sm90)
        target, reason = choose_target(variant, AUTO, "single_prefill", q.device)
        why_not = None if target_of(target).needs_sm90a else reason
    if backend == "auto":
        return ("fa3", "FA3 forward") if why_not is None else ("triton", f"Triton forward: {why_not}")
    if why_not is not None:
        raise FivarError(f"variant '{variant.name}': attention(backend={backend!r}) cannot run this call: {why_not}; "
                         "use backend='triton' or 'auto'")
    return backend, f"backend={backend!r} was requested"


def attention(variant, q, k, v, *, causal=False, sm_scale=None, backend="auto", qo_indptr=None, kv_indptr=None,
              return_lse=False, params=None):
    """Differentiable attention. q [qo_tokens, Hq, D], k/v [kv_tokens, Hkv, D]: one request, or a ragged batch
    given `qo_indptr`/`kv_indptr` (int32, request b owns rows [indptr[b], indptr[b+1])). Returns o, or (o, lse)
    with `return_lse` (lse: float32 [qo_tokens, Hq], log2 of each row's softmax denominator in the units of
    `logits * log2(e)`; zeros without softmax). `backend`: the forward's kernel (forward_target); the backward is
    the generated Triton one."""
    target, call = _call_args(variant, q, k, v, causal, sm_scale, backend, qo_indptr, kv_indptr, params)
    if torch.compiler.is_compiling():
        o, lse = attention_fwd(variant.key, q, k, v, *call, target)
    else:
        o, lse = _EagerStep.apply(variant.key, target, call, q, k, v, *call[6])
    return (o, lse) if return_lse else o


def _call_args(variant, q, k, v, causal, sm_scale, backend, qo_indptr, kv_indptr, params) -> tuple[str, tuple]:
    """(the forward's target, the ops' arguments after q, k, v: indptrs, max lengths, causal, sm_scale, tensor and
    scalar params), checked."""
    from .attention import _check_ragged_indptr, _prepare
    from .triton_attention import _check_inputs, _single_indptr
    _check_inputs(variant, q, k, v)
    if (qo_indptr is None) != (kv_indptr is None):
        raise FivarError(f"variant '{variant.name}': pass both qo_indptr and kv_indptr, or neither")
    if qo_indptr is None:
        batch = 1
        qo_indptr, kv_indptr = _single_indptr(q.shape[0], q.device), _single_indptr(k.shape[0], q.device)
        max_qo_len, max_kv_len = q.shape[0], k.shape[0]
        late_rows = q.shape[0] > k.shape[0]
    else:
        qo_indptr, kv_indptr, batch = _check_ragged_indptr(variant, q, k, qo_indptr, kv_indptr)
        lens = torch.stack([qo_indptr[1:] - qo_indptr[:-1], kv_indptr[1:] - kv_indptr[:-1]]).cpu()  # one sync
        max_qo_len, max_kv_len = int(lens[0].max()), int(lens[1].max())
        late_rows = bool((lens[0] > lens[1]).any())
    target, _ = forward_target(variant, backend, q, k, bool(causal), late_rows)
    bound, sm_scale = _prepare(variant, params or {}, q, k.shape[1], batch, sm_scale)
    if backend == AUTO and not runs_twin(target) and not torch.compiler.is_compiling() and cold_start.runs_triton(
            variant, "single_prefill" if batch == 1 else "batch_prefill", target, AUTO, q, params, sm_scale, causal):
        target = "triton"  # the forward's modules are building (fivar.runtime.cold_start): the twin's meanwhile
    tensors = [bound.tensors[n] for n in variant.tensor_params]  # .contiguous() of the caller's: in its graph
    scalars = [float(bound.scalars[n]) for n in variant.scalar_params]
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        _warn_unlearnable(variant, tensors)
    return target, (qo_indptr, kv_indptr, max_qo_len, max_kv_len, bool(causal), sm_scale, tensors, scalars)


_warned: set = set()


def _warn_unlearnable(variant, tensors) -> None:
    """A tensor param that requires grad but is not declared learnable gets no gradient (a frozen table may well
    require grad elsewhere in a model, so this is not an error): said once per variant and param, since an optimizer
    would otherwise never move it and nothing else would show it."""
    asking = [n for n, t in zip(variant.tensor_params, tensors) if t.requires_grad and (variant.key, n) not in _warned]
    if not asking:  # the common call: nothing to look up
        return
    from ..codegen.triton_bwd import learnable_params
    learnable = set(learnable_params(variant))
    for name in asking:
        if name not in learnable:
            _warned.add((variant.key, name))
            warnings.warn(f"variant '{variant.name}': tensor param '{name}' requires grad but is not declared "
                          f"learnable, so attention() gives it no gradient (declare it Tensor(..., learnable=True) "
                          f"to train it)", stacklevel=4)


def attention_grads(variant, q, k, v, o, lse, do, dlse=None, *, causal=False, sm_scale=None, params=None):
    """(dq, dk, dv, {learnable tensor param: float32 gradient}) of one request's attention given an (o, lse) and
    their gradients, without running the forward: the generated backward. With o and lse of a row's attention over
    more keys than k/v (a merge of several parts, as context parallelism has them) each key's probability is its
    share of the whole row, so the result is these keys' part of the whole row's gradients."""
    from ..codegen.triton_bwd import learnable_params
    _, call = _call_args(variant, q, k, v, causal, sm_scale, "triton", None, None, params)
    run = attention_bwd if torch.compiler.is_compiling() else _attention_bwd  # eager: no op dispatch (_EagerStep)
    dq, dk, dv, dparams = run(variant.key, do, q, k, v, o, lse, *call, dlse)
    return dq, dk, dv, dict(zip(learnable_params(variant), dparams))
