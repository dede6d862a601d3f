"""Speculative verify: 8, 16 or 64 draft tokens per request over a paged context with a custom mask (a chain or a
random draft tree, fivar.integrations.serving), batch 32 x 8192 keys of context, page 16, bf16, head dim 128, GQA
32/8, causal; soft-cap, sliding window (512) and gpt-oss (a sink per head in a 128-key window).

Contenders: `fivar-fa3` (the one-shot `batch_prefill_paged(..., packed_custom_mask=)`, backend auto: FA3's
tile-list form on sm90), `fivar-fa3-planned` (`plan_paged` once, then `run`), `triton` (the twin's prefill
reading the pages through the page table and the mask's bits), `stock` (FlashInfer's
BatchPrefillWithPagedKVCacheWrapper with the same packed mask and `logits_soft_cap` / `window_left`, where those
compute the variant: not for the sink) and `flex` (FlexAttention over the batch gathered dense, its block mask
from the variant's mask and the custom mask; no sink either). Ratios against stock, else the Triton twin.
"""
from __future__ import annotations

import random

import torch

from ..contenders import Contender, selected, stock_mapping
from ..runner import Case, Prepared
from ...testing import compare

BATCH, CONTEXT, PAGE = 32, 8192, 16
DRAFTS = (8, 16, 64)
HEADS, HEAD_DIM, DTYPE = (32, 8), 128, torch.bfloat16
VARIANTS = {"softcap": {}, "sliding_window": {"window": 512}, "gpt_oss": {"window": 128}}
CHECK_REQUESTS = 2


def _parents(form: str, n: int, rng: random.Random) -> list[int]:
    if form == "chain":
        return list(range(-1, n - 1))
    return [-1] + [rng.randrange(max(-1, j - 4), j) for j in range(1, n)]  # bushy near the root, then deeper


def _problem(name: str, drafts: int, form: str):
    import fivar
    from ...integrations.serving import tree_mask, tree_rows
    from ...testing import _to_paged, example_params
    v = fivar.load(name)
    hq, hkv = HEADS
    kv = CONTEXT + drafts
    rnd = lambda *s: torch.randn(*s, dtype=DTYPE, device="cuda")  # noqa: E731
    q, k, vv = rnd(BATCH * drafts, hq, HEAD_DIM), rnd(BATCH * kv, hkv, HEAD_DIM), rnd(BATCH * kv, hkv, HEAD_DIM)
    cache, kv_indptr, kv_indices, last = _to_paged(k, vv, [kv] * BATCH, PAGE)
    rng = random.Random(drafts)
    parents = [_parents(form, drafts, rng) for _ in range(BATCH)]
    packed, mask_indptr = tree_mask([CONTEXT] * BATCH, parents, device="cuda")
    rows = torch.stack([torch.cat([torch.ones(drafts, CONTEXT, dtype=torch.bool), tree_rows(p)], 1)
                        for p in parents]).cuda()  # [batch, drafts, kv]
    params = {**example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=BATCH, max_len=kv, device="cuda"),
              **VARIANTS[name]}
    qo_indptr = torch.arange(0, BATCH * drafts + 1, drafts, dtype=torch.int32, device="cuda")
    return v, dict(q=q, k=k, v=vv, cache=cache, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                   last=last, packed=packed, mask_indptr=mask_indptr, rows=rows, kv=kv, drafts=drafts), params


def _contenders(v, t, params) -> list[Contender]:
    hq, hkv = HEADS
    q, cache = t["q"], t["cache"]
    paged = (t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["last"])
    mask = dict(packed_custom_mask=t["packed"], mask_indptr=t["mask_indptr"])
    out = []
    if selected("fivar-fa3"):
        out.append(Contender("fivar-fa3", lambda: v.batch_prefill_paged(q, cache, *paged, causal=True, **mask,
                                                                        **params), "one call, backend auto"))
    if selected("fivar-fa3-planned"):
        plan = v.plan_paged(*paged, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, page_size=PAGE,
                            dtype=DTYPE, causal=True, backend="fa3", **mask, **params)
        out.append(Contender("fivar-fa3-planned", lambda: plan.run(q, cache), "tile list planned once"))
    if selected("triton"):
        out.append(Contender("triton", lambda: v.batch_prefill_paged(q, cache, *paged, causal=True, backend="triton",
                                                                     **mask, **params),
                             "the twin's prefill over the page table"))
    mapped = stock_mapping(v, params)
    if mapped is not None and selected("stock"):
        import flashinfer
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                           "NHD")
        w.plan(*paged, hq, hkv, HEAD_DIM, PAGE, packed_custom_mask=t["packed"], causal=True, q_data_type=DTYPE,
               kv_data_type=DTYPE, **mapped[0])
        out.append(Contender("stock", lambda: w.run(q, cache), mapped[1] + ", packed custom mask"))
    if v.sink is None and selected("flex"):
        out.append(Contender("flex", _flex(v, t, params), "torch.compile, the batch gathered dense"))
    return out


