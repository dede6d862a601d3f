"""Read a `bench_fa3.py --clock-trace` JSON: each contender's median time and the clock it ran at, its
samples split by whether Flex (the coolest contender) was timed just before, and each FA3 contender's ratio
to Flex at the measured clocks and per clock cycle.

    python3 benchmarks/tools/clock_report.py RUN.json  (a bench_fa3.py --clock-trace --json RUN.json output)

Per-cycle ratios are a diagnosis, not a result: the bar is wall-clock time, and a kernel that draws
the board to its power limit pays for it in clock. 0x4 among the reasons is the driver's software power cap.
"""
from __future__ import annotations

import json
import statistics
import sys


def _median(values):
    values = list(values)
    return statistics.median(values) if values else float("nan")


def report(path: str) -> str:
    rows = json.load(open(path))["variants_vs_flex"]
    lines = []
    for row in rows:
        samples = row.get("samples")
        if not samples:
            continue
        # sustained timing runs each contender in one block: "after flex" then says nothing about the board
        interleaved = "sustained" not in row.get("timing", "") and any(
            len({x["after"] for x in xs}) > 1 for xs in samples.values())
        timing = row.get("timing") or ("interleaved" if interleaved else "sustained")
        lines.append(f"{row['variant']} S={row['S']} causal={row['causal']} ({timing})")
        lines.append(f"  {'contender':34} {'ms':>7} {'MHz':>5} {'W':>4} {'ms after flex':>13} {'ms otherwise':>12}"
                     f" {'x flex':>7} {'x flex/cycle':>12}  reasons")
        clock = {n: _median(x["mhz"] for x in xs if x["n"]) for n, xs in samples.items()}
        flex_ms = row["ms"].get("flex")
        for n, xs in samples.items():
            after_flex = _median(x["ms"] for x in xs if x["after"] == "flex" and interleaved)
            otherwise = _median(x["ms"] for x in xs if x["after"] != "flex" and interleaved)
            ratio = per_cycle = float("nan")
            if flex_ms and n != "flex":
                ratio = flex_ms / row["ms"][n]
                per_cycle = ratio * clock["flex"] / clock[n]
            reasons = sorted({r for x in xs for r in x.get("reasons", [])})
            watts = _median(x["watts"] for x in xs if x["n"])
            lines.append(f"  {n:34} {row['ms'][n]:7.3f} {clock[n]:5.0f} {watts:4.0f} {after_flex:13.3f} "
                         f"{otherwise:12.3f} {ratio:7.2f} {per_cycle:12.2f}  {' '.join(reasons)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1]))
