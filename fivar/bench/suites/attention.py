"""Prefill of the bundled variants on FA3, FA2 and Triton against stock FlashInfer (the built-in computing the
same function, else plain attention as a yardstick) and FlexAttention; S = 4096, 8192, 16384, causal and not."""
from __future__ import annotations

from ._attention import case

BUNDLED = ("softcap", "sliding_window", "softcap_sliding_window", "alibi", "document_mask", "relative_bias",
           "sigmoid")
EXACT_STOCK = {"softcap", "sliding_window", "softcap_sliding_window", "document_mask"}


def _loader(name):
    import fivar
    return lambda: fivar.load(name)


def cases(quick: bool = False) -> list:
    out = []
    for name in BUNDLED:
        # the ratio that matters: the stock kernel computing the same function, else Flex (softmax variants)
        baseline = "stock" if name in EXACT_STOCK else "flex" if name != "sigmoid" else "stock"
        for S in (8192,) if quick else (4096, 8192, 16384):
            for causal in (False, True):
                out.append(case("attention", f"{name} prefill S={S} {'causal' if causal else 'full'}",
                                _loader(name), "prefill", S, causal, baseline=baseline))
    return out
