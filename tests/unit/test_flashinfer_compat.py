"""Every FlashInfer coupling matches the installed FlashInfer; a changed FlashInfer turns the optimisation off and says
so once, naming it (or, for a required coupling, refuses to run)."""
import logging

import pytest

import fivar
from fivar import flashinfer_compat as compat
from fivar.flashinfer_compat import _base, fa2_launchers, fa3_launchers, wrappers
from fivar.jit.build import gen_module


def test_every_coupling_is_active_with_the_installed_flashinfer():
    """Fails loudly, coupling by coupling, when a FlashInfer upgrade no longer matches what fivar relies on: on a
    tested release exactly the couplings that release is known to change are off, every other one is active."""
    import flashinfer
    line = compat.release()
    assert line is not None, f"FlashInfer {flashinfer.__version__} is not a release fivar is tested against"
    broken = {s.name: s.reason for s in compat.report() if not s.active}
    assert set(broken) == compat.OFF_IN_RELEASE[line], f"FlashInfer {flashinfer.__version__}: {broken}"
    assert len(compat.COUPLINGS) >= 11 and not any(s.required for s in compat.report() if not s.active)


def test_each_check_can_fail():
    """The checks compare real text: an altered copy of FlashInfer's is refused by each one."""
    from flashinfer.jit import env as jit_env
    inc = jit_env.FLASHINFER_INCLUDE_DIR / "flashinfer"
    prefill, utils = (inc / "attention" / "prefill.cuh").read_text(), (inc / "utils.cuh").read_text()
    pinned = fa2_launchers.pinned_kv_tiles_problem_in(prefill, utils)
    assert (pinned is None) == ("fa2_pinned_kv_tiles" not in compat.OFF_IN_RELEASE[compat.release()]), pinned
    assert "8/4/2/1" in fa2_launchers.pinned_kv_tiles_problem_in(
        prefill, utils.replace("NUM_MMA_KV = 8;", "NUM_MMA_KV = 16;"))
    assert fa3_launchers.mirrored_function_problem(fa3_launchers._DISPATCH_SIGNATURE, "0" * 64, "x").endswith(
        "changed since fivar's x was written against 0.7.2")


def test_kv_tiles_are_pinned_in_each_release_launcher_steps():
    """The installed prefill.cuh's launchers are read in their own release's form (0.7.4 adds the token-head-scale
    steps the pinned macro then repeats); launchers in two forms, or one in neither, are not pinned."""
    from flashinfer.jit import env as jit_env
    inc = jit_env.FLASHINFER_INCLUDE_DIR / "flashinfer"
    prefill, utils = (inc / "attention" / "prefill.cuh").read_text(), (inc / "utils.cuh").read_text()
    form, why = fa2_launchers.pinned_launcher_form_in(prefill, utils)
    assert (form, why) == ({"0.7.2": "0.7.2", "0.7.4": "token_head_sf"}[compat.release()], None)
    pad = "\n// ...\n" * 800  # launchers lie thousands of lines apart
    launcher = {f: "\n".join(steps) for f, steps in fa2_launchers.LAUNCHER_STEPS.items()}
    for f, text in launcher.items():
        assert fa2_launchers.pinned_launcher_form_in(pad + text + pad + text, utils) == (f, None)
    mixed = fa2_launchers.pinned_launcher_form_in(pad + launcher["0.7.2"] + pad + launcher["token_head_sf"], utils)
    assert mixed[0] is None and mixed[1] == "the DISPATCH_NUM_MMA_KV launchers in prefill.cuh follow different steps"
    # 0.7.4's launcher without its bound by the per-block limit with the scales: neither form
    broken = launcher["token_head_sf"].replace("min(max_num_mma_kv_smem_occ, max_num_mma_kv_smem_scale)",
                                               "max_num_mma_kv_smem_occ")
    assert "neither" in fa2_launchers.pinned_launcher_form_in(pad + broken, utils)[1]
    # the budget assigned again after the steps, before the dispatch takes it: not the value the macro computes
    for f, text in launcher.items():
        again = text.replace("DISPATCH_NUM_MMA_KV(", "max_num_mma_kv_smem = 8; DISPATCH_NUM_MMA_KV(")
        assert "neither" in fa2_launchers.pinned_launcher_form_in(pad + again, utils)[1], f


def test_a_changed_flashinfer_turns_the_fa3_tile_off_and_says_which_once(monkeypatch, caplog):
    """The FA3 tile and schedule defaults used to fall back to FlashInfer's silently: now one warning each names
    the optimisation, and doctor's report lists it as disabled with the reason."""
    monkeypatch.setattr(fa3_launchers, "DISPATCH_SHA256", "0" * 64)
    fa3_launchers.dispatch_problem.cache_clear()
    _base._warned.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="fivar"):
            for _ in range(2):
                m = gen_module(fivar.load("softcap_sliding_window"), "single_prefill", "fa3")
        assert m.options["cta_tile"] == "flashinfer" and m.options["schedule"] == "grid"
        said = [r.getMessage() for r in caplog.records if "is off" in r.getMessage()]
        assert len([t for t in said if "own CTA tile" in t]) == 1, said
        assert len([t for t in said if "persistent schedule" in t]) == 1, said
        status = {s.name: s for s in compat.report()}
        assert not status["fa3_cta_tile"].active and "SinglePrefillWithKVCacheDispatched" in status["fa3_cta_tile"].reason
        assert not status["fa3_persistent_schedule"].active
        assert status["fa2_pinned_kv_tiles"].active == ("fa2_pinned_kv_tiles" not in
                                                        compat.OFF_IN_RELEASE[compat.release()])
    finally:
        monkeypatch.undo()
        fa3_launchers.dispatch_problem.cache_clear()
        _base._warned.clear()


