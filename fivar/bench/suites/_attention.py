"""What the attention suites share: a prefill or decode case of one variant, its modules, its contenders."""
from __future__ import annotations

import torch

from ..contenders import AUTO, contenders, make_problem
from ..harness import _checker, work
from ..runner import Case, Prepared

DTYPE = torch.bfloat16
HEADS = (32, 8)  # GQA 32/8
HEAD_DIM = 128


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def prefill_modules(variant) -> list:
    """The modules the prefill contenders run: FA3 (on sm90) and FA2 single prefill, and FA3's KV-range form."""
    from ...jit.build import serving_modules
    targets = ("fa3", "fa2") if _sm90() else ("fa2",)
    mods = [m for t in targets for m in serving_modules(variant, "single_prefill", t, "bf16", HEAD_DIM)]
    if _sm90() and variant.scans_mask:
        mods += serving_modules(variant, "batch_prefill", "fa3", "bf16", HEAD_DIM)
    return mods


def decode_modules(variant) -> list:
    from ...jit.build import serving_modules
    return serving_modules(variant, "batch_decode", "fa2", "bf16", HEAD_DIM)


def shape(op: str, seqlen: int, batch: int, causal: bool) -> dict:
    return {"seqlen": seqlen, "batch": batch, "heads": f"{HEADS[0]}/{HEADS[1]}", "head_dim": HEAD_DIM,
            "dtype": "bf16", "causal": causal, **({"page_size": 16} if op == "decode" else {})}


def case(suite: str, name: str, load, op: str, seqlen: int, causal: bool = False, batch: int = 1,
         wanted=("stock", "stock-fa2", "triton", "flex"), stock=AUTO, baseline: str | None = "stock", params=None) -> Case:
    """A prefill or decode case of the variant `load()` returns. `stock(params, seqlen)` gives the stock
    equivalent (a contenders.Stock or None), or AUTO for the bundled mapping; `params(variant, seqlen)` sets
    scalar params over the variant's example."""
    def prepare() -> Prepared:
        v = load()
        p = make_problem(v, op, seqlen, batch, HEADS, HEAD_DIM, DTYPE, causal, "cuda",
                         params=params(v, seqlen) if params else None)
        st = stock if stock is AUTO else stock(p.params, seqlen)
        flops, nbytes = work(v, p)
        return Prepared(contenders(v, p, list(wanted), stock=st), _checker(v, p), flops=flops, nbytes=nbytes,
                        memory_bound=op == "decode")

    mods = (lambda: prefill_modules(load())) if op == "prefill" else (lambda: decode_modules(load()))
    return Case(suite, name, op, shape(op, seqlen, batch, causal), prepare, baseline=baseline, modules=mods)
