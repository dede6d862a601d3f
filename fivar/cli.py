"""The `fivar` command line: new-variant, list, show, build, check."""
from __future__ import annotations

import keyword
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Column, Table

from .console import console_width
from .errors import FivarError

console = Console(width=console_width())
err_console = Console(stderr=True, width=console_width(sys.stderr))

OPS = ("single_prefill", "batch_prefill", "batch_decode")
CHECK_OPS_DEFAULT = ",".join(OPS)


def _split(value: str | None, cast=str) -> list:
    return [cast(x) for x in value.split(",") if x] if value else []


def _choices(value: str | None, allowed, option: str) -> list[str]:
    """A comma list whose every item is one of `allowed`, else one line naming the option and the item."""
    import difflib
    items = _split(value)
    for x in items:
        if x not in allowed:
            close = difflib.get_close_matches(x, allowed, n=2, cutoff=0.4) or [a for a in allowed if x in a]
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            raise FivarError(f"{option}: unknown {x!r}{hint}; choose from {', '.join(allowed)}")
    if not items:
        raise FivarError(f"{option}: empty; choose from {', '.join(allowed)}")
    return items


def _ints(value: str, option: str) -> list[int]:
    try:
        return [int(x) for x in _split(value)]
    except ValueError:
        raise FivarError(f"{option}: expected a comma list of integers, got {value!r}") from None


class FivarGroup(click.Group):
    """Turns FivarError into one red line and exit code 1; anything else is a real bug and surfaces."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FivarError as e:
            err_console.print(f"[bold red]error:[/] {_escape(str(e))}", highlight=False)
            sys.exit(1)


def _escape(text: str) -> str:
    from rich.markup import escape
    return escape(text)


@click.group(cls=FivarGroup)
@click.version_option(package_name="fivar", message="fivar %(version)s")
def main():
    """Author attention variants once in Python; build them through FlashInfer's JIT; check and bench them."""


def _set_arch(arch: str | None):
    from .jit.toolchain import set_arch_env
    set_arch_env(arch)


@main.command("list")
def list_cmd():
    """Variants on the search path (FIVAR_VARIANT_PATH, ./variants, bundled)."""
    from .registry import all_variant_files, load_named
    table = Table(Column("name", overflow="fold"), "kind", "params", Column("file", overflow="fold"))
    for name, paths in sorted(all_variant_files().items()):
        path, shown = paths[0], _escape(str(paths[0]))
        if len(paths) > 1:  # a ./variants/softcap.py is the softcap every command loads: say what it hides
            shown += f" [yellow](hides {_escape(', '.join(map(str, paths[1:])))})[/]"
        try:
            v = load_named(name, path)
        except FivarError as e:
            table.add_row(name, "[red]error[/]", _escape(str(e).splitlines()[0]), shown)
            continue
        if getattr(v, "kind", None) == "fusion":
            table.add_row(name, "fusion", _escape(v.describe()), shown)
            continue
        try:
            v.ir  # parse and type-check: a spec error shows here, not at the first build
        except FivarError as e:
            table.add_row(name, "[red]error[/]", _escape(str(e).splitlines()[0]), shown)
            continue
        kind = " + ".join(k for k in ("logits" if v.logits else "", "mask" if v.mask else "") if k)
        if not v.softmax:
            kind += " (no softmax)"
        table.add_row(name, kind, ", ".join(v.params) or "-", shown)
    console.print(table)


@main.command("new-variant")
@click.argument("name")
@click.option("--dir", "variants_dir", default="variants", show_default=True, help="where the variant file goes")
@click.option("--tests-dir", default="tests/variants", show_default=True, help="where its test goes")
@click.option("--kind", type=click.Choice(["attention", "fusion"]), default="attention", show_default=True,
              help="an attention variant, or a norm/residual/RoPE fusion")
