"""`fivar show`: what fivar generates for a variant, and (--explain) which kernels run it and why."""
from __future__ import annotations

import os

import click

from ..errors import FivarError
from ._common import (CHECK_OPS_DEFAULT, OPS, _arch_capability, _build_capabilities, _builds_sm90a, _choices,
                      _escape, _given, _ints, _print_code, _set_arch, _split, console, format_program_expr, main)


@main.command()
@click.argument("name")
@click.option("--target", type=click.Choice(["fa2", "fa3", "triton", "ir"]), default=None,
              help="attention variants only  [default: fa2]")
@click.option("--explain", is_flag=True, help="say in a few lines which kernel `backend='auto'` runs each path on, "
              "what it skips and what the mask costs (with --verbose: every rule, and why)")
@click.option("--verbose", is_flag=True, help="with --explain: the full rules behind each choice")
@click.option("--op", type=click.Choice(OPS), default="single_prefill", show_default=True)
@click.option("--sources", is_flag=True, help="print every generated source file of the module, not just the struct")
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--head-dim", default=128, show_default=True)
@click.option("--arch", default=None, help="target arch for --sources and --explain without a GPU, e.g. 9.0a")
def show(name, target, op, sources, dtype, head_dim, arch, explain, verbose):
    """Print what fivar generates for a variant."""
    from .. import load
    from ..spec import optimize
    from ..spec.ir import format_program
    if verbose and not explain:
        raise FivarError("--verbose goes with --explain (`fivar show NAME --explain --verbose`)")
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
        from ..fusion.build import render_sources
        srcs = render_sources(v, dtype)
        for fname, text in srcs.items():
            if sources or fname.endswith(".cu"):
                if sources:
                    console.print(f"\n// ===== {fname} =====", style="bold", markup=False)
                _print_code(text)
        return
    from ..jit.build import DTYPES, HEAD_DIMS
    from ..jit.targets import FA2, FA3, named, runs_twin, target_of
    target = target or FA2.name
    kernels = named(target)  # None for --target ir
    flashinfer = kernels is not None and kernels.is_flashinfer
    if flashinfer and (dtype not in DTYPES or head_dim not in HEAD_DIMS):  # `build` refuses these
        raise FivarError(f"variant '{v.name}': " + (f"dtype '{dtype}' is not supported (use one of {sorted(DTYPES)})"
                         if dtype not in DTYPES else f"head_dim {head_dim} is not supported (use one of {HEAD_DIMS})"))
    if explain:
        import torch

        from ..runtime.attention import choose_target
        capability = None
        where = "--arch" if arch else "FLASHINFER_CUDA_ARCH_LIST"
        arch = arch or os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
        no_sm90a, as_on = False, ""
        if arch and not torch.cuda.is_available():  # what auto would pick on that GPU
            from ..jit.toolchain import check_arch_list
            check_arch_list(arch, where)
            capability = _arch_capability(arch)
            no_sm90a = not _builds_sm90a(arch)
            as_on = f"no GPU visible: as on sm{capability[0]}{capability[1]} ({where} {arch})"
        elif not arch and not torch.cuda.is_available():  # the answer for no GPU at all, not what a GPU would run
            as_on = "no GPU visible and no target arch (--arch 9.0a: what an sm90 GPU runs)"
        picks = []
        for o in OPS:
            t, why = choose_target(v, "auto", o, capability=capability)
            if target_of(t).needs_sm90a and no_sm90a:  # what `fivar build` does with such a list
                t, why = "fa2", f"{where} {arch} builds no sm_90a code, which FA3 kernels need: FA2 (add 9.0a for FA3)"
            picks.append((o, t, why))
        from ..explain import lines, short
        # the answer in a few lines, the same choices rendered short; --verbose adds every rule and why
        console.print((f"{as_on}: " if as_on else "") + ", ".join(f"{o} [bold]{t}[/]" for o, t, _ in picks)
                      + ("" if verbose else " (--verbose: why, and every rule)"))
        for line in short(v, arch, where):
            console.print(_escape(line))
        if not verbose:
            return
        console.print()
        if as_on:
            console.print(as_on)
        for o, t, why in picks:
            console.print(f"{o}: [bold]{t}[/] - {_escape(why)}")
        for line in lines(v, arch, where):
            console.print(_escape(line))
        return
    if runs_twin(target):  # the Triton twin: one Python module with every kernel
        from ..codegen.triton import render_attention
        _print_code(render_attention(v), lexer="python")
        return
    if target == "ir":
        vir = v.ir
        for prog, role in ((vir.logits, "logits"), (vir.mask, "mask"), (vir.sink, "sink")):
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
    from ..codegen import fa2, fa3
    from ..codegen.tile_list import bits_kernel
    if not sources:
        from ..jit.module_key import ModuleKey
        ModuleKey(op, target, dtype, head_dim).checked(v)  # an op the target has no kernel for: its one-line error
        tiles = fa3.uses_tile_list(v, op)  # the tile-list form on both, its struct the shared mask-free one
        s = bits_kernel(v) if tiles else v
        decl = (fa3.variant_decl(s, tile_list=tiles, logits_range=fa3.softmax_range(v, dtype))
                if target_of(target) is FA3 else fa2.variant_decl(s, tile_list=tiles))
        _print_code(decl.source)
        return
    _set_arch(arch)
    from ..jit.build import gen_module
    m = gen_module(v, op=op, target=target, dtype=dtype, head_dim=head_dim)
    console.print(f"# module {m.uri}", style="bold")
    for fname, text in m.sources.items():
        console.print(f"\n// ===== {fname} =====", style="bold", markup=False)
        _print_code(text)
