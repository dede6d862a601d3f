"""Who runs against a variant: fivar's kernels, the closest stock FlashInfer kernel, the Triton twin,
FlexAttention and SDPA. Each contender is a zero-argument callable plus how its output is checked.

"stock" is the closest built-in FlashInfer kernel: soft-capping and sliding windows map onto FlashInfer's
`logits_soft_cap` / `window_left`; gpt-oss's sinks onto FlashInfer's attention-sink wrapper (paged, serving
suite); a document mask onto FlashInfer's ragged batch prefill with one request per document (the same output, no
mask); anything else runs plain attention, labelled as such and checked
against a plain-attention reference (it computes a different function, it is only a speed yardstick).
"""
from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Callable

import torch

from ..spec.positions import has_position_term


@dataclass
class Contender:
    name: str
    fn: Callable[[], torch.Tensor]
    label: str = ""
    #: output rows to check and the variant whose reference they must match (None: plain attention)
    checks_variant: bool = True
    #: (variant, params, causal): checked against that variant's reference instead (a yardstick computing another
    #: function, e.g. plain attention over a mask's non-empty tiles)
    reference: tuple | None = None


@dataclass
class Problem:
    """One benchmark problem: which op, the shapes, and fresh random inputs."""
    op: str  # prefill | batch-prefill | decode
    seqlen: int
    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    device: str = "cuda"
    tensors: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    #: decode's cache dtype when not q's (float8_e4m3fn): the cache holds k / k_scale, v / v_scale, and the
    #: tensors k, v are its dequantized values (what the reference reads)
    kv_dtype: torch.dtype | None = None
    scales: dict = field(default_factory=dict)  # k_scale, v_scale


def stock_mapping(variant, params: dict) -> tuple[dict, str] | None:
    """FlashInfer built-in kwargs computing exactly this variant, or None if there is no such built-in."""
    name = variant.name
    if name == "softcap":
        return {"logits_soft_cap": float(params["softcap"])}, "stock logits_soft_cap"
    if name in ("sliding_window", "softcap_sliding_window") and int(params["window"]) < 1:
        return None  # FlashInfer's window_left = -1 means no window at all
    if name == "sliding_window":  # fivar keeps q - kv < window; FlashInfer keeps q - kv <= window_left
        return {"window_left": int(params["window"]) - 1}, "stock window_left"
    if name == "softcap_sliding_window":
        return ({"logits_soft_cap": float(params["softcap"]), "window_left": int(params["window"]) - 1},
                "stock logits_soft_cap + window_left")
    return None


def stock_workspace(device="cuda") -> torch.Tensor:
    """A float workspace of its own for a stock FlashInfer wrapper (what FlashInfer's examples allocate)."""
    return torch.empty(256 << 20, dtype=torch.uint8, device=device)


@dataclass(frozen=True)
class SinkStock:
    """FlashInfer's attention-sink wrapper (flashinfer.BatchAttentionWithAttentionSinkWrapper) computing a sink
    variant: its kernel adds exp(sink[h]) to each row's denominator (natural-log units, not scaled by sm_scale, as
    fivar's `sink`) and keeps q - kv <= window_left (fivar's q - kv < window). Its mask hook is that window alone: it
    reads no custom mask (given one it would drop causal too), so it verifies chain drafts only (causal, no mask)."""
    window_left: int
    sink: torch.Tensor  # float32 [num_qo_heads]
    label: str

    def wrapper(self, head_dim: int, dtype, backend: str = "auto", device="cuda", **cuda_graph_buffers):
        """A wrapper for this variant (built for its dtypes and window: the constructor compiles them in, and an
        auto backend is picked there, without a mask: FA3 on sm90); plan it with `plan_kwargs`, call it by `run`."""
        return sink_wrapper(head_dim, dtype, backend, device, window_left=self.window_left, **cuda_graph_buffers)

    @property
    def plan_kwargs(self) -> dict:
        return {"window_left": self.window_left}  # run checks it is the one the wrapper was planned with

    def run(self, wrapper, q, paged_kv_cache, **kw):
        """The JIT module's extra tensor ("sink") and scalar ("sm_scale", fivar's default 1/sqrt(head_dim))
        positionally, after the cache."""
        return wrapper.run(q, paged_kv_cache, self.sink, q.shape[-1] ** -0.5, **kw)


