"""Timing that does not lie: CUDA-event medians, interleaved contenders, spreads, counted work.

Contenders are timed round-robin (A, B, C, A, B, C, ...) so clock and thermal drift hit all alike, and
every figure is a median over rounds with its min..max spread. Inputs are random; callers check
correctness before calling any of this.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Timing:
    samples_ms: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def spread(self) -> tuple[float, float]:
        return (min(self.samples_ms), max(self.samples_ms))


def _cpu_bench(fn, warmup_ms: float, rep_ms: float) -> float:
    t_end = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < t_end:
        fn()
    times = []
    t_end = time.perf_counter() + rep_ms / 1e3
    while time.perf_counter() < t_end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_interleaved(fns: dict, rounds: int = 5, warmup_ms: float = 100, rep_ms: float = 300,
                     device: str = "cuda", on_sample=None) -> dict[str, Timing]:
    """Median ms per call of each contender; each round times every contender once, in an order shuffled per
    round (seeded: runs repeat). A fixed order biases it: on an H100 the contender timed right after a slower,
    cooler one (Flex) measured up to 4% faster than the same kernel timed after a hot one.

    On CUDA: triton's do_bench (CUDA events, L2 flushed between calls). On the CPU (tests): wall clock.
    `on_sample(name, previous_name, t0, t1, ms)` sees each sample with its wall-clock span (time.time()).
    """
    if device == "cpu":
        do_bench = lambda fn, warmup, rep, return_mode: _cpu_bench(fn, warmup, rep)  # noqa: E731
    else:
        from triton.testing import do_bench
    out = {name: Timing() for name in fns}
    for fn in fns.values():  # first call: JIT/autotune/compile out of the timed region
        fn()
    order, shuffle, previous = list(fns), random.Random(0).shuffle, None
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            t0 = time.time()
            ms = do_bench(fns[name], warmup=warmup_ms, rep=rep_ms, return_mode="median")
            out[name].samples_ms.append(ms)
            if on_sample is not None:
                on_sample(name, previous, t0, time.time(), ms)
            previous = name
    return out


def time_sustained(fns: dict, seconds: float = 3.0, settle_s: float = 1.0, bin_ms: float = 100,
                   device: str = "cuda", on_sample=None) -> dict[str, Timing]:
    """Each contender alone, back to back, as a serving loop runs it: `settle_s` untimed (the board's power
    controller finds its clock), then `seconds` timed in bins of about `bin_ms` of calls, one sample per bin
    (the median call), the median of the bins reported. Unlike time_interleaved, no contender inherits a
    cooler board from the one before it: under a power cap this is the rate a kernel keeps.

    On CUDA: CUDA events around every call, synchronized per bin (no L2 flush: each call reads its inputs
    from HBM only when they exceed L2). On the CPU (tests): wall clock.
    `on_sample(name, previous_name, t0, t1, ms)` sees each bin with its wall-clock span (time.time()).
    """
    if device == "cpu":
        def run_bin(fn, calls):
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return times
    else:
        import torch

        def run_bin(fn, calls):
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(calls)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in events]
    out = {name: Timing() for name in fns}
    order, previous = list(fns), None
    random.Random(0).shuffle(order)
    for name in order:
        fn = fns[name]
        call_ms = statistics.median(run_bin(fn, 3))
        calls = max(1, round(bin_ms / max(call_ms, 1e-3)))
        t_end = time.time() + settle_s
        while time.time() < t_end:
            run_bin(fn, calls)
        t_end = time.time() + seconds
        while time.time() < t_end or not out[name].samples_ms:
            t0 = time.time()
            ms = statistics.median(run_bin(fn, calls))
            out[name].samples_ms.append(ms)
            if on_sample is not None:
                on_sample(name, previous, t0, time.time(), ms)
        previous = name
    return out


def attention_flops(qo_len: int, kv_len: int, num_qo_heads: int, head_dim: int, causal: bool,
                    batch: int = 1) -> float:
    """Useful FLOPs of attention forward: 2 matmuls x 2 FLOP/MAC; masked-out work not counted.

    Causal keeps, for query row i (bottom-right aligned), kv_len - qo_len + i + 1 keys.
    """
    if causal:
        offset = kv_len - qo_len
        pairs = qo_len * offset + qo_len * (qo_len + 1) // 2
    else:
        pairs = qo_len * kv_len
    return 4.0 * pairs * num_qo_heads * head_dim * batch


def decode_kv_bytes(kv_lens, num_kv_heads: int, head_dim: int, elem_bytes: int = 2) -> float:
    """Bytes of K and V read by decode (each read once): the figure decode is judged by."""
    return 2.0 * sum(kv_lens) * num_kv_heads * head_dim * elem_bytes
