"""FA2 batch plans of a windowed mask: the KV chunks FlashInfer's scheduler makes must reach every kept key.

FlashInfer's FA2 scheduler (scheduler.cuh, PrefillSplitQOKVIndptr) sizes each request's split-KV work as
min(window_left + cta_tile_q, kv_len) keys, and the kernel starts each query tile's chunks at kv_start =
kv_len + tile_row0 - (qo_len + window_left). That reaches a causal window's keys, not the keys right of the
diagonal that a non-causal call keeps: `_split_kwargs` must then plan unsplit (one chunk from kv_start to kv_len).
This models the scheduler's worst case (chunks that cover exactly the effective length) and checks every kept
(q, kv) pair of every query tile against brute force.
"""
import random

import pytest

import fivar
from fivar.runtime.attention import _split_kwargs


def covered(kv_len, qo_len, window_left, tile_row0, cta_rows, split: bool):
    """[lo, hi) of keys a query tile's chunks visit (FlashInfer's rule; worst-case chunking when split)."""
    kv_start = max(0, kv_len + tile_row0 - (qo_len + window_left))
    if not split:
        return kv_start, kv_len
    effective = min(window_left + cta_rows, kv_len)
    return kv_start, min(kv_start + effective, kv_len)


def missed_pairs(causal: bool, split: bool, window: int, qo_len: int, kv_len: int, cta_rows: int) -> int:
    window_left = window - 1  # sliding_window keeps q - kv < window
    missed = 0
    for row0 in range(0, qo_len, cta_rows):
        lo, hi = covered(kv_len, qo_len, window_left, row0, cta_rows, split)
        for r in range(row0, min(row0 + cta_rows, qo_len)):
            q = kv_len - qo_len + r
            for kv in range(kv_len):
                kept = q - kv < window and (kv <= q or not causal)
                missed += kept and not (lo <= kv < hi)
    return missed


@pytest.mark.parametrize("causal", [False, True])
def test_planned_chunks_reach_every_kept_key(causal):
    v = fivar.load("sliding_window")
    rng = random.Random(0)
    for _ in range(12):
        qo_len, window, cta_rows = rng.randint(1, 200), rng.randint(1, 90), rng.choice([16, 64, 128])
        kv_len = qo_len + rng.randint(0, 300)
        split = not _split_kwargs(v, "fa2", causal, window - 1).get("disable_split_kv", False)
        assert missed_pairs(causal, split, window, qo_len, kv_len, cta_rows) == 0, (qo_len, kv_len, window, cta_rows)


def test_decode_keeps_split_kv():
    """One query per request at its last key: nothing lies right of it, so decode keeps FlashInfer's split-KV."""
    v = fivar.load("sliding_window")
    assert "disable_split_kv" not in _split_kwargs(v, "fa2", True, 127)
    assert missed_pairs(False, True, 128, 1, 5000, 16) == 0


def test_the_model_catches_a_split_non_causal_window():
    """The check can fail: split chunks sized for a causal window miss a non-causal call's right-hand keys."""
    assert missed_pairs(False, True, 20, 100, 300, 16) > 0
