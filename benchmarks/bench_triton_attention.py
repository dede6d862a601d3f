"""The Triton twin of every bundled variant vs fivar's FlashInfer FA2 kernel and FlexAttention, one run.

    python3 benchmarks/bench_triton_attention.py [--json FILE] [--seqlen 8192] [--variants a,b]

Single prefill, bf16, hd128, 32 heads, non-causal. All three run the same variant: FlashInfer and Triton
from fivar's generated code, Flex through `fivar.flex` (the torch reference evaluator as score_mod /
mask_mod under torch.compile; no-softmax variants have no Flex form). Every contender is checked
against the torch reference (at --check-seqlen) and against the Triton twin (at --seqlen) before it
is timed; a contender that fails to run or to agree is reported, not timed.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

BUNDLED = ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask", "relative_bias",
           "softcap_sliding_window"]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def contenders(v, params, q, k, vv):
    fns = {"triton": lambda: v.prefill(q, k, vv, backend="triton", **params),
           "flashinfer_fa2": lambda: v.prefill(q, k, vv, backend="fa2", **params)}
    if v.softmax:
        from fivar.flex import flex_attention_fn
        fns["flex"] = flex_attention_fn(v, params, q, k, vv, causal=False)
    return fns


def bench_variant(name, args):
    import fivar
    from fivar.bench.timing import attention_flops, time_interleaved
    from fivar.testing import compare, example_params
    v = fivar.load(name)
    H, HKV, D, S = args.heads, args.kv_heads, args.head_dim, args.seqlen
    row = {"variant": name, "errors": {}}

    def qkv(n):
        return (torch.randn(n, H, D, dtype=torch.bfloat16, device="cuda"),
                torch.randn(n, HKV, D, dtype=torch.bfloat16, device="cuda"),
                torch.randn(n, HKV, D, dtype=torch.bfloat16, device="cuda"))

    # 1. correctness against the torch reference where it is affordable
    n = args.check_seqlen
    q, k, vv = qkv(n)
    params = example_params(v, num_qo_heads=H, num_kv_heads=HKV, batch_size=1, max_len=n, device="cuda")
    ref = v.reference(q, k, vv, **params)
    good = {}
    for cname, fn in contenders(v, params, q, k, vv).items():
        try:
            r = compare(name, f"{cname} vs reference S={n}", fn(), ref, torch.bfloat16)
            print(r, flush=True)
            good[cname] = r.passed
            if not r.passed:
                row["errors"][cname] = str(r)
        except Exception as e:  # a contender that cannot run this variant is reported, not fatal
            row["errors"][cname] = f"{type(e).__name__}: {e}".splitlines()[0]
            traceback.print_exc()
    # 2. the timed size: every passing contender must agree with the Triton twin there too
    q, k, vv = qkv(S)
    params = example_params(v, num_qo_heads=H, num_kv_heads=HKV, batch_size=1, max_len=S, device="cuda")
    fns = {c: fn for c, fn in contenders(v, params, q, k, vv).items() if good.get(c)}
    if "triton" not in fns:
        return row
    base = fns["triton"]()
    row["rel_err_vs_triton"] = {}
    for cname in list(fns):
        err = rel(fns[cname](), base)
        row["rel_err_vs_triton"][cname] = err
        if err > 2e-2:
            row["errors"][cname] = f"disagrees with the Triton twin at S={S}: rel {err:.2e}"
            del fns[cname]
    t = time_interleaved(fns, rounds=args.rounds)
    flops = attention_flops(S, S, H, D, causal=False)
    row["ms"] = {c: x.median for c, x in t.items()}
    row["spread_ms"] = {c: x.spread for c, x in t.items()}
    row["tflops"] = {c: flops / x.median / 1e9 for c, x in t.items()}
    print(f"{name}: " + ", ".join(f"{c} {tf:.0f} TF/s" for c, tf in row["tflops"].items()), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--check-seqlen", type=int, default=1024, help="length checked against the torch reference")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=",".join(BUNDLED))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    rows = [bench_variant(n, args) for n in args.variants.split(",") if n]
    dev = torch.cuda.get_device_name()
    print(f"\nbf16, hd{args.head_dim}, {args.heads}/{args.kv_heads} heads, S={args.seqlen}, non-causal, {dev}")
    names = ("triton", "flashinfer_fa2", "flex")
    print(f"{'variant':<24}" + "".join(f"{n + ' TF/s':>22}" for n in names))
    for r in rows:
        tf = r.get("tflops", {})
        print(f"{r['variant']:<24}" + "".join(f"{tf[n]:>22.1f}" if n in tf else f"{'-':>22}" for n in names))
        for c, e in r["errors"].items():
            print(f"    {c}: {e}")
    if args.json:
        import triton
        with open(args.json, "w") as f:
            json.dump(dict(gpu=dev, date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                           triton=triton.__version__, seqlen=args.seqlen, heads=args.heads,
                           kv_heads=args.kv_heads, head_dim=args.head_dim, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