def new_variant(name, variants_dir, tests_dir, kind):
    """Scaffold variants/NAME.py and tests/variants/test_NAME.py (never overwrites)."""
    from .codegen.fa2 import render
    if not name.isidentifier() or keyword.iskeyword(name):
        raise FivarError(f"variant name {name!r} must be a Python identifier (letters, digits, _) and not a keyword")
    if name.startswith("_"):  # the variant search path skips such files (private helpers)
        raise FivarError(f"variant name {name!r} starts with '_': fivar skips such files when it looks up variants, "
                         "so nothing could find it; pick a name that starts with a letter")
    if name.replace("_", "-") in main.commands:  # `fivar new-variant list` is more likely a slip than a name
        raise FivarError(f"variant name {name!r} is a fivar command (`fivar {name.replace('_', '-')}`); pick another")
    vpath, tpath = Path(variants_dir) / f"{name}.py", Path(tests_dir) / f"test_{name}.py"
    for p in (vpath, tpath):
        if p.exists():
            raise FivarError(f"{p} already exists; fivar new-variant never overwrites a file")
        in_the_way = next((d for d in p.parents if d.exists() and not d.is_dir()), None)
        if in_the_way:
            raise FivarError(f"cannot create {p}: {in_the_way} is a file, not a directory (--dir / --tests-dir)")
    from .registry import search_path, variant_files
    hidden = variant_files().get(name)
    vpath.parent.mkdir(parents=True, exist_ok=True)
    tpath.parent.mkdir(parents=True, exist_ok=True)
    fusion = kind == "fusion"
    vpath.write_text(render("new_fusion.py.jinja" if fusion else "new_variant.py.jinja", name=name))
    relpath = os.path.relpath(vpath.resolve(), tpath.parent.resolve())
    conftest = tpath.parent / "conftest.py"
    if not conftest.exists():  # registers the `gpu` mark the test uses (pytest warns on an unknown one)
        conftest.write_text(render("conftest.py.jinja"))
    tpath.write_text(render("test_fusion.py.jinja" if fusion else "test_variant.py.jinja", name=name,
                            variant_relpath=relpath))
    console.print(f"created [bold]{vpath}[/] and [bold]{tpath}[/]", highlight=False)
    order = [d.resolve() for d in search_path()]
    if vpath.parent.resolve() not in order:
        console.print(f"note: fivar finds variants by name in FIVAR_VARIANT_PATH, ./variants and its bundled ones; "
                      f"for `fivar ... {name}` run `export FIVAR_VARIANT_PATH={vpath.parent.resolve()}`",
                      highlight=False)
    elif hidden is not None:
        first = order.index(hidden.parent.resolve()) < order.index(vpath.parent.resolve())
        console.print(f"note: {hidden} {'comes first and hides this one' if first else 'is hidden by this one'} "
                      "(`fivar list` shows which one runs)", highlight=False)
    console.print(f"next: edit {vpath}, then `fivar show {name}`, `fivar build {name}`, `fivar check {name}`"
                  + (" (on a GPU; without one, `pytest " + str(tpath) + "` runs its reference on the CPU)" if fusion
                     else ""), highlight=False)


def _tile_skipping(v) -> str:
    """What each target skips instead of masking, from the band fivar reads off the mask."""
    from .spec.ir import format_expr
    if v.ir.mask is None:
        return "KV tile skipping: causal only (no mask)"
    band = v.kv_band
    sides = [f"kv_idx >= q_idx - {format_expr(band.left)}"] if band.left is not None else []
    sides += [f"kv_idx <= q_idx + {format_expr(band.right)}"] if band.right is not None else []
    kv_ranges = ("fa3 runs each 128-row query block (192 at head_dim 64) as its own request over the keys a "
                 "mask pre-pass finds it keeps (KV-range form; single and ragged prefill, planned per call or "
                 "once with plan_ragged; when every row keeps one run of keys the kernel checks each row's run "
                 "instead of the mask; paged prefill visits every tile)")
    if not sides:
        return (f"KV tile skipping: the mask implies no band; {kv_ranges}; triton pre-scans it per query "
                "block and attends over the tiles between the first and last kept one; fa2 evaluates it on "
                "every tile")
    how = "is exactly" if band.exact else "implies"
    from .codegen.fa3 import runs_as_window
    fa3_part = (kv_ranges if v.scans_mask else
                "fa3 runs it as FlashInfer's own sliding window (window_left from the band: only the window's "
                "boundary tiles are masked, and the struct carries no mask)" if runs_as_window(v) else
                "fa3 builds with FlashInfer's sliding-window schedule (window_left from the band) and masks "
                "element-wise on every tile it visits" if band.left is not None else
                "fa3 has no hook for a right-only band")
    return (f"KV tile skipping: the mask {how} the band {' and '.join(sides)}; {fa3_part}; triton bounds its "
            f"KV loop by it{'' if band.exact else ' and pre-scans the rest'}; fa2 masks element-wise "
            "(FlashInfer's FA2 kernels visit every tile)")


