"""Paged decode of the bundled variants (planned once, and the one-shot call) against stock FlashInfer decode
(with `window_left` / `logits_soft_cap` where they compute the variant, else plain decode as a yardstick) and the
Triton twin; batch 32, page 16."""
from __future__ import annotations

from ._attention import case
from .attention import BUNDLED


def _loader(name):
    import fivar
    return lambda: fivar.load(name)


def cases(quick: bool = False) -> list:
    return [case("decode", f"{name} decode {batch}x{kv}", _loader(name), "decode", kv, batch=batch,
                 wanted=("stock", "triton", "call"), baseline="stock")
            for name in BUNDLED for batch, kv in (((32, 8192),) if quick else ((32, 4096), (32, 32768)))]