def sink_wrapper(head_dim: int, dtype, backend: str = "auto", device="cuda", window_left: int = -1,
                 **cuda_graph_buffers):
    """A BatchAttentionWithAttentionSinkWrapper, NHD, its JIT module built (or loaded) here."""
    import flashinfer
    return flashinfer.BatchAttentionWithAttentionSinkWrapper(
        stock_workspace(device), "NHD", backend=backend, q_data_type=dtype,
        kv_data_type=dtype, head_dim_qk=head_dim, head_dim_vo=head_dim, window_left=window_left, **cuda_graph_buffers)


def stock_sink(variant, params: dict) -> SinkStock | None:
    """The stock sink wrapper computing exactly this variant (gpt-oss: a sink per query head in a causal window),
    or None (stock_mapping covers the variants without a sink)."""
    if variant.name != "gpt_oss" or int(params["window"]) < 1:  # window_left = -1 would be no window at all
        return None
    return SinkStock(int(params["window"]) - 1, params["sinks"].float().contiguous(),
                     "stock attention-sink wrapper, window_left")


@dataclass(frozen=True)
class Stock:
    """A stock FlashInfer call computing exactly the variant: built-in kwargs (`window_left`, `logits_soft_cap`,
    ...), or, with `doc_ids` (one packed sequence's sorted document ids), ragged prefill with a request per
    document and no mask."""
    kwargs: dict
    label: str
    doc_ids: torch.Tensor | None = None


AUTO = "auto"  # contenders(stock=AUTO): the bundled variants' mapping, else plain attention as a yardstick


def auto_stock(variant, params: dict) -> Stock | None:
    """The stock equivalent of a bundled variant (stock_mapping, or documents for `document_mask`)."""
    if variant.name == "document_mask":
        return Stock({}, "stock batch prefill, a request per document", doc_ids=params["doc_ids"][0])
    mapped = stock_mapping(variant, params)
    return Stock(*mapped) if mapped else None


def document_indptr(doc_ids: torch.Tensor) -> torch.Tensor:
    """int32 [documents + 1]: where each document of one packed sequence starts, from its sorted document ids
    (`document_mask`'s `doc_ids` row). Attention with each document as its own request is the document mask."""
    starts = torch.nonzero(doc_ids[1:] != doc_ids[:-1]).flatten().to(torch.int32) + 1
    return torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), doc_ids.numel())])


def stock_documents(q, k, v, doc_ids: torch.Tensor, causal: bool, backend: str = "auto"):
    """FlashInfer's ragged batch prefill, planned once, over the documents of `doc_ids` (one packed sequence) as
    requests: what the document mask computes, with no mask. A zero-argument callable."""
    import flashinfer
    indptr = document_indptr(doc_ids)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=q.device),
                                                        kv_layout="NHD", backend=backend)
    w.plan(indptr, indptr, q.shape[1], k.shape[1], q.shape[-1], causal=causal, q_data_type=q.dtype,
           kv_data_type=k.dtype)
    return lambda: w.run(q, k, v)


def scalar_params(variant, items) -> dict:
    """{name: value} from NAME=VALUE texts setting the variant's scalar params (`fivar bench --param`), each
    value cast to its declared type."""
    if not items:
        return {}
    from ..errors import FivarError
    from ..runtime.params import checked_scalar
    from ..spec.params import Scalar, Tensor
    scalars = {n: d for n, d in variant.params.items() if isinstance(d, Scalar)}
    out = {}
    for item in items:
        name, eq, text = (x.strip() for x in item.partition("="))
        where = f"variant '{variant.name}': --param {item!r}"
        if not eq or not name:
            raise FivarError(f"{where}: expected NAME=VALUE, e.g. --param window=1024")
        if name not in scalars:
            kind = "a tensor param (only scalars can be set here)" if name in variant.params else "not a param"
            raise FivarError(f"{where}: '{name}' is {kind}; its scalar params: {', '.join(scalars) or 'none'}")
        sized = [t for t, d in variant.params.items() if isinstance(d, Tensor)
                 and any(re.search(rf"\b{re.escape(name)}\b", dim) for dim in d.dims)]
        if sized:  # the example drew that tensor for its own value: a new one would index it out of shape
            raise FivarError(f"{where}: '{name}' sizes tensor param '{sized[0]}' "
                             f"({', '.join(variant.params[sized[0]].dims)}), which the example draws for its own "
                             f"'{name}'; change both in the variant's example instead")
        cast = scalars[name].dtype
        try:
            value = cast(text)
        except ValueError:
            raise FivarError(f"{where}: '{name}' is declared {cast.__name__}, got {text!r}") from None
        out[name] = checked_scalar(variant, name, value)  # what a call would refuse: non-finite, int32, a 0 divisor
    return out


