"""Real-model attention variants (benchmarks/zoo/*.py, written with the public API as a user would) on prefill
(S = 8192) and paged decode (batch 32 x 32768 keys, page 16); bf16, head dim 128, GQA 32/8.

Prefill contenders: FA3, FA2, the tile-list form planned once (masks that need it), the Triton twin, FlexAttention,
and the stock FlashInfer call computing the same function where one exists. Decode: fivar planned, the one-shot
call, the Triton twin, and stock decode where it computes the same function. Each entry of ZOO says how the
variant is called (causal or not) and what its stock equivalent is; the variant files themselves know nothing of
benchmarks.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..contenders import Stock
from ._attention import case

PREFILL_S = 8192
DECODE = (32, 32768)  # batch, keys per request


def zoo_dir() -> Path:
    from ..runner import repo_root
    root = repo_root()
    return (root if root else Path.cwd()) / "benchmarks" / "zoo"


def load(name: str):
    from ...registry import load_file
    return load_file(zoo_dir() / f"{name}.py")


def _window(label: str, softcap: bool = False):
    """Stock `window_left` (+ `logits_soft_cap`): fivar's `q - kv < window` is FlashInfer's `q - kv <= window_left`."""
    def stock(params: dict, seqlen: int) -> Stock:
        kw = {"window_left": int(params["window"]) - 1}
        if softcap:
            kw["logits_soft_cap"] = float(params["softcap"])
        return Stock(kw, label)
    return stock


def _chunks_prefill(params: dict, seqlen: int) -> Stock:
    import torch
    ids = (torch.arange(seqlen, device="cuda") // int(params["chunk"])).to(torch.int32)
    return Stock({}, "stock ragged prefill, a request per chunk", doc_ids=ids)


def _chunks_decode(params: dict, seqlen: int) -> Stock:
    # the last query of every request sits at seqlen - 1: it sees its chunk's keys, a window of (seqlen-1) % chunk
    return Stock({"window_left": (seqlen - 1) % int(params["chunk"])}, "stock decode window_left (the query's chunk)")


def _documents(params: dict, seqlen: int) -> Stock:
    return Stock({}, "stock ragged prefill, a request per document", doc_ids=params["doc_ids"][0])


def _plain_decode(params: dict, seqlen: int) -> Stock:
    return Stock({}, "stock plain decode (the last query sees the whole prefix and all before it)")


@dataclass(frozen=True)
class Entry:
    causal: bool
    prefill_stock: Callable | None = None
    decode_stock: Callable | None = None


#: ALiBi + soft-cap has no stock equivalent: FlashInfer's ALiBi with a soft-cap scales the biased logit by
#: sm_scale a second time before the tanh, a different function (and FA3 has no ALiBi).
ZOO = {
    "gemma2_local": Entry(True, _window("stock window_left + logits_soft_cap", softcap=True),
                          _window("stock decode window_left + logits_soft_cap", softcap=True)),
    "gemma3_local": Entry(True, _window("stock window_left"), _window("stock decode window_left")),
    "mistral_window": Entry(True, _window("stock window_left"), _window("stock decode window_left")),
    "llama4_chunked": Entry(True, _chunks_prefill, _chunks_decode),
    "prefix_lm": Entry(False, None, _plain_decode),
    "packed_documents": Entry(True, _documents, None),
    "streaming_llm": Entry(True),
    "t5_buckets": Entry(False),
    "alibi_softcap": Entry(True),
    "sigmoid_head_bias": Entry(False),
    "learned_relative_table": Entry(True),
    "per_head_window": Entry(True),
}


def cases(quick: bool = False) -> list:
    out = []
    for name, e in ZOO.items():
        softmax = name != "sigmoid_head_bias"
        pre_base = "stock" if e.prefill_stock else "flex" if softmax else "triton"
        # plain: stock FlashInfer with no variant, the yardstick of a position-only logits term (where one is)
        wanted = ("stock", "stock-fa2", "triton", "flex", "plain")
        out.append(case("zoo", f"{name} prefill S={PREFILL_S}", lambda n=name: load(n), "prefill", PREFILL_S,
                        e.causal, wanted=wanted, stock=e.prefill_stock or (lambda p, s: None), baseline=pre_base))
        batch, kv = (DECODE[0], 8192) if quick else DECODE
        out.append(case("zoo", f"{name} decode {batch}x{kv}", lambda n=name: load(n), "decode", kv, batch=batch,
                        wanted=("stock", "triton", "call"), stock=e.decode_stock or (lambda p, s: None),
                        baseline="stock" if e.decode_stock else "triton"))
    return out
