"""What fivar's variant struct computes for one request of a FlashInfer kernel, in float64 on the CPU: the test
stand-ins of FlashInfer's wrappers (FA2 block form, FA3 KV-range form, paged and ragged) share it, each mapping its
request's local rows and keys to positions its own way."""
import math

import torch

from fivar.codegen.cuda import param_ident
from fivar.codegen.torch_ref import TorchEvaluator


def attend(variant, named: dict, rows, keys, vals, q_idx, kv_idx, batch: int, keep, heads=None):
    """(out [rows, Hq, D], log2 lse [rows, Hq]) of one request. `named`: the kernel's additional arguments by
    name (sm_scale, the mangled params); q_idx [1, rows, 1] and kv_idx [1, 1, keys] the positions the struct
    gives the local rows and keys; `keep(ev, env)` the pairs it keeps (ev evaluates the variant's IR); `heads`:
    the (query head, KV head) the struct gives a request of one head (else the kernel's own)."""
    hq, hkv = rows.shape[1], keys.shape[1]
    head = torch.arange(hq).view(-1, 1, 1)
    score = torch.einsum("qhd,khd->hqk", rows.double(), keys.double().repeat_interleave(hq // hkv, 1))
    score = score * named["sm_scale"]
    qo_head, kv_head = (head, head // (hq // hkv)) if heads is None else (torch.tensor(heads[0]).view(1, 1, 1),
                                                                          torch.tensor(heads[1]).view(1, 1, 1))
    env = {"score": score, "sm_scale": named["sm_scale"], "batch": torch.tensor(batch), "qo_head": qo_head,
           "kv_head": kv_head, "q_idx": q_idx, "kv_idx": kv_idx}
    ev = TorchEvaluator(env, {n: named[param_ident(n)] for n in variant.params}, torch.float64)
    kept = keep(ev, env) & torch.ones_like(score, dtype=torch.bool)
    logits = (ev.run(variant.ir.logits).expand_as(score) if variant.ir.logits else score).masked_fill(~kept, -math.inf)
    w = torch.softmax(logits, -1).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", w, vals.double().repeat_interleave(hq // hkv, 1))
    return out, (torch.logsumexp(logits, -1) / math.log(2)).T
