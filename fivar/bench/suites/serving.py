"""Speculative verify: 8, 16 or 64 draft tokens per request over a paged context with a custom mask (a chain or a
random draft tree, fivar.integrations.serving), batch 32 x 8192 keys of context, page 16, bf16, head dim 128, GQA
32/8, causal; soft-cap, sliding window (512) and gpt-oss (a sink per head in a 128-key window).

Contenders: `fivar` (the one-shot `batch_prefill_paged(..., packed_custom_mask=)`, backend auto: FA2's tile list for
up to 32 drafts, else FA3's; a chain's mask, adding nothing to causal, runs as causal with no bits), `fivar-fa3`
(the same call on FA3's tile-list form), `fivar-fa3-planned` (`plan_paged` once on FA3, then `run`), `fivar-fa2`
(the one-shot call on FA2's tile-list form), `fivar-causal` (chains: the one-shot call with causal and no custom
mask, the same function, as stock's sink wrapper and vLLM's chain drafts pass it), `triton` (the twin's prefill
reading the pages through the page table and the mask's bits), `stock`
(FlashInfer's BatchPrefillWithPagedKVCacheWrapper with the same mask and `logits_soft_cap` / `window_left`, where
those compute the variant; for gpt-oss its BatchAttentionWithAttentionSinkWrapper, whose kernel reads no custom
mask: chain drafts only, as causal, on FA2 up to 32 drafts, else auto) and `flex` (FlexAttention over the batch
gathered dense, its block mask from the variant's mask and the custom mask; a sink joined after from Flex's
log-sum-exp). Ratios against stock, else the Triton twin.

Verify replayed from CUDA graphs ("verify graph" cases, the same steps): `fivar-graph` (`plan_paged(...,
cuda_graph=True, uniform_qo_len=True)` with the case's batch, drafts and pages as its capacity, `run` captured; a
chain's plan made without a custom mask, causal, as an engine plans chains)
against `stock-graph` (stock's wrapper above with use_cuda_graph, fixed buffers and `uniform_q_len` = the drafts,
`run` captured), each timed as its graph's replay; ratios against stock-graph.

Mixed steps (op "mixed"): two or four prefill chunks of 512-2048 tokens (some after a cached prefix) beside
decodes over 8192 keys to 32 requests, and four 2048-token chunks beside 64 decodes, in one paged batch
(fivar.integrations.serving.mixed_step), causal; soft-cap, sliding window, gpt-oss and documents. Contenders
`fivar-fa3`, `fivar-fa3-planned` and `triton` run the step in one call; `stock` runs it as an engine without
mixed batches does, FlashInfer's decode wrapper over the decodes and its paged prefill wrapper over the chunks
(soft-cap and the window; for gpt-oss a sink wrapper over each, the decodes' on FA2); `flex`, where stock cannot
compute the variant (documents), runs the step packed into one sequence (a sink joined after, as in verify).
Ratios against stock, else Flex, else the Triton twin.
"""
from __future__ import annotations

import random

import torch

from ..contenders import Contender, _replayed, selected, stock_mapping, stock_sink, stock_workspace
from ..runner import Case, Prepared
from ...flashinfer_compat.wrappers import uniform_plan_kwargs
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