def make_problem(variant, op, seqlen, batch, heads, head_dim, dtype, causal, device="cuda",
                 params: dict | None = None, kv_dtype: torch.dtype | None = None) -> Problem:
    """Fresh random inputs for one problem; `params` (scalar values) replace the variant's example ones.
    `kv_dtype` (decode): an FP8 cache with per-tensor scales."""
    from ..testing import _kv_case, _to_paged, example_params
    hq, hkv = heads
    if kv_dtype is not None and op != "decode":
        raise ValueError("kv_dtype applies to decode problems")
    p = Problem(op, seqlen, batch, hq, hkv, head_dim, dtype, causal, device, kv_dtype=kv_dtype)
    rnd = lambda *s: torch.randn(*s, dtype=dtype, device=device)  # noqa: E731
    if op == "prefill":
        p.tensors = dict(q=rnd(seqlen, hq, head_dim), k=rnd(seqlen, hkv, head_dim), v=rnd(seqlen, hkv, head_dim))
    elif op == "batch-prefill":
        n = batch * seqlen
        p.tensors = dict(q=rnd(n, hq, head_dim), k=rnd(n, hkv, head_dim), v=rnd(n, hkv, head_dim),
                         indptr=torch.arange(0, n + 1, seqlen, dtype=torch.int32, device=device))
    elif op == "decode":
        k, v = rnd(batch * seqlen, hkv, head_dim), rnd(batch * seqlen, hkv, head_dim)
        k_held, v_held, k, v, p.scales = _kv_case(k, v, kv_dtype)
        cache, indptr, indices, last = _to_paged(k_held, v_held, [seqlen] * batch, 16)
        p.tensors = dict(q=rnd(batch, hq, head_dim), k=k, v=v, cache=cache, kv_indptr=indptr, kv_indices=indices,
                         last=last)
    else:
        raise ValueError(f"unknown op {op}")
    p.params = example_params(variant, num_qo_heads=hq, num_kv_heads=hkv, batch_size=batch, max_len=seqlen,
                              device=device)
    p.params.update(params or {})
    return p


#: The contenders a run builds and times (`python -m fivar.bench --contender PATTERN`): None for all. A contender left
#: out is never constructed, so nothing it would plan or compile runs.
SELECTED: contextvars.ContextVar = contextvars.ContextVar("fivar_bench_contenders", default=None)


def selected(name: str) -> bool:
    chosen = SELECTED.get()
    return chosen is None or any(fnmatch(name, pattern) for pattern in chosen)


