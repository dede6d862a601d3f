"""`fivar bench`: a variant's kernels timed against stock FlashInfer, its Triton twin and FlexAttention."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.table import Table

from ..errors import FivarError
from ._common import (CHECK_OPS_DEFAULT, OPS, _arch_capability, _build_capabilities, _builds_sm90a, _choices,
                      _escape, _given, _ints, _print_code, _set_arch, _split, console, format_program_expr, main)


@main.command()
@click.argument("name")
@click.option("--vs", "vs", multiple=True, type=click.Choice(["stock", "triton", "flex", "sdpa"]),
              help="contenders besides fivar's own kernels (repeatable); default: stock, triton, flex")
@click.option("--op", type=click.Choice(["prefill", "batch-prefill", "decode", "train", "verify", "mixed"]),
              default="prefill", show_default=True, help="train: forward + backward (v.attention) against Flex and "
              "SDPA; verify / mixed: the serving suite's speculative-verify or mixed prefill+decode steps "
              "(docs/serving.md)")
@click.option("--seqlens", default="1024,4096,8192", show_default=True)
@click.option("--batch", default=1, show_default=True, help="requests (batch-prefill, decode)")
@click.option("--heads", default="32/32", show_default=True, help="Hq/Hkv")
@click.option("--head-dim", default=128, show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option("--causal", is_flag=True)
@click.option("--rounds", default=4, show_default=True, help="interleaved timing rounds (each a do_bench median)")
@click.option("--sustained", "sustained_s", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS", help="instead of --rounds, time each contender alone, back to back, for SECONDS after "
              "1 s untimed: the rate a serving loop keeps at the GPU's power limit")
@click.option("--param", "param_texts", multiple=True, metavar="NAME=VALUE",
              help="set a scalar param (repeatable), e.g. --param window=1024; default: the variant's example values")
@click.option("--json", "json_path", default=None, help="write the full report (raw samples included)")
@click.option("--plot", "plot_path", default=None, help="write a PNG: throughput vs seqlen + roofline")
@click.option("--compile", "compile_", is_flag=True, help="cold/disk/memory build latency, fivar vs FlashInfer's path "
              "(at --dtype and --head-dim; without a GPU: compile only, for --arch)")
@click.option("--arch", default=None, help="--compile without a GPU: e.g. 9.0a (default: FLASHINFER_CUDA_ARCH_LIST)")
@click.option("--cuda-graph", "cuda_graph", is_flag=True, help="decode: also replay fivar's plan_decode(cuda_graph=True) "
              "and stock FlashInfer's use_cuda_graph decode from CUDA graphs (fivar-graph vs stock-graph), at batch "
              "1, 8 and 64 unless --batch is given; verify: the verify steps replayed from CUDA graphs too "
              "(plan_paged(cuda_graph=True) vs stock's use_cuda_graph wrapper)")
def bench(name, vs, op, seqlens, batch, heads, head_dim, dtype, causal, rounds, sustained_s, param_texts, json_path,
          plot_path, compile_, arch, cuda_graph):
    """Benchmark a variant against stock FlashInfer, its Triton twin and FlexAttention (needs a GPU)."""
    import json as _json

    import torch

    if cuda_graph and op not in ("decode", "verify"):
        raise FivarError(f"--cuda-graph replays decode and verify plans from CUDA graphs; it applies to --op decode "
                         f"and --op verify only (got --op {op})")
    if compile_:
        ignored = _given("vs", "op", "seqlens", "batch", "heads", "causal", "rounds", "sustained_s", "param_texts",
                         "plot_path", "cuda_graph")
        if ignored:  # build latency of one module: those shape a timed run
            raise FivarError(f"--compile measures one module's build latency (at --dtype and --head-dim); "
                             f"{', '.join(ignored)} shape a timed run only; drop {'them' if len(ignored) > 1 else 'it'}")
        import subprocess
        _set_arch(arch)
        from ..jit.toolchain import ensure_arch_env
        ensure_arch_env()  # no GPU and no arch: one line, not the script's traceback
        from .. import load
        from ..fusion import FusionVariant
        from ..jit.build import HEAD_DIMS
        if isinstance(load(name), FusionVariant):  # an unknown name: the registry's one line
            raise FivarError(f"'{name}' is a fusion; bench --compile measures an attention variant's FA2 module")
        if head_dim not in HEAD_DIMS:
            raise FivarError(f"--head-dim must be one of {', '.join(map(str, HEAD_DIMS))}, got {head_dim}")
        args = [sys.executable, "-m", "fivar.bench.compile_time", "--variant", name, "--dtype", dtype, "--head-dim", str(head_dim)] + (
            ["--json", json_path] if json_path else [])
        if not torch.cuda.is_available():
            console.print("no GPU visible: compiling only (hits are build() disk checks, not loads)", highlight=False)
            args.append("--no-load")
        sys.exit(subprocess.call(args))
    from .. import load
    from ..bench.contenders import scalar_params
    from ..fusion import FusionVariant
    v = load(name)
    if isinstance(v, FusionVariant):
        raise FivarError(f"'{name}' is a fusion; fivar bench times attention variants (`python -m fivar.bench "
                         "--suite fusions` times fusions against stock FlashInfer)")
    params = scalar_params(v, param_texts)  # before the GPU check: a typo is reported on any machine
    if sustained_s and _given("rounds"):
        raise FivarError("--sustained times each contender once, for SECONDS; --rounds sets interleaved rounds: "
                         "give one of them")
    if op in SERVING_OPS:
        serving_cases(name, op, vs, params, cuda_graph)  # its refusals on any machine
    if not torch.cuda.is_available():
        raise FivarError("fivar bench times kernels, so it needs a CUDA GPU (without one: fivar bench NAME --compile "
                         "--arch 9.0a measures build latency)")
    if arch:
        raise FivarError("--arch applies to --compile only: a timed run uses the visible GPU")
    if op in SERVING_OPS:
        return _bench_serving(name, op, vs, params, rounds, json_path, cuda_graph)
    from ..bench import ceilings as ceil_mod
    from ..bench.harness import run
    try:
        hq, hkv = (int(x) for x in heads.split("/"))
    except ValueError:
        raise FivarError(f"--heads must look like 32/8, got {heads!r}") from None
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if op == "train":
        from ..bench.train import bench_train, format_rows
        # "triton": v.attention with the Triton twin's forward (fivar's default takes FA3's on sm90)
        wanted = ("fivar",) + tuple({"triton": "fivar-triton"}.get(x, x) for x in (vs or ("triton", "flex", "sdpa"))
                                    if x in ("triton", "flex", "sdpa"))
        # made only for a variant with learnable tensors: Flex with them held, and fivar doing the same work
        wanted += ("fivar-frozen", "flex-frozen") if "flex" in wanted else ()
        rows = [r for S in _split(seqlens, int) for r in bench_train(
            v, seqlen=S, heads=(hq, hkv), head_dim=head_dim, causal=causal, dtype=dt, params=params, wanted=wanted,
            rounds=rounds)]
        console.print(format_rows(rows), markup=False)
        if json_path:
            Path(json_path).write_text(_json.dumps(rows, indent=1, default=str))
        return
    ceilings = ceil_mod.get()
    console.print(f"ceilings on {ceilings['gpu']}: copy {ceilings['copy_tb_per_s']:.2f} TB/s, "
                  f"bf16 matmul {ceilings['bf16_matmul_tflops']:.0f} TFLOP/s")
    wanted = tuple(vs or ("stock", "triton", "flex")) + (("graph",) if cuda_graph else ())
    batches = [batch] if (_given("batch") or not cuda_graph) else [1, 8, 64]
    reports = [run(v, op=op, seqlens=_split(seqlens, int), batch=b, heads=(hq, hkv), head_dim=head_dim, dtype=dt,
                   causal=causal, vs=wanted, rounds=rounds, ceilings=ceilings, params=params,
                   sustained_s=sustained_s or 0.0, progress=lambda s: console.print(s, style="dim", markup=False))
               for b in batches]
    for report in reports:
        _print_report(name, op, report)
    if json_path:
        Path(json_path).write_text(_json.dumps(reports[0] if len(reports) == 1 else reports, indent=1, default=str))
        console.print(f"wrote {json_path}")
    if plot_path:
        from ..bench.plot import plot
        plot(reports[0], plot_path)
        console.print(f"wrote {plot_path}")


#: ops that run the serving suite's cases of one variant (fivar.bench.suites.serving) through the bench runner
SERVING_OPS = ("verify", "mixed")
#: the serving suite's contenders: fivar's own always (the default call and each target's), the others as --vs picks
SERVING_OWN = ("fivar", "fivar-fa3", "fivar-fa2", "fivar-fa3-planned", "fivar-causal")


def serving_cases(name, op, vs, params, cuda_graph: bool = False):
    """(cases, contender names) of `fivar bench NAME --op verify|mixed`; refuses the options those fixed shapes
    ignore, in one line. cuda_graph (verify): the steps replayed from CUDA graphs too (fivar-graph, and stock-graph
    where stock is asked for)."""
    ignored = _given("seqlens", "batch", "heads", "head_dim", "dtype", "causal", "sustained_s", "plot_path")
    if ignored:
        from ..bench.suites.serving import BATCH, CONTEXT, HEADS, PAGE
        raise FivarError(f"--op {op} runs the serving suite's {op} cases (batch {BATCH}, {CONTEXT}-key contexts, page "
                         f"{PAGE}, bf16, head dim 128, GQA {HEADS[0]}/{HEADS[1]}, causal); {', '.join(ignored)} "
                         f"{'do' if len(ignored) > 1 else 'does'} not apply: drop "
                         f"{'them' if len(ignored) > 1 else 'it'}")
    if "sdpa" in vs:
        raise FivarError(f"--op {op} has no SDPA contender (--vs stock, triton or flex)")
    from ..bench.suites.serving import variant_cases
    contenders = SERVING_OWN + tuple(vs or ("stock", "triton", "flex"))
    if cuda_graph:
        contenders += ("fivar-graph",) + (("stock-graph",) if "stock" in contenders else ())
    return variant_cases(name, op, params, graph=cuda_graph), contenders


def _bench_serving(name, op, vs, params, rounds, json_path, cuda_graph: bool = False) -> None:
    """The serving suite's cases of this variant, run as `python -m fivar.bench --suite serving` runs them (built in
    one parallel pass, each contender checked, then timed), their rows printed; --json writes the rows."""
    import json as _json
    import tempfile

    from ..bench import runner
    from ..bench.contenders import SELECTED
    cases, contenders = serving_cases(name, op, vs, params, cuda_graph)
    token = SELECTED.set(frozenset(contenders))
    try:
        with tempfile.TemporaryDirectory() as tmp:  # rows of an ad-hoc run stay out of benchmarks/results
            rows = runner.run(cases, runner.Options.make(rounds), Path(tmp),
                              log=lambda s: console.print(s, style="dim", markup=False))
    finally:
        SELECTED.reset(token)
    table = Table("case", "contender", "check", "ms", "TFLOP/s", "vs baseline", title=f"fivar bench {name} --op {op}")
    tflops = {(r["case"], r["contender"]): r["value"] for r in rows if r["metric"] == "tflops_useful"}
    for r in rows:
        if r["metric"] != "ms":
            continue
        tf = tflops.get((r["case"], r["contender"]))
        table.add_row(_escape(r["case"]), _escape(r["contender"]),
                      {"pass": "[green]pass[/]", "fail": "[red]FAILED check[/]", "error": "[red]error[/]"}[r["check"]],
                      f"{r['value']:.3f}" if r["value"] is not None else
                      _escape(str(r["detail"].get("error") or r["detail"].get("rel_err")))[:40],
                      f"{tf:.1f}" if tf else "-",
                      f"{r['ratio']:.2f}x vs {r['baseline']}"
                      if r["ratio"] is not None and r["contender"] != r["baseline"] else "-")
    console.print(table)
    if json_path:
        Path(json_path).write_text(_json.dumps(rows, indent=1, default=str))
        console.print(f"wrote {json_path}")


def _print_report(name, op, report) -> None:
    batch = f" batch {report['config']['batch']}" if op == "decode" else ""
    table = Table("S", "contender", "status", "ms (min..max)", "TFLOP/s", "% matmul", "TB/s", "% copy",
                  "vs stock", title=f"fivar bench {name} --op {op}{batch} on {report['gpu']} ({report['date']})")
    for r in report["results"]:
        # a graph-replayed contender against the graph-replayed stock decode, the rest against stock
        stock = r["ratio_vs"].get("stock-graph" if r["contender"].endswith("-graph") else "stock")
        table.add_row(str(r["seqlen"]), _escape(r["contender"] + (f" [{r['label']}]" if r["label"] else "")),
                      {"ok": "[green]ok[/]", "failed": "[red]FAILED check[/]", "error": "[red]error[/]"}[r["status"]],
                      f"{r['median_ms']:.3f} ({r['spread_ms'][0]:.3f}..{r['spread_ms'][1]:.3f})" if r["median_ms"] else
                      _escape(str(r["check"].get("error") or r["check"].get("rel_err")))[:40],
                      f"{r['tflops']:.1f}" if r["tflops"] else "-", f"{r['pct_of_matmul']:.0f}%" if r["tflops"] else "-",
                      f"{r['tb_per_s']:.2f}" if r["tb_per_s"] else "-", f"{r['pct_of_copy']:.0f}%" if r["tb_per_s"] else "-",
                      f"{stock:.2f}x" if stock else "-")
    console.print(table)
