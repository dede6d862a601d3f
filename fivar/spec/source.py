"""Where a variant function's source comes from: its lines in its file, or, for a sink written as a lambda, the
lambda's node in the whole file (the lines around a lambda need not parse alone)."""
from __future__ import annotations

import ast
import inspect
import linecache
import types

from ..errors import FivarSpecError


def function_source(variant, fn, role: str) -> tuple[str, int, int]:
    """(source, first line, column offset) of `fn`'s definition; a one-line error where it has none."""
    if not isinstance(fn, types.FunctionType):
        raise FivarSpecError(f"`{role}` must be a plain Python function (def), got {type(fn).__name__}",
                             variant=variant.name)
    try:
        lines, first_line = inspect.getsourcelines(fn)
    except (OSError, TypeError) as e:
        raise FivarSpecError(f"cannot read the source of `{role}` ({e}); define it in a .py file",
                             variant=variant.name, filename=fn.__code__.co_filename,
                             line=fn.__code__.co_firstlineno) from None
    return "".join(lines), first_line, len(lines[0]) - len(lines[0].lstrip())


def sink_lambda(variant, fn) -> tuple[ast.Lambda, str]:
    """The sink's lambda node and the text of its whole file (its lines and columns are the file's): `inspect` gives
    only the lines around a lambda, which need not parse alone (`sink=lambda qo_head, params: ...,` inside a call),
    so the whole file is parsed and the lambda is the one on the code's first line with its argument names."""
    code, filename = fn.__code__, fn.__code__.co_filename
    try:
        linecache.checkcache(filename)  # the file as it is now, as inspect reads a def
        text = "".join(linecache.getlines(filename)) or inspect.getsource(inspect.getmodule(fn))
        tree = ast.parse(text)
    except (OSError, TypeError, SyntaxError, RecursionError, MemoryError) as e:
        raise FivarSpecError(f"cannot read the source of the `sink` lambda ({e}); define it in a .py file",
                             variant=variant.name, filename=filename, line=code.co_firstlineno) from None
    names = list(code.co_varnames[:code.co_argcount])
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda) and n.lineno == code.co_firstlineno
             and [a.arg for a in n.args.args] == names]
    if len(found) != 1:
        raise FivarSpecError(f"cannot tell which lambda on line {code.co_firstlineno} is the `sink` "
                             f"({len(found)} match its arguments); define it with `def`",
                             variant=variant.name, filename=filename, line=code.co_firstlineno)
    return found[0], text
