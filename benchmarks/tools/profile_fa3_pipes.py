"""Where FA3 soft-cap spends its cycles: Nsight Compute's pipe utilisation and warp stalls, kernel by kernel.

    python3 benchmarks/tools/profile_fa3_pipes.py [--seqlen 8192] [--causal] [--window W] [--contenders a,b] [--out DIR]

#3 asks, where a target is missed, for the reason with evidence. Timing sweeps (exp2 splits, CTA tiles, the
bounded softmax) say what is faster, not what bounds it. This script builds, in one parallel ninja:

- fivar's soft-cap FA3 single prefill (its default: the bounded softmax, 2 of 8 exp2 columns on the FMA pipe),
- the same with FIVAR_FA3_EXP2_EMULATION=0 (every exp2 on MUFU),
- stock FA3 with `logits_soft_cap=30`, and stock FA3 without a cap (no tanh: one MUFU op per score);

checks each against the torch reference on the last 256 query rows, then runs `ncu --clock-control none` (the
device notes: leave the clocks alone) on one launch of each, bf16, hd128, 32 heads, and reads the raw metrics
back: the share of cycles each pipe is busy (tensor/wgmma, XU = MUFU, FMA, ALU), instructions issued per cycle,
and why warps stalled. The raw CSV of every kernel lands in --out; a short table is printed last.

`--window W` profiles the soft-capped sliding window instead (fivar's `softcap_sliding_window`, stock FA3 with
`window_left=W-1`, with and without the cap): the per-block fixed cost #3's causal window row is short by shows as
the tensor pipe's share of elapsed cycles against the full-length kernels'.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import time

H, D, CAP = 32, 128, 30.0
CONTENDERS = ("fivar_fa3", "fivar_fa3_exp2_0", "stock_fa3_softcap", "stock_fa3_plain")
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "InstructionStats", "WarpStateStats", "SchedulerStats",
            "LaunchStats", "Occupancy")


def _setup(window):
    """(fivar variant name, its params, stock FA3's extra kwargs) for a window of `window` keys (0: none)."""
    if window:
        return "softcap_sliding_window", {"softcap": CAP, "window": window}, {"window_left": window - 1}
    return "softcap", {"softcap": CAP}, {}


def _calls(seqlen, causal, window):
    """{contender: a zero-argument call} on fresh random bf16 inputs, and the inputs."""
    import flashinfer
    import torch

    import fivar
    from fivar.codegen.fa3 import exp2_split
    name, params, stock = _setup(window)
    v = fivar.load(name)
    q, k, vv = (torch.randn(seqlen, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))

    def emulation_off():
        with exp2_split(0):
            return v.prefill(q, k, vv, causal=causal, backend="fa3", **params)

    calls = {
        "fivar_fa3": lambda: v.prefill(q, k, vv, causal=causal, backend="fa3", **params),
        "fivar_fa3_exp2_0": emulation_off,
        "stock_fa3_softcap": lambda: flashinfer.single_prefill_with_kv_cache(
            q, k, vv, causal=causal, logits_soft_cap=CAP, backend="fa3", **stock),
        "stock_fa3_plain": lambda: flashinfer.single_prefill_with_kv_cache(q, k, vv, causal=causal, backend="fa3",
                                                                           **stock),
    }
    return calls, (v, params, q, k, vv)


def build(window, contenders):
    """Every module, in one parallel ninja (fivar's) beside FlashInfer's own, before anything is profiled."""
    import fivar
    from fivar.codegen.fa3 import exp2_split
    from fivar.jit.build import serving_modules
    from prewarm_gpu import build_beside_stock, stock_fa3_spec  # benchmarks/tools/ is this script's directory
    v = fivar.load(_setup(window)[0])
    mods = serving_modules(v, "single_prefill", "fa3", head_dim=D)
    if "fivar_fa3_exp2_0" in contenders:
        with exp2_split(0):
            mods += serving_modules(v, "single_prefill", "fa3", head_dim=D)
    stock = [stock_fa3_spec(D, bool(window), cap) for cap in (True, False)]
    seconds = build_beside_stock(mods, stock)
    print(f"built {len(mods)} fivar modules and {len(stock)} stock FA3 modules in {seconds:.0f} s", flush=True)


def check(seqlen, causal, window, contenders):
    """Each contender against the reference (last 256 rows), stock without the cap against the cap-free one (the
    bundled sliding_window, or plain attention); returns {contender: passed}."""
    import torch

    import fivar
    from fivar.bench.contenders import plain as plain_attention
    from fivar.testing import compare
    calls, (v, params, q, k, vv) = _calls(seqlen, causal, window)
    ref = v.reference(q[-256:], k, vv, causal=causal, **params)
    uncapped = fivar.load("sliding_window") if window else plain_attention()
    plain = uncapped.reference(q[-256:], k, vv, causal=causal, **({"window": window} if window else {}))
    ok = {}
    for name in contenders:
        call = calls[name]
        result = compare(v.name, f"{name} vs reference (last 256 rows)", call()[-256:],
                         plain if name == "stock_fa3_plain" else ref, torch.bfloat16)
        print(result, flush=True)
        ok[name] = result.passed
    return ok


def run_one(name, seqlen, causal, window, launches=3):
    import torch
    calls, _ = _calls(seqlen, causal, window)
    for _ in range(launches):
        calls[name]()
    torch.cuda.synchronize()


def profile(name, seqlen, causal, window, out_dir):
    """ncu on the third launch of the contender's prefill kernel; returns {metric: value} from the raw page."""
    cmd = [_ncu(), "--clock-control", "none", "--kernel-name", "regex:Prefill", "--launch-skip", "2",
           "--launch-count", "1", "--csv", "--page", "raw"]
    for section in SECTIONS:
        cmd += ["--section", section]
    cmd += [sys.executable, __file__, "--run", name, "--seqlen", str(seqlen), "--window", str(window)]
    cmd += ["--causal"] if causal else []
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    with open(os.path.join(out_dir, f"ncu_{name}{_suffix(seqlen, causal, window)}.csv"), "w") as f:
        f.write(done.stdout)
    if done.returncode:
        with open(os.path.join(out_dir, f"ncu_{name}{_suffix(seqlen, causal, window)}.err"), "w") as f:
            f.write(done.stderr)
    print(f"ncu {name}: rc {done.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
    return parse_raw(done.stdout)


def _suffix(seqlen, causal, window):
    """File-name tail for one configuration: none for the default (S=8192, non-causal, no window)."""
    tail = ("" if seqlen == 8192 else f"_s{seqlen}") + ("_causal" if causal else "") + (f"_w{window}" if window else "")
    return tail


def _ncu():
    import glob
    import shutil
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
                                             + glob.glob("/usr/local/cuda/bin/ncu")), None)
    if found is None:
        raise SystemExit("profile_fa3_pipes.py: Nsight Compute (ncu) not found on PATH, in /opt/nvidia/nsight-compute "
                         "or /usr/local/cuda/bin")
    return found