def contenders(variant, p: Problem, wanted: list[str], stock: Stock | None | str = AUTO,
               fivar: bool = True) -> list[Contender]:
    """fivar's kernels plus the `wanted` others (stock, triton, flex, sdpa, plain: stock FlashInfer with no variant,
    for a variant with a position-only logits term; decode: call, the one-shot `variant.decode`). `stock`: the stock
    equivalent (a Stock), None for none, AUTO for the bundled mapping (else plain attention, checked as plain
    attention: a speed yardstick only). `fivar` False: the others only (the stock warm-up of fivar.bench.runner)."""
    t, prm = p.tensors, p.params
    out: list[Contender] = []
    if p.op == "prefill":
        q, k, v = t["q"], t["k"], t["v"]
        fivar_backends = ("fa3", "fa2") if torch.cuda.get_device_capability() == (9, 0) else ("fa2",)
        for backend in fivar_backends if fivar else ():
            out.append(Contender(f"fivar-{backend}",
                                 lambda b=backend: variant.prefill(q, k, v, causal=p.causal, backend=b, **prm)))
        if fivar and variant.scans_mask and torch.cuda.get_device_capability() == (9, 0) and \
                selected("fivar-fa3-planned"):
            # FA3's tile-list form plans per call signature; planned once here, as Flex's block mask is built once
            ind = torch.tensor([0, p.seqlen], dtype=torch.int32, device=p.device)
            plan = variant.plan_ragged(ind, ind, num_qo_heads=p.num_qo_heads, num_kv_heads=p.num_kv_heads,
                                       head_dim=p.head_dim, dtype=p.dtype, causal=p.causal, backend="fa3",
                                       device=p.device, **prm)
            out.append(Contender("fivar-fa3-planned", lambda: plan.run(q, k, v), "tile list planned once"))
        if "triton" in wanted:
            out.append(Contender("triton", lambda: variant.prefill(q, k, v, causal=p.causal, backend="triton", **prm)))
        if "stock" in wanted:
            st = auto_stock(variant, prm) if stock is AUTO else stock
            # on Hopper stock runs FA3; "stock-fa2" is then the like-for-like yardstick of fivar-fa2
            backends = [("stock", "auto")] + ([("stock-fa2", "fa2")] if "stock-fa2" in wanted and st is not None
                                               and torch.cuda.get_device_capability() == (9, 0) else [])
            for cname, backend in filter(lambda b: selected(b[0]), backends):  # stock_documents plans here
                suffix = "" if backend == "auto" else f" ({backend})"
                if st is not None and st.doc_ids is not None:
                    out.append(Contender(cname, stock_documents(q, k, v, st.doc_ids, p.causal, backend=backend),
                                         st.label + suffix))
                elif st is not None or stock is AUTO:
                    import flashinfer
                    kw, label = ((st.kwargs, st.label) if st else
                                 ({}, f"stock plain attention (no built-in for {variant.name})"))
                    out.append(Contender(cname, lambda kw=kw, b=backend: flashinfer.single_prefill_with_kv_cache(
                        q, k, v, causal=p.causal, backend=b, **kw), label + suffix, checks_variant=st is not None))
        if "plain" in wanted and has_position_term(variant.ir.logits):  # what a position-only term costs
            import flashinfer
            out.append(Contender("plain", lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=p.causal),
                                 "plain attention, stock FlashInfer (no variant: a yardstick)", checks_variant=False))
        if "flex" in wanted and variant.softmax and variant.sink is None and selected("flex"):
            from ..flex import flex_attention_fn
            out.append(Contender("flex", flex_attention_fn(variant, prm, q, k, v, causal=p.causal), "torch.compile"))
        if "sdpa" in wanted and selected("sdpa"):
            g = p.num_qo_heads // p.num_kv_heads
            qt, kt, vt = q.transpose(0, 1), k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1)
            out.append(Contender("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=p.causal).transpose(0, 1), "plain attention", checks_variant=False))
    elif p.op == "batch-prefill":
        q, k, v, ind = t["q"], t["k"], t["v"], t["indptr"]
        # planned once like the stock wrapper below (and FA3's tile list, when the mask needs it)
        if selected("fivar"):
            plan = variant.plan_ragged(ind, ind, num_qo_heads=p.num_qo_heads, num_kv_heads=p.num_kv_heads,
                                       head_dim=p.head_dim, dtype=p.dtype, causal=p.causal, device=p.device, **prm)
            out.append(Contender("fivar", lambda: plan.run(q, k, v), f"planned, {plan.target}"))
        if "triton" in wanted:
            out.append(Contender("triton", lambda: variant.batch_prefill_ragged(q, k, v, ind, ind, causal=p.causal,
                                                                                backend="triton", **prm)))
        if "stock" in wanted and selected("stock"):
            import flashinfer
            mapped = stock_mapping(variant, prm)
            kw, label = mapped if mapped else ({}, f"stock plain attention (no built-in for {variant.name})")
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                stock_workspace(p.device), "NHD")
            w.plan(ind, ind, p.num_qo_heads, p.num_kv_heads, p.head_dim, causal=p.causal, q_data_type=q.dtype,
                   kv_data_type=k.dtype, **kw)
            out.append(Contender("stock", lambda: w.run(q, k, v), label, checks_variant=mapped is not None))
    else:  # decode
        q, cache, ind, idx, last = t["q"], t["cache"], t["kv_indptr"], t["kv_indices"], t["last"]
        # planned once like the stock wrapper below, so both time only the kernel launch
        sc, kv_dtype = p.scales, p.kv_dtype or p.dtype
        fp8 = " fp8 KV" if p.kv_dtype is not None else ""
        if fivar and selected("fivar"):
            plan = variant.plan_decode(ind, idx, last, num_qo_heads=p.num_qo_heads, num_kv_heads=p.num_kv_heads,
                                       head_dim=p.head_dim, page_size=16, dtype=p.dtype, device=p.device,
                                       **({"kv_dtype": p.kv_dtype} if p.kv_dtype is not None else {}), **prm)
            out.append(Contender("fivar", lambda: plan.run(q, cache, **sc), "planned" + fp8))
        if "call" in wanted:
            out.append(Contender("fivar-call", lambda: variant.decode(q, cache, ind, idx, last, **sc, **prm),
                                 "one call, planned inside" + fp8))
        if "graph" in wanted and (selected("fivar-graph") or selected("stock-graph")):
            out += graph_contenders(variant, p, stock)
        if "triton" in wanted and p.kv_dtype is None:  # the twin reads 16-bit caches
            out.append(Contender("triton", lambda: variant.decode(q, cache, ind, idx, last, backend="triton", **prm)))
        st = (Stock(*stock_mapping(variant, prm)) if stock_mapping(variant, prm) else None) if stock is AUTO else stock
        if "stock" in wanted and (st is not None or stock is AUTO) and selected("stock"):
            import flashinfer
            kw, label = (st.kwargs, st.label) if st else ({}, f"stock plain attention (no built-in for {variant.name})")
            # FA2 named: with an FP8 cache FlashInfer's auto would look for another backend
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                stock_workspace(p.device), "NHD", use_tensor_cores=True,
                backend="fa2")
            w.plan(ind, idx, last, p.num_qo_heads, p.num_kv_heads, p.head_dim, 16, q_data_type=q.dtype,
                   kv_data_type=kv_dtype, **kw)
            out.append(Contender("stock", lambda: w.run(q, cache, **sc), label + " (tensor-core decode)" + fp8,
                                 checks_variant=st is not None))
    return [c for c in out if selected(c.name)]