def _fa3_softmax(v) -> str:
    from .codegen import fa3
    if not v.softmax:
        return "fa3 softmax: none (the variant's weights are used as they are)"
    mufu, k = fa3.mufu_ops_per_score(v), fa3.exp2_emulated_of_8(v)
    cost = f"the logits transform costs {mufu} MUFU op(s) per score"
    rng = fa3.softmax_range(v, "bf16", True)
    bounded = ("; the transform is unbounded, so the max is a running one" if rng is None else
               f"; the transform stays in [{rng[0]:g}, {rng[1]:g}], and unless {fa3.BOUNDED_SOFTMAX_ENV}=0 (bf16) the "
               f"softmax takes its max from the bound where the range times the softmax scale spans at most "
               f"{fa3.BOUNDED_SOFTMAX_SPAN:g} powers of two, {'on' if fa3.softmax_range(v, 'bf16') else 'off'} here")
    if not k:
        return f"fa3 softmax: FlashInfer's OnlineSoftmax, every exp2 on the MUFU pipe ({cost}{bounded})"
    return (f"fa3 softmax: {k} of every 8 score columns compute exp2 on the FMA pipe ({cost}; "
            f"{fa3.EXP2_EMULATION_ENV}=0..8 overrides{bounded})")


def _fa3_tile(v) -> str:
    from .codegen import fa3
    from .jit.build import serving_op
    if serving_op(v, "single_prefill", "fa3") != "single_prefill":
        return ("fa3 single prefill CTA tile: FlashInfer's (it runs as batch prefill in the KV-range form, whose "
                f"tiles fivar does not change; {fa3.CTA_TILE_ENV} does not apply)")
    tiles = fa3.tile_text(fa3.cta_tiles(v, "single_prefill", 128, None))
    if os.environ.get(fa3.CTA_TILE_ENV, "").strip():
        why = fa3.CTA_TILE_ENV
    elif tiles in (fa3.MUFU_BOUND_TILE, fa3.MUFU_BOUND_WINDOW_TILE):
        why = (f"the transform costs MUFU ops: smaller score tiles measured faster; non-causal, 192x64 from "
               f"{fa3.LONG_QO_LEN} query rows (three warpgroups, more work per clock at the power limit), 128x128 "
               "below" + ("; causal, 192x64 (three warpgroups share each K/V tile of the window)"
                          if tiles == fa3.MUFU_BOUND_WINDOW_TILE else ""))
    elif tiles != fa3.FLASHINFER_TILES:
        why = "the transform costs MUFU ops: a smaller score tile measured faster"
    else:
        why = "FlashInfer's choice"
    if tiles == fa3.FLASHINFER_TILES:
        tiles = "{}x{} non-causal, {}x{} causal".format(*sum(fa3.FLASHINFER_SINGLE_PREFILL_TILES[128], ()))
    return (f"fa3 single prefill CTA tile at hd128: {tiles} ({why}; {fa3.CTA_TILE_ENV}=QxKV[|QxKV][,QxKV[|QxKV]] "
            "or flashinfer overrides)")


def _fa3_schedule(v) -> str:
    from .codegen import fa3
    from .jit.build import serving_op
    if serving_op(v, "single_prefill", "fa3") != "single_prefill":
        return ("fa3 single prefill schedule: FlashInfer's (it runs as batch prefill in the KV-range form, on "
                f"FlashInfer's planned schedule; {fa3.SCHEDULE_ENV} does not apply)")
    chosen = fa3.schedules(v, "single_prefill", None, 128)
    if os.environ.get(fa3.SCHEDULE_ENV, "").strip():
        why = fa3.SCHEDULE_ENV
    elif "persistent" in chosen.values():
        why = ("a window makes every causal query tile about as long as the next: one CTA per SM walking them "
               "measured faster")
    elif fa3.default_schedule(v, "single_prefill", 128) != "grid":
        why = f"FlashInfer's grid: {fa3.flashinfer_dispatch_problem() or fa3.flashinfer_launcher_problem()}"
    else:
        why = "FlashInfer's grid; a static persistent schedule measured slower where tile costs differ"
    return (f"fa3 single prefill schedule at hd128: {chosen[fa3.MASK_NONE]} non-causal, {chosen[fa3.MASK_CAUSAL]} "
            f"causal ({why}; {fa3.SCHEDULE_ENV}=grid|persistent[,grid|persistent] overrides)")


