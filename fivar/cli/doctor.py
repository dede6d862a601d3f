"""`fivar doctor`: the toolchain, and every FlashInfer coupling with whether its optimisation is active and why."""
from __future__ import annotations

import sys

import click
from rich.table import Column, Table

from ._common import _escape, console, main


@main.command()
def doctor():
    """Print the toolchain (nvcc, CUDA_HOME, archs, torch, triton, FlashInfer) and every place fivar relies on
    FlashInfer's internals: active, or disabled and why. Exits 1 when a required coupling is broken."""
    from ..flashinfer_compat import report
    from ..jit.toolchain import report as toolchain_report
    tools = Table("", Column("", overflow="fold"), title="toolchain", show_header=False)
    for name, value in toolchain_report():
        tools.add_row(name, _escape(value))
    console.print(tools)
    table = Table(Column("coupling", overflow="fold"), "status", Column("enables", overflow="fold"),
                  Column("why", overflow="fold"), title="FlashInfer couplings")
    for s in report():
        status = "[green]active[/]" if s.active else "[red]broken[/]" if s.required else "[yellow]disabled[/]"
        why = f"relies on {s.relies_on}" if s.active else f"{s.reason}; instead: {s.fallback}"
        table.add_row(s.name, status, _escape(s.enables), _escape(why))
    console.print(table)
    broken = [s.name for s in report() if s.required and not s.active]
    off = [s.name for s in report() if not s.active]
    console.print(f"{len(report()) - len(off)} active, {len(off)} disabled" + (f" ({', '.join(off)})" if off else ""),
                  highlight=False)
    if broken:
        sys.exit(1)
