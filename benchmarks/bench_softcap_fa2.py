"""fivar's FA2 soft-cap variant vs FlashInfer's stock FA2 soft-cap, in one run.

Both run the same FlashInfer FA2 prefill template; fivar's struct folds sm_scale/cap into one per-block
constant and cap into the softmax exponent scale, which is exactly the stock kernel's arithmetic, so the
target is parity (>= 0.97x). Correctness is checked before anything is timed.

    python3 benchmarks/bench_softcap_fa2.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json
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
    args = ap.parse_args()

    import flashinfer

    import fivar
    from fivar.testing import compare

    dev = torch.cuda.get_device_name()
    v = fivar.load("softcap")
    H, D, cap = args.heads, args.head_dim, args.softcap
    rows = []
    # correctness against the torch reference at a size the reference can afford
    q, k, vv = (torch.randn(1024, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    for causal in (False, True):
        r = compare("softcap", f"vs reference S=1024 causal={causal}", v.prefill(q, k, vv, causal=causal, softcap=cap, backend="fa2"),
                    v.reference(q, k, vv, causal=causal, softcap=cap), torch.bfloat16)
        print(r)
        assert r.passed, r
    for S in [int(s) for s in args.seqlens.split(",")]:
        for causal in (False, True):
            q, k, vv = (torch.randn(S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            fivar_fn = lambda: v.prefill(q, k, vv, causal=causal, softcap=cap, backend="fa2")  # noqa: E731
            stock_fn = lambda: flashinfer.single_prefill_with_kv_cache(  # noqa: E731
                q, k, vv, causal=causal, logits_soft_cap=cap, backend="fa2")
            a, b = fivar_fn(), stock_fn()
            rel = float((a.double() - b.double()).norm() / b.double().norm())
            assert rel < 1e-2, f"fivar and stock disagree: rel {rel}"
            t = time_interleaved({"fivar": fivar_fn, "stock": stock_fn}, rounds=6)
            tf, ts = t["fivar"].samples_ms, t["stock"].samples_ms
            flops = attention_flops(S, S, H, D, causal)
            mf, ms = t["fivar"].median, t["stock"].median
            rows.append(dict(S=S, causal=causal, fivar_ms=mf, stock_ms=ms, fivar_tflops=flops / mf / 1e9,
                             stock_tflops=flops / ms / 1e9, ratio=ms / mf, rel_err_vs_stock=rel,
                             fivar_samples=tf, stock_samples=ts,
                             fivar_spread=(min(tf), max(tf)), stock_spread=(min(ts), max(ts))))
    print(f"\nsoftcap={cap}, bf16, hd{D}, {H} heads, {dev}, {time.strftime('%Y-%m-%d')}")
    print(f"{'S':>6} {'causal':>6} {'fivar ms':>9} {'stock ms':>9} {'fivar TF/s':>10} {'stock TF/s':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['S']:>6} {str(r['causal']):>6} {r['fivar_ms']:>9.3f} {r['stock_ms']:>9.3f} "
              f"{r['fivar_tflops']:>10.1f} {r['stock_tflops']:>10.1f} {r['ratio']:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=dev, date=time.strftime("%Y-%m-%d"), flashinfer=flashinfer.__version__,
                           torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