def _problem(name, drafts: int, form: str, overrides: dict | None = None, *, batch: int = BATCH,
             context: int = CONTEXT, heads=HEADS, head_dim: int = HEAD_DIM, dtype=DTYPE, device="cuda"):
    """A verify batch (`name`: a variant's name, or the variant): `batch` requests of `drafts` queries each at the
    end of `context + drafts` keys, their drafts a chain or a random tree."""
    import fivar
    from ...integrations.serving import tree_mask, tree_rows
    from ...testing import _to_paged, example_params
    v = fivar.load(name) if isinstance(name, str) else name
    hq, hkv = heads
    kv = context + drafts
    rnd = lambda *s: torch.randn(*s, dtype=dtype, device=device)  # noqa: E731
    q, k, vv = rnd(batch * drafts, hq, head_dim), rnd(batch * kv, hkv, head_dim), rnd(batch * kv, hkv, head_dim)
    cache, kv_indptr, kv_indices, last = _to_paged(k, vv, [kv] * batch, PAGE)
    rng = random.Random(drafts)
    parents = [_parents(form, drafts, rng) for _ in range(batch)]
    packed, mask_indptr = tree_mask([context] * batch, parents, device=device)
    rows = torch.stack([torch.cat([torch.ones(drafts, context, dtype=torch.bool), tree_rows(p)], 1)
                        for p in parents]).to(device)  # [batch, drafts, kv]
    params = {**example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=batch, max_len=kv, device=device),
              **VARIANTS.get(v.name, {}), **(overrides or {})}
    qo_indptr = torch.arange(0, batch * drafts + 1, drafts, dtype=torch.int32, device=device)
    return v, dict(q=q, k=k, v=vv, cache=cache, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                   last=last, packed=packed, mask_indptr=mask_indptr, rows=rows, kv=kv, drafts=drafts,
                   form=form), params


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
    if t["form"] == "chain" and selected("fivar-causal"):  # a chain's mask is causal: what vLLM passes, no mask
        out.append(Contender("fivar-causal", lambda: v.batch_prefill_paged(q, cache, *paged, causal=True, **params),
                             "one call, the chain as causal with no custom mask (as stock's sink wrapper gets it)"))
    if selected("triton"):
        out.append(Contender("triton", lambda: v.batch_prefill_paged(q, cache, *paged, causal=True, backend="triton",
                                                                     **mask, **params),
                             "the twin's prefill over the page table"))
    stock = _stock_verify(v, t, params) if selected("stock") else None
    if stock is not None:
        out.append(_built("stock", *stock))
    if v.softmax and selected("flex"):
        out.append(Contender("flex", _flex(v, t, params), "torch.compile, the batch gathered dense"
                             + (", the sink joined from its LSE" if v.sink is not None else "")))
    return out


def _built(name: str, label: str, build) -> Contender:
    """Contender `name` running what `build()` returns; where building raises (a plan, a capture, a JIT build),
    one that raises the same when run: an error row of its own, not the case's."""
    try:
        return Contender(name, build(), label)
    except Exception as e:  # noqa: BLE001 - reported in the contender's row
        def failed(error=e):
            raise error
        return Contender(name, failed, label)


def _stock_verify(v, t, params, cuda_graph: bool = False):
    """(label, build) of stock FlashInfer's paged prefill computing the verify step, or None where no stock kernel
    computes it; build() plans the wrapper once and returns its run. cuda_graph: a use_cuda_graph wrapper over
    buffers of the batch's size, its run captured (the callable replays it)."""
    hq, hkv = HEADS
    q, cache = t["q"], t["cache"]
    paged = (t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["last"])
    mapped, sunk = stock_mapping(v, params), stock_sink(v, params)
    if mapped is None and (sunk is None or t["form"] != "chain"):  # the sink wrapper reads no custom mask
        return None
    i32 = dict(dtype=torch.int32, device="cuda")
    bufs = dict(use_cuda_graph=True, qo_indptr_buf=torch.empty(BATCH + 1, **i32),
                paged_kv_indptr_buf=torch.empty(BATCH + 1, **i32),
                paged_kv_indices_buf=torch.empty(t["kv_indices"].numel(), **i32),
                paged_kv_last_page_len_buf=torch.empty(BATCH, **i32)) if cuda_graph else {}
    # a graph's: every request the case's drafts, the promise FlashInfer's FA2 graph scheduler sizes its tiles by
    kw = dict(causal=True, q_data_type=DTYPE, kv_data_type=DTYPE,
              **(uniform_plan_kwargs(t["drafts"]) if cuda_graph else {}))
    if sunk is not None:
        backend = _sink_backend(t["drafts"])
        label = f"{sunk.label} ({backend}), causal: the chain's mask"

        def build():
            w = sunk.wrapper(HEAD_DIM, DTYPE, backend, **bufs)
            w.plan(*paged, hq, hkv, HEAD_DIM, PAGE, **kw, **sunk.plan_kwargs)
            return lambda: sunk.run(w, q, cache)
    else:
        label = mapped[1] + ", custom mask"
        if cuda_graph:  # the mask packed into these by plan, each request from a byte of its own
            bufs.update(custom_mask_buf=torch.empty(t["packed"].numel(), dtype=torch.uint8, device="cuda"),
                        mask_indptr_buf=torch.empty(BATCH + 1, **i32))

        def build():
            import flashinfer
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                stock_workspace(), "NHD", **bufs)
            # The bool mask, which the wrapper packs itself: given only packed_custom_mask, FlashInfer 0.7 offsets
            # each request by its mask's bit count where its kernel reads bytes (an illegal access past a few).
            w.plan(*paged, hq, hkv, HEAD_DIM, PAGE, custom_mask=t["rows"].reshape(-1), **kw, **mapped[0])
            return lambda: w.run(q, cache)
    if cuda_graph:
        promise = ", uniform_q_len" if "uniform_q_len" in kw else ""
        return label + f", use_cuda_graph{promise}, replayed", lambda: _replayed(build())
    return label, build


