"""Training with a variant: gradient checks against float64 autograd of the reference, and the forward+backward
benchmark (`--op train`): fivar's Triton forward+backward against FlexAttention's and SDPA's flash backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..testing import TOLERANCE, CheckResult, compare


def learnable_copy(variant, names=None):
    """The variant with its float tensor params (or those in `names`) declared learnable=True."""
    from dataclasses import replace

    from ..spec import AttentionVariant, Tensor
    params = {n: (replace(p, learnable=True, where=p.where) if isinstance(p, Tensor) and p.ir_type == "f32"
                  and (names is None or n in names) else p) for n, p in variant.params.items()}
    return AttentionVariant(name=variant.name, logits=variant.logits, mask=variant.mask, params=params,
                            softmax=variant.softmax, doc=variant.doc, example=variant.example)


def reference_gradients(variant, q, k, v, do, *, qo_lens, kv_lens, causal, params, sm_scale=None):
    """(o, {"q": dq, "k": dk, "v": dv, param: dparam}) by float64 autograd through the torch reference, request by
    request; gradients of the float tensor params declared learnable=True."""
    from ..codegen.torch_ref import reference_attention
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    learn = {n: params[n].detach().float().requires_grad_(True) for n, p in variant.tensor_params.items()
             if p.learnable}
    full = {**params, **learn}
    outs, qo, ko = [], 0, 0
    for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens)):
        outs.append(reference_attention(variant, q64[qo:qo + lq], k64[ko:ko + lk], v64[ko:ko + lk], causal=causal,
                                        sm_scale=sm_scale, params=full, batch_idx=b, batch_size=len(qo_lens),
                                        float_dtype=torch.float64))
        qo, ko = qo + lq, ko + lk
    o = torch.cat(outs)
    o.backward(do.double())
    grads = {"q": q64.grad, "k": k64.grad, "v": v64.grad}
    grads.update({n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in learn.items()})
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


def check_gradients(variant, q, k, v, *, qo_lens, kv_lens, causal, params, dtype, sm_scale=None) -> GradCheck:
    """Forward + backward through `variant.attention` against `reference_gradients` (fresh random `do`)."""
    dev = q.device
    learn = [n for n, p in variant.tensor_params.items() if p.learnable]
    params = {n: (t.detach().clone().requires_grad_(True) if n in learn else t) for n, t in params.items()}
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    kw = {}
    if len(qo_lens) > 1:
        kw = dict(qo_indptr=torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0)), dtype=torch.int32, device=dev),
                  kv_indptr=torch.tensor([0] + list(torch.tensor(kv_lens).cumsum(0)), dtype=torch.int32, device=dev))
    o = variant.attention(qg, kg, vg, causal=causal, sm_scale=sm_scale, **kw, **params)
    do = torch.randn_like(o)
    o.backward(do)
    ref_o, ref = reference_gradients(variant, q, k, v, do, qo_lens=qo_lens, kv_lens=kv_lens, causal=causal,
                                     params=params, sm_scale=sm_scale)
    got = {"q": qg.grad, "k": kg.grad, "v": vg.grad, **{n: params[n].grad for n in learn}}
    results = [compare(variant.name, "o", o.detach(), ref_o, dtype)]
    for name, want in ref.items():
        g = got[name]
        if g is None:
            g = torch.zeros_like(want)
        results.append(compare(variant.name, f"d{name}", g.detach(), want, dtype))
    return GradCheck(results)


__all__ = ["TOLERANCE", "check_gradients", "learnable_copy", "reference_gradients"]
