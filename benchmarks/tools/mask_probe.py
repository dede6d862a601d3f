"""The Triton twin's block-sparse path on masks, against FlexAttention and plain attention, in one process.

A diagnostic (the results file's rows come from `python -m fivar.bench --suite masks`): for each variant file named
(or every mask of benchmarks/masks and the seeded random masks), S = 8192 prefill, bf16, head dim 128, GQA 32/8, it
checks the Triton twin, Flex (block mask from the same mask) and SDPA against the float64 reference (last rows),
then times them (median of triton.testing.do_bench) and prints the block map's shape (non-empty, whole and cut tile
fractions) and its planning time.

    python benchmarks/tools/mask_probe.py [FILE.py ...] [--random N] [--seed S] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def probe(v, seqlen: int, causal: bool, params: dict | None = None, sync_check: bool = False) -> dict:
    import triton.testing
    from fivar.bench.contenders import contenders, make_problem
    from fivar.bench.harness import _checker
    from fivar.codegen.triton import kernel_arg_values, reads_mask_bits
    from fivar.jit.triton_module import load_triton_module
    from fivar.runtime.launch import _prepare

    p = make_problem(v, "prefill", seqlen, 1, (32, 8), 128, torch.bfloat16, causal, "cuda", params=params)
    row = {"variant": v.name, "causal": causal, "bits": reads_mask_bits(v)}
    q, k = p.tensors["q"], p.tensors["k"]
    module = load_triton_module(v)
    if hasattr(module, "block_map"):
        bound, sm_scale = _prepare(v, p.params, q, k.shape[1], 1, None)
        args = kernel_arg_values(v, bound, sm_scale)
        ind = torch.tensor([0, seqlen], dtype=torch.int32, device="cuda")
        make = lambda: module.block_map(ind, ind, seqlen, seqlen, 32, 4, causal, args)  # noqa: E731
        plan = make()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            plan = make()
        torch.cuda.synchronize()
        row["plan_ms"] = (time.perf_counter() - t0) / 5 * 1e3
        n = plan.kinds.numel()
        row.update(nonempty=float((plan.kinds > 0).sum()) / n, whole=float((plan.kinds == 2).sum()) / n,
                   cut=float((plan.kinds == 1).sum()) / n)
        # the module's launch with the map made once (no runtime checks, no plan lookup), then its kernels alone
        launch = lambda: module.prefill(q, k, p.tensors["v"], ind, ind, seqlen, causal, args, plan=plan)  # noqa: E731
        launch()
        row["direct"] = triton.testing.do_bench(launch, warmup=50, rep=300, return_mode="median")
        try:
            row["graph"] = triton.testing.do_bench_cudagraph(launch, rep=300, return_mode="median")
        except Exception as e:  # noqa: BLE001 (a diagnostic column)
            row["graph"] = f"{type(e).__name__}"
    check = _checker(v, p)
    for c in contenders(v, p, ["triton", "flex"], stock=None, fivar=False):
        r = check(c)
        if not r.passed and c.checks_variant:
            row[c.name] = f"FAILED rel {r.rel_err:.3g}"
            continue
        row[c.name] = triton.testing.do_bench(c.fn, warmup=50, rep=300, return_mode="median")
        if sync_check:
            import warnings
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                c.fn()
            torch.cuda.set_sync_debug_mode(0)
            row[f"{c.name}_syncs"] = [f"{Path(w.filename).name}:{w.lineno}" for w in caught]
    if isinstance(row.get("triton"), float) and isinstance(row.get("flex"), float):
        row["triton_vs_flex"] = row["flex"] / row["triton"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", type=Path, help="variant files, called causally (default: the battery)")
    ap.add_argument("--random", type=int, default=0, help="also this many seeded random masks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first SKIP random masks (a run in parts)")
    ap.add_argument("--no-battery", action="store_true")
    ap.add_argument("--sync-check", action="store_true", help="report device syncs in one call of each contender")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from fivar.bench.suites import masks, random_masks
    from fivar.registry import load_file
    todo = [(load_file(f), True) for f in args.files]  # a file named here is called causally
    if not args.files and not args.no_battery:
        todo = [(masks.load(name), e.causal) for name, e in masks.BATTERY.items()]
    todo += [(random_masks.load(m), m.causal) for m in random_masks.generate(args.seed, args.random)[args.skip:]]
    rows = []
    for v, causal in todo:
        try:
            row = probe(v, args.seqlen, causal, sync_check=args.sync_check)
        except Exception as e:  # a probe reports every mask, whatever one of them does
            row = {"variant": v.name, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    print(f"\n{'variant':28} {'causal':6} {'bits':5} {'nonempty':>8} {'cut':>6} {'plan ms':>8} {'triton':>8} "
          f"{'direct':>8} {'graph':>8} {'flex':>8} {'x flex':>7}")
    for r in rows:
        f = lambda key, fmt: (format(r[key], fmt) if isinstance(r.get(key), float) else str(r.get(key, "-"))[:8])  # noqa: E731
        print(f"{r['variant'][:28]:28} {str(r.get('causal', '-')):6} {str(r.get('bits', '-')):5} "
              f"{f('nonempty', '8.3f')} {f('cut', '6.3f')} {f('plan_ms', '8.3f')} {f('triton', '8.3f')} "
              f"{f('direct', '8.3f')} {f('graph', '8.3f')} {f('flex', '8.3f')} {f('triton_vs_flex', '7.2f')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