def _flex(v, t, params, compiled: bool = True):
    """FlexAttention over [batch, heads, len, dim] (every request the same lengths): its mask the variant's, causal
    and the custom rows; a sink joined after from Flex's log-sum-exp (fivar.flex.join_sink). compiled False: eager
    Flex (a CPU test's)."""
    import math

    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ...flex import flex_mods, flex_sink, join_sink, without_sink
    rows, q = t["rows"], t["q"]
    (batch, n, kv), (_, hq, d), hkv, dev = rows.shape, q.shape, t["k"].shape[1], q.device
    sm_scale = 1.0 / math.sqrt(d)
    score_mod, base = flex_mods(without_sink(v), params, qo_len=n, kv_len=kv, num_qo_heads=hq, num_kv_heads=hkv,
                                sm_scale=sm_scale, causal=True, device=dev, batch_size=batch)
    sink = flex_sink(v, params, num_qo_heads=hq, num_kv_heads=hkv, device=dev, batch_size=batch)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = rows[b, q_idx, kv_idx]
        return keep & base(b, h, q_idx, kv_idx) if base is not None else keep
    block_mask = create_block_mask(mask_mod, batch, None, n, kv, device=dev)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    fa = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    qb = q.view(batch, n, hq, d).transpose(1, 2)
    kb, vb = (x.view(batch, kv, hkv, d).transpose(1, 2) for x in (t["k"], t["v"]))

    def run():
        if sink is None:
            o = fa(qb, kb, vb, score_mod=score_mod, block_mask=block_mask, scale=sm_scale, enable_gqa=True)
        else:  # lse [batch, heads, n]; each row's sink that of its request and head
            o, lse = fa(qb, kb, vb, score_mod=score_mod, block_mask=block_mask, scale=sm_scale, enable_gqa=True,
                        return_lse=True)
            o = join_sink(o, lse, sink[:, :, None])
        return o.transpose(1, 2).reshape(batch * n, hq, d)
    return run


def _graph_contenders(v, t, params) -> list[Contender]:
    """The verify step replayed from CUDA graphs, each captured once after warm-up launches
    (fivar.bench.contenders._replayed) and timed as its replay alone, returning the graph's output: fivar's
    `plan_paged(cuda_graph=True)`, its capacity the case's batch, drafts and pages, and stock's use_cuda_graph
    wrapper where stock computes the variant (_stock_verify)."""
    hq, hkv = HEADS
    q, cache = t["q"], t["cache"]  # q: max_batch * max_qo_len rows, the static input the plan wants
    paged = (t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["last"])
    out = []
    if selected("fivar-graph"):
        # a chain's mask is causal: an engine plans its graph without one (its steps then take none)
        chain = t["form"] == "chain"
        mask = {} if chain else dict(packed_custom_mask=t["packed"], mask_indptr=t["mask_indptr"])

        def build():
            plan = v.plan_paged(*paged, cuda_graph=True, max_batch=BATCH, max_qo_len=t["drafts"],
                                max_pages=t["kv_indices"].numel(), uniform_qo_len=True, num_qo_heads=hq,
                                num_kv_heads=hkv, head_dim=HEAD_DIM, page_size=PAGE, dtype=DTYPE, causal=True,
                                **mask, **params)
            return _replayed(lambda: plan.run(q, cache))
        out.append(_built("fivar-graph", "plan_paged(cuda_graph=True, uniform_qo_len=True), backend auto"
                          + (", the chain as causal with no custom mask" if chain else "") + ", replayed", build))
    stock = _stock_verify(v, t, params, cuda_graph=True) if selected("stock-graph") else None
    if stock is not None:
        out.append(_built("stock-graph", *stock))
    return out


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