def _fa3_wave_split(v) -> str:
    from .codegen import fa3
    from .runtime import wave_split
    if wave_split.applies(v, causal=False, window_left=-1) and fa3.schedules(
            v, "single_prefill", None, 128)[fa3.MASK_NONE] != "grid":
        return ("fa3 single prefill last wave: never split (the non-causal kernel is persistent: it holds every SM "
                "to its end, so the tail's launches could only start after it)")
    if not wave_split.applies(v, causal=False, window_left=-1):
        return ("fa3 single prefill last wave: never split (only softmax variants whose logits read nothing but the "
                "score and scalar params, with no mask, non-causal, can run as key chunks merged through their LSE)")
    return ("fa3 single prefill last wave, non-causal: the last heads run as key chunks merged through their LSE "
            "where a simulated schedule says it saves at least "
            f"{wave_split.MIN_GAIN:.1%} (with 32 heads on 132 SMs, S=8192 on the 192x64 tile does; "
            f"{wave_split.ENV}=0 turns it off)")


@main.command()
@click.argument("name")
@click.option("--target", type=click.Choice(["fa2", "fa3", "triton", "ir"]), default=None,
              help="attention variants only  [default: fa2]")
@click.option("--explain", is_flag=True, help="say which target `backend='auto'` picks for each op here, and why")
@click.option("--op", type=click.Choice(OPS), default="single_prefill", show_default=True)
@click.option("--sources", is_flag=True, help="print every generated source file of the module, not just the struct")
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--head-dim", default=128, show_default=True)
@click.option("--arch", default=None, help="target arch for --sources and --explain without a GPU, e.g. 9.0a")
def show(name, target, op, sources, dtype, head_dim, arch, explain):
    """Print what fivar generates for a variant."""
    from . import load
    from .spec import optimize
    from .spec.ir import format_program
    v = load(name)
    if getattr(v, "kind", None) == "fusion":  # a fusion: its rendered CUDA source (--sources: with the header)
        if target or explain:
            raise FivarError(f"'{name}' is a fusion: it has one CUDA source and no attention targets, so "
                             f"{'--target' if target else '--explain'} does not apply (`fivar show {name}` prints it)")
        given = _given("op", "head_dim")
        if given:  # a fusion declares its own head dim and has no ops
            raise FivarError(f"'{name}' is a fusion: {' and '.join(given)} {'are' if len(given) > 1 else 'is'} for attention "
                             f"variants only (a fusion has no ops, and its head dim is in its declaration)")
        _set_arch(arch)
        from .fusion.build import render_sources
        srcs = render_sources(v, dtype)
        for fname, text in srcs.items():
            if sources or fname.endswith(".cu"):
                if sources:
                    console.print(f"\n// ===== {fname} =====", style="bold", markup=False)
                _print_code(text)
        return
    from .jit.build import DTYPES, HEAD_DIMS
    target = target or "fa2"
    if target in ("fa2", "fa3") and (dtype not in DTYPES or head_dim not in HEAD_DIMS):  # `build` refuses these
        raise FivarError(f"variant '{v.name}': " + (f"dtype '{dtype}' is not supported (use one of {sorted(DTYPES)})"
                         if dtype not in DTYPES else f"head_dim {head_dim} is not supported (use one of {HEAD_DIMS})"))
    if explain:
        import torch

        from .runtime.attention import choose_target
        capability = None
        where = "--arch" if arch else "FLASHINFER_CUDA_ARCH_LIST"
        arch = arch or os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
        no_sm90a = False
        if arch and not torch.cuda.is_available():  # what auto would pick on that GPU
            from .jit.toolchain import check_arch_list
            check_arch_list(arch, where)
            capability = _arch_capability(arch)
            no_sm90a = not _builds_sm90a(arch)
            console.print(f"no GPU visible: as on sm{capability[0]}{capability[1]} ({where} {arch})")
        for o in OPS:
            t, why = choose_target(v, "auto", o, capability=capability)
            if t == "fa3" and no_sm90a:  # what `fivar build` does with such a list
                t, why = "fa2", f"{where} {arch} builds no sm_90a code, which FA3 kernels need: FA2 (add 9.0a for FA3)"
            console.print(f"{o}: [bold]{t}[/] - {_escape(why)}")
        console.print(_escape(_tile_skipping(v)))
        console.print(_escape(_fa2_kv_tiles(arch, where)))
        console.print(_escape(_fa3_softmax(v)))
        console.print(_escape(_fa3_tile(v)))
        console.print(_escape(_fa3_schedule(v)))
        console.print(_escape(_fa3_wave_split(v)))
        from .codegen.triton import TritonEmitter
        for read, how in TritonEmitter(v).read_plan():
            console.print(_escape(f"triton reads {read}: {how}"))
        return
    if target == "triton":  # the Triton twin: one Python module with every kernel
        from .codegen.triton import render_attention
        _print_code(render_attention(v), lexer="python")
        return
    if target == "ir":
        vir = v.ir
        for prog, role in ((vir.logits, "logits"), (vir.mask, "mask")):
            if prog:
                console.print(format_program(prog, role), highlight=False, markup=False)
        low = optimize.lower(vir, v.softmax)
        console.print("\n# lowered for the compiled targets (qk = unscaled q.k):", style="dim")
        for n, e in low.hoisted.items():
            console.print(f"  per-block {n} = {format_program_expr(e)}", highlight=False, markup=False)
        for prog, role in ((low.logits, "logits"), (low.mask, "mask")):
            if prog:
                console.print(format_program(prog, role), highlight=False, markup=False)
        if low.output_scale is not None:
            console.print(f"  softmax exponent scale: log2(e) * {format_program_expr(low.output_scale)}",
                          highlight=False, markup=False)
        return
    from .codegen import fa2, fa3
    if not sources:
        decl = (fa3.variant_decl(v, kv_ranges=fa3.uses_kv_ranges(v, op), logits_range=fa3.softmax_range(v, dtype))
                if target == "fa3"
                else fa2.variant_decl(v))
        _print_code(decl.source)
        return
    _set_arch(arch)
    from .jit.build import gen_module
    m = gen_module(v, op=op, target=target, dtype=dtype, head_dim=head_dim)
    console.print(f"# module {m.uri}", style="bold")
    for fname, text in m.sources.items():
        console.print(f"\n// ===== {fname} =====", style="bold", markup=False)
        _print_code(text)


