"""fivar works with every FlashInfer release it is tested against (flashinfer_compat.SUPPORTED): it tells them apart,
passes each one's template variables, and renders every bundled variant's modules with the installed one.
CI runs this file (and test_flashinfer_compat.py) under the system FlashInfer and again under the newest release."""
import os
import random
import re
from pathlib import Path

import jinja2
import pytest

import fivar
from fivar import flashinfer_compat as compat
from fivar.errors import FivarError
from fivar.flashinfer_compat import fa2_launchers, templates

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version, line", [("0.7.2", "0.7.2"), ("0.7.2.post1", "0.7.2"), ("0.7.4", "0.7.4"),
                                           ("0.7.4.post2", "0.7.4"), ("0.7.3", None), ("0.8.0", None),
                                           ("0.7.10", None), ("not a version", None)])
def test_release_lines(version, line):
    assert compat.release(version) == line


def test_pyproject_admits_exactly_tested_release_lines():
    """pyproject's range holds every tested release, and nothing outside a line fivar knows the couplings of."""
    from packaging.requirements import Requirement
    spec = Requirement(re.search(r'"(flashinfer-python[^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1)).specifier
    assert all(spec.contains(v) for v in compat.SUPPORTED), spec
    rng = random.Random()
    probes = {f"0.{rng.randint(6, 8)}.{rng.randint(0, 6)}" + rng.choice(["", ".post1", ".post3"]) for _ in range(40)}
    admitted = [v for v in probes | set(compat.SUPPORTED) | {"0.7.3", "0.7.5", "0.8.0", "0.7.2"} if spec.contains(v)]
    assert admitted and all(compat.release(v) is not None for v in admitted), admitted
    assert {compat.release(v) for v in compat.SUPPORTED} == set(compat.OFF_IN_RELEASE)


def _fake_csrc(monkeypatch, tmp_path, files: dict[str, str]):
    from flashinfer.jit import env as jit_env
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(jit_env, "FLASHINFER_CSRC_DIR", tmp_path)


def test_a_release_variable_is_passed_only_to_a_template_that_reads_it(monkeypatch, tmp_path):
    """0.7.4's FA2 prefill templates read use_token_head_sf, 0.7.2's and the decode ones do not: each gets what it
    reads, and a caller's own value wins."""
    head = random.randint(32, 256)
    _fake_csrc(monkeypatch, tmp_path, {
        "new.jinja": "D={{ head_dim_qk }} SF={{ use_token_head_sf }}",
        "old.jinja": "D={{ head_dim_qk }}",
    })
    assert templates.render_template("new.jinja", head_dim_qk=head) == f"D={head} SF=false"
    assert templates.render_template("new.jinja", head_dim_qk=head, use_token_head_sf="true").endswith("SF=true")
    assert templates.render_template("old.jinja", head_dim_qk=head) == f"D={head}"
    assert "use_token_head_sf" in templates.release_kwargs("new.jinja", {"head_dim_qk": head})
    assert "use_token_head_sf" not in templates.release_kwargs("old.jinja", {"head_dim_qk": head})


def test_a_variable_no_release_defines_is_still_a_one_line_error(monkeypatch, tmp_path):
    _fake_csrc(monkeypatch, tmp_path, {"later.jinja": "{{ head_dim_qk }} {{ use_something_new }}"})
    with pytest.raises(FivarError, match=r"later.jinja needs a value fivar does not pass .*use_something_new") as e:
        templates.render_template("later.jinja", head_dim_qk=64)
    assert "\n" not in str(e.value)


def test_installed_templates_get_use_token_head_sf_only_where_they_read_it():
    from flashinfer.jit import env as jit_env
    from fivar.flashinfer_layout import FA2_LAYOUT, FA3_LAYOUT
    for layout in (FA2_LAYOUT, FA3_LAYOUT):
        for config_t, inst_ts, _, _ in layout.values():
            for name in (config_t, *inst_ts):
                reads = "use_token_head_sf" in (jit_env.FLASHINFER_CSRC_DIR / name).read_text()
                assert ("use_token_head_sf" in templates.release_kwargs(name, {})) == reads, name


def test_per_tile_batch_units_are_off_when_flashinfer_takes_a_variable_they_do_not(monkeypatch):
    """The per-tile batch units repeat FlashInfer's instantiations: a template parameter they do not pass (0.7.4's
    use_token_head_sf) turns them off in the check, not only when a module's statements are compared."""
    extra = f"use_var_{random.randrange(10**6)}"
    real = templates.template_variables
    monkeypatch.setattr(templates, "template_variables", lambda name: real(name) | {extra})
    fa2_launchers.batch_prefill_split_problem.cache_clear()
    try:
        assert extra in (fa2_launchers.batch_prefill_split_problem() or "")
    finally:
        monkeypatch.undo()
        fa2_launchers.batch_prefill_split_problem.cache_clear()
    ok = fa2_launchers.batch_prefill_split_problem()
    assert (ok is None) == ("fa2_batch_prefill_split" not in compat.OFF_IN_RELEASE[compat.release()]), ok


ATTENTION = sorted(p.stem for p in (ROOT / "variants").glob("*.py")
                   if p.stem != "__init__" and "AttentionVariant(" in p.read_text())


@pytest.mark.parametrize("name", ATTENTION)
def test_every_bundled_variant_renders_with_the_installed_release(name, monkeypatch, tmp_path):
    """Every op and target a variant serves renders from the installed FlashInfer's templates with no variable left
    unset: FlashInfer's template text is in the sources, with 0.7.4's USE_TOKEN_HEAD_SF off where it has one."""
    from fivar.jit.build import serving_modules
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    variant, rendered = fivar.load(name), 0
    for op in ("single_prefill", "batch_prefill", "batch_decode"):
        for target in ("fa2", "fa3"):
            try:
                mods = serving_modules(variant, op, target)
            except FivarError as e:
                assert "has no FA3 kernel" in str(e), e
                continue
            for m in mods:
                text = "".join(m.sources.values())
                assert m.sources and "{{" not in text and "{%" not in text
                sf = re.findall(r"constexpr bool USE_TOKEN_HEAD_SF = (\w+);", text)
                assert sf in ([], ["false"]) and (bool(sf) == (compat.release() == "0.7.4" and "fa2" in m.uri
                                                              and "decode" not in m.uri)), (m.uri, sf)
                rendered += 1
    assert rendered >= 2


def test_attach_leaves_a_wrapper_expecting_no_token_head_scale(monkeypatch):
    """0.7.4's wrapper plan() refuses use_token_head_sf other than its module's: fivar's modules render it false."""
    from types import SimpleNamespace

    from flashinfer import prefill
    from fivar.flashinfer_compat import wrappers
    monkeypatch.setattr(prefill, "get_batch_prefill_jit_module", lambda uri, module: (uri, module))
    names = [f"t{random.randrange(100)}"]
    fmod = SimpleNamespace(additional=(names, ["float"], [], []), op="batch_prefill", uri="u")
    w = wrappers.attach(SimpleNamespace(_jit_use_token_head_sf=True), "m", fmod, False)
    assert w._jit_use_token_head_sf is False and w._jit_module == ("u", "m") and w._jit_additional_tensor_names == names
    plain = wrappers.attach(SimpleNamespace(), "m", fmod, False)
    assert not hasattr(plain, "_jit_use_token_head_sf")
