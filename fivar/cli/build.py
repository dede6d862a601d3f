"""`fivar build`: compile variants through FlashInfer's JIT (cached)."""
from __future__ import annotations

import time

import click
from rich.table import Column, Table

from ..errors import FivarError
from ..runtime.build_set import DEFAULT_OPS, build_modules
from ._common import (OPS, _choices, _escape, _head_dims, _one_line, _set_arch,
                      _split, console, err_console, main, report_load_errors)

#: the ops `fivar build NAME` compiles unless --ops says otherwise


@main.command()
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="every variant on the search path (imports, so runs, each file)")
@click.option("--prewarm", is_flag=True, help="build every requested module in one parallel ninja")
@click.option("--ops", default=",".join(DEFAULT_OPS), show_default=True)
@click.option("--targets", default="auto", show_default=True,
              help="auto (what backend='auto' runs on the target arch: FA3 prefill on sm90a, FA2 otherwise and for "
                   "decode; and fusions), or a comma list of fa2, fa3 (no decode: skipped), triton (writes and "
                   "imports the twin; Triton compiles per launch shape on first use), fusion (norm/RoPE fusions)")
@click.option("--dtypes", default="bf16", show_default=True)
@click.option("--head-dims", default="128", show_default=True)
@click.option("--arch", default=None, help="e.g. 9.0a; default: FLASHINFER_CUDA_ARCH_LIST or the visible GPU")
@click.option("--jobs", type=int, default=None,
              help="parallel nvcc jobs (default: MAX_JOBS, else min(1.5 x cores, MemAvailable / 3 GiB))")
@click.option("--launcher", default=None, help="compiler launcher for nvcc and c++, e.g. sccache or ccache")
def build(names, all_, prewarm, ops, targets, dtypes, head_dims, arch, jobs, launcher):
    """Compile variants through FlashInfer's JIT (cached: unchanged modules are hits)."""
    from .. import load
    from ..registry import variant_files
    _set_arch(arch)
    from ..jit.prewarm import configure_jobs, configure_launcher
    jobs, jobs_why = configure_jobs(jobs)
    launcher = configure_launcher(launcher)
    if all_:
        if names:
            raise FivarError(f"--all builds every variant; drop it to build only {', '.join(names)}, or drop the names")
        from ..registry import describe_search
        err_console.print(_escape(describe_search("fivar build --all")), highlight=False, soft_wrap=True)
        names = sorted(variant_files())
    if not names:
        raise FivarError("name at least one variant, or pass --all")
    from ..runtime.attention import ALL_BACKENDS
    wanted = _choices(targets, (*ALL_BACKENDS, "fusion"), "--targets")
    ops_ = _choices(ops, OPS, "--ops")
    variants, load_errors = {}, []
    for n in names:  # once: a load is a search-path scan
        try:
            v = variants[n] = load(n)
            if all_ and getattr(v, "kind", None) != "fusion":
                v.ir  # a spec error: that file's line, and the others still build
        except FivarError as e:
            if not all_:
                raise
            variants.pop(n, None)
            load_errors.append(_one_line(e, variant_files().get(n, n)))  # --all goes on with the others
    if variants:
        try:
            _build_loaded(variants, all_, wanted, ops_, targets, ops, dtypes, head_dims, prewarm, jobs, jobs_why,
                          launcher)
        except FivarError:
            report_load_errors(load_errors, exit=False)
            raise
    report_load_errors(load_errors)


def _build_loaded(variants, all_, wanted, ops_, targets, ops, dtypes, head_dims, prewarm, jobs, jobs_why, launcher):
    from ..fusion.build import gen_fusion_module
    from ..jit.build import build_many
    from ..jit.prewarm import live_progress
    from ..jit.targets import runs_twin
    wrote_twins = any(runs_twin(t) for t in wanted)
    fusions = [n for n, v in variants.items() if getattr(v, "kind", None) == "fusion"]
    skipped = [] if {"auto", "fusion"} & {*wanted} else fusions
    if skipped and not all_:
        console.print(f"skipping fusion(s) {', '.join(skipped)}: --targets {targets} has no fusion (add "
                      f"--targets ...,fusion)", highlight=False)
    wanted = [t for t in wanted if t != "fusion"]  # the attention targets: none for --targets fusion
    if wrote_twins:
        _write_triton_twins([v for n, v in variants.items() if n not in fusions])
        wanted = [t for t in wanted if not runs_twin(t)]
    modules = [gen_fusion_module(variants[n], dt) for n in fusions if n not in skipped for dt in _split(dtypes)]
    modules += build_modules([v for n, v in variants.items() if n not in fusions], wanted, ops_, _split(dtypes),
                             _head_dims(head_dims))
    if not modules:
        if wrote_twins:
            return
        raise FivarError(f"nothing to build: --targets {targets} --ops {ops} names no module (FA3 has no decode; "
                         f"a fusion builds with --targets auto or fusion)")
    modules = list({m.uri: m for m in modules}.values())  # a fusion ignores --ops/--targets/--head-dims
    t0 = time.perf_counter()
    todo = [m for m in modules if not m.manifest_ok()]
    if (prewarm or len(modules) > 1) and todo:
        console.print(f"building {len(todo)} of {len(modules)} module(s) with {jobs} nvcc job(s) ({jobs_why})"
                      + (f", launcher {launcher}" if launcher else ""), highlight=False)
    elif prewarm or len(modules) > 1:
        console.print(f"all {len(modules)} module(s) up to date", highlight=False)
    with live_progress(modules, console, enabled=prewarm or len(modules) > 1) as progress:
        results = build_many(modules, parallel=prewarm or len(modules) > 1, progress=progress)
    table = Table(Column("module", overflow="fold"), "result", "seconds", title=f"fivar build: {len(modules)} module(s)")
    for m, (kind, secs) in zip(modules, results):
        table.add_row(m.uri, {"cold": "[yellow]compiled[/]", "disk": "[green]hit (disk)[/]",
                              "memory": "[green]hit (memory)[/]"}[kind], f"{secs:.2f}")
    console.print(table)
    console.print(f"total {time.perf_counter() - t0:.1f} s")


def _write_triton_twins(variants) -> None:
    """`build --targets triton`: render, write and import each variant's Triton twin (a spec the twin cannot take
    fails here); Triton then compiles each kernel on its first launch of a shape, into its own cache."""
    from ..jit.triton_module import load_triton_module
    for v in variants:
        mod = load_triton_module(v)
        console.print(f"triton twin of '{v.name}': {mod.__file__}", highlight=False)