def _case(name: str, drafts: int, form: str, overrides: dict | None = None, graph: bool = False) -> Case:
    """A verify case; `graph`: its steps replayed from CUDA graphs (fivar-graph against stock-graph)."""
    def prepare() -> Prepared:
        v, t, params = _problem(name, drafts, form, overrides)
        hq, hkv = HEADS
        rows = t["rows"]
        flops = 4.0 * kept_pairs(v, params, rows) * HEAD_DIM
        nbytes = float(DTYPE.itemsize * HEAD_DIM * (2 * t["q"].shape[0] * hq + 2 * BATCH * t["kv"] * hkv))
        made = _graph_contenders(v, t, params) if graph else _contenders(v, t, params)
        return Prepared(made, _check(v, t, params), flops=flops, nbytes=nbytes,
                        memory_bound=drafts < 64, detail={"drafts": drafts, "mask": form})
    shape = {"seqlen": CONTEXT, "batch": BATCH, "drafts": drafts, "mask": form, "heads": f"{HEADS[0]}/{HEADS[1]}",
             "head_dim": HEAD_DIM, "dtype": "bf16", "causal": True, "page_size": PAGE,
             **({"cuda_graph": True} if graph else {})}
    return Case("serving", f"{name} verify {'graph ' if graph else ''}{form} {drafts} x{BATCH} ctx{CONTEXT}",
                "verify", shape, prepare, baseline="stock-graph" if graph else ("stock", "triton"),
                modules=lambda: _modules(name),
                warm_stock=_warm_sinks(name, (_sink_backend(drafts),)) if form == "chain" else None)


def _sink_backend(qo_len: int) -> str:
    """The sink wrapper's backend for requests of `qo_len` queries: FA2 where they fill at most a quarter of FA3's
    query tile, as fivar's auto picks for them (FA3 would give each head's few rows a 128-row tile), else auto."""
    from ...runtime.mixed import short_requests
    return "fa2" if bool(short_requests(torch.tensor([qo_len]), HEAD_DIM).all()) else "auto"


def _warm_sinks(name: str, backends):
    """A case's warm_stock where stock runs FlashInfer's sink wrapper (stock_sink: gpt-oss's): its modules built
    (the wrapper compiles them when made) in the runner's prebuild, beside the others, not inside the case."""
    if name != "gpt_oss":
        return None

    def warm():
        from ..contenders import sink_wrapper
        if selected("stock") or selected("stock-graph"):
            for backend in backends:  # the module is the same for every window (only window_left >= 0 is built in)
                sink_wrapper(HEAD_DIM, DTYPE, backend, window_left=VARIANTS[name]["window"] - 1)
    return warm


# ------------------------------------------------------------------------------------------------ mixed steps

#: a mixed step: its prefill chunks, (cached prefix, new tokens) each, and how many decodes over CONTEXT keys beside
#: them (the last: four 2048-token chunks of 8192-token prompts beside 64 decodes)
MIXED = {"2 chunks": (((0, 2048), (6144, 2048)), BATCH - 2),
         "4 chunks": (((0, 512), (2048, 1024), (4096, 1536), (6144, 2048)), BATCH - 4),
         "4 x 2048": (((0, 2048), (2048, 2048), (4096, 2048), (6144, 2048)), 64)}
MIXED_VARIANTS = {"softcap": {}, "sliding_window": {"window": 512}, "gpt_oss": {"window": 128}, "document_mask": {}}


