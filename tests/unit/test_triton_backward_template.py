"""The Triton backward's template: every bundled variant's training module renders to valid Python, and the
Triton kernels' parts are written at their own indentation (constexpr switches, not Jinja-computed indents)."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

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
COMPUTED_INDENT = re.compile(r"^\{\{-? *(ind|indent|pi)\b"  # a line led by an indent variable
                             r"|\|\s*indent\b|\bindent\("  # Jinja's indent filter
                             r"|\{\{-? *['\"] ['\"] *\*"  # spaces made by an expression
                             r"|[(,]\s*['\"] +['\"]")  # a macro handed its indentation


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


def _signature(kernel, variant, constexprs) -> dict:
    """Triton's types for the backward kernels' arguments: bf16 activations, fp32 LSE/delta/gradients, int32
    offsets and sizes, and the variant's params as declared."""
    types = {}
    for a in kernel.arg_names:
        if a in constexprs:
            types[a] = "constexpr"
        elif a in ("Q", "K", "V", "DO", "DK", "DV", "DQ"):
            types[a] = "*bf16"
        elif a in ("Lse", "Delta") or a.startswith("fv_grad"):
            types[a] = "*fp32"
        elif a == "sm_scale":
            types[a] = "fp32"
        elif a.startswith("fvp_"):
            p = variant.params[a[4:]]
            t = "fp32" if p.ir_type == "f32" else "i32"
            types[a] = "*" + t if a[4:] in variant.tensor_params else t
        else:  # pointers to int32 (indptrs, ranges, orders) or int32 strides and sizes
            types[a] = "*i32" if a[0].isupper() or a.endswith("_indptr") else "i32"
    return types


def _compile_for_hopper(name: str) -> None:
    """Compiles both backward kernels of `name` for sm90 (no GPU needed); run where Triton is not interpreting."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fivar.jit.triton_module import load_triton_module
    from test_triton_backward import READS, SCATTERED
    variant = {"learnable_reads": READS, "learnable_scattered": SCATTERED}.get(name) or fivar.load(name)
    module = load_triton_module(variant, training=True)
    for kernel in (module.bwd_dkdv_kernel.fn, module.bwd_dq_kernel.fn):
        constexprs = dict(GROUP=2, HEAD_DIM=64, CAUSAL=True, BLOCK_M=64, BLOCK_N=64, USE_TMA=False)
        source = ASTSource(fn=kernel, signature=_signature(kernel, variant, constexprs), constexprs=constexprs)
        ttir = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ttir"]
        assert "tt.dot" in ttir and "tt.return" in ttir, kernel.__name__


def test_triton_kernels_compile_for_hopper():
    """Triton's compiler, not only its interpreter, takes both kernels: the BWD_* and EDGE constexprs prune the
    branches a variant does not have (their names stay undefined there) and the learnable reads' constant tests
    fold. A pre-pass mask, no softmax, every kind of learnable read. Triton fixes interpreted-or-compiled at its
    import, so the compile runs in a process of its own."""
    names = ["document_mask", "sigmoid", "learnable_reads", "learnable_scattered"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).parent
    code = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent.parent)!r}]; "
            f"import {Path(__file__).stem} as t; [t._compile_for_hopper(n) for n in {names!r}]")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