def _print_code(text: str, lexer: str = "cpp"):
    if console.is_terminal:
        console.print(Syntax(text, lexer, theme="ansi_dark", word_wrap=True))
    else:  # piped: exact text, no wrapping or truncation
        click.echo(text)


def format_program_expr(e):
    from .spec.ir import format_expr
    return format_expr(e)


@main.command()
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="every variant on the search path")
@click.option("--prewarm", is_flag=True, help="build every requested module in one parallel ninja")
@click.option("--ops", default="single_prefill,batch_prefill,batch_decode", show_default=True)
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
    from . import load
    from .registry import variant_files
    _set_arch(arch)
    from .jit.prewarm import configure_jobs, configure_launcher, live_progress
    jobs, jobs_why = configure_jobs(jobs)
    launcher = configure_launcher(launcher)
    if all_:
        if names:
            raise FivarError(f"--all builds every variant; drop it to build only {', '.join(names)}, or drop the names")
        names = sorted(variant_files())
    if not names:
        raise FivarError("name at least one variant, or pass --all")
    from .jit.build import build_many, serving_modules
    from .fusion.build import gen_fusion_module
    from .runtime.attention import ALL_BACKENDS
    wanted = _choices(targets, (*ALL_BACKENDS, "fusion"), "--targets")
    ops_ = _choices(ops, OPS, "--ops")
    wrote_twins = "triton" in wanted
    variants = {n: load(n) for n in names}  # once: a load is a search-path scan
    fusions = [n for n, v in variants.items() if getattr(v, "kind", None) == "fusion"]
    skipped = [] if {"auto", "fusion"} & {*wanted} else fusions
    if skipped and not all_:
        console.print(f"skipping fusion(s) {', '.join(skipped)}: --targets {targets} has no fusion (add "
                      f"--targets ...,fusion)", highlight=False)
    wanted = [t for t in wanted if t != "fusion"]  # the attention targets: none for --targets fusion
    if wrote_twins:
        _write_triton_twins([v for n, v in variants.items() if n not in fusions])
        wanted = [t for t in wanted if t != "triton"]

    def targets_for(v, op):
        if "auto" not in wanted:
            return wanted
        from .runtime.attention import choose_target
        chosen = {choose_target(v, "auto", op, capability=c)[0] for c in _build_capabilities()}
        if "fa3" in chosen and not _builds_sm90a():  # a plain 9.0 build lacks what FA3 needs
            chosen = (chosen - {"fa3"}) | {"fa2"}
        return sorted(({*wanted} | chosen) - {"auto"})
    head_dims_ = _ints(head_dims, "--head-dims")
    modules = [gen_fusion_module(variants[n], dt) for n in fusions if n not in skipped for dt in _split(dtypes)]
    modules += [m for n, v in variants.items() if n not in fusions for op in ops_ for t in targets_for(v, op)
                for dt in _split(dtypes) for hd in head_dims_
                if not (t == "fa3" and op == "batch_decode") for m in serving_modules(v, op, t, dt, hd)]
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
    with live_progress(modules, console, enabled=prewarm or len(modules) > 1):
        results = build_many(modules, parallel=prewarm or len(modules) > 1)
    table = Table(Column("module", overflow="fold"), "result", "seconds", title=f"fivar build: {len(modules)} module(s)")
    for m, (kind, secs) in zip(modules, results):
        table.add_row(m.uri, {"cold": "[yellow]compiled[/]", "disk": "[green]hit (disk)[/]",
                              "memory": "[green]hit (memory)[/]"}[kind], f"{secs:.2f}")
    console.print(table)
    console.print(f"total {time.perf_counter() - t0:.1f} s")