def _flex(v, t, params):
    """FlexAttention over [batch, heads, len, dim] (every request the same lengths): its mask the variant's, causal
    and the custom rows."""
    import math

    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ...flex import flex_mods
    hq, hkv = HEADS
    n, kv = t["drafts"], t["kv"]
    sm_scale = 1.0 / math.sqrt(HEAD_DIM)
    score_mod, base = flex_mods(v, params, qo_len=n, kv_len=kv, num_qo_heads=hq, num_kv_heads=hkv,
                                sm_scale=sm_scale, causal=True, device="cuda", batch_size=BATCH)
    rows = t["rows"]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = rows[b, q_idx, kv_idx]
        return keep & base(b, h, q_idx, kv_idx) if base is not None else keep
    block_mask = create_block_mask(mask_mod, BATCH, None, n, kv, device="cuda")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    fa = torch.compile(flex_attention, dynamic=False)
    qb = t["q"].view(BATCH, n, hq, HEAD_DIM).transpose(1, 2)
    kb, vb = (x.view(BATCH, kv, hkv, HEAD_DIM).transpose(1, 2) for x in (t["k"], t["v"]))

    def run():
        o = fa(qb, kb, vb, score_mod=score_mod, block_mask=block_mask, scale=sm_scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(BATCH * n, hq, HEAD_DIM)
    return run


def _check(v, t, params):
    from ...codegen.torch_ref import reference_attention
    n, kv = t["drafts"], t["kv"]

    def check(c: Contender):
        out = c.fn()
        outs, refs = [], []
        for b in range(CHECK_REQUESTS):
            qs, ks = slice(b * n, (b + 1) * n), slice(b * kv, (b + 1) * kv)
            refs.append(reference_attention(v, t["q"][qs], t["k"][ks], t["v"][ks], causal=True, params=params,
                                            batch_idx=b, batch_size=BATCH, custom_mask=t["rows"][b]))
            outs.append(out[qs])
        return compare(v.name, f"{c.name} first {CHECK_REQUESTS} requests", torch.cat(outs), torch.cat(refs), DTYPE)
    return check


def _modules(name: str):
    import fivar
    from ...jit.build import gen_module
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        return []
    v = fivar.load(name)
    own = v.scans_mask  # a mask beyond a band keeps its own tile-list module
    return [gen_module(v, "batch_prefill", "fa3", "bf16", HEAD_DIM, custom_mask=not own)]


def _case(name: str, drafts: int, form: str) -> Case:
    def prepare() -> Prepared:
        v, t, params = _problem(name, drafts, form)
        hq, hkv = HEADS
        rows = t["rows"]
        kept = float(rows.sum()) * hq  # pairs the custom mask keeps (the variant's own mask not counted)
        flops = 4.0 * kept * HEAD_DIM
        nbytes = float(DTYPE.itemsize * HEAD_DIM * (2 * t["q"].shape[0] * hq + 2 * BATCH * t["kv"] * hkv))
        return Prepared(_contenders(v, t, params), _check(v, t, params), flops=flops, nbytes=nbytes,
                        memory_bound=drafts < 64, detail={"drafts": drafts, "mask": form})
    shape = {"seqlen": CONTEXT, "batch": BATCH, "drafts": drafts, "mask": form, "heads": f"{HEADS[0]}/{HEADS[1]}",
             "head_dim": HEAD_DIM, "dtype": "bf16", "causal": True, "page_size": PAGE}
    return Case("serving", f"{name} verify {form} {drafts} x{BATCH} ctx{CONTEXT}", "verify", shape, prepare,
                baseline=("stock", "triton"), modules=lambda: _modules(name))


def cases(quick: bool = False) -> list:
    drafts = (16,) if quick else DRAFTS
    return [_case(name, n, form) for name in VARIANTS for n in drafts for form in ("chain", "tree")]
