"""FlashInfer's JIT templates (its csrc/*.jinja), rendered for fivar's modules, with each release's variables."""
from __future__ import annotations

import functools

import jinja2
import jinja2.meta

from ..errors import FivarError
from ._base import SUPPORTED

#: Variables a later release's templates take that fivar's callers do not pass, with the value that builds what the
#: earlier release built: 0.7.4's FA2 prefill templates take `use_token_head_sf` (its FP8 per-(token, head) KV scale,
#: which fivar does not use). Passed only to a template that declares it, so 0.7.2's sources render byte for byte.
RELEASE_DEFAULTS = {"use_token_head_sf": "false"}


def _template(path) -> tuple[jinja2.Template, frozenset[str]]:
    return _parse(path.read_text())


@functools.lru_cache(maxsize=64)
def _parse(text: str) -> tuple[jinja2.Template, frozenset[str]]:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    return env.from_string(text), frozenset(jinja2.meta.find_undeclared_variables(env.parse(text)))


def variables_of(text: str) -> frozenset[str]:
    """The variables a Jinja template's text reads."""
    return _parse(text)[1]


def template_variables(name: str) -> frozenset[str]:
    """The variables FlashInfer's template `name` (under its csrc/) reads."""
    from flashinfer.jit import env as jit_env
    return _template(jit_env.FLASHINFER_CSRC_DIR / name)[1]


def release_kwargs(name: str, kwargs: dict) -> dict:
    """`kwargs` plus the RELEASE_DEFAULTS the installed release's template `name` reads and the caller left out."""
    needed = template_variables(name)
    return {**{k: v for k, v in RELEASE_DEFAULTS.items() if k in needed and k not in kwargs}, **kwargs}


def render_template(name: str, **kwargs) -> str:
    """One of FlashInfer's JIT templates, rendered; a variable fivar does not pass (a FlashInfer other than the ones
    fivar is written against) is a one-line error, not a blank that nvcc reports as a fivar bug."""
    import flashinfer
    from flashinfer.jit import env as jit_env
    template = _template(jit_env.FLASHINFER_CSRC_DIR / name)[0]
    try:
        return template.render(**release_kwargs(name, kwargs))
    except jinja2.UndefinedError as e:
        raise FivarError(f"FlashInfer {flashinfer.__version__}'s template {name} needs a value fivar does not pass "
                         f"({e.message}): fivar is written against FlashInfer {', '.join(SUPPORTED)} (pip install "
                         f"'flashinfer-python>={SUPPORTED[0]},<={SUPPORTED[-1]}')") from None