def _build_capabilities() -> list:
    """The GPUs `build --targets auto` builds for: each arch of FLASHINFER_CUDA_ARCH_LIST (or --arch) when one is
    set, else the visible GPU (None); so `--arch 8.0 9.0a` builds what both would run."""
    from .jit.toolchain import ensure_arch_env
    ensure_arch_env()  # no GPU and no arch list: one line asking for FLASHINFER_CUDA_ARCH_LIST or --arch
    text = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")  # checked: space-separated
    if not text:
        return [None]
    return [_arch_capability(a) for a in text.split()]


def _builds_sm90a(arch_list: str | None = None) -> bool:
    """Whether modules are built for sm_90a (what FA3 kernels need): `arch_list`, else FlashInfer's."""
    text = arch_list or os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
    if text:
        return "9.0a" in text.split()
    from .jit.toolchain import arch_tag
    return "90a" in arch_tag().split("_")


def _fa2_kv_tiles(arch: str | None, where: str) -> str:
    """How FA2 prefill modules built for these archs (else the visible GPU's) choose their KV tile."""
    from .jit import pinned_kv_tiles
    if arch:
        archs = {(int(a.split(".")[0]), a.split(".")[1]) for a in arch.split()}
        built = f"{where} {arch}"
    else:
        import torch
        if not torch.cuda.is_available():
            return "fa2 prefill KV tiles: depend on the target archs (give --arch)"
        major, minor = torch.cuda.get_device_capability()
        archs, built = {(major, str(minor))}, f"this GPU, sm{major}{minor}"
    smem, why = pinned_kv_tiles.decide(archs)
    if smem:
        return (f"fa2 prefill KV tiles: fixed at compile time for {smem[0]} bytes of shared memory per SM ({built}): one "
                f"kernel per CTA tile instead of one per NUM_MMA_KV ({pinned_kv_tiles.ENV}=0 keeps FlashInfer's "
                "run-time choice)")
    return f"fa2 prefill KV tiles: chosen at run time by FlashInfer ({built}: {why})"


def _arch_capability(arch_list: str) -> tuple[int, int]:
    """(major, minor) of a checked arch list: sm90 if it has 9.0a (what FA3 is built for), else its first arch."""
    archs = arch_list.split()
    if "9.0a" in archs:
        return 9, 0
    major, minor = archs[0].split(".")
    return int(major), int(minor.rstrip("abcdefghijklmnopqrstuvwxyz"))


def _given(*params: str) -> list[str]:
    """Which of these options of the running command were given on the command line (not left at their default)."""
    from click.core import ParameterSource
    ctx = click.get_current_context()
    opts = {p.name: p.opts[0] for p in ctx.command.params}
    return [opts[p] for p in params if ctx.get_parameter_source(p) not in (None, ParameterSource.DEFAULT)]


def _write_triton_twins(variants) -> None:
    """`build --targets triton`: render, write and import each variant's Triton twin (a spec the twin cannot take
    fails here); Triton then compiles each kernel on its first launch of a shape, into its own cache."""
    from .jit.triton_module import load_triton_module
    for v in variants:
        mod = load_triton_module(v)
        console.print(f"triton twin of '{v.name}': {mod.__file__}", highlight=False)


