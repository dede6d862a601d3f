"""fivar.triton_ops (Triton norm/RoPE baselines) vs stock FlashInfer, as % of device copy bandwidth (H100/H200; bf16).

Cases, at 65536 tokens x 4096 hidden by default (q: 32 heads x 128, k/v: 8 heads x 128 for the RoPE cases,
q/k being strided views of a packed QKV buffer):

1. rmsnorm                vs flashinfer.rmsnorm                    (x -> out)
2. fused_add_rmsnorm      vs flashinfer.fused_add_rmsnorm          (in place on x and residual)
3. apply_rope neox (full rotary) and gptj (rotary_dim 64 of 128)
                          vs flashinfer.apply_rope_with_cos_sin_cache_inplace
4. qk_norm_rope (Qwen3-style per-head q/k RMSNorm + NeoX RoPE, one kernel)
                          vs the unfused stock sequence flashinfer.rmsnorm(q) + rmsnorm(k) + apply_rope_...

Every contender is checked against the torch reference (fivar.fusion.reference) and against the other
before anything is timed. Timings: fivar.bench.timing.time_interleaved (CUDA-event medians, contenders
interleaved, L2 flushed). Bandwidth counts the bytes each op must move (every element it has to read or
write once; for partial rotary, only the rotated features) and is reported as a % of a measured
device-to-device torch copy (1 GiB, read + write counted).

    python3 benchmarks/bench_triton_ops.py [--tokens 65536] [--hidden 4096] [--json FILE] [--quick]
"""
from __future__ import annotations

import argparse
import json
import time

from fivar.bench.membound import bandwidth_row, check_close, copy_bandwidth

HEAD_DIM = 128
MAX_POS = 8192


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=4096,
                    help=f"hidden size (rmsnorm rows; RoPE cases: hidden/{HEAD_DIM} q heads, a quarter of that kv)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="4096 tokens and 2 rounds (smoke run)")
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--cases", default="rmsnorm,fused_add_rmsnorm,rope_neox,rope_gptj,qk_norm_rope")
    ap.add_argument("--tile", type=int, default=None,
                    help="elements per chunk of heads in the RoPE and QK-norm+RoPE kernels (their TILE), to sweep")
    return ap.parse_args(argv)


def _row(case, timings, bytes_moved, copy_gbs, **extra):
    r = bandwidth_row(case, timings, bytes_moved, copy_gbs, **extra)
    r["triton_vs_flashinfer"] = timings["flashinfer"].median / timings["triton"].median
    return r


