"""Does FA3 single prefill idle in its last wave? Time it at 31, 32 and 33 query heads.

    python3 benchmarks/tools/wave_quantization.py [--seqlens 8192,16384] [--json FILE]

Non-causal FA3 single prefill runs one CTA per (128-row query tile, head), one CTA per SM, all of one length. At
S=16384 on a 132-SM GPU, 32 heads make 4096 CTAs: 31 full waves and a 32nd of 4 CTAs. 33 heads (4224 CTAs) fill
exactly 32 waves, 31 heads (3968) need 31. If the last wave's idle SMs cost what the wave count says, the kernel
takes about as long at 33 heads as at 32, and 31/32 of it at 31 heads; if CTAs overlap across waves well enough
for the count not to matter, time grows with the heads (31 : 32 : 33). This is the evidence behind
fivar.runtime.wave_split. fivar's soft-cap (with its wave split off) and stock FA3 with `logits_soft_cap=30`, bf16,
hd128; each is checked against the other before anything is timed.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

import fivar
from fivar.bench.timing import attention_flops, time_interleaved
from fivar.runtime.wave_split import wave_split

D, CAP, HEADS = 128, 30.0, (31, 32, 33)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="8192,16384")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    import flashinfer
    from fivar.codegen.fa3 import non_causal_tile
    from fivar.jit.build import serving_modules
    from prewarm_gpu import build_beside_stock, stock_fa3_spec  # benchmarks/tools/: this script's directory
    v = fivar.load("softcap")
    mods = serving_modules(v, "single_prefill", "fa3", head_dim=D)
    print(f"built in {build_beside_stock(mods, [stock_fa3_spec(D, False, True)]):.0f} s", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = dict(gpu=torch.cuda.get_device_name(), sms=sms, date=time.strftime("%Y-%m-%d"), rows=[])
    for S in (int(s) for s in args.seqlens.split(",")):
        for H in HEADS:
            q, k, vv = (torch.randn(S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))

            def fivar_fa3():
                with wave_split(False):
                    return v.prefill(q, k, vv, softcap=CAP, backend="fa3")
            fns = {"fivar_fa3": fivar_fa3,
                   "stock_fa3": lambda: flashinfer.single_prefill_with_kv_cache(q, k, vv, logits_soft_cap=CAP,
                                                                               backend="fa3")}
            a, b = (fn().double() for fn in fns.values())
            err = float((a - b).norm() / b.norm())
            assert err < 1e-2, f"fivar vs stock at S={S} H={H}: relative error {err}"
            t = time_interleaved(fns, args.rounds)
            ctas = math.ceil(S / non_causal_tile(mods[0].options.get("cta_tile"), D, S)[0]) * H
            row = dict(S=S, heads=H, ctas=ctas, waves=math.ceil(ctas / sms), full_waves=ctas / sms,
                       rel_err_vs_stock=err, ms={n: x.median for n, x in t.items()},
                       spread_ms={n: x.spread for n, x in t.items()},
                       tflops={n: attention_flops(S, S, H, D, False) / x.median / 1e9 for n, x in t.items()})
            out["rows"].append(row)
            print(f"S={S} H={H}: {ctas} CTAs, {row['full_waves']:.2f} waves -> {row['waves']}: " + ", ".join(
                f"{n} {t[n].median:.3f} ms ({row['tflops'][n]:.0f} TF/s)" for n in fns), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print("\nms per head relative to 32 heads (1.000 = the time grows with the heads; the wave count predicts "
          "31 heads: 31/32 waves, 33 heads: 32/32):")
    for r in out["rows"]:
        base = next(x for x in out["rows"] if x["S"] == r["S"] and x["heads"] == 32)
        print(f"  S={r['S']} H={r['heads']}: " + ", ".join(
            f"{n} {r['ms'][n] / r['heads'] / (base['ms'][n] / 32):.3f}" for n in r["ms"]))


if __name__ == "__main__":
    main()