@main.command()
@click.argument("name")
@click.option("--ops", default=CHECK_OPS_DEFAULT, show_default=True)
@click.option("--dtypes", default=None, help="comma list of bf16, fp16 (default: bf16; fp16 on the CPU)")
@click.option("--head-dims", default="128", show_default=True)
@click.option("--backends", default="auto", show_default=True,
              help="comma list of auto, fa2, fa3, triton (triton alone runs on the CPU without a GPU)")
def check(name, ops, dtypes, head_dims, backends):
    """Run the variant's kernels at awkward shapes and compare with its torch reference. Without a GPU,
    `--backends triton` runs the Triton twin on the CPU (Triton's interpreter, float16, smaller shapes)."""
    import torch

    from . import load
    from .testing import run_checks
    v = load(name)
    on_cpu = not torch.cuda.is_available() and _split(backends) == ["triton"]
    if dtypes is None:  # Triton's interpreter has no bfloat16 arithmetic
        dtypes = "fp16" if on_cpu else "bf16"
    dts = [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in _choices(dtypes, ("bf16", "fp16"), "--dtypes")]
    fusion = getattr(v, "kind", None) == "fusion"
    if fusion and (ops != CHECK_OPS_DEFAULT or backends != "auto" or head_dims != "128"):
        raise FivarError(f"'{name}' is a fusion: one CUDA kernel checked at its own shapes, so --ops, --backends and "
                         "--head-dims do not apply (without a GPU, its scaffolded test runs the reference on the CPU)")
    if not fusion:
        _choices(ops, OPS, "--ops")
        from .runtime.attention import ALL_BACKENDS
        _choices(backends, ALL_BACKENDS, "--backends")
    if fusion:  # odd token counts, and a packed QKV view for per-head fusions
        from .fusion.check import check_fusion
        results = [r for t in (1, 7, 4097) for p in ((False, True) if v.is_head else (False,))
                   for dt in dts for r in check_fusion(v, tokens=t, packed=p, dtype=dt)]
    else:
        results = run_checks(v, ops=_split(ops), dtypes=dts, head_dims=_ints(head_dims, "--head-dims"),
                             backends=_split(backends), **(dict(device="cpu", heads=((4, 2),)) if on_cpu else {}))
    where = "the CPU (Triton's interpreter)" if on_cpu else torch.cuda.get_device_name()
    table = Table(Column("case", overflow="fold"), "rel err", "max err", "result", title=f"fivar check {name} on {where}")
    for r in results:
        table.add_row(_escape(r.case), f"{r.rel_err:.2e}", f"{r.max_err:.2e}", "[green]pass[/]" if r.passed else "[red]FAIL[/]")
    console.print(table)
    failed = sum(not r.passed for r in results)
    console.print(f"{len(results) - failed} passed, {failed} failed")
    if failed or not results:  # nothing checked is not a pass
        sys.exit(1)


from .cache_cli import cache  # noqa: E402
main.add_command(cache)


@main.command()
@click.argument("name")
@click.option("--vs", "vs", multiple=True, type=click.Choice(["stock", "triton", "flex", "sdpa"]),
              help="contenders besides fivar's own kernels (repeatable); default: stock, triton, flex")