def bench_rmsnorm(torch, flashinfer, T, copy_gbs, rounds, tokens, hidden, eps=1e-6):
    from fivar.bench.timing import time_interleaved
    from fivar.fusion import reference as R
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(hidden, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    ref = R.rms_norm(x, w, eps)
    out_t, out_f = torch.empty_like(x), torch.empty_like(x)
    T.rmsnorm(x, w, eps, out=out_t)
    flashinfer.rmsnorm(x, w, eps, out=out_f)
    errs = dict(triton_vs_ref=check_close("triton rmsnorm", out_t, ref),
                flashinfer_vs_ref=check_close("flashinfer rmsnorm", out_f, ref),
                triton_vs_flashinfer=check_close("rmsnorm triton vs flashinfer", out_t, out_f))
    t = time_interleaved({"triton": lambda: T.rmsnorm(x, w, eps, out=out_t),
                          "flashinfer": lambda: flashinfer.rmsnorm(x, w, eps, out=out_f)}, rounds=rounds)
    moved = tokens * hidden * 2 * 2 + hidden * 2  # read x, write out; weight
    return _row("rmsnorm", t, moved, copy_gbs, tokens=tokens, hidden=hidden, errs=errs)


def bench_fused_add_rmsnorm(torch, flashinfer, T, copy_gbs, rounds, tokens, hidden, eps=1e-6):
    from fivar.bench.timing import time_interleaved
    from fivar.fusion import reference as R
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(hidden, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    s = x.float() + r.float()
    ref_out = R.rms_norm(s, w, eps)
    x1, r1, x2, r2 = x.clone(), r.clone(), x.clone(), r.clone()
    del x, r
    T.fused_add_rmsnorm(x1, r1, w, eps)
    flashinfer.fused_add_rmsnorm(x2, r2, w, eps)
    errs = dict(triton_vs_ref=check_close("triton fused_add_rmsnorm", x1, ref_out),
                triton_residual=check_close("triton residual", r1, s),
                flashinfer_vs_ref=check_close("flashinfer fused_add_rmsnorm", x2, ref_out),
                triton_vs_flashinfer=check_close("fused_add_rmsnorm triton vs flashinfer", x1, x2))
    del s, ref_out
    t = time_interleaved({"triton": lambda: T.fused_add_rmsnorm(x1, r1, w, eps),
                          "flashinfer": lambda: flashinfer.fused_add_rmsnorm(x2, r2, w, eps)}, rounds=rounds)
    moved = tokens * hidden * 2 * 4 + hidden * 2  # read x, residual; write residual, x; weight
    return _row("fused_add_rmsnorm", t, moved, copy_gbs, tokens=tokens, hidden=hidden, errs=errs)


def _qkv(torch, tokens, hq, hk, d):
    buf = torch.randn(tokens, (hq + 2 * hk) * d, dtype=torch.bfloat16, device="cuda")
    return buf


def _views(buf, hq, hk, d):
    tokens = buf.shape[0]
    q2, k2 = buf[:, :hq * d], buf[:, hq * d:(hq + hk) * d]  # [T, H*D] strided (FlashInfer's layout)
    return q2, k2, q2.view(tokens, hq, d), k2.view(tokens, hk, d)


def bench_rope(torch, flashinfer, T, copy_gbs, rounds, tokens, hidden, style, rotary_dim):
    from fivar.bench.timing import time_interleaved
    from fivar.fusion import reference as R
    d = HEAD_DIM
    hq = hidden // d
    hk = max(1, hq // 4)
    buf = _qkv(torch, tokens, hq, hk, d)
    pos = torch.randint(0, MAX_POS, (tokens,), device="cuda")
    cs = R.cos_sin_cache(MAX_POS, rotary_dim, device="cuda")
    _, _, q, k = _views(buf, hq, hk, d)
    q_ref, k_ref = R.apply_rope(q, pos, cs, rotary_dim, style), R.apply_rope(k, pos, cs, rotary_dim, style)
    a, b = buf.clone(), buf.clone()
    del buf
    _, _, qa, ka = _views(a, hq, hk, d)
    qb2, kb2, qb, _ = _views(b, hq, hk, d)
    is_neox = style == "neox"

    def stock():
        flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, qb2, kb2, d, cs, is_neox=is_neox)

    T.apply_rope(qa, ka, pos, cs, rotary_dim, style)
    stock()
    errs = dict(triton_vs_ref=check_close(f"triton rope {style}", qa, q_ref),
                triton_k_vs_ref=check_close(f"triton rope {style} k", ka, k_ref),
                flashinfer_vs_ref=check_close(f"flashinfer rope {style}", qb, q_ref),
                triton_vs_flashinfer=check_close(f"rope {style} triton vs flashinfer", a, b))
    del q_ref, k_ref
    t = time_interleaved({"triton": lambda: T.apply_rope(qa, ka, pos, cs, rotary_dim, style),
                          "flashinfer": stock}, rounds=rounds)
    moved = tokens * (hq + hk) * rotary_dim * 2 * 2 + tokens * rotary_dim * 4 + tokens * 8  # rotated q,k r+w
    return _row(f"rope_{style}_rot{rotary_dim}", t, moved, copy_gbs, tokens=tokens, hidden=hidden,
                heads=(hq, hk), head_dim=d, rotary_dim=rotary_dim, errs=errs)


def bench_qk_norm_rope(torch, flashinfer, T, copy_gbs, rounds, tokens, hidden, eps=1e-6):
    from fivar.bench.timing import time_interleaved
    from fivar.fusion import reference as R
    d = HEAD_DIM
    hq = hidden // d
    hk = max(1, hq // 4)
    buf = _qkv(torch, tokens, hq, hk, d)
    pos = torch.randint(0, MAX_POS, (tokens,), device="cuda")
    cs = R.cos_sin_cache(MAX_POS, d, base=1000000.0, device="cuda")
    qw = torch.randn(d, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    kw = torch.randn(d, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    _, _, q, k = _views(buf, hq, hk, d)
    q_ref = R.apply_rope(R.rms_norm(q, qw, eps), pos, cs, d, "neox")
    k_ref = R.apply_rope(R.rms_norm(k, kw, eps), pos, cs, d, "neox")
    a, b = buf.clone(), buf.clone()
    del buf
    _, _, qa, ka = _views(a, hq, hk, d)
    qb2, kb2, qb, kb = _views(b, hq, hk, d)

    def stock():
        flashinfer.rmsnorm(qb, qw, eps, out=qb)
        flashinfer.rmsnorm(kb, kw, eps, out=kb)
        flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, qb2, kb2, d, cs, is_neox=True)

    T.qk_norm_rope(qa, ka, qw, kw, pos, cs, d, eps=eps)
    stock()
    errs = dict(triton_vs_ref=check_close("triton qk_norm_rope q", qa, q_ref),
                triton_k_vs_ref=check_close("triton qk_norm_rope k", ka, k_ref),
                flashinfer_vs_ref=check_close("stock q", qb, q_ref),
                triton_vs_flashinfer=check_close("qk_norm_rope triton vs stock", a, b))
    del q_ref, k_ref
    t = time_interleaved({"triton": lambda: T.qk_norm_rope(qa, ka, qw, kw, pos, cs, d, eps=eps),
                          "flashinfer": stock}, rounds=rounds)
    moved = tokens * (hq + hk) * d * 2 * 2 + tokens * d * 4 + tokens * 8  # q,k read+write; cos/sin; pos
    return _row("qk_norm_rope", t, moved, copy_gbs, tokens=tokens, hidden=hidden, heads=(hq, hk), head_dim=d,
                rotary_dim=d, errs=errs)


def main(argv=None):
    args = _args(argv)
    import flashinfer
    import torch

    import fivar.triton_ops as T
    if args.tile:
        import fivar.triton_ops.qk_norm_rope
        import fivar.triton_ops.rope
        fivar.triton_ops.rope.TILE = fivar.triton_ops.qk_norm_rope.TILE = args.tile

    tokens = 4096 if args.quick else args.tokens
    rounds = 2 if args.quick else args.rounds
    if args.hidden % HEAD_DIM:
        raise SystemExit(f"--hidden must be a multiple of {HEAD_DIM}")
    dev = torch.cuda.get_device_name()
    copy_gbs, copy_ms = copy_bandwidth()
    print(f"{dev}: device copy {copy_gbs:.0f} GB/s (1 GiB, read + write); {tokens} tokens x {args.hidden} hidden")
    common = (torch, flashinfer, T, copy_gbs, rounds, tokens, args.hidden)
    rows = []
    cases = {"rmsnorm": (bench_rmsnorm, {}), "fused_add_rmsnorm": (bench_fused_add_rmsnorm, {}),
             "rope_neox": (bench_rope, dict(style="neox", rotary_dim=HEAD_DIM)),
             "rope_gptj": (bench_rope, dict(style="gptj", rotary_dim=HEAD_DIM // 2)),
             "qk_norm_rope": (bench_qk_norm_rope, {})}
    for name in args.cases.split(","):
        fn, kw = cases[name]
        rows.append(fn(*common, **kw))
        torch.cuda.empty_cache()
    print(f"\n{'case':<22} {'MB moved':>9} {'triton ms':>10} {'fi ms':>9} {'fi/triton':>9} "
          f"{'triton %copy':>12} {'fi %copy':>9}")
    for r in rows:
        print(f"{r['case']:<22} {r['bytes_moved'] / 1e6:>9.1f} {r['triton_ms']:>10.4f} {r['flashinfer_ms']:>9.4f} "
              f"{r['triton_vs_flashinfer']:>9.2f} {r['triton_pct_copy']:>11.1f}% {r['flashinfer_pct_copy']:>8.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=dev, date=time.strftime("%Y-%m-%d"), flashinfer=flashinfer.__version__,
                           torch=torch.__version__, copy_GBps=copy_gbs, copy_ms=copy_ms, tokens=tokens,
                           hidden=args.hidden, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
