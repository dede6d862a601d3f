"""Paged decode of the bundled variants (planned once, and the one-shot call) against stock FlashInfer decode
(with `window_left` / `logits_soft_cap` where they compute the variant, else plain decode as a yardstick) and the
Triton twin; batch 32, page 16. Also: an FP8 (e4m3) KV cache against stock FlashInfer's FP8 decode with the same
k/v scales ("fp8" cases), and decode replayed from CUDA graphs, fivar's plan_decode(cuda_graph=True) against stock's
use_cuda_graph wrapper at batch 1, 8 and 64 ("graph" cases: contenders fivar-graph, stock-graph, next to the
plain planned fivar and stock)."""
from __future__ import annotations

import torch

from ._attention import case
from .attention import BUNDLED

#: the variants with a stock equivalent (stock computes the same function, so the ratio is like for like)
MAPPED = ("softcap", "sliding_window")
GRAPH_BATCHES = (1, 8, 64)


def _loader(name):
    import fivar
    return lambda: fivar.load(name)


def cases(quick: bool = False) -> list:
    plain = [case("decode", f"{name} decode {batch}x{kv}", _loader(name), "decode", kv, batch=batch,
                  wanted=("stock", "triton", "call"), baseline="stock")
             for name in BUNDLED for batch, kv in (((32, 8192),) if quick else ((32, 4096), (32, 32768)))]
    fp8 = [case("decode", f"{name} decode fp8 {batch}x{kv}", _loader(name), "decode", kv, batch=batch,
                wanted=("stock", "call"), baseline="stock", kv_dtype=torch.float8_e4m3fn)
           for name in MAPPED for batch, kv in ((32, 8192),)]
    graph = [case("decode", f"{name} decode graph {batch}x{kv}", _loader(name), "decode", kv, batch=batch,
                  wanted=("stock", "graph"), baseline="stock-graph")
             for name in MAPPED[:1 if quick else 2] for batch in GRAPH_BATCHES for kv in (4096,)]
    return plain + fp8 + graph
