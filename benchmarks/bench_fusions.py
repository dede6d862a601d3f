"""fivar's norm/RoPE fusions vs stock FlashInfer, in one run (H100/H200; bf16).

1. qwen3_qk_norm_rope (one kernel, in place on packed QKV) vs the unfused stock sequence
   flashinfer.rmsnorm(q heads) + flashinfer.rmsnorm(k heads) + apply_rope_with_cos_sin_cache_inplace,
   at 4096 tokens (32 q heads, 8 kv heads, head dim 128), and achieved bandwidth at 65536 tokens as a
   % of a measured device copy (torch copy of a large tensor, bytes read + written).
2. llama_add_rmsnorm vs flashinfer.fused_add_rmsnorm (both in place) at tokens {1, 16, 256, 4096, 16384,
   65536} x hidden {4096, 8192}, with % of copy bandwidth.
3. RoPE alone vs flashinfer.apply_rope_with_cos_sin_cache_inplace: partial_rope_gptj (GPT-J, 64 of 128)
   and a NeoX full-rotary rope-only fusion.

Every contender is checked against the torch reference (and fivar against stock) before timing.
`fivar` is the validated Python call, `fivar_bound` the pre-validated launch (v.bind(...)), which is
what a serving loop / CUDA graph would use. Timings: fivar.bench.timing.time_interleaved (CUDA-event
medians, contenders interleaved).

    python3 benchmarks/bench_fusions.py [--json FILE] [--quick]
"""
from __future__ import annotations

import argparse
import json
import time

from fivar.bench.membound import bandwidth_row, check_close, copy_bandwidth


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and rounds (smoke run)")
    ap.add_argument("--rounds", type=int, default=5)
    return ap.parse_args(argv)


