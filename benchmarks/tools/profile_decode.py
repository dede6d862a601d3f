"""Where a decode call's time goes: host cost per call, GPU time alone, and the kernels, fivar vs stock FlashInfer.

    python3 benchmarks/tools/profile_decode.py sliding_window [--batch 32] [--kv 8192] [--json out.json]

Not a benchmark (the runner's decode suite is): for fivar's planned `run`, the one-shot `v.decode` and the stock
wrapper computing the same function (the decode suite's contenders), it prints
- `host_us`: wall microseconds per call of back-to-back calls with no sync inside (when the GPU work is short, this
  is the host path: Python, argument checks, launches);
- `gpu_us`: microseconds per replay of the call captured in a CUDA graph (the GPU work alone, launch gaps removed);
- the CUDA kernels one call launches, with their GPU microseconds (torch.profiler).
A fivar call slower than stock by its host_us with equal gpu_us is host-bound; equal host_us with more gpu_us is a
kernel (or an extra kernel) to look at.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import fivar
from fivar.bench.contenders import _replayed, contenders, make_problem


def per_call_us(fn, n: int = 300) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def kernels(fn, n: int = 20) -> list[tuple[str, float]]:
    """(kernel name, GPU microseconds per call) of every CUDA kernel `fn` launches."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.device_time / n
    return sorted(out.items(), key=lambda kv: -kv[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kv", type=int, default=8192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    v = fivar.load(args.variant)
    p = make_problem(v, "decode", args.kv, args.batch, (32, 8), 128, torch.bfloat16, False, "cuda")
    report = {"variant": v.name, "batch": args.batch, "kv": args.kv, "gpu": torch.cuda.get_device_name(),
              "contenders": {}}
    for c in contenders(v, p, ["stock", "call"]):
        row = {"label": c.label, "host_us": per_call_us(c.fn), "kernels": kernels(c.fn)}
        # the one-shot call looks its plan up on the host (a sync): only planned runs are captured
        graph_us = per_call_us(_replayed(c.fn)) if c.name != "fivar-call" else "one-shot, not captured"
        row["gpu_us"] = graph_us
        report["contenders"][c.name] = row
        g = f"{graph_us:8.1f}" if isinstance(graph_us, float) else graph_us
        print(f"{c.name:12s} host {row['host_us']:8.1f} us/call   graph {g} us/call   ({c.label})")
        for name, us in row["kernels"]:
            print(f"    {us:8.1f} us  {name[:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
