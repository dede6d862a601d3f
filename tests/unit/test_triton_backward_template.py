"""The Triton backward's template: every bundled variant's training module renders to valid Python, and the
Triton kernels' parts are written at their own indentation (constexpr switches, not Jinja-computed indents)."""
import ast
import re

import pytest

import fivar
from fivar.codegen.triton_bwd import render_training
from fivar.paths import bundled_variants_dir, templates_dir
from fivar.spec import AttentionVariant

BUNDLED = sorted(p.stem for p in bundled_variants_dir().glob("*.py") if p.stem != "__init__")
# the parts holding the Triton kernels and their launcher (the Gluon kernels' parts still take an indent argument)
TRITON_PARTS = ["attention_bwd.py.jinja", "bwd/schedule.jinja", "bwd/dkdv.jinja", "bwd/dq.jinja", "bwd/launch.jinja"]
# a line whose indentation Jinja computes: an indent variable or filter, a run of spaces made by an expression, or a
# macro handed its indentation as a string of spaces
COMPUTED_INDENT = re.compile(r"^\{\{-? *(ind|indent|pi)\b|\|\s*indent\b|\bindent\(|\{\{-? *['\"] ['\"] *\*|[(,]\s*['\"] +['\"]")


def _attention_variants():
    return [n for n in BUNDLED if isinstance(fivar.load(n), AttentionVariant)]


@pytest.mark.parametrize("name", _attention_variants())
def test_every_bundled_variant_renders_a_backward_that_parses(name):
    text = render_training(fivar.load(name))
    tree = ast.parse(text)
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"bwd_dkdv_kernel", "bwd_dq_kernel", "backward"} <= defined
    assert "\n\n\n\n" not in text.split("# --- Backward (training)")[1]  # at most two blank lines between parts


def test_the_bundled_variants_include_every_backward_shape():
    """The renders above cover a mask the pre-pass scans, a band, no softmax and a mask-free variant."""
    shapes = {n: fivar.load(n) for n in _attention_variants()}
    assert any(v.scans_mask for v in shapes.values())
    assert any(v.kv_band.left is not None for v in shapes.values())
    assert any(not v.softmax for v in shapes.values())
    assert any(v.lowered.mask is None for v in shapes.values())


@pytest.mark.parametrize("part", TRITON_PARTS)
def test_triton_kernel_parts_have_no_computed_indentation(part):
    path = templates_dir() / "triton" / part
    bad = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
           if COMPUTED_INDENT.search(line)]
    assert not bad, "\n".join(bad)
