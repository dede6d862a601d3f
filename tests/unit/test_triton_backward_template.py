"""The Triton backward's template: every bundled variant's training module renders to valid Python, and the
kernels' parts (Triton's and Gluon's) are written at their own indentation (constexpr switches, not Jinja-computed
indents)."""
import ast
import builtins
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

import fivar
from fivar.bench.train import learnable_copy
from fivar.codegen.triton_bwd import render_training
from fivar.paths import bundled_variants_dir, templates_dir
from fivar.spec import AttentionVariant

BUNDLED = sorted(p.stem for p in bundled_variants_dir().glob("*.py") if p.stem != "__init__")
# the parts holding the Triton and Gluon kernels and their launcher
KERNEL_PARTS = ["attention_bwd.py.jinja", "bwd/schedule.jinja", "bwd/dkdv.jinja", "bwd/dq.jinja", "bwd/launch.jinja",
                "bwd/gluon_dkdv.jinja", "bwd/gluon_dq.jinja", "bwd/gluon_macros.jinja"]
GLUON_KERNELS = ("gl_bwd_dkdv_kernel", "gl_bwd_dq_kernel")
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


@pytest.mark.parametrize("part", KERNEL_PARTS)
def test_kernel_parts_have_no_computed_indentation(part):
    path = templates_dir() / "triton" / part
    assert path.is_file(), path
    bad = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
           if COMPUTED_INDENT.search(line)]
    assert not bad, "\n".join(bad)


def _switches(tree: ast.Module) -> dict:
    """The module's BWD_* constexprs: {name: value}."""
    return {s.targets[0].id: s.value.args[0].value for s in tree.body
            if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name) and s.targets[0].id.startswith("BWD_")}


class _Pruned(ast.NodeTransformer):
    """A kernel as Triton compiles it for the module's BWD_* values: an `if` on the switches (and on constants, such
    as `RUN_HEADS`'s choice) keeps only the branch they take; the others are never compiled."""

    def __init__(self, switches):
        self.switches = switches

    def value(self, e):
        """The test's value where the switches decide it, else None."""
        if isinstance(e, ast.Name) and e.id in self.switches:
            return self.switches[e.id]
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            v = self.value(e.operand)
            return None if v is None else not v
        if isinstance(e, ast.BoolOp):
            vs = [self.value(x) for x in e.values]
            decisive = False if isinstance(e.op, ast.And) else True
            if decisive in vs:
                return decisive
            return None if None in vs else not decisive
        return None

    def visit_If(self, node):
        self.generic_visit(node)
        v = self.value(node.test)
        return node if v is None else (node.body if v else node.orelse)


def _undefined_names(fn: ast.FunctionDef, module_names: set) -> set:
    """Names the kernel reads that neither it (arguments, assignments, loop targets) nor the module defines."""
    local = {a.arg for a in fn.args.args}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            local.add(n.id)
    return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local - \
        module_names - set(dir(builtins))


def _module_names(tree: ast.Module) -> set:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n in tree.body:
            names.add(n.name)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[0])
    for s in tree.body:
        for n in ast.walk(s):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and not isinstance(s, ast.FunctionDef):
                names.add(n.id)
    return names


def _statement_starts(source: str) -> list[tuple[int, int]]:
    """(row, column) where each statement of `source` starts (not its continuation lines or comments)."""
    starts, at_start = [], True
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            at_start = True
        elif tok.type not in (tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER) and at_start:
            starts.append(tok.start)
            at_start = False
    return starts


def _gluon_variants():
    """The shapes the Gluon kernels take: the bundled variants (a pre-pass mask, bands, no softmax, no mask), frozen
    and with learnable tables (per-program, per-row and per-element reads)."""
    out = {}
    for name in _attention_variants():
        v = fivar.load(name)
        out[name] = v
        out[name + "+learnable"] = learnable_copy(v)
    return out


def test_gluon_kernels_render_at_their_own_indentation_and_prune_to_defined_names():
    """The Gluon dK/dV and dQ kernels of every shape parse; each statement starts at a multiple of four columns; and
    with the BWD_* switches pruned as Triton prunes them, every name a kernel reads is defined (a switch guarding
    the wrong lines, e.g. the mask call on a mask-free variant or the pre-pass's KeyRows without it, reads a name
    the module lacks)."""
    shapes = set()
    for name, variant in _gluon_variants().items():
        text = render_training(variant)
        tree = ast.parse(text)
        switches = _switches(tree)
        shapes.add(tuple(sorted(switches.items())))
        kernels = {s.name: s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name in GLUON_KERNELS}
        assert set(kernels) == set(GLUON_KERNELS), name
        lines = text.splitlines(keepends=True)
        for kernel in kernels.values():
            source = "".join(lines[kernel.lineno - 1:kernel.end_lineno])
            off = [f"{kernel.name}:{row}: column {col}" for row, col in _statement_starts(source) if col % 4]
            assert not off, f"{name}: " + "; ".join(off[:5])
            pruned = _Pruned(switches).visit(kernel)
            missing = _undefined_names(pruned, _module_names(tree))
            assert not missing, f"{name}: {kernel.name} reads undefined {sorted(missing)}"
    flags = {k: {dict(s)[k] for s in shapes} for k in ("BWD_SOFTMAX", "BWD_MASK", "BWD_TILE_LISTS", "BWD_BAND_LEFT")}
    assert all(v == {True, False} for v in flags.values()), flags  # both sides of each switch were rendered


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
