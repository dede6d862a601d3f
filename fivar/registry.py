"""Finding variants by name: FIVAR_VARIANT_PATH, then ./variants, then fivar's bundled variants."""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import signal
import sys
import threading
from pathlib import Path

from .errors import FivarError, FivarSpecError
from .paths import bundled_variants_dir
from .spec import AttentionVariant

_loaded: dict[Path, AttentionVariant] = {}


def search_path() -> list[Path]:
    from .config import variant_path
    dirs = [Path(p) for p in variant_path()]
    dirs.append(Path.cwd() / "variants")
    dirs.append(bundled_variants_dir())
    seen, out = set(), []
    for d in dirs:
        r = d.resolve()
        if r not in seen and r.is_dir():
            seen.add(r)
            out.append(r)
    return out


def variant_files() -> dict[str, Path]:
    """name -> file, first match on the search path wins."""
    return {name: files[0] for name, files in all_variant_files().items()}


def all_variant_files() -> dict[str, list[Path]]:
    """name -> every file of that name on the search path, in search order (the first is the one loaded)."""
    found: dict[str, list[Path]] = {}
    for d in search_path():
        for f in sorted(d.glob("*.py")):
            if not f.name.startswith("_"):
                found.setdefault(f.stem, []).append(f)
    return found


def load_file(path: Path) -> AttentionVariant:
    path = Path(path).resolve()
    if path in _loaded:
        return _loaded[path]
    if not path.is_file() or path.suffix != ".py":
        what = "no such file" if not path.exists() else "a directory" if path.is_dir() else "not a .py file"
        raise FivarError(f"{path}: {what}; a variant is a .py file that defines `variant = fivar.AttentionVariant(...)`"
                         " (or a name on the search path: `fivar list`)")
    try:  # what is executed below: fivar cache staleness tells an edited file from changed code generation
        file_sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        file_sha256 = None
    mod_name = f"fivar_variant_{path.stem}_{abs(hash(str(path))):x}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # inspect.getsource needs the module registered
    try:
        with _interrupts_told_apart() as interrupted:
            spec.loader.exec_module(module)
    except FivarSpecError:
        raise
    except SyntaxError as e:
        raise FivarSpecError(f"syntax error: {e.msg}", filename=str(path), line=e.lineno,
                             col=(e.offset or 1) - 1) from None
    except Exception as e:  # the user's module failed to import: say where, not a fivar traceback
        first = str(e).splitlines()[0] if str(e).strip() else ""
        raise FivarSpecError(f"importing the variant file failed: {type(e).__name__}: {first}",
                             filename=str(path), line=_line_in(e, path), col=0) from None
    except BaseException as e:  # SystemExit, KeyboardInterrupt, GeneratorExit or its own BaseException subclass,
        # raised by the file itself: a broken file, not a quit of fivar
        if isinstance(e, KeyboardInterrupt) and interrupted:
            raise  # Ctrl-C while the file ran: the user's, not the file's
        what = f"{type(e).__name__}({e.code!r})" if isinstance(e, SystemExit) else type(e).__name__
        raise FivarSpecError(f"importing the variant file raised {what} (a variant file must define `variant = "
                             "...`, not exit)", filename=str(path), line=_line_in(e, path), col=0) from None
    v = getattr(module, "variant", None)
    from .fusion import FusionVariant
    if not isinstance(v, (AttentionVariant, FusionVariant)):
        raise FivarSpecError("the file must define `variant = fivar.AttentionVariant(...)`",
                             filename=str(path), line=1, col=0)
    v.loaded_file_sha256 = file_sha256
    _loaded[path] = v
    return v


def _line_in(e: BaseException, path: Path) -> int:
    """The last line of `path` in the traceback of `e` (1 when the file is not in it)."""
    tb, line = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line or 1


@contextlib.contextmanager
def _interrupts_told_apart():
    """While a variant file runs: a list that becomes non-empty when a real Ctrl-C (SIGINT) arrives, so that a
    KeyboardInterrupt the file raises itself is told apart from the user stopping fivar."""
    seen: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):
        seen.append(True)
        if callable(previous):  # Python's own handler raises KeyboardInterrupt
            return previous(signum, frame)
        if previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def describe_search(action: str) -> str:
    """One line for a command that loads every variant on the search path: loading one runs its file's code."""
    return (f"note: {action} runs (imports) every variant file (*.py) in "
            f"{', '.join(map(str, search_path())) or 'no directory'}")


def load_variant(name: str) -> AttentionVariant:
    if name.endswith(".py") or os.sep in name:
        return load_file(Path(name))
    files = variant_files()
    if name not in files:
        import difflib
        close = difflib.get_close_matches(name, list(files), n=1)
        known = ", ".join(sorted(files)) or "none"
        raise FivarError(f"no variant named '{name}'{f' (did you mean {close[0]!r}?)' if close else ''} (searched "
                         f"{', '.join(map(str, search_path()))}; found: {known})")
    return load_named(name, files[name])


def load_named(name: str, path: Path):
    """load_file, for the variant `name` found by its file name: the file must define that variant."""
    v = load_file(path)
    if v.name != name:
        raise FivarSpecError(f"file {path.name} defines variant '{v.name}', expected '{name}' (a variant is found by "
                             "its file name)", filename=str(path), line=1, col=0)
    return v
