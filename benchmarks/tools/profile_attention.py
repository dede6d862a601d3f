"""Where the time goes: per-kernel GPU time of one variant's Triton twin, FA3 kernel and Flex, by profiler.

    python3 benchmarks/tools/profile_attention.py document_mask [--seqlen 8192] [--causal]

Not a benchmark (benchmarks/tools/bench_fa3.py is): kernel times under torch.profiler, to see how a contender's
time splits between its kernels (say the Triton mask pre-pass vs the attention kernel) and launch gaps.
"""
from __future__ import annotations

import argparse

import torch

import fivar
from fivar.testing import example_params


def contenders(v, params, q, k, vv, causal):
    fns = {"triton": lambda: v.prefill(q, k, vv, causal=causal, backend="triton", **params),
           "fa3": lambda: v.prefill(q, k, vv, causal=causal, backend="fa3", **params)}
    if v.softmax:
        from fivar.flex import flex_attention_fn
        fns["flex"] = flex_attention_fn(v, params, q, k, vv, causal=causal)
    return fns


def host_overhead(v, params, causal, n=200):
    """Host microseconds per call at a shape whose GPU work is negligible: launches queue faster than the
    GPU drains them only if the host path is cheap, so this is what a call costs the CPU."""
    import time
    q, k, vv = (torch.randn(128, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    small = example_params(v, num_qo_heads=2, num_kv_heads=2, batch_size=1, max_len=128, device="cuda")
    small.update({n_: params[n_] for n_ in params if not isinstance(params[n_], torch.Tensor)})
    out = {}
    for name, fn in contenders(v, small, q, k, vv, causal).items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variant")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    v = fivar.load(args.variant)
    S, H, D = args.seqlen, args.heads, 128
    q, k, vv = (torch.randn(S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    params = example_params(v, num_qo_heads=H, num_kv_heads=H, batch_size=1, max_len=S, device="cuda")
    if "window" in v.params:
        params["window"] = 1024
    host_us = host_overhead(v, params, args.causal)
    for name, fn in contenders(v, params, q, k, vv, args.causal).items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        print(f"{name}: host time per call {host_us[name]:.0f} us (tiny shape: CPU-bound)")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        rows = sorted(((e.key, e.device_time_total / args.iters, e.count // args.iters)
                       for e in prof.key_averages() if e.device_time_total > 0), key=lambda r: -r[1])
        total = sum(r[1] for r in rows)
        print(f"{args.variant} S={S} causal={args.causal} {name}: {total:.0f} us of kernels per call")
        for key, us, count in rows[:6]:
            print(f"    {us:8.1f} us  x{count}  {key[:90]}")


if __name__ == "__main__":
    main()