@click.option("--op", type=click.Choice(["prefill", "batch-prefill", "decode"]), default="prefill", show_default=True)
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
def bench(name, vs, op, seqlens, batch, heads, head_dim, dtype, causal, rounds, sustained_s, param_texts, json_path,
          plot_path, compile_, arch):
    """Benchmark a variant against stock FlashInfer, its Triton twin and FlexAttention (needs a GPU)."""
    import json as _json

    import torch

    if compile_:
        ignored = _given("vs", "op", "seqlens", "batch", "heads", "causal", "rounds", "sustained_s", "param_texts",
                         "plot_path")
        if ignored:  # build latency of one module: those shape a timed run
            raise FivarError(f"--compile measures one module's build latency (at --dtype and --head-dim); "
                             f"{', '.join(ignored)} shape a timed run only; drop {'them' if len(ignored) > 1 else 'it'}")
        script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_compile.py"
        if not script.exists():
            raise FivarError("fivar bench --compile runs benchmarks/bench_compile.py from a fivar checkout")
        import subprocess
        _set_arch(arch)
        from .jit.toolchain import ensure_arch_env
        ensure_arch_env()  # no GPU and no arch: one line, not the script's traceback
        from . import load
        from .fusion.spec import FusionVariant
        from .jit.build import HEAD_DIMS
        if isinstance(load(name), FusionVariant):  # an unknown name: the registry's one line
            raise FivarError(f"'{name}' is a fusion; bench --compile measures an attention variant's FA2 module")
        if head_dim not in HEAD_DIMS:
            raise FivarError(f"--head-dim must be one of {', '.join(map(str, HEAD_DIMS))}, got {head_dim}")
        args = [sys.executable, str(script), "--variant", name, "--dtype", dtype, "--head-dim", str(head_dim)] + (
            ["--json", json_path] if json_path else [])
        if not torch.cuda.is_available():
            console.print("no GPU visible: compiling only (hits are build() disk checks, not loads)", highlight=False)
            args.append("--no-load")
        sys.exit(subprocess.call(args))
    from . import load
    from .bench.contenders import scalar_params
    from .fusion.spec import FusionVariant
    v = load(name)
    if isinstance(v, FusionVariant):
        raise FivarError(f"'{name}' is a fusion; fivar bench times attention variants (benchmarks/bench_fusions.py "
                         "times fusions against stock FlashInfer)")
    params = scalar_params(v, param_texts)  # before the GPU check: a typo is reported on any machine
    if sustained_s and _given("rounds"):
        raise FivarError("--sustained times each contender once, for SECONDS; --rounds sets interleaved rounds: "
                         "give one of them")
    if not torch.cuda.is_available():
        raise FivarError("fivar bench times kernels, so it needs a CUDA GPU (without one: fivar bench NAME --compile "
                         "--arch 9.0a measures build latency)")
    if arch:
        raise FivarError("--arch applies to --compile only: a timed run uses the visible GPU")
    from .bench import ceilings as ceil_mod
    from .bench.harness import run
    try:
        hq, hkv = (int(x) for x in heads.split("/"))
    except ValueError:
        raise FivarError(f"--heads must look like 32/8, got {heads!r}") from None
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    ceilings = ceil_mod.get()
    console.print(f"ceilings on {ceilings['gpu']}: copy {ceilings['copy_tb_per_s']:.2f} TB/s, "
                  f"bf16 matmul {ceilings['bf16_matmul_tflops']:.0f} TFLOP/s")
    report = run(v, op=op, seqlens=_split(seqlens, int), batch=batch, heads=(hq, hkv), head_dim=head_dim, dtype=dt,
                 causal=causal, vs=vs or ("stock", "triton", "flex"), rounds=rounds, ceilings=ceilings, params=params,
                 sustained_s=sustained_s or 0.0, progress=lambda s: console.print(s, style="dim", markup=False))
    table = Table("S", "contender", "status", "ms (min..max)", "TFLOP/s", "% matmul", "TB/s", "% copy",
                  "vs stock", title=f"fivar bench {name} --op {op} on {report['gpu']} ({report['date']})")
    for r in report["results"]:
        stock = r["ratio_vs"].get("stock")
        table.add_row(str(r["seqlen"]), _escape(r["contender"] + (f" [{r['label']}]" if r["label"] else "")),
                      {"ok": "[green]ok[/]", "failed": "[red]FAILED check[/]", "error": "[red]error[/]"}[r["status"]],
                      f"{r['median_ms']:.3f} ({r['spread_ms'][0]:.3f}..{r['spread_ms'][1]:.3f})" if r["median_ms"] else
                      _escape(str(r["check"].get("error") or r["check"].get("rel_err")))[:40],
                      f"{r['tflops']:.1f}" if r["tflops"] else "-", f"{r['pct_of_matmul']:.0f}%" if r["tflops"] else "-",
                      f"{r['tb_per_s']:.2f}" if r["tb_per_s"] else "-", f"{r['pct_of_copy']:.0f}%" if r["tb_per_s"] else "-",
                      f"{stock:.2f}x" if stock else "-")
    console.print(table)
    if json_path:
        Path(json_path).write_text(_json.dumps(report, indent=1, default=str))
        console.print(f"wrote {json_path}")
    if plot_path:
        from .bench.plot import plot
        plot(report, plot_path)
        console.print(f"wrote {plot_path}")
