"""What the attention suites share: a prefill or decode case of one variant, its modules, its contenders."""
from __future__ import annotations

import torch

from ..contenders import AUTO, contenders, make_problem
from ..harness import _checker, work
from ..runner import Case, Prepared

DTYPE = torch.bfloat16
HEADS = (32, 8)  # GQA 32/8
HEAD_DIM = 128
STOCK_CONTENDERS = ("stock", "stock-fa2", "plain")  # stock FlashInfer: modules built by the runner's warm-up
WARM_LEN = 256  # the warm-up's sequence length: module choice depends on dtypes and flags, not lengths


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def prefill_modules(variant) -> list:
    """The modules the prefill contenders run: FA3 (on sm90) and FA2 single prefill, and FA3's tile-list form (each
    only where its contender is selected: `--contender`)."""
    from ...jit.build import serving_modules
    from ..contenders import selected
    targets = [t for t in (("fa3", "fa2") if _sm90() else ("fa2",)) if selected(f"fivar-{t}")]
    mods = [m for t in targets for m in serving_modules(variant, "single_prefill", t, "bf16", HEAD_DIM)]
    if _sm90() and variant.scans_mask and selected("fivar-fa3-planned"):
        mods += serving_modules(variant, "batch_prefill", "fa3", "bf16", HEAD_DIM)
    return mods


def decode_modules(variant, kv_dtype=None) -> list:
    from ...jit.build import gen_module, kv_dtype_name, serving_modules
    from ..contenders import selected
    if not any(selected(n) for n in ("fivar", "fivar-call", "fivar-graph")):  # only others run: nothing to build
        return []
    if kv_dtype is None:
        return serving_modules(variant, "batch_decode", "fa2", "bf16", HEAD_DIM)
    kv = kv_dtype_name(kv_dtype, DTYPE)  # an FP8 cache: both kernels decode may run
    return [gen_module(variant, op, "fa2", "bf16", HEAD_DIM, kv_dtype=kv) for op in ("batch_decode", "batch_prefill")]


def shape(op: str, seqlen: int, batch: int, causal: bool) -> dict:
    return {"seqlen": seqlen, "batch": batch, "heads": f"{HEADS[0]}/{HEADS[1]}", "head_dim": HEAD_DIM,
            "dtype": "bf16", "causal": causal, **({"page_size": 16} if op == "decode" else {})}


def case(suite: str, name: str, load, op: str, seqlen: int, causal: bool = False, batch: int = 1,
         wanted=("stock", "stock-fa2", "triton", "flex"), stock=AUTO, baseline: str | tuple | None = "stock",
         params=None, kv_dtype=None, extra=None) -> Case:
    """A prefill or decode case of the variant `load()` returns. `stock(params, seqlen)` gives the stock
    equivalent (a contenders.Stock or None), or AUTO for the bundled mapping; `params(variant, seqlen)` sets
    scalar params over the variant's example. `kv_dtype`: decode over an FP8 cache (contenders.make_problem).
    `extra(variant, problem)` -> (contenders, detail): more stock FlashInfer contenders (warmed up with the others)
    and facts of the case for every row's detail."""
    def prepare() -> Prepared:
        v = load()
        p = make_problem(v, op, seqlen, batch, HEADS, HEAD_DIM, DTYPE, causal, "cuda",
                         params=params(v, seqlen) if params else None, kv_dtype=kv_dtype)
        st = stock if stock is AUTO else stock(p.params, seqlen)
        flops, nbytes = work(v, p)
        more, detail = extra(v, p) if extra else ([], {})
        return Prepared(contenders(v, p, list(wanted), stock=st) + more, _checker(v, p), flops=flops, nbytes=nbytes,
                        memory_bound=op == "decode", detail=detail)

    def warm_stock():  # the stock contenders once at a small shape: FlashInfer builds their modules then
        v = load()
        p = make_problem(v, op, WARM_LEN, min(batch, 2), HEADS, HEAD_DIM, DTYPE, causal, "cuda",
                         params=params(v, WARM_LEN) if params else None, kv_dtype=kv_dtype)
        st = stock if stock is AUTO else stock(p.params, WARM_LEN)
        for c in contenders(v, p, [w for w in wanted if w in STOCK_CONTENDERS], stock=st, fivar=False):
            c.fn()
        for c in extra(v, p)[0] if extra else ():
            c.fn()

    mods = (lambda: prefill_modules(load())) if op == "prefill" else (lambda: decode_modules(load(), kv_dtype))
    sh = {**shape(op, seqlen, batch, causal), **({"kv_dtype": "fp8_e4m3"} if kv_dtype is not None else {})}
    return Case(suite, name, op, sh, prepare, baseline=baseline, modules=mods,
                warm_stock=warm_stock if set(wanted) & set(STOCK_CONTENDERS) or extra else None)