def bench_qwen3(torch, flashinfer, copy_gbs, rounds, token_list):
    import fivar
    from fivar.bench.timing import time_interleaved
    from fivar.fusion import reference as R
    v = fivar.load("qwen3_qk_norm_rope")
    hq, hk, d, eps = 32, 8, 128, 1e-6
    rows = []
    for tokens in token_list:
        qkv = torch.randn(tokens, (hq + 2 * hk) * d, dtype=torch.bfloat16, device="cuda")
        pos = torch.randint(0, 8192, (tokens,), device="cuda")
        cs = R.cos_sin_cache(8192, d, 1000000.0, device="cuda")
        qw = torch.randn(d, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
        kw = torch.randn(d, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
        kw_args = dict(num_q_heads=hq, num_kv_heads=hk, positions=pos, cos_sin_cache=cs, q_weight=qw,
                       k_weight=kw, eps=eps)
        q_ref, k_ref = v.reference(qkv=qkv, **kw_args)

        def stock(buf):
            q = buf[:, :hq * d].unflatten(1, (hq, d))
            k = buf[:, hq * d:(hq + hk) * d].unflatten(1, (hk, d))
            flashinfer.rmsnorm(q, qw, eps, out=q)
            flashinfer.rmsnorm(k, kw, eps, out=k)
            flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, buf[:, :hq * d], buf[:, hq * d:(hq + hk) * d],
                                                             d, cs, is_neox=True)
            return q, k
        a, b = qkv.clone(), qkv.clone()
        fq, fk = v(qkv=a, **kw_args)
        sq, sk = stock(b)
        errs = dict(fivar_vs_ref=check_close("qwen3 q", fq, q_ref), fivar_k_vs_ref=check_close("qwen3 k", fk, k_ref),
                    stock_vs_ref=check_close("stock q", sq, q_ref), fivar_vs_stock=check_close("q vs stock", fq, sq))
        bound = v.bind(qkv=a, **kw_args)
        t = time_interleaved({"fivar": lambda: v(qkv=a, **kw_args), "fivar_bound": bound,
                              "stock": lambda: stock(b)}, rounds=rounds)
        moved = tokens * (hq + hk) * d * 2 * 2 + tokens * d * 4 + tokens * 8  # q,k read+write; cos/sin; pos
        rows.append(bandwidth_row("qwen3_qk_norm_rope", t, moved, copy_gbs, tokens=tokens, heads=(hq, hk), head_dim=d,
                         errs=errs, speedup_vs_stock=t["stock"].median / t["fivar_bound"].median))
    return rows


def bench_add_rmsnorm(torch, flashinfer, copy_gbs, rounds, token_list, hiddens):
    import fivar
    v = fivar.load("llama_add_rmsnorm")
    return [_add_rmsnorm_row(torch, flashinfer, v, copy_gbs, rounds, tokens, hidden)
            for hidden in hiddens for tokens in token_list]


def _add_rmsnorm_row(torch, flashinfer, v, copy_gbs, rounds, tokens, hidden):
    """One shape; its tensors go when it returns."""
    from fivar.bench.timing import time_interleaved
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(hidden, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    out_ref, res_ref = v.reference(x=x, residual=r, weight=w, eps=1e-5)
    x1, r1, x2, r2 = x.clone(), r.clone(), x.clone(), r.clone()
    v(x=x1, residual=r1, weight=w, eps=1e-5, out=x1)
    flashinfer.fused_add_rmsnorm(x2, r2, w, 1e-5)
    errs = dict(fivar_vs_ref=check_close("add_rmsnorm", x1, out_ref),
                residual=check_close("residual", r1, res_ref),
                fivar_vs_stock=check_close("vs stock", x1, x2))
    bound = v.bind(x=x1, residual=r1, weight=w, eps=1e-5, out=x1)
    t = time_interleaved({"fivar": lambda: v(x=x1, residual=r1, weight=w, eps=1e-5, out=x1),
                          "fivar_bound": bound,
                          "stock": lambda: flashinfer.fused_add_rmsnorm(x2, r2, w, 1e-5)}, rounds=rounds)
    moved = tokens * hidden * 2 * 4 + hidden * 2  # read x, r; write r, out; weight
    return bandwidth_row("llama_add_rmsnorm", t, moved, copy_gbs, tokens=tokens, hidden=hidden, errs=errs,
                         speedup_vs_stock=t["stock"].median / t["fivar_bound"].median)


def bench_rope(torch, flashinfer, copy_gbs, rounds, tokens):
    import fivar
    from fivar.bench.timing import time_interleaved
    from fivar.fusion import reference as R
    rows = []
    neox = fivar.FusionVariant(name="rope_neox_hd128", norm=None, rope="neox", head_dim=128)
    for v in (fivar.load("partial_rope_gptj"), neox):
        hq, hk, d = 32, 8, v.head_dim
        q = torch.randn(tokens, hq * d, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(tokens, hk * d, dtype=torch.bfloat16, device="cuda")
        pos = torch.randint(0, 8192, (tokens,), device="cuda")
        cs = R.cos_sin_cache(8192, v.rotary_dim, device="cuda")
        q_ref, k_ref = v.reference(q=q, k=k, positions=pos, cos_sin_cache=cs)
        q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
        v(q=q1, k=k1, positions=pos, cos_sin_cache=cs)
        is_neox = v.rope == "neox"
        flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, q2, k2, d, cs, is_neox=is_neox)
        errs = dict(fivar_vs_ref=check_close(v.name, q1.unflatten(1, (hq, d)), q_ref),
                    stock_vs_ref=check_close("stock rope", q2.unflatten(1, (hq, d)), q_ref),
                    fivar_vs_stock=check_close("rope vs stock", q1, q2))
        bound = v.bind(q=q1, k=k1, positions=pos, cos_sin_cache=cs)
        t = time_interleaved({"fivar": lambda: v(q=q1, k=k1, positions=pos, cos_sin_cache=cs), "fivar_bound": bound,
                              "stock": lambda: flashinfer.apply_rope_with_cos_sin_cache_inplace(
                                  pos, q2, k2, d, cs, is_neox=is_neox)}, rounds=rounds)
        moved = tokens * (hq + hk) * d * 2 * 2 + tokens * v.rotary_dim * 4 + tokens * 8
        rows.append(bandwidth_row(f"rope_only:{v.name}", t, moved, copy_gbs, tokens=tokens, heads=(hq, hk), head_dim=d,
                         rotary_dim=v.rotary_dim, errs=errs,
                         speedup_vs_stock=t["stock"].median / t["fivar_bound"].median))
    return rows


def main(argv=None):
    args = _args(argv)
    import torch
    import flashinfer

    rounds = 2 if args.quick else args.rounds
    dev = torch.cuda.get_device_name()
    copy_gbs, copy_ms = copy_bandwidth()
    print(f"{dev}: device copy {copy_gbs:.0f} GB/s (1 GiB, read + write)")
    rows = []
    rows += bench_qwen3(torch, flashinfer, copy_gbs, rounds, [4096] if args.quick else [4096, 65536])
    rows += bench_add_rmsnorm(torch, flashinfer, copy_gbs, rounds,
                              [1, 256, 16384] if args.quick else [1, 16, 256, 4096, 16384, 65536],
                              [4096] if args.quick else [4096, 8192])
    rows += bench_rope(torch, flashinfer, copy_gbs, rounds, 4096 if args.quick else 16384)
    print(f"\n{'case':<34} {'tokens':>6} {'hidden':>6} {'fivar ms':>9} {'bound ms':>9} {'stock ms':>9} "
          f"{'x stock':>7} {'bound %copy':>11} {'stock %copy':>11}")
    for r in rows:
        print(f"{r['case']:<34} {r['tokens']:>6} {r.get('hidden', ''):>6} {r['fivar_ms']:>9.4f} "
              f"{r['fivar_bound_ms']:>9.4f} {r['stock_ms']:>9.4f} {r['speedup_vs_stock']:>7.2f} "
              f"{r['fivar_bound_pct_copy']:>10.1f}% {r['stock_pct_copy']:>10.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=dev, date=time.strftime("%Y-%m-%d"), flashinfer=flashinfer.__version__,
                           torch=torch.__version__, copy_GBps=copy_gbs, copy_ms=copy_ms, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
