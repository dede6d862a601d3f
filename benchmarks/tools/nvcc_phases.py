"""Where an FA2 module's compile goes: nvcc --time per phase, per translation unit, for fivar build options.

nvcc runs a unit's phases one after another (host and device preprocessing, cudafe++, cicc, ptxas, fatbinary, the
host compiler), so once a module's units run in parallel, its cold compile is its slowest unit's phase sum. This
compiles each unit of the modules the given configs render (FlashInfer's own compile command, from its JitSpec, plus
--time), one at a time and in alternating rounds, and prints per phase the median milliseconds.

    python benchmarks/tools/nvcc_phases.py softcap --configs default,plain --rounds 2 --json out.json
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _config(cta_tiles=False, nvcc_split=True, pin=True, skip_headers=True, parallel_passes=True):
    """gen_module build options, every one spelled out so that no environment override makes two configs one."""
    return {"split_cta_tiles": cta_tiles, "nvcc_split_compile": nvcc_split, "pin_kv_tiles": pin,
            "skip_unused_headers": skip_headers, "nvcc_parallel_passes": parallel_passes}


FIVAR_CONFIGS = {"default": _config(), "unpinned": _config(pin=False), "keep-headers": _config(skip_headers=False),
                 "serial-passes": _config(parallel_passes=False), "no-nvcc-split": _config(nvcc_split=False),
                 "cta-tiles": _config(cta_tiles=True),
                 "plain": _config(pin=False, skip_headers=False, parallel_passes=False)}


def unit_commands(module) -> dict[str, str]:
    """unit file name -> FlashInfer's nvcc command for it (without -o)."""
    spec = module.jit_spec()
    module._prepare()
    out = {}
    for entry in spec.get_compile_commands():
        cmd = entry["command"]
        unit = re.search(r"-c (\S+\.cu)\b", cmd).group(1)
        out[Path(unit).name] = re.sub(r"\s-o\s+\S+", "", cmd)
    return out


def time_unit(cmd: str, work: Path) -> dict[str, float]:
    """Runs one nvcc command with --time; phase name -> ms, and 'wall'."""
    table = work / "time.csv"
    table.unlink(missing_ok=True)
    t0 = time.perf_counter()
    subprocess.run(shlex.split(cmd) + ["--time", str(table), "-o", str(work / "unit.o")], check=True,
                   capture_output=True, text=True)
    wall = time.perf_counter() - t0
    phases: dict[str, float] = {}
    with open(table) as f:
        for row in list(csv.reader(f))[1:]:
            row = [c.strip() for c in row]
            if len(row) >= 7 and row[1]:
                phases[row[1]] = phases.get(row[1], 0.0) + float(row[6])
    phases["wall"] = wall * 1000
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", nargs="?", default="softcap")
    ap.add_argument("--op", default="single_prefill")
    ap.add_argument("--target", default="fa2", choices=["fa2", "fa3"])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--configs", default="default,plain")
    ap.add_argument("--units", default="", help="comma-separated unit names to time (default: all)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    import fivar
    from fivar.jit.build import gen_module
    from fivar.jit.toolchain import split_compile_threads

    variant = fivar.load(args.variant)
    configs = args.configs.split(",")
    def options(c: str) -> dict:  # FA3 takes only the options that apply to it
        return FIVAR_CONFIGS[c] if args.target == "fa2" else {"nvcc_parallel_passes": FIVAR_CONFIGS[c]["nvcc_parallel_passes"]}
    commands = {c: unit_commands(gen_module(variant, op=args.op, target=args.target, dtype=args.dtype,
                                            head_dim=args.head_dim, **options(c))) for c in configs}
    wanted = set(filter(None, args.units.split(",")))
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for c in configs:
                for unit, cmd in commands[c].items():
                    if not wanted or unit in wanted:
                        runs.setdefault((c, unit), []).append(time_unit(cmd, Path(tmp)))
    result = {"variant": args.variant, "op": args.op, "target": args.target, "dtype": args.dtype, "head_dim": args.head_dim,
              "cpus": os.cpu_count(), "split_compile_threads": split_compile_threads(), "rounds": args.rounds,
              "date": time.strftime("%Y-%m-%d"), "units": []}
    for (c, unit), rs in runs.items():
        phases = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in rs[0]}
        result["units"].append({"config": c, "unit": unit, "ms": {k: round(v) for k, v in phases.items()}})
        print(f"{c:>13} {unit:<40} wall {phases['wall'] / 1000:5.2f} s  " +
              "  ".join(f"{k} {v:.0f}" for k, v in phases.items() if k not in ("wall", "nvcc (driver)")))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
