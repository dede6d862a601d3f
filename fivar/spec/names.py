"""Parameter names the generated CUDA cannot take.

A variant's params become members of FlashInfer's `Params` struct and arguments of its run functions (FlashInfer's
`additional_params`), so a param called `o`, `lse` or `window_left` redeclares one of FlashInfer's own, and one
called `int` is not a name at all; nvcc would say so long after fivar accepted the spec. The names are read off the
FlashInfer files a module's params go into (the `Params` struct's config and the host sources whose run functions
take them: fivar.jit.build's layouts), so a FlashInfer that adds a field is covered without a list to keep up to
date. Only names a param can clash with count: not include paths, not members reached through `.`, `->` or `::`,
not namespaces. fivar's own code only ever reads a param as `params.NAME`, which no other name can clash with.
"""
from __future__ import annotations

import functools
import importlib.util
import keyword
import re
from pathlib import Path

CPP_KEYWORDS = frozenset("""
alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t class compl
concept const consteval constexpr constinit const_cast continue co_await co_return co_yield decltype default delete
do double dynamic_cast else enum explicit export extern false float for friend goto if inline int long mutable
namespace new noexcept not not_eq nullptr operator or or_eq private protected public register reinterpret_cast
requires return short signed sizeof static static_assert static_cast struct switch template this thread_local throw
true try typedef typeid typename union unsigned using virtual void volatile wchar_t while xor xor_eq
""".split())

def _identifiers(text: str) -> set[str]:
    """Names declared or used unqualified in C++ source (a superset of what a param could redeclare or shadow)."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"|<[\w/.]+\.(?:h|cuh|hpp)>', " ", text)
    text = re.sub(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}", " ", text, flags=re.S)  # jinja: filled in per module
    text = re.sub(r"^\s*#\s*(include|pragma)\b[^\n]*", " ", text, flags=re.M)
    return {m.group(1) for m in re.finditer(r"(?<![\w.>:])(?<!->)([A-Za-z_]\w*)\b(?!\s*::)", text)}


def _flashinfer_csrc() -> Path | None:
    spec = importlib.util.find_spec("flashinfer")  # finds the package without importing it (slow)
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "data" / "csrc"
    return d if d.is_dir() else None


@functools.lru_cache(maxsize=1)
def generated_code_names() -> dict[str, str]:
    """name -> the first source file that declares or uses it, the Params structs' configs first."""
    from ..jit.build import _FA2_LAYOUT, _FA3_LAYOUT
    fi = _flashinfer_csrc()
    layouts = [*_FA2_LAYOUT.values(), *_FA3_LAYOUT.values()]
    names_ = [config for config, _, _, _ in layouts] + [h for _, _, host, _ in layouts for h in host]
    files = [] if fi is None else [fi / n for n in dict.fromkeys(names_)]
    names: dict[str, str] = {}
    for p in files:
        try:
            text = p.read_text()
        except OSError:
            continue
        for n in _identifiers(text):
            names.setdefault(n, p.name)
    return names


def why_param_name_is_taken(name: str) -> str | None:
    """Why `name` cannot be a param of a generated module, or None when it can."""
    if name in CPP_KEYWORDS:
        return "it is a C++ keyword"
    if keyword.iskeyword(name):
        return "it is a Python keyword"
    source = generated_code_names().get(name)
    if source is not None:
        return f"the generated CUDA already uses it ({source})"
    return None