def parse_raw(text):
    """ncu --page raw --csv: a header row of metric names, a units row, then one row per kernel (the first)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if len(lines) < 3:
        return {}
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header, units, values = rows[0], rows[1], rows[2]
    parsed = {}
    for metric, unit, value in zip(header, units, values):
        try:
            parsed[metric] = (float(value.replace(",", "")), unit)
        except ValueError:
            parsed[metric] = (value, unit)
    return parsed


# The columns of the table (the README's), from GH100's metric names; everything else stays in the raw CSV.
COLUMNS = {
    "us": "gpu__time_duration.sum",
    "sm_clock_ghz": "gpc__cycles_elapsed.avg.per_second",
    "tensor_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor_elapsed_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "mufu_pct": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "fma_pct": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "alu_pct": "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "instructions": "smsp__inst_executed.sum",
    "registers": "launch__registers_per_thread",
}
#: to the column's unit (us, GHz) from the units ncu may report
UNIT_SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
              "hz": 1e-9, "Hz": 1e-9, "Khz": 1e-6, "KHz": 1e-6, "Mhz": 1e-3, "MHz": 1e-3, "Ghz": 1.0, "GHz": 1.0,
              "cycle/nsecond": 1.0, "cycle/usecond": 1e-3}
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def summarize(raw):
    """The table's columns and the stall reasons (warps stalled per issued instruction, largest first)."""
    row = {}
    for key, metric in COLUMNS.items():
        value, unit = raw.get(metric, (None, ""))
        if isinstance(value, float):
            row[key] = value * (UNIT_SCALE.get(unit, 1.0) if key in ("us", "sm_clock_ghz") else 1.0)
    stalls = {m[len(STALL_PREFIX):-len(STALL_SUFFIX)]: v for m, (v, _) in raw.items()
              if m.startswith(STALL_PREFIX) and m.endswith(STALL_SUFFIX) and isinstance(v, float)}
    row["stalls_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    return row


def print_table(report):
    window = f", window {report['window']}" if report.get("window") else ""
    print(f"\n{report['gpu']}, S={report['seqlen']}, causal={report['causal']}{window}, bf16, hd{D}, {H} heads, "
          f"cap {CAP}; one launch each under ncu; pipes: % of active cycles busy (tensor also % of elapsed); stalls: "
          "warps per issued instruction")
    print(f"{'kernel':18s} {'us':>6s} {'GHz':>5s} {'tensor':>6s} {'(elap)':>6s} {'MUFU':>5s} {'FMA':>5s} {'instr':>8s}"
          "  top stalls")
    nan = float("nan")
    for name, row in report["kernels"].items():
        if "error" in row:
            print(f"{name:18s} {row['error']}")
            continue
        stalls = ", ".join(f"{k} {v:.2f}" for k, v in list(row["stalls_per_issue"].items())[:4])
        col = {k: row.get(k, nan) for k in COLUMNS}
        print(f"{name:18s} {col['us']:6.0f} {col['sm_clock_ghz']:5.2f} {col['tensor_pct']:5.0f}% "
              f"{col['tensor_elapsed_pct']:5.0f}% "
              f"{col['mufu_pct']:4.0f}% {col['fma_pct']:4.0f}% {col['instructions']:8.2g}  {stalls}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", type=int, default=0, help="keys in the soft-capped sliding window (0: soft-cap alone)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--run", choices=CONTENDERS, help="(internal) launch one contender, for ncu")
    ap.add_argument("--out", default=os.environ.get("OUT", "profile-out"))
    args = ap.parse_args()
    if args.run:
        return run_one(args.run, args.seqlen, args.causal, args.window)
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        ap.error(f"--contenders: unknown {', '.join(unknown)} (known: {', '.join(CONTENDERS)})")
    os.makedirs(args.out, exist_ok=True)
    import torch
    build(args.window, contenders)
    passed = check(args.seqlen, args.causal, args.window, contenders)
    report = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), seqlen=args.seqlen,
                  causal=args.causal, window=args.window, heads=H, head_dim=D, softcap=CAP, kernels={})
    out_json = os.path.join(args.out, f"profile_fa3_pipes{_suffix(args.seqlen, args.causal, args.window)}.json")
    for name in contenders:
        if not passed[name]:
            report["kernels"][name] = {"error": "failed the reference check; not profiled"}
            continue
        report["kernels"][name] = summarize(profile(name, args.seqlen, args.causal, args.window, args.out))
        with open(out_json, "w") as f:
            json.dump(report, f, indent=1)
    print_table(report)


if __name__ == "__main__":
    main()