def graph_contenders(variant, p: Problem, stock=AUTO) -> list[Contender]:
    """Decode replayed from a CUDA graph: fivar's `plan_decode(..., cuda_graph=True)` ("fivar-graph") and stock
    FlashInfer's use_cuda_graph wrapper ("stock-graph", with the variant's built-in kwargs, else plain decode),
    each captured once; a contender replays its graph and returns the graph's output."""
    import flashinfer
    t, prm = p.tensors, p.params
    q, cache, ind, idx, last = t["q"], t["cache"], t["kv_indptr"], t["kv_indices"], t["last"]
    hq, hkv, d, dev = p.num_qo_heads, p.num_kv_heads, p.head_dim, p.device
    plan = variant.plan_decode(ind, idx, last, cuda_graph=True, max_batch=p.batch, max_pages=idx.numel(),
                               num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16, dtype=p.dtype,
                               device=dev, **prm)
    st = (Stock(*stock_mapping(variant, prm)) if stock_mapping(variant, prm) else None) if stock is AUTO else stock
    kw, label = (st.kwargs, st.label) if st else ({}, f"stock plain attention (no built-in for {variant.name})")
    i32 = dict(dtype=torch.int32, device=dev)
    bufs = (torch.empty(p.batch + 1, **i32), torch.empty(idx.numel(), **i32), torch.empty(p.batch, **i32))
    # the kernel fivar's plan runs (tensor cores once a KV head serves >= 4 query heads): stock runs the same one
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        stock_workspace(dev), "NHD", use_cuda_graph=True,
        use_tensor_cores=plan.tensor_cores, paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
        paged_kv_last_page_len_buffer=bufs[2], backend="fa2")
    w.plan(ind, idx, last, hq, hkv, d, 16, q_data_type=p.dtype, kv_data_type=p.dtype, **kw)
    label += " (tensor-core decode" if plan.tensor_cores else " (CUDA-core decode"
    return [Contender("fivar-graph", _replayed(lambda: plan.run(q, cache)), "plan_decode(cuda_graph=True), replayed"),
            Contender("stock-graph", _replayed(lambda: w.run(q, cache)), label + ", use_cuda_graph, replayed)",
                      checks_variant=st is not None)]


def _replayed(fn):
    """`fn` captured in a CUDA graph (after warm-up launches, the first on the current stream, as a model's first
    step runs eagerly): a callable that replays it. The callable holds `fn`, and so the plan or wrapper whose
    buffers the graph reads: a graph holds only raw addresses, and freed buffers are handed to other tensors (then
    released by the allocator) while the graph still reads and writes them."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    replay.captured = fn  # keeps fn's closure (the plan, the wrapper and their buffers) alive with the graph
    return replay


def plain(variant=None):
    """Plain softmax attention: the reference for contenders that compute it instead of the variant."""
    from ..flex import keep_every_key
    from ..spec import AttentionVariant
    global _PLAIN
    if _PLAIN is None:
        _PLAIN = AttentionVariant(name="plain", mask=keep_every_key)
    return _PLAIN


_PLAIN = None
