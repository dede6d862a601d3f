"""fivar's FA2 soft-cap variant vs FlashInfer's stock FA2 soft-cap, in one run.

Both run the same FlashInfer FA2 prefill template; fivar's struct folds sm_scale/cap into one per-block
constant and cap into the softmax exponent scale, which is exactly the stock kernel's arithmetic, so the
target is parity (>= 0.97x). Correctness is checked before anything is timed.

    python3 benchmarks/bench_softcap_fa2.py [--json FILE]
    python3 benchmarks/bench_softcap_fa2.py --nvcc-split-ab --seqlens 16,64,512,8192

--nvcc-split-ab also times fivar's module built without nvcc's --split-compile (FIVAR_NVCC_SPLIT_COMPILE=1)
in the same interleaved rounds: the split changes the scheduling of some small-tile kernels' SASS (the
CTA_TILE_Q=128 kernels come out identical), so this checks it costs no speed. Short sequences pick the
small tiles (FA2DetermineCtaTileQ: 16 rows -> tile 16, 64 -> tile 64).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from fivar.bench.timing import attention_flops, time_interleaved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--seqlens", default="4096,8192")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--nvcc-split-ab", action="store_true",
                    help="also time fivar's module built without nvcc --split-compile")
    args = ap.parse_args()

    import flashinfer

    import fivar
    from fivar.jit import toolchain
    from fivar.testing import compare

    dev = torch.cuda.get_device_name()
    v = fivar.load("softcap")
    H, D, cap = args.heads, args.head_dim, args.softcap
    rows = []
    # correctness against the torch reference at a size the reference can afford
    q, k, vv = (torch.randn(1024, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    def with_split(threads: str, fn):
        def call():
            os.environ[toolchain.SPLIT_COMPILE_ENV] = threads  # picks the module (fivar.jit.build.module_for)
            return fn()
        return call
    default_split = os.environ.get(toolchain.SPLIT_COMPILE_ENV, "")
    for causal in (False, True):
        r = compare("softcap", f"vs reference S=1024 causal={causal}", v.prefill(q, k, vv, causal=causal, softcap=cap, backend="fa2"),
                    v.reference(q, k, vv, causal=causal, softcap=cap), torch.bfloat16)
        print(r)
        assert r.passed, r
    for S in [int(s) for s in args.seqlens.split(",")]:
        for causal in (False, True):
            q, k, vv = (torch.randn(S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            fivar_fn = with_split(default_split, lambda: v.prefill(  # noqa: E731
                q, k, vv, causal=causal, softcap=cap, backend="fa2"))
            stock_fn = lambda: flashinfer.single_prefill_with_kv_cache(  # noqa: E731
                q, k, vv, causal=causal, logits_soft_cap=cap, backend="fa2")
            fns = {"fivar": fivar_fn, "stock": stock_fn}
            if args.nvcc_split_ab:
                fns["fivar_no_nvcc_split"] = with_split("1", lambda: v.prefill(  # noqa: E731
                    q, k, vv, causal=causal, softcap=cap, backend="fa2"))
            b = stock_fn()
            rels = {}
            for name, fn in fns.items():
                if name != "stock":
                    a = fn()
                    rels[name] = float((a.double() - b.double()).norm() / b.double().norm())
                    assert rels[name] < 1e-2, f"{name} and stock disagree: rel {rels[name]}"
            rel = rels["fivar"]
            t = time_interleaved(fns, rounds=6)
            tf, ts = t["fivar"].samples_ms, t["stock"].samples_ms
            flops = attention_flops(S, S, H, D, causal)
            mf, ms = t["fivar"].median, t["stock"].median
            rows.append(dict(S=S, causal=causal, fivar_ms=mf, stock_ms=ms, fivar_tflops=flops / mf / 1e9,
                             stock_tflops=flops / ms / 1e9, ratio=ms / mf, rel_err_vs_stock=rel,
                             fivar_samples=tf, stock_samples=ts,
                             fivar_spread=(min(tf), max(tf)), stock_spread=(min(ts), max(ts))))
            if args.nvcc_split_ab:
                mn = t["fivar_no_nvcc_split"].median
                rows[-1].update(fivar_no_nvcc_split_ms=mn, split_over_no_split_speed=mn / mf,
                                no_nvcc_split_rel_err_vs_stock=rels["fivar_no_nvcc_split"],
                                fivar_no_nvcc_split_samples=t["fivar_no_nvcc_split"].samples_ms)
    print(f"\nsoftcap={cap}, bf16, hd{D}, {H} heads, {dev}, {time.strftime('%Y-%m-%d')}")
    ab = " no-split ms  split/no-split speed" if args.nvcc_split_ab else ""
    print(f"{'S':>6} {'causal':>6} {'fivar ms':>9} {'stock ms':>9} {'fivar TF/s':>10} {'stock TF/s':>10} {'ratio':>6}{ab}")
    for r in rows:
        ab = f" {r['fivar_no_nvcc_split_ms']:>11.4f} {r['split_over_no_split_speed']:>20.3f}" if args.nvcc_split_ab else ""
        print(f"{r['S']:>6} {str(r['causal']):>6} {r['fivar_ms']:>9.4f} {r['stock_ms']:>9.4f} "
              f"{r['fivar_tflops']:>10.1f} {r['stock_tflops']:>10.1f} {r['ratio']:>6.3f}{ab}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=dev, date=time.strftime("%Y-%m-%d"), flashinfer=flashinfer.__version__,
                           torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