def _mixed_problem(name, chunks, decodes: int, overrides: dict | None = None, device="cuda", *,
                   context: int = CONTEXT, heads=HEADS, head_dim: int = HEAD_DIM, dtype=DTYPE):
    """The step in an engine's order (decodes first, over `context` keys, then the chunks), over a shuffled page
    pool (`name`: a variant's name, or the variant)."""
    import fivar
    from ...integrations.serving import mixed_step
    from ...testing import example_params
    v = fivar.load(name) if isinstance(name, str) else name
    hq, hkv = heads
    batch = decodes + len(chunks)
    cached = [context - 1] * decodes + [c for c, _ in chunks]
    new = [1] * decodes + [n for _, n in chunks]
    kv = [c + n for c, n in zip(cached, new)]
    n_pages = [-(-n // PAGE) for n in kv]
    perm = torch.randperm(sum(n_pages), device=device).to(torch.int32)
    table = torch.zeros(batch, max(n_pages), dtype=torch.int32, device=device)
    at = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[at:at + n]
        at += n
    cache = tuple(torch.randn(sum(n_pages), PAGE, hkv, head_dim, dtype=dtype, device=device) for _ in range(2))
    q = torch.randn(sum(new), hq, head_dim, dtype=dtype, device=device)
    params = {**example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=batch, max_len=max(kv),
                               device=device), **MIXED_VARIANTS.get(v.name, {}), **(overrides or {})}
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
    mapped, sunk = stock_mapping(v, params), stock_sink(v, params)
    if mapped is not None and selected("stock"):
        out.append(Contender("stock", _stock_two_calls(t, mapped[0]), mapped[1] + ": decode wrapper + prefill wrapper"))
    if sunk is not None and selected("stock"):
        out.append(_built("stock", f"{sunk.label}: a wrapper over the decodes ({_sink_backend(1)}), one over the "
                                   "chunks (auto)", lambda: _stock_two_calls(t, sunk.plan_kwargs, sunk)))
    if mapped is None and sunk is None and v.softmax and selected("flex"):  # the baseline where stock cannot
        out.append(Contender("flex", _mixed_flex(v, t, params), "torch.compile, the step packed into one sequence"
                             + (", the sink joined from its LSE" if v.sink is not None else "")))
    return out


def _stock_two_calls(t, kwargs: dict, sink=None):
    """What an engine without mixed batches runs: FlashInfer's decode wrapper over the decodes and its paged
    prefill wrapper over the chunks, each writing its rows of one output. `sink` (a SinkStock): FlashInfer's decode
    wrapper has none, so both parts run its sink wrapper, the decodes on FA2 (GQA-packed rows, as fivar's)."""
    import flashinfer
    hq, hkv = HEADS
    d = t["decodes"]
    qo, kv_ind, idx, last = t["step"]
    kw = dict(q_data_type=DTYPE, kv_data_type=DTYPE, **kwargs)
    decodes = (kv_ind[:d + 1], idx[:int(kv_ind[d])], last[:d], hq, hkv, HEAD_DIM, PAGE)
    chunks = (qo[d:] - qo[d], kv_ind[d:] - kv_ind[d], idx[int(kv_ind[d]):], last[d:], hq, hkv, HEAD_DIM, PAGE)
    if sink is None:
        dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(stock_workspace(), "NHD", use_tensor_cores=hq // hkv >= 4)
        dec.plan(*decodes, **kw)
        pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(stock_workspace(), "NHD")
        call = lambda w, q, cache, out: w.run(q, cache, out=out)  # noqa: E731
    else:
        dec = sink.wrapper(HEAD_DIM, DTYPE, _sink_backend(1))
        dec.plan(qo[:d + 1], *decodes, causal=True, **kw)  # a prefill wrapper: one query a request
        pre = sink.wrapper(HEAD_DIM, DTYPE)
        call = lambda w, q, cache, out: sink.run(w, q, cache, out=out)  # noqa: E731
    pre.plan(*chunks, causal=True, **kw)
    q, cache = t["q"], t["cache"]
    out = torch.empty_like(q)

    def run():
        call(dec, q[:d], cache, out[:d])
        call(pre, q[d:], cache, out[d:])
        return out
    return run


def _mixed_flex(v, t, params, compiled: bool = True):
    """FlexAttention over the step packed into one sequence (its keys gathered dense from the pages): the block
    mask keeps each request's own keys, at their positions, ANDed with the variant's mask and causal; a sink joined
    after from Flex's log-sum-exp, each row's that of its request (fivar.flex.join_sink). compiled False: eager
    Flex (a CPU test's)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ...flex import flex_mods, flex_sink, join_sink, without_sink
    q, (k_cache, v_cache) = t["q"], t["cache"]
    (_, hq, d), (_, page, hkv, _) = q.shape, k_cache.shape
    sm_scale = d ** -0.5
    dev = q.device
    batch = t["batch"]
    score_inner, mask_inner = flex_mods(without_sink(v), params, qo_len=1, kv_len=1, num_qo_heads=hq,
                                        num_kv_heads=hkv, sm_scale=sm_scale, causal=True, device=dev,
                                        batch_size=batch)
    new, kv, cached = t["new"], t["kv"], t["cached"]
    q_req = torch.repeat_interleave(torch.arange(batch, device=dev), torch.tensor(new, device=dev))
    kv_req = torch.repeat_interleave(torch.arange(batch, device=dev), torch.tensor(kv, device=dev))
    q_pos = torch.cat([torch.arange(c, c + n, device=dev) for c, n in zip(cached, new)])
    kv_pos = torch.cat([torch.arange(n, device=dev) for n in kv])
    pages = torch.cat([t["table"][b, :-(-n // page)] for b, n in enumerate(kv)]).long()
    k, vv = (c[pages].reshape(-1, page, hkv, d) for c in (k_cache, v_cache))
    starts = torch.tensor([0] + [-(-n // page) * page for n in kv[:-1]], device=dev).cumsum(0)
    flat = (starts[kv_req] + kv_pos)  # each key's row in the gathered pages
    k, vv = (x.reshape(-1, hkv, d)[flat] for x in (k, vv))
    sink = flex_sink(v, params, num_qo_heads=hq, num_kv_heads=hkv, device=dev, batch_size=batch)
    row_sink = sink[q_req].transpose(0, 1).unsqueeze(0) if sink is not None else None  # [1, heads, rows]

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
    qb = q.transpose(0, 1).unsqueeze(0)
    kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (k, vv))

    def run():
        if row_sink is None:
            o = fa(qb, kb, vb, score_mod=score_mod, block_mask=block_mask, scale=sm_scale, enable_gqa=True)
        else:
            o, lse = fa(qb, kb, vb, score_mod=score_mod, block_mask=block_mask, scale=sm_scale, enable_gqa=True,
                        return_lse=True)
            o = join_sink(o, lse, row_sink)
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
                shape, prepare, baseline=("stock", "flex", "triton"), modules=lambda: _mixed_modules(name),
                warm_stock=_warm_sinks(name, (_sink_backend(1), "auto")))


def verify_cases(quick: bool = False) -> list:
    """The verify cases, then the same steps replayed from CUDA graphs."""
    drafts = (16,) if quick else DRAFTS
    return [_case(name, n, form, graph=graph) for graph in (False, True) for name in VARIANTS for n in drafts
            for form in ("chain", "tree")]


def mixed_cases(quick: bool = False) -> list:
    labels = ("4 chunks",) if quick else tuple(MIXED)
    return [_mixed_case(name, label) for name in MIXED_VARIANTS for label in labels]


def cases(quick: bool = False) -> list:
    return verify_cases(quick) + mixed_cases(quick)


def variant_cases(name: str, op: str, params: dict | None = None, graph: bool = False) -> list:
    """`fivar bench NAME --op verify|mixed`: this suite's cases of that op for any variant (its example params, the
    suite's for the bundled ones, then `params`); graph (verify): the steps replayed from CUDA graphs too."""
    if op == "verify":
        cases = [_case(name, n, form, params, graph=g) for g in ((False, True) if graph else (False,))
                 for n in DRAFTS for form in ("chain", "tree")]
    elif op == "mixed":
        cases = [_mixed_case(name, label, params) for label in MIXED]
    else:
        raise ValueError(f"the serving suite has no {op!r} cases (verify, mixed)")
    for c in cases:  # the rows say which params were set
        if params:
            c.shape["params"] = dict(params)
    return cases
