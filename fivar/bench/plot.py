"""The benchmark picture: throughput vs sequence length per contender, and a roofline panel."""
from __future__ import annotations


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["results"] if r["status"] == "ok"]
    fig, (ax, rf) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["contender"] for r in ok):
        pts = sorted((r["seqlen"], r["tflops"]) for r in ok if r["contender"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s (useful work)")
    ax.set_title(f"{report['variant']} {report['op']} on {report['gpu']}")
    ax.grid(alpha=0.3)
    ax.legend()

    ceil = report.get("ceilings")
    for name in dict.fromkeys(r["contender"] for r in ok):
        pts = [(r["tflops"] / r["tb_per_s"], r["tflops"]) for r in ok if r["contender"] == name and r["tb_per_s"]]
        rf.scatter([p[0] for p in pts], [p[1] for p in pts], label=name)
    if ceil:
        xs = [2 ** i for i in range(-2, 14)]
        rf.plot(xs, [min(ceil["bf16_matmul_tflops"], ceil["copy_tb_per_s"] * x) for x in xs], "k--",
                label=f"roofline ({ceil['copy_tb_per_s']:.1f} TB/s, {ceil['bf16_matmul_tflops']:.0f} TF/s)")
    rf.set_xscale("log", base=2)
    rf.set_yscale("log")
    rf.set_xlabel("arithmetic intensity (FLOP / byte, minimal traffic)")
    rf.set_ylabel("TFLOP/s")
    rf.set_title("roofline")
    rf.grid(alpha=0.3)
    rf.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
