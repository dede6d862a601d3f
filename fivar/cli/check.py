"""`fivar check`: a variant's kernels against its torch reference at awkward shapes."""
from __future__ import annotations

import sys

import click
from rich.table import Column, Table

from ..errors import FivarError
from ._common import (CHECK_OPS_DEFAULT, OPS, _arch_capability, _build_capabilities, _builds_sm90a, _choices,
                      _escape, _given, _head_dims, _print_code, _set_arch, _split, console, format_program_expr, main)


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

    from .. import load
    from ..testing import run_checks
    v = load(name)
    from ..jit.targets import runs_twin
    on_cpu = not torch.cuda.is_available() and len(_split(backends)) == 1 and runs_twin(_split(backends)[0])
    if dtypes is None:  # Triton's interpreter has no bfloat16 arithmetic
        dtypes = "fp16" if on_cpu else "bf16"
    dts = [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in _choices(dtypes, ("bf16", "fp16"), "--dtypes")]
    fusion = getattr(v, "kind", None) == "fusion"
    if fusion and (ops != CHECK_OPS_DEFAULT or backends != "auto" or head_dims != "128"):
        raise FivarError(f"'{name}' is a fusion: one CUDA kernel checked at its own shapes, so --ops, --backends and "
                         "--head-dims do not apply (without a GPU, its scaffolded test runs the reference on the CPU)")
    if not fusion:
        _choices(ops, OPS, "--ops")
        from ..runtime.attention import ALL_BACKENDS
        _choices(backends, ALL_BACKENDS, "--backends")
    if fusion:  # odd token counts, and a packed QKV view for per-head fusions
        from ..fusion.check import check_fusion
        results = [r for t in (1, 7, 4097) for p in ((False, True) if v.is_head else (False,))
                   for dt in dts for r in check_fusion(v, tokens=t, packed=p, dtype=dt)]
    else:
        results = run_checks(v, ops=_split(ops), dtypes=dts, head_dims=_head_dims(head_dims),
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
