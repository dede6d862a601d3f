"""`fivar list` and `fivar new-variant`: the variants on the search path, and a new one scaffolded."""
from __future__ import annotations

import keyword
import os
from pathlib import Path

import click
from rich.table import Column, Table

from ..errors import FivarError
from ._common import (CHECK_OPS_DEFAULT, OPS, _arch_capability, _build_capabilities, _builds_sm90a, _choices,
                      _escape, _given, _ints, _one_line, _print_code, _set_arch, _split, console, err_console,
                      format_program_expr, main, report_load_errors)


@main.command("list")
def list_cmd():
    """Variants on the search path (FIVAR_VARIANT_PATH, ./variants, bundled); listing imports, so runs, each file."""
    from ..registry import all_variant_files, describe_search, load_named
    err_console.print(_escape(describe_search("fivar list")), highlight=False, soft_wrap=True)
    table = Table(Column("name", overflow="fold"), "kind", "params", Column("file", overflow="fold"))
    errors = []
    for name, paths in sorted(all_variant_files().items()):
        path, shown = paths[0], _escape(str(paths[0]))
        if len(paths) > 1:  # a ./variants/softcap.py is the softcap every command loads: say what it hides
            shown += f" [yellow](hides {_escape(', '.join(map(str, paths[1:])))})[/]"
        try:
            v = load_named(name, path)
            if getattr(v, "kind", None) != "fusion":
                v.ir  # parse and type-check: a spec error shows here, not at the first build
        except FivarError as e:  # the other files are still listed; the exit status says some failed
            errors.append(_one_line(e, path))
            table.add_row(name, "[red]error[/]", _escape(str(e).splitlines()[0]), shown)
            continue
        if getattr(v, "kind", None) == "fusion":
            table.add_row(name, "fusion", _escape(v.describe()), shown)
            continue
        table.add_row(name, _attention_kind(v), ", ".join(v.params) or "-", shown)
    console.print(table)
    report_load_errors(errors)


def _attention_kind(v) -> str:
    """What an attention variant changes, as `fivar list` shows it: its logits, mask and sink (one at least)."""
    kind = " + ".join(k for k, has in (("logits", v.logits), ("mask", v.mask), ("sink", v.sink)) if has)
    return kind if v.softmax else kind + " (no softmax)"


@main.command("new-variant")
@click.argument("name")
@click.option("--dir", "variants_dir", default="variants", show_default=True, help="where the variant file goes")
@click.option("--tests-dir", default="tests/variants", show_default=True, help="where its test goes")
@click.option("--kind", type=click.Choice(["attention", "fusion"]), default="attention", show_default=True,
              help="an attention variant, or a norm/residual/RoPE fusion")
def new_variant(name, variants_dir, tests_dir, kind):
    """Scaffold variants/NAME.py and tests/variants/test_NAME.py (never overwrites)."""
    from ..codegen.fa2 import render
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
    from ..registry import search_path, variant_files
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
