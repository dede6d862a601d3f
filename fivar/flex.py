"""A variant as FlexAttention's score_mod / mask_mod (the "flex" contender in benchmarks).

Both are the torch reference evaluator applied to the index tensors FlexAttention passes, so Flex runs
exactly the function the kernels were generated from. Flex always normalises with softmax, so
no-softmax variants (sigmoid attention) have no Flex equivalent. A sink, which score_mod cannot add to the
denominator, joins after: Flex runs the variant without it (without_sink) with its log-sum-exp, and join_sink
scales each row by what the sink takes of it (flex_sink evaluates the sink per request and head).
"""
from __future__ import annotations

import torch

from .codegen.torch_ref import TorchEvaluator
from .errors import FivarError
from .spec import ir
from .runtime.params import bind_params


def flex_mods(variant, params: dict, *, qo_len: int, kv_len: int, num_qo_heads: int, num_kv_heads: int,
              sm_scale: float, causal: bool, device, batch_size: int = 1):
    """(score_mod, mask_mod) for torch.nn.attention.flex_attention (mask_mod None if nothing is masked)."""
    if not variant.softmax:
        raise FivarError(f"variant '{variant.name}': FlexAttention always applies softmax, so a no-softmax "
                         "variant has no Flex equivalent")
    if variant.sink is not None:
        raise FivarError(f"variant '{variant.name}': FlexAttention's score_mod cannot add a sink to the softmax "
                         "denominator, so a variant with a sink has no Flex equivalent of its own: run Flex of "
                         "fivar.flex.without_sink(variant) with return_lse=True, then fivar.flex.join_sink")
    bound = bind_params(variant, params, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                        batch_size=batch_size, device=device)
    values = {**bound.scalars, **bound.tensors}
    group = num_qo_heads // num_kv_heads
    offset = kv_len - qo_len
    vir = variant.ir

    def env(b, h, q_idx, kv_idx, score=None):
        return {"score": score, "sm_scale": sm_scale, "batch": b, "qo_head": h, "kv_head": h // group,
                "q_idx": q_idx + offset, "kv_idx": kv_idx}

    score_mod = None
    if vir.logits is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return TorchEvaluator(env(b, h, q_idx, kv_idx, score), values, torch.float32).run(vir.logits)

    mask_mod = None
    if vir.mask is not None or causal:
        def mask_mod(b, h, q_idx, kv_idx):
            keep = (kv_idx <= q_idx + offset) if causal else (kv_idx >= 0)
            if vir.mask is not None:
                keep = keep & TorchEvaluator(env(b, h, q_idx, kv_idx), values, torch.float32).run(vir.mask)
            return keep
    return score_mod, mask_mod


def keep_every_key(batch, qo_head, kv_head, q_idx, kv_idx, params):
    """A mask keeping every key (plain attention, and what a variant with only a sink keeps)."""
    return kv_idx >= 0


def without_sink(variant):
    """What Flex runs of a variant with a sink: the variant without it (join_sink adds it after); a variant needs
    a function, so one with a sink alone keeps every key. A variant without a sink is returned as it is."""
    if variant.sink is None:
        return variant
    from dataclasses import replace
    return replace(variant, sink=None, mask=variant.mask or keep_every_key)


def flex_sink(variant, params: dict, *, num_qo_heads: int, num_kv_heads: int, device, batch_size: int = 1):
    """The variant's sink logit of each (request, query head), float32 [batch_size, num_qo_heads], its program
    evaluated as the reference evaluates it (any expression of the request, the head and params); None without."""
    if variant.sink is None:
        return None
    bound = bind_params(variant, params, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                        batch_size=batch_size, device=device)
    heads = torch.arange(num_qo_heads, device=device).view(1, -1)
    env = {"batch": torch.arange(batch_size, device=device).view(-1, 1), "qo_head": heads,
           "kv_head": heads // (num_qo_heads // num_kv_heads)}
    sink = TorchEvaluator(env, {**bound.scalars, **bound.tensors}, torch.float32, device).run(variant.ir.sink)
    return torch.broadcast_to(sink.float(), (batch_size, num_qo_heads))


def join_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The variant's output from Flex's of the rest, out [..., rows, D], and its log-sum-exp [..., rows] (natural
    log: flex_attention returns it so, its kernels' log2 converted) with `sink` the sink logit of each row
    (broadcast to lse): with S = exp(lse), out * S / (S + exp(sink)) = out * sigmoid(lse - sink). A row that keeps
    no key (lse -inf) stays zero."""
    return out * torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype)


def flex_block_mask(variant, mask_mod, qo_len: int, kv_len: int, num_qo_heads: int, device):
    """Flex's block mask of one request (None without a mask_mod): one per head when the mask reads the head (a
    window per head), else one broadcast over the heads. A broadcast mask is evaluated at head 0, and compiled Flex
    skips its empty blocks for every head."""
    if mask_mod is None:
        return None
    from torch.nn.attention.flex_attention import create_block_mask
    mask = variant.ir.mask
    heads = num_qo_heads if mask is not None and {"qo_head", "kv_head"} & ir.uses(mask) else None
    return create_block_mask(mask_mod, None, heads, qo_len, kv_len, device=device)


def flex_attention_fn(variant, params, q, k, v, *, causal=False, sm_scale=None, compile=True):
    """A callable running `variant` through FlexAttention on [len, heads, dim] tensors (one request)."""
    import math

    from torch.nn.attention.flex_attention import flex_attention
    qo_len, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    score_mod, mask_mod = flex_mods(variant, params, qo_len=qo_len, kv_len=kv_len, num_qo_heads=hq,
                                    num_kv_heads=hkv, sm_scale=sm_scale, causal=causal, device=q.device)
    # Every variant/shape is a new score_mod closure, so torch.compile recompiles per call here; past
    # dynamo's default limit (8) it silently falls back to eager Flex, which would make Flex look ~100x
    # slower than it is in a benchmark over many variants.
    import torch._dynamo
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    block_mask = flex_block_mask(variant, mask_mod, qo_len, kv_len, hq, q.device)
    fa = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, len, dim]

    def run():
        out = fa(qb, kb, vb, score_mod=score_mod, block_mask=block_mask, scale=sm_scale,
                 enable_gqa=hq != hkv)
        return out.squeeze(0).transpose(0, 1)
    return run
