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
    from ..flashinfer_compat import OFF_IN_RELEASE, SUPPORTED, release, report
    from ..jit.toolchain import flashinfer_version
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
    statuses = report()
    broken = [s.name for s in statuses if s.required and not s.active]
    off = [s.name for s in statuses if not s.active]
    console.print(f"{len(statuses) - len(off)} active, {len(off)} disabled" + (f" ({', '.join(off)})" if off else ""),
                  highlight=False)
    line, version = release(), flashinfer_version()
    if line is None:
        said = f"not a release fivar is tested against ({', '.join(SUPPORTED)})"
    else:
        unexpected = sorted(set(off) - OFF_IN_RELEASE[line])
        said = f"release {line}, tested ({', '.join(SUPPORTED)}); off by design on it: " + \
            (", ".join(sorted(OFF_IN_RELEASE[line])) or "none") + \
            (f"; off unexpectedly: {', '.join(unexpected)}" if unexpected else "")
    console.print(_escape(f"FlashInfer {version}: {said}; paths it enables: "
                          f"{', '.join(s.name for s in statuses if s.active) or 'none'}"), highlight=False)
    if broken:
        sys.exit(1)
