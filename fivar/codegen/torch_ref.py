"""IR -> torch: the reference every kernel is checked against.

The variant's programs are evaluated on broadcast index tensors by fivar.spec.evaluate (the semantics the
compiled targets implement); attention itself is plain float32 (or float64) math: no tiling, no online softmax.
The call's inputs and params are checked as the runtime checks them (fivar.spec.inputs).
"""
from __future__ import annotations

import math
import operator

import torch

from ..errors import FivarError
# eval_scalar is re-exported: callers and tests import the reference's evaluator from here
from ..spec.evaluate import TorchEvaluator, eval_scalar  # noqa: F401
from ..spec.inputs import LOG2E, bind_params, check_lse, check_qkv_layout, check_sm_scale


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
                        v_scale=None, custom_mask=None):
    """out[i, h] for one request, q: [qo_len, Hq, D], k/v: [kv_len, Hkv, D]; returns float_dtype. return_lse:
    (out, lse), lse [qo_len, Hq] the log2-sum-exp of each row's kept logits (fivar.runtime.lse), -inf if none; with
    a sink, its exp joins the sum (as in FlashInfer's sink kernels), so a row that keeps nothing has lse = sink.
    custom_mask: bool [qo_len, kv_len], pairs also dropped where False (an engine's custom mask, fivar.runtime.custom_mask)."""
    return_lse = check_lse(variant, return_lse)
    batch_idx = _check_reference_inputs(variant, q, k, v, batch_idx, batch_size)
    qo_len, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    sm_scale = check_sm_scale(variant.name, sm_scale, d)
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
    if custom_mask is not None:
        if not (isinstance(custom_mask, torch.Tensor) and custom_mask.dtype == torch.bool
                and tuple(custom_mask.shape) == (qo_len, kv_len)):
            got = (f"{custom_mask.dtype} {list(custom_mask.shape)}" if isinstance(custom_mask, torch.Tensor)
                   else type(custom_mask).__name__)
            raise FivarError(f"variant '{variant.name}': custom_mask must be a bool tensor [qo_len, kv_len] = "
                             f"[{qo_len}, {kv_len}], got {got}")
        keep = keep & custom_mask.to(dev)[None]
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
