"""FlashInfer's JIT templates (its csrc/*.jinja), rendered for fivar's modules."""
from __future__ import annotations

import jinja2

from ..errors import FivarError


def render_template(name: str, **kwargs) -> str:
    """One of FlashInfer's JIT templates, rendered; a variable fivar does not pass (a FlashInfer other than the one
    fivar is written against) is a one-line error, not a blank that nvcc reports as a fivar bug."""
    import flashinfer
    from flashinfer.jit import env as jit_env
    template = jinja2.Template((jit_env.FLASHINFER_CSRC_DIR / name).read_text(), undefined=jinja2.StrictUndefined)
    try:
        return template.render(**kwargs)
    except jinja2.UndefinedError as e:
        from . import WRITTEN_AGAINST
        raise FivarError(f"FlashInfer {flashinfer.__version__}'s template {name} needs a value fivar does not pass "
                         f"({e.message}): fivar is written against FlashInfer {WRITTEN_AGAINST} (pip install "
                         f"'flashinfer-python~={WRITTEN_AGAINST}.0')") from None
