"""Speculative verify: 8, 16 or 64 draft tokens per request over a paged context with a custom mask (a chain or a
random draft tree, fivar.integrations.serving), batch 32 x 8192 keys of context, page 16, bf16, head dim 128, GQA
32/8, causal; soft-cap, sliding window (512) and gpt-oss (a sink per head in a 128-key window).

Contenders: `fivar` (the one-shot `batch_prefill_paged(..., packed_custom_mask=)`, backend auto: FA2's tile list
for up to 32 drafts, else FA3's), `fivar-fa3` (the same call on FA3's tile-list form), `fivar-fa3-planned`
(`plan_paged` once on FA3, then `run`), `fivar-fa2` (the one-shot call on FA2's tile-list form), `triton` (the
twin's prefill reading the pages through the page table and the mask's bits), `stock` (FlashInfer's
BatchPrefillWithPagedKVCacheWrapper with the same mask and `logits_soft_cap` / `window_left`, where those compute
the variant: not for the sink) and `flex` (FlexAttention over the batch gathered dense, its block mask from the
variant's mask and the custom mask; no sink either). Ratios against stock, else the Triton twin.

Mixed steps (op "mixed"): two or four prefill chunks of 512-2048 tokens (some after a cached prefix) beside
decodes over 8192 keys to 32 requests, and four 2048-token chunks beside 64 decodes, in one paged batch
(fivar.integrations.serving.mixed_step), causal; soft-cap, sliding window, gpt-oss and documents. Contenders
`fivar-fa3`, `fivar-fa3-planned` and `triton` run the step in one call; `stock` runs it as an engine without
mixed batches does, FlashInfer's decode wrapper over the decodes and its paged prefill wrapper over the chunks
(soft-cap and the window); `flex`, where stock cannot compute the variant (documents; no
sink), runs the step packed into one sequence.
Ratios against stock, else Flex, else the Triton twin.
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


def _problem(name: str, drafts: int, form: str, overrides: dict | None = None):
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
              **VARIANTS.get(name, {}), **(overrides or {})}
    qo_indptr = torch.arange(0, BATCH * drafts + 1, drafts, dtype=torch.int32, device="cuda")
    return v, dict(q=q, k=k, v=vv, cache=cache, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                   last=last, packed=packed, mask_indptr=mask_indptr, rows=rows, kv=kv, drafts=drafts), params


def _contenders(v, t, params) -> list[Contender]:
    hq, hkv = HEADS
    q, cache = t["q"], t["cache"]
    paged = (t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["last"])
    mask = dict(packed_custom_mask=t["packed"], mask_indptr=t["mask_indptr"])
    out = []
    if selected("fivar"):
        out.append(Contender("fivar", lambda: v.batch_prefill_paged(q, cache, *paged, causal=True, **mask, **params),
                             "one call, backend auto (FA2 for short requests, else FA3)"))
    if selected("fivar-fa3"):
        out.append(Contender("fivar-fa3", lambda: v.batch_prefill_paged(q, cache, *paged, causal=True, backend="fa3",
                                                                        **mask, **params), "one call, FA3's tile list"))
    if selected("fivar-fa3-planned"):
        plan = v.plan_paged(*paged, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, page_size=PAGE,
                            dtype=DTYPE, causal=True, backend="fa3", **mask, **params)
        out.append(Contender("fivar-fa3-planned", lambda: plan.run(q, cache), "tile list planned once"))
    if selected("fivar-fa2"):
        out.append(Contender("fivar-fa2", lambda: v.batch_prefill_paged(q, cache, *paged, causal=True, backend="fa2",
                                                                        **mask, **params),
                             "one call, FA2's tile list (a GQA group's rows in one query tile)"))
    if selected("triton"):
        out.append(Contender("triton", lambda: v.batch_prefill_paged(q, cache, *paged, causal=True, backend="triton",
                                                                     **mask, **params),
                             "the twin's prefill over the page table"))
    mapped = stock_mapping(v, params)
    if mapped is not None and selected("stock"):
        import flashinfer
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                           "NHD")
        # The bool mask, which the wrapper packs itself: given only packed_custom_mask, FlashInfer 0.7 offsets each
        # request by its mask's bit count where its kernel reads bytes (an illegal access past a few requests).
        w.plan(*paged, hq, hkv, HEAD_DIM, PAGE, custom_mask=t["rows"].reshape(-1), causal=True, q_data_type=DTYPE,
               kv_data_type=DTYPE, **mapped[0])
        out.append(Contender("stock", lambda: w.run(q, cache), mapped[1] + ", custom mask"))
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
    return [gen_module(v, "batch_prefill", "fa3", "bf16", HEAD_DIM, custom_mask=not own),
            gen_module(v, "batch_prefill", "fa2", "bf16", HEAD_DIM, custom_mask=True)]


def kept_pairs(v, params: dict, rows: torch.Tensor) -> float:
    """(query, key) pairs a verify batch keeps, summed over query heads: its custom mask `rows` [batch, drafts, kv]
    (queries at the last `drafts` positions), causal and the variant's own mask, every pair evaluated on the host by
    fivar.spec.sparsity.keep_matrix (a window keeps a fraction of the custom mask's pairs: its useful work is that)."""
    from ...runtime.params import bind_params
    from ...spec.sparsity import keep_matrix
    batch, n, kv = rows.shape
    hq, hkv = HEADS
    host = {k: x.cpu() if isinstance(x, torch.Tensor) else x for k, x in params.items()}
    bound = bind_params(v, host, num_qo_heads=hq, num_kv_heads=hkv, batch_size=batch, device="cpu")
    rows = rows.cpu()
    return float(sum(int((keep_matrix(v.ir.mask, qo_len=n, kv_len=kv, scalars=bound.scalars, tensors=bound.tensors,
                                      num_qo_heads=hq, num_kv_heads=hkv, batch_idx=b, causal=True) & rows[b]).sum())
                     for b in range(batch)))


def _case(name: str, drafts: int, form: str, overrides: dict | None = None) -> Case:
    def prepare() -> Prepared:
        v, t, params = _problem(name, drafts, form, overrides)
        hq, hkv = HEADS
        rows = t["rows"]
        flops = 4.0 * kept_pairs(v, params, rows) * HEAD_DIM
        nbytes = float(DTYPE.itemsize * HEAD_DIM * (2 * t["q"].shape[0] * hq + 2 * BATCH * t["kv"] * hkv))
        return Prepared(_contenders(v, t, params), _check(v, t, params), flops=flops, nbytes=nbytes,
                        memory_bound=drafts < 64, detail={"drafts": drafts, "mask": form})
    shape = {"seqlen": CONTEXT, "batch": BATCH, "drafts": drafts, "mask": form, "heads": f"{HEADS[0]}/{HEADS[1]}",
             "head_dim": HEAD_DIM, "dtype": "bf16", "causal": True, "page_size": PAGE}
    return Case("serving", f"{name} verify {form} {drafts} x{BATCH} ctx{CONTEXT}", "verify", shape, prepare,
                baseline=("stock", "triton"), modules=lambda: _modules(name))




# ------------------------------------------------------------------------------------------------ mixed steps

#: a mixed step: its prefill chunks, (cached prefix, new tokens) each, and how many decodes over CONTEXT keys beside
#: them (the last: four 2048-token chunks of 8192-token prompts beside 64 decodes)
MIXED = {"2 chunks": (((0, 2048), (6144, 2048)), BATCH - 2),
         "4 chunks": (((0, 512), (2048, 1024), (4096, 1536), (6144, 2048)), BATCH - 4),
         "4 x 2048": (((0, 2048), (2048, 2048), (4096, 2048), (6144, 2048)), 64)}
MIXED_VARIANTS = {"softcap": {}, "sliding_window": {"window": 512}, "gpt_oss": {"window": 128}, "document_mask": {}}


def _mixed_problem(name: str, chunks, decodes: int, overrides: dict | None = None, device="cuda"):
    """The step in an engine's order (decodes first, then the chunks), over a shuffled page pool."""
    import fivar
    from ...integrations.serving import mixed_step
    from ...testing import example_params
    v = fivar.load(name)
    hq, hkv = HEADS
    batch = decodes + len(chunks)
    cached = [CONTEXT - 1] * decodes + [c for c, _ in chunks]
    new = [1] * decodes + [n for _, n in chunks]
    kv = [c + n for c, n in zip(cached, new)]
    n_pages = [-(-n // PAGE) for n in kv]
    perm = torch.randperm(sum(n_pages), device=device).to(torch.int32)
    table = torch.zeros(batch, max(n_pages), dtype=torch.int32, device=device)
    at = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[at:at + n]
        at += n
    cache = tuple(torch.randn(sum(n_pages), PAGE, hkv, HEAD_DIM, dtype=DTYPE, device=device) for _ in range(2))
    q = torch.randn(sum(new), hq, HEAD_DIM, dtype=DTYPE, device=device)
    params = {**example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=batch, max_len=max(kv),
                               device=device), **MIXED_VARIANTS.get(name, {}), **(overrides or {})}
    step = mixed_step(cached, new, table, PAGE, device=device)
    return v, dict(q=q, cache=cache, table=table, step=step, cached=cached, new=new, kv=kv, decodes=decodes,
                   batch=batch), params


def _mixed_contenders(v, t, params) -> list[Contender]:
    hq, hkv = HEADS
    q, cache, step = t["q"], t["cache"], t["step"]
    out = []
    if selected("fivar-fa3"):
        out.append(Contender("fivar-fa3", lambda: v.batch_prefill_paged(q, cache, *step, causal=True, **params),
                             "one call, backend auto"))
    if selected("fivar-fa3-planned"):
        plan = v.plan_paged(*step, num_qo_heads=hq, num_kv_heads=hkv, head_dim=HEAD_DIM, page_size=PAGE,
                            dtype=DTYPE, causal=True, **params)
        out.append(Contender("fivar-fa3-planned", lambda: plan.run(q, cache), "planned once a step, backend auto"))
    if selected("triton"):
        out.append(Contender("triton", lambda: v.batch_prefill_paged(q, cache, *step, causal=True, backend="triton",
                                                                     **params), "the twin's prefill over the pages"))
    mapped = stock_mapping(v, params)
    if mapped is not None and selected("stock"):
        out.append(Contender("stock", _stock_two_calls(t, mapped[0]), mapped[1] + ": decode wrapper + prefill wrapper"))
    if mapped is None and v.sink is None and selected("flex"):  # the baseline where stock cannot compute it
        out.append(Contender("flex", _mixed_flex(v, t, params), "torch.compile, the step packed into one sequence"))
    return out


def _stock_two_calls(t, kwargs: dict):
    """What an engine without mixed batches runs: FlashInfer's decode wrapper over the decodes and its paged
    prefill wrapper over the chunks, each writing its rows of one output."""
    import flashinfer
    hq, hkv = HEADS
    d = t["decodes"]
    qo, kv_ind, idx, last = t["step"]
    ws = lambda: torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # noqa: E731
    dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=hq // hkv >= 4)
    dec.plan(kv_ind[:d + 1], idx[:int(kv_ind[d])], last[:d], hq, hkv, HEAD_DIM, PAGE, q_data_type=DTYPE,
             kv_data_type=DTYPE, **kwargs)
    pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD")
    pre.plan(qo[d:] - qo[d], kv_ind[d:] - kv_ind[d], idx[int(kv_ind[d]):], last[d:], hq, hkv, HEAD_DIM, PAGE,
             causal=True, q_data_type=DTYPE, kv_data_type=DTYPE, **kwargs)
    q, cache = t["q"], t["cache"]
    out = torch.empty_like(q)

    def run():
        dec.run(q[:d], cache, out=out[:d])
        pre.run(q[d:], cache, out=out[d:])
        return out
    return run


def _mixed_flex(v, t, params, compiled: bool = True):
    """FlexAttention over the step packed into one sequence (its keys gathered dense from the pages): the block
    mask keeps each request's own keys, at their positions, ANDed with the variant's mask and causal. compiled
    False: eager Flex (a CPU test's)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ...flex import flex_mods
    hq, hkv = HEADS
    sm_scale = HEAD_DIM ** -0.5
    dev = t["q"].device
    batch = t["batch"]
    score_inner, mask_inner = flex_mods(v, params, qo_len=1, kv_len=1, num_qo_heads=hq, num_kv_heads=hkv,
                                        sm_scale=sm_scale, causal=True, device=dev, batch_size=batch)
    new, kv, cached = t["new"], t["kv"], t["cached"]
    q_req = torch.repeat_interleave(torch.arange(batch, device=dev), torch.tensor(new, device=dev))
    kv_req = torch.repeat_interleave(torch.arange(batch, device=dev), torch.tensor(kv, device=dev))
    q_pos = torch.cat([torch.arange(c, c + n, device=dev) for c, n in zip(cached, new)])
    kv_pos = torch.cat([torch.arange(n, device=dev) for n in kv])
    pages = torch.cat([t["table"][b, :-(-n // PAGE)] for b, n in enumerate(kv)]).long()
    k, vv = (c[pages].reshape(-1, PAGE, hkv, HEAD_DIM) for c in t["cache"])
    starts = torch.tensor([0] + [-(-n // PAGE) * PAGE for n in kv[:-1]], device=dev).cumsum(0)
    flat = (starts[kv_req] + kv_pos)  # each key's row in the gathered pages
    k, vv = (x.reshape(-1, hkv, HEAD_DIM)[flat] for x in (k, vv))

    def mask_mod(b, h, qi, ki):
        keep = q_req[qi] == kv_req[ki]
        return keep & mask_inner(q_req[qi], h, q_pos[qi], kv_pos[ki])

    def remapped_score(score, b, h, qi, ki):
        return score_inner(score, q_req[qi], h, q_pos[qi], kv_pos[ki])
    score_mod = remapped_score if score_inner is not None else None
    n_q, n_kv = q_req.numel(), kv_req.numel()
    block_mask = create_block_mask(mask_mod, None, None, n_q, n_kv, device=dev)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    fa = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    qb = t["q"].transpose(0, 1).unsqueeze(0)
    kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (k, vv))

    def run():
        o = fa(qb, kb, vb, score_mod=score_mod, block_mask=block_mask, scale=sm_scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
    return run


def _mixed_check(v, t, params):
    """The first decode and every chunk against the reference."""
    from ...codegen.torch_ref import reference_attention
    qo, table = t["step"].qo_indptr.tolist(), t["table"]
    check_rows = [0] + list(range(t["decodes"], t["batch"]))

    def check(c: Contender):
        out = c.fn()
        outs, refs = [], []
        for b in check_rows:
            n = t["kv"][b]
            pages = table[b, :-(-n // PAGE)].long()
            k, vv = (x[pages].reshape(-1, HEADS[1], HEAD_DIM)[:n] for x in t["cache"])
            refs.append(reference_attention(v, t["q"][qo[b]:qo[b + 1]], k, vv, causal=True, params=params,
                                            batch_idx=b, batch_size=t["batch"]))
            outs.append(out[qo[b]:qo[b + 1]])
        return compare(v.name, f"{c.name} a decode and the chunks", torch.cat(outs), torch.cat(refs), DTYPE)
    return check


def _mixed_modules(name: str):
    import fivar
    from ...jit.build import serving_modules
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        return []
    v = fivar.load(name)  # auto: the chunks on FA3, the decodes on FA2 as decode runs them (fivar.runtime.mixed)
    return serving_modules(v, "batch_prefill", "fa3", "bf16", HEAD_DIM) + \
        serving_modules(v, "batch_decode", "fa2", "bf16", HEAD_DIM)


def _mixed_case(name: str, label: str, overrides: dict | None = None) -> Case:
    chunks, decodes = MIXED[label]
    batch = decodes + len(chunks)

    def prepare() -> Prepared:
        v, t, params = _mixed_problem(name, chunks, decodes, overrides)
        hq, hkv = HEADS
        # pairs causal keeps (the variant's own mask not counted): a decode its keys, a chunk's row its prefix
        pairs = sum(c * n + n * (n + 1) // 2 for c, n in zip(t["cached"], t["new"]))
        nbytes = float(DTYPE.itemsize * HEAD_DIM * (2 * t["q"].shape[0] * hq + 2 * sum(t["kv"]) * hkv))
        return Prepared(_mixed_contenders(v, t, params), _mixed_check(v, t, params), flops=4.0 * pairs * hq * HEAD_DIM,
                        nbytes=nbytes, memory_bound=False,
                        detail={"chunks": [n for _, n in chunks], "decodes": t["decodes"]})
    shape = {"seqlen": CONTEXT, "batch": batch, "chunks": [list(c) for c in chunks], "decodes": decodes,
             "heads": f"{HEADS[0]}/{HEADS[1]}", "head_dim": HEAD_DIM, "dtype": "bf16", "causal": True,
             "page_size": PAGE}
    return Case("serving", f"{name} mixed {label} + {decodes} decodes x{batch} ctx{CONTEXT}", "mixed",
                shape, prepare, baseline=("stock", "flex", "triton"), modules=lambda: _mixed_modules(name))


def verify_cases(quick: bool = False) -> list:
    drafts = (16,) if quick else DRAFTS
    return [_case(name, n, form) for name in VARIANTS for n in drafts for form in ("chain", "tree")]


def mixed_cases(quick: bool = False) -> list:
    labels = ("4 chunks",) if quick else tuple(MIXED)
    return [_mixed_case(name, label) for name in MIXED_VARIANTS for label in labels]


def cases(quick: bool = False) -> list:
    return verify_cases(quick) + mixed_cases(quick)


def variant_cases(name: str, op: str, params: dict | None = None) -> list:
    """`fivar bench NAME --op verify|mixed`: this suite's cases of that op for any variant (its example params, the
    suite's for the bundled ones, then `params`)."""
    if op == "verify":
        cases = [_case(name, n, form, params) for n in DRAFTS for form in ("chain", "tree")]
    elif op == "mixed":
        cases = [_mixed_case(name, label, params) for label in MIXED]
    else:
        raise ValueError(f"the serving suite has no {op!r} cases (verify, mixed)")
    for c in cases:  # the rows say which params were set
        if params:
            c.shape["params"] = dict(params)
    return cases