def test_a_required_coupling_that_breaks_is_reported_broken(monkeypatch):
    monkeypatch.setattr(wrappers, "ATTACHED", wrappers.ATTACHED + ("_no_such_attribute",))
    wrappers.attach_problem.cache_clear()
    try:
        status = {s.name: s for s in compat.report()}["wrapper_jit_module"]
        assert status.required and not status.active and "_no_such_attribute" in status.reason
    finally:
        monkeypatch.undo()
        wrappers.attach_problem.cache_clear()


def test_doctor_lists_the_toolchain_and_every_coupling():
    from click.testing import CliRunner

    from fivar.cli import main
    r = CliRunner().invoke(main, ["doctor"])
    assert r.exit_code == 0, r.output
    for name in ("nvcc", "CUDA_HOME", "torch", "triton", "flashinfer", *compat.COUPLINGS):
        assert name in r.output, name
    import flashinfer
    off = compat.OFF_IN_RELEASE[compat.release()]
    assert f"{len(compat.COUPLINGS) - len(off)} active, {len(off)} disabled" in r.output
    said = " ".join(r.output.split())
    assert f"FlashInfer {flashinfer.__version__}: release {compat.release()}, tested" in said, r.output
    assert "off unexpectedly" not in said and all(name in said.split("paths it enables:")[1]
                                                   for name in compat.COUPLINGS if name not in off)


def test_a_template_variable_fivar_does_not_pass_is_a_one_line_error():
    """FlashInfer's JIT templates render with every variable defined: one missing (a later FlashInfer's template)
    names the template, the variable and the version fivar is written against, instead of a blank nvcc rejects."""
    from fivar.errors import FivarError
    from fivar.flashinfer_compat import SUPPORTED
    from fivar.jit.build import _render_flashinfer
    with pytest.raises(FivarError, match=f"single_prefill_customize_config.jinja needs a value fivar does not pass "
                       f".*is undefined.*{SUPPORTED[-1]}") as e:
        _render_flashinfer("single_prefill_customize_config.jinja", variant_decl="")
    assert "\n" not in str(e.value)


_JIT_LOG_PROBE = """
import json, logging, os, sys
plain_init, plain_access = logging.FileHandler.__init__, os.access
# as on a read-only workspace: FlashInfer's log cannot be written (root ignores modes, so say it here)
os.access = lambda p, m, **k: False if os.path.basename(str(p)) == "flashinfer_jit.log" else plain_access(p, m, **k)
if sys.argv[1] == "fivar":
    import fivar.jit.build  # noqa: F401
import importlib
import flashinfer.jit.core as core
opened = []
for _ in range(2):  # the import, then a reload (the module runs again)
    handler = next(h for h in core.logger.handlers if isinstance(h, logging.FileHandler))
    opened.append(handler.stream is not None)
    core = importlib.reload(core)
print(json.dumps({"opened": opened, "restored": logging.FileHandler.__init__ is plain_init}))
"""


@pytest.mark.parametrize("first", ["fivar", "flashinfer"])
def test_flashinfer_log_opens_lazily_where_read_only_and_logging_is_left_as_it_was(first, tmp_path):
    """With fivar imported first, FlashInfer's log handler on an unwritable log opens nothing until something is
    logged, on a reload too; logging.FileHandler is the standard one afterwards. FlashInfer imported on its own opens
    the file."""
    import json
    import os
    import subprocess
    import sys
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(fivar.__file__)),
                                                       os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", _JIT_LOG_PROBE, first], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res == {"opened": [first == "flashinfer"] * 2, "restored": True}


def _declaration(text: str, name: str) -> str:
    """The primary template declaration of `name` in a C++ text, whitespace collapsed."""
    import re
    found = re.search(r"template\s*<[^>]*>\s*cudaError_t\s+" + name + r"\([^;{]*\);", text)
    assert found, name
    return " ".join(found.group(0).split())


@pytest.mark.parametrize("target, form, stubs, host, entry", [
    ("fa2", {"tile_list": True}, "fivar_fa2_ragged_stubs.inc", "batch_prefill.cu",
     "BatchPrefillWithRaggedKVCacheDispatched"),
    ("fa3", {"mask_free": True}, "fivar_fa3_paged_stubs.inc", "batch_prefill_sm90.cu",
     "BatchPrefillWithPagedKVCacheDispatched")])
def test_entry_stubs_specialize_the_template_the_installed_release_declares(monkeypatch, target, form, stubs, host,
                                                                           entry):
    """The stubs a module's host unit includes declare the entry point as the installed release's host source does
    (0.7.4's FA2 added a template parameter), and each specialization passes one argument per parameter: otherwise
    they specialize another template, and the library links with the release's entry point undefined."""
    from flashinfer.jit import env as jit_env
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    m = gen_module(fivar.load("document_mask"), "batch_prefill", target, **form)
    ours = _declaration(m.sources[stubs], entry)
    assert ours == _declaration((jit_env.FLASHINFER_CSRC_DIR / host).read_text(), entry)
    params = ours[ours.index("<") + 1:ours.index(">")].count(",") + 1
    specializations = m.sources[stubs].split("template <>")[1:]
    assert specializations
    for spec in specializations:
        args = spec[spec.index(entry + "<") + len(entry) + 1:spec.index(">(")]
        assert args.count(",") + 1 == params, args
