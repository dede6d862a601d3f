"""What every `fivar` command shares: the group, its error handling, consoles and option parsing."""
from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.syntax import Syntax

from ..console import console_width
from ..errors import FivarError

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


def _head_dims(value: str, option: str = "--head-dims") -> list[int]:
    from ..spec.inputs import check_head_dims
    return check_head_dims(_ints(value, option), option)


class FivarGroup(click.Group):
    """Turns FivarError into one red line and exit code 1; anything else is a real bug and surfaces."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FivarError as e:
            err_console.print(f"[bold red]error:[/] {_escape(str(e))}", highlight=False, soft_wrap=True)  # one line in logs too
            sys.exit(1)


def _one_line(e: FivarError, path) -> str:
    """A variant file's load error as one line that names the file."""
    text = str(e).splitlines()[0]
    return text if str(path) in text else f"{path}: {text}"


def report_load_errors(errors: list[str], exit: bool = True) -> None:
    """After `list` / `build --all` went on past variant files that failed to load: one line each, then exit 1."""
    for text in errors:
        err_console.print(f"[bold red]error:[/] {_escape(text)}", highlight=False, soft_wrap=True)
    if errors and exit:
        sys.exit(1)


def _escape(text: str) -> str:
    from rich.markup import escape
    return escape(text)


@click.group(cls=FivarGroup)
@click.version_option(package_name="fivar", message="fivar %(version)s")
def main():
    """Author attention variants once in Python; build them through FlashInfer's JIT; check and bench them."""


def _set_arch(arch: str | None):
    from ..jit.toolchain import set_arch_env
    set_arch_env(arch)


def _print_code(text: str, lexer: str = "cpp"):
    if console.is_terminal:
        console.print(Syntax(text, lexer, theme="ansi_dark", word_wrap=True))
    else:  # piped: exact text, no wrapping or truncation
        click.echo(text)


from ..runtime.build_set import (arch_capability as _arch_capability,  # noqa: E402,F401 (the commands import them here)
                                 build_capabilities as _build_capabilities, builds_sm90a as _builds_sm90a)


def format_program_expr(e):
    from ..spec.ir import format_expr
    return format_expr(e)


def _given(*params: str) -> list[str]:
    """Which of these options of the running command were given on the command line (not left at their default)."""
    from click.core import ParameterSource
    ctx = click.get_current_context()
    opts = {p.name: p.opts[0] for p in ctx.command.params}
    return [opts[p] for p in params if ctx.get_parameter_source(p) not in (None, ParameterSource.DEFAULT)]
