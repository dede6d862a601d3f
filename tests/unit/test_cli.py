"""The command line as a new user drives it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fivar.cli import main
from fivar.flashinfer_compat import OFF_IN_RELEASE, release

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def runner():
    return CliRunner()


def test_list_shows_bundled_variants(runner):
    r = runner.invoke(main, ["list"])
    assert r.exit_code == 0
    for name in ("softcap", "alibi", "document_mask"):
        assert name in r.output


def test_list_names_what_each_variant_changes(runner, tmp_path, monkeypatch):
    """The kind column names the logits, mask and sink a variant defines (a sink alone was a blank)."""
    head = "from fivar import AttentionVariant, Tensor, sigmoid\n\n\n"
    files = {
        "only_sink": "variant = AttentionVariant(name='only_sink', sink=lambda qo_head, params: params.s[qo_head],\n"
                     "                           params={'s': Tensor('float32', ('qo_head',))})\n",
        "window_sink": "def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):\n    return q_idx - kv_idx < 8\n\n\n"
                       "variant = AttentionVariant(name='window_sink', mask=mask, sink=lambda qo_head, params: 1.0)\n",
        "sig_only": "def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):\n    return sigmoid(score)\n\n\n"
                    "variant = AttentionVariant(name='sig_only', logits=logits, softmax=False)\n",
    }
    for name, body in files.items():
        (tmp_path / f"{name}.py").write_text(head + body)
    monkeypatch.setenv("FIVAR_VARIANT_PATH", str(tmp_path))
    r = runner.invoke(main, ["list"])
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    for name, kind in (("only_sink", "sink"), ("window_sink", "mask + sink"),
                       ("sig_only", "logits (no softmax)")):
        assert f"│ {name} │ {kind} │" in flat, (name, r.output)


def test_show_prints_the_fa2_struct(runner):
    r = runner.invoke(main, ["show", "softcap"])
    assert r.exit_code == 0, r.output
    assert "struct Fivar_softcap : flashinfer::AttentionVariantBase" in r.output
    assert "fivar::tanh" in r.output


def test_show_ir(runner):
    r = runner.invoke(main, ["show", "alibi", "--target", "ir"])
    assert r.exit_code == 0, r.output
    assert "params.slopes[qo_head]" in r.output


def test_show_sources_lists_every_file(runner):
    r = runner.invoke(main, ["show", "sliding_window", "--sources", "--arch", "9.0a"])
    assert r.exit_code == 0, r.output
    for f in ("single_prefill_config.inc", "single_prefill_kernel_mask_2.cu", "fivar_ops.cuh"):
        assert f"===== {f} =====" in r.output


def test_new_variant_scaffolds_and_never_overwrites(tmp_path, monkeypatch, runner):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(main, ["new-variant", "my_softcap_alibi"])
    assert r.exit_code == 0, r.output
    vfile, tfile = tmp_path / "variants/my_softcap_alibi.py", tmp_path / "tests/variants/test_my_softcap_alibi.py"
    assert vfile.exists() and tfile.exists()
    vfile.write_text(vfile.read_text() + "\n# my edit\n")
    r = runner.invoke(main, ["new-variant", "my_softcap_alibi"])
    assert r.exit_code == 1 and "already exists" in r.output
    assert vfile.read_text().endswith("# my edit\n")  # nothing lost
    r = runner.invoke(main, ["show", "my_softcap_alibi"])
    assert r.exit_code == 0 and "struct Fivar_my_softcap_alibi" in r.output
    # the scaffolded test runs as-is (its GPU tests skip here; the Triton twin runs under the interpreter)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tfile)], cwd=tmp_path,
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "4 passed" in p.stdout


def test_bad_name_for_new_variant(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(main, ["new-variant", "not-valid"])
    assert r.exit_code == 1 and "must be a Python identifier" in r.output
    r = runner.invoke(main, ["new-variant", "lambda"])
    assert r.exit_code == 1 and "not a keyword" in r.output
    for command in ("list", "new_variant"):
        r = runner.invoke(main, ["new-variant", command])
        assert r.exit_code == 1 and "is a fivar command" in r.output, r.output
    assert not (tmp_path / "variants").exists()


@pytest.mark.parametrize("args,text", [(["llama_add_rmsnorm"], "'llama_add_rmsnorm' is a fusion"),
                                       (["softcap", "--head-dim", "100"], "--head-dim must be one of 64, 128, 256"),
                                       (["nosuch"], "no variant named 'nosuch'")])
def test_bench_compile_checks_its_arguments_first(runner, args, text):
    r = runner.invoke(main, ["bench", *args, "--compile", "--arch", "9.0a"])
    assert r.exit_code == 1 and text in r.output, r.output


def test_new_variant_into_a_file_is_one_line(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    r = runner.invoke(main, ["new-variant", "mine", "--dir", "afile"])
    assert r.exit_code == 1 and f"cannot create {Path('afile') / 'mine.py'}: afile is a file" in r.output, r.output
    assert not (tmp_path / "tests").exists()


@pytest.mark.parametrize("what,make", [("not a .py file", lambda d: d / "notes.txt"), ("a directory", lambda d: d),
                                       ("no such file", lambda d: d / "gone.py")])
def test_a_path_that_is_no_variant_file_is_one_line(runner, tmp_path, what, make):
    (tmp_path / "notes.txt").write_text("x")
    r = runner.invoke(main, ["show", str(make(tmp_path)) + ("/" if what == "a directory" else "")])
    assert r.exit_code == 1 and f"{make(tmp_path)}: {what}; a variant is a .py file" in r.output, r.output


def test_an_error_stays_one_line_on_a_narrow_console(runner, tmp_path, monkeypatch):
    """The error line is never broken by the console's width (a log or an 80-column terminal wraps it itself)."""
    from fivar.cli import _common
    monkeypatch.setattr(_common.err_console, "width", 40)
    r = runner.invoke(main, ["show", str(tmp_path / ("a-long-directory-name-" * 4) / "gone.py")])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output


def test_spec_error_is_one_clear_message_not_a_traceback(tmp_path, monkeypatch, runner):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "loopy.py").write_text(
        "from fivar import AttentionVariant\n\n"
        "def logits(score, b, h, kh, qi, ki, p):\n"
        "    while True:\n"
        "        pass\n"
        "    return score\n\n"
        "variant = AttentionVariant(name='loopy', logits=logits)\n")
    monkeypatch.setenv("FIVAR_VARIANT_PATH", str(d))
    r = runner.invoke(main, ["show", "loopy"])
    assert r.exit_code == 1
    assert "Traceback" not in r.output
    assert f"{d / 'loopy.py'}:4:5" in r.output.replace("\n", "") and "`while` loop" in r.output


def test_check_without_gpu_says_so(runner):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = runner.invoke(main, ["check", "softcap"])
    assert r.exit_code == 1 and "needs a CUDA GPU" in r.output


def test_build_without_gpu_or_arch_asks_for_one(runner, monkeypatch):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
    r = runner.invoke(main, ["build", "softcap"])
    assert r.exit_code == 1 and "FLASHINFER_CUDA_ARCH_LIST" in r.output


def test_python_dash_m_fivar_works():
    p = subprocess.run([sys.executable, "-m", "fivar", "--help"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0 and "new-variant" in p.stdout


def test_show_refuses_what_build_refuses_and_list_reports_spec_errors(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fivar.cli import main
    for args, says in ((["show", "softcap", "--head-dim", "100"], "head_dim 100 is not supported"),
                       (["show", "softcap", "--target", "fa3", "--dtype", "fp32"], "dtype 'fp32' is not supported"),
                       (["show", "sofcap"], "no variant named 'sofcap' (did you mean 'softcap'?)"),
                       (["show", "softcap", "--target", "fa3", "--op", "batch_decode"],
                        "FlashInfer has no FA3 kernel for batch_decode"),
                       (["show", "gpt_oss", "--op", "batch_decode"], "a sink runs decode on FA2 batch prefill")):
        r = CliRunner().invoke(main, args)
        assert r.exit_code != 0 and says in " ".join(r.output.split()), (args, r.output)
    (tmp_path / "typo.py").write_text(
        "from fivar import AttentionVariant, Scalar\n\n\n"
        "def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):\n"
        "    return score * params.sofcap\n\n\n"
        "variant = AttentionVariant(name='typo', logits=logits, params={'softcap': Scalar(float, default=30.0)})\n")
    monkeypatch.setenv("FIVAR_VARIANT_PATH", str(tmp_path))
    r = CliRunner().invoke(main, ["list"])
    flat = " ".join(r.output.split())
    assert "│ typo │ error │" in flat and "unknown parameter `sofcap`" in flat, r.output


@pytest.mark.skipif("fa2_pinned_kv_tiles" in OFF_IN_RELEASE.get(release(), frozenset()),
                    reason="pinned FA2 KV tiles are off by design on this FlashInfer release")
def test_explain_with_an_arch_says_what_auto_picks_there():
    from click.testing import CliRunner

    from fivar.cli import main
    r = CliRunner().invoke(main, ["show", "softcap", "--explain", "--verbose", "--arch", "9.0a"])
    assert r.exit_code == 0 and "single_prefill: fa3" in r.output and "batch_decode: fa2" in r.output, r.output
    flat = " ".join(r.output.split())
    assert "fa2 prefill KV tiles: fixed at compile time for 233472 bytes of shared memory per SM" in flat, r.output
    r = CliRunner().invoke(main, ["show", "softcap", "--explain", "--verbose", "--arch", "8.0"])
    assert r.exit_code == 0 and "single_prefill: fa2 - sm80 GPU" in r.output, r.output
    assert "fixed at compile time for 167936 bytes" in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(main, ["show", "softcap", "--explain", "--verbose", "--arch", "8.0 9.0a"])
    flat = " ".join(r.output.split())
    assert "KV tiles: chosen at run time by FlashInfer (--arch 8.0 9.0a: archs of different" in flat, r.output
    r = CliRunner().invoke(main, ["show", "softcap", "--explain", "--verbose", "--arch", "9.0a"], env={"FIVAR_PIN_KV_TILES": "0"})
    assert "KV tiles: chosen at run time by FlashInfer (--arch 9.0a: FIVAR_PIN_KV_TILES=0)" in " ".join(r.output.split())


def test_explain_says_which_variants_split_fa3s_last_wave():
    from click.testing import CliRunner

    from fivar.cli import main
    flat = " ".join(CliRunner().invoke(main, ["show", "softcap", "--explain", "--verbose", "--arch", "9.0a"]).output.split())
    assert "last wave, non-causal: the last heads run as key chunks" in flat and "FIVAR_FA3_WAVE_SPLIT=0" in flat, flat
    flat = " ".join(CliRunner().invoke(main, ["show", "alibi", "--explain", "--verbose", "--arch", "9.0a"]).output.split())
    assert "fa3 single prefill last wave: never split" in flat, flat


def test_explain_says_which_fa3_kernels_run_persistent(monkeypatch):
    from click.testing import CliRunner

    from fivar.cli import main
    monkeypatch.delenv("FIVAR_FA3_SCHEDULE", raising=False)

    def explained(name, **env):
        r = CliRunner().invoke(main, ["show", name, "--explain", "--verbose", "--arch", "9.0a"], env=env)
        assert r.exit_code == 0, r.output
        return " ".join(r.output.split())
    flat = explained("sliding_window")
    assert "schedule at hd128: grid non-causal, persistent causal (a window makes every causal query tile" in flat
    assert "schedule at hd128: grid non-causal, grid causal (FlashInfer's grid;" in explained("softcap")
    flat = explained("softcap", FIVAR_FA3_SCHEDULE="persistent")
    assert "persistent non-causal, persistent causal (FIVAR_FA3_SCHEDULE;" in flat
    assert "last wave: never split (the non-causal kernel is persistent" in flat
    r = CliRunner().invoke(main, ["show", "softcap", "--explain", "--verbose", "--arch", "9.0a"], env={"FIVAR_FA3_SCHEDULE": "x"})
    assert r.exit_code != 0 and "variant 'softcap': FIVAR_FA3_SCHEDULE='x': expected grid or persistent" in r.output
    assert "Traceback" not in r.output


def test_check_runs_the_triton_twin_on_the_cpu(monkeypatch):
    """Without a GPU, `fivar check NAME --backends triton` runs every op the twin has (Triton's interpreter,
    float16) against the reference; other backends and bfloat16 are refused naming why."""
    import torch
    from click.testing import CliRunner

    from fivar.cli import main
    if torch.cuda.is_available():
        pytest.skip("the CPU path is for machines without a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # restored afterwards (check sets it for its own process)
    r = CliRunner().invoke(main, ["check", "alibi", "--backends", "triton", "--head-dims", "32"])
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert "8 passed, 0 failed" in flat and "single_prefill[triton] torch.float16" in flat
    assert "batch_prefill_ragged[triton]" in flat and "batch_decode[triton]" in flat
    for args, says in ((["--backends", "triton,fa2"], "needs a CUDA GPU"),
                       (["--backends", "triton", "--dtypes", "bf16"], "bfloat16 on the CPU")):
        r = CliRunner().invoke(main, ["check", "alibi", *args])
        assert r.exit_code != 0 and says in " ".join(r.output.split()), (args, r.output)


def test_list_says_which_bundled_variant_a_local_one_hides(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fivar.cli import main
    from fivar.paths import bundled_variants_dir
    (tmp_path / "variants").mkdir()
    (tmp_path / "variants" / "softcap.py").write_text((bundled_variants_dir() / "softcap.py").read_text())
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(main, ["list"]).output
    compact = "".join(c for c in out if not c.isspace() and c != "│")  # long paths fold across lines
    want = f"{tmp_path / 'variants' / 'softcap.py'}(hides{bundled_variants_dir() / 'softcap.py'})"
    assert "".join(want.split()) in compact, out
    assert out.count("(hides") == 1, out  # only the shadowed one says so


def test_show_a_fusion_refuses_attention_targets(runner):
    r = runner.invoke(main, ["show", "llama_add_rmsnorm", "--target", "fa3"])
    assert r.exit_code == 1 and "is a fusion" in r.output and "--target does not apply" in r.output
    r = runner.invoke(main, ["show", "llama_add_rmsnorm"])
    assert r.exit_code == 0 and "fusion 'llama_add_rmsnorm'" in r.output


def test_build_targets_default_to_what_auto_runs_on_the_arch(runner, monkeypatch):
    """sm90a: FA3 prefill (both softmax forms of a soft-cap, the tile-list form of a document mask), FA2 decode;
    any other arch: FA2 everywhere. `--targets triton` writes and imports the twin."""
    import fivar.jit.build as jb
    built = []
    monkeypatch.setattr(jb, "build_many", lambda mods, parallel=False, progress=None: (built.extend(mods), [("disk", 0.0)] * len(mods))[1])

    def targets(*args):
        built.clear()
        r = runner.invoke(main, ["build", *args])
        assert r.exit_code == 0, r.output
        return sorted((m.variant.name, m.op, m.target, m.options.get("bounded_softmax", False),
                       m.options.get("tile_list", False)) for m in built)
    assert targets("softcap", "--arch", "9.0a") == [
        ("softcap", "batch_decode", "fa2", False, False),
        ("softcap", "batch_prefill", "fa2", False, False),  # the tensor-core decode path (GQA >= 4)
        ("softcap", "batch_prefill", "fa3", False, False), ("softcap", "batch_prefill", "fa3", True, False),
        ("softcap", "single_prefill", "fa3", False, False), ("softcap", "single_prefill", "fa3", True, False)]
    assert {t[2] for t in targets("document_mask", "--arch", "8.0 9.0a")} == {"fa2", "fa3"}
    assert all(t[2] == "fa2" for t in targets("softcap", "--arch", "8.0"))
    assert all(t[2] == "fa2" for t in targets("softcap", "--arch", "9.0"))  # FA3 needs 9.0a
    both = {(t[1], t[2]) for t in targets("softcap", "--arch", "8.0 9.0a", "--ops", "single_prefill")}
    assert both == {("single_prefill", "fa2"), ("single_prefill", "fa3")}  # what each of the two GPUs runs
    assert len(targets("softcap", "--arch", "9.0a", "--targets", "fa2")) == 3
    built.clear()
    r = runner.invoke(main, ["build", "softcap", "--arch", "9.0a", "--targets", "triton"])
    assert r.exit_code == 0 and "triton twin of 'softcap'" in r.output and not built
    r = runner.invoke(main, ["build", "softcap", "--arch", "9.0a", "--targets", "fa4"])
    assert r.exit_code == 1 and "--targets: unknown 'fa4'" in r.output


def test_build_targets_select_fusions(runner, monkeypatch):
    """A fusion builds under --targets auto (the default) or fusion; a target list without fusion skips it, with a
    line when it was named, and builds no CUDA for --targets triton."""
    import fivar.jit.build as jb
    built = []
    monkeypatch.setattr(jb, "build_many", lambda mods, parallel=False, progress=None: (built.extend(mods), [("disk", 0.0)] * len(mods))[1])

    def uris(*args):
        built.clear()
        r = runner.invoke(main, ["build", "llama_add_rmsnorm", "softcap", "--arch", "9.0a", "--ops", "single_prefill",
                                 *args])
        assert r.exit_code == 0, r.output
        return r.output, sorted({"fusion" if "llama_add_rmsnorm" in m.uri else m.target for m in built})
    assert uris()[1] == ["fa3", "fusion"]
    assert uris("--targets", "fusion")[1] == ["fusion"]
    assert uris("--targets", "fa2,fusion")[1] == ["fa2", "fusion"]
    out, got = uris("--targets", "fa2")
    assert got == ["fa2"] and "skipping fusion(s) llama_add_rmsnorm" in out
    out, got = uris("--targets", "triton")
    assert got == [] and "triton twin of 'softcap'" in out


def test_new_variant_refuses_a_name_lookup_would_skip(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(main, ["new-variant", "_mine"])
    assert r.exit_code == 1 and "starts with '_'" in r.output and not (tmp_path / "variants").exists()


def test_explain_reads_the_arch_list_and_builds_fa3_only_for_9_0a(runner, monkeypatch):
    """`show --explain` answers as `build` acts: FLASHINFER_CUDA_ARCH_LIST like --arch, and a list without 9.0a
    (a plain 9.0 builds no sm_90a code) runs FA2."""
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    r = runner.invoke(main, ["show", "softcap", "--explain", "--verbose"])
    assert r.exit_code == 0 and "single_prefill: fa3" in r.output and "FLASHINFER_CUDA_ARCH_LIST 9.0a" in r.output
    r = runner.invoke(main, ["show", "softcap", "--explain", "--verbose", "--arch", "9.0"])
    flat = " ".join(r.output.split())
    assert r.exit_code == 0 and "single_prefill: fa2 - --arch 9.0 builds no sm_90a code" in flat, r.output


def test_an_arch_nvcc_cannot_compile_is_refused_before_building(runner, monkeypatch):
    from fivar.jit import toolchain
    monkeypatch.setattr(toolchain, "nvcc_archs", lambda: ("8.0", "9.0"))
    for arch in ("9.1", "8.9z", "8.0 7.0"):
        r = runner.invoke(main, ["build", "softcap", "--arch", arch])
        flat = " ".join(r.output.split())
        assert r.exit_code == 1 and "cannot compile for" in flat and "it knows 8.0, 9.0" in flat, r.output
    assert toolchain.nvcc_supports("9.0a") and toolchain.nvcc_supports("8.0")


@pytest.mark.parametrize("args,text", [
    (["bench", "softcap", "--compile", "--vs", "flex", "--causal"], "--vs, --causal shape a timed run only"),
    (["bench", "softcap", "--compile", "--seqlens", "64"], "--seqlens shape a timed run only"),
    (["build", "--all", "softcap"], "--all builds every variant"),
    (["show", "llama_add_rmsnorm", "--head-dim", "64"], "--head-dim is for attention variants only"),
    (["show", "llama_add_rmsnorm", "--op", "batch_decode"], "--op is for attention variants only"),
])
def test_options_that_would_be_ignored_are_refused(runner, args, text):
    r = runner.invoke(main, args)
    assert r.exit_code == 1 and text in " ".join(r.output.split()), r.output


def test_check_on_the_cpu_without_the_interpreter_is_one_clear_line():
    """Triton picks interpreted kernels only if TRITON_INTERPRET=1 is set before it is imported: `fivar check
    --backends triton` started without it either runs (Triton not yet imported) or says how to start it, never a
    Triton traceback."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "fivar", "check", "softcap", "--backends", "triton", "--ops",
                        "single_prefill"], capture_output=True, text=True, timeout=600, env=env)
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out[-2000:]
    assert r.returncode == 0 or "TRITON_INTERPRET=1" in out, out[-2000:]


_GOOD = ("from fivar import AttentionVariant\n\n\ndef mask(batch, qo_head, kv_head, q_idx, kv_idx, params):\n"
         "    return kv_idx <= q_idx\n\n\nvariant = AttentionVariant(name='{name}', mask=mask)\n")


@pytest.mark.parametrize("stop,what", [("import sys\nsys.exit(0)\n", "SystemExit(0)"),
                                       ("raise SystemExit('bye')\n", "SystemExit('bye')"),
                                       ("raise KeyboardInterrupt\n", "KeyboardInterrupt"),
                                       ("raise GeneratorExit\n", "GeneratorExit"),
                                       ("class Stop(BaseException):\n    pass\n\n\nraise Stop\n", "raised Stop")])
def test_a_variant_file_that_exits_is_an_error_naming_it_not_a_silent_success(tmp_path, monkeypatch, stop, what):
    """A file that stops the import (sys.exit, SystemExit, KeyboardInterrupt; GeneratorExit and any other
    BaseException escaped as a traceback) once made every command exit 0 with no output; now each command names the file, and list / build --all go on with the other files, then exit 1."""
    (tmp_path / "quitter.py").write_text(_GOOD.format(name="quitter").replace("variant =", stop + "variant ="))
    (tmp_path / "fine.py").write_text(_GOOD.format(name="fine"))
    monkeypatch.setenv("FIVAR_VARIANT_PATH", str(tmp_path))
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path / "cache"))
    quitter = str(tmp_path / "quitter.py")
    for args in (["show", "quitter"], ["build", "quitter", "--arch", "9.0a"], ["check", "quitter"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1, (args, r.output)
        assert r.stderr.count("\n") == 1 and quitter in r.stderr and what in r.stderr, (args, r.stderr)
    r = CliRunner().invoke(main, ["list"])
    assert r.exit_code == 1 and "│ fine " in r.stdout and "│ softcap " in r.stdout, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and quitter in errors[0] and what in errors[0], r.stderr
    r = CliRunner().invoke(main, ["build", "--all", "--targets", "triton", "--arch", "9.0a"])
    assert r.exit_code == 1 and "triton twin of 'fine'" in r.stdout, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and quitter in errors[0] and what in errors[0], r.stderr


def test_list_and_build_all_say_they_run_the_variant_files_and_from_where(tmp_path, monkeypatch):
    (tmp_path / "fine.py").write_text(_GOOD.format(name="fine"))
    monkeypatch.setenv("FIVAR_VARIANT_PATH", str(tmp_path))
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path / "cache"))
    from fivar.paths import bundled_variants_dir
    for args in (["list"], ["build", "--all", "--targets", "triton", "--arch", "9.0a"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        notes = [line for line in r.stderr.splitlines() if "runs (imports) every variant file" in line]
        assert len(notes) == 1 and str(tmp_path) in notes[0] and str(bundled_variants_dir()) in notes[0], r.stderr


def test_a_real_ctrl_c_while_a_variant_file_runs_still_stops_fivar(tmp_path):
    """Only a KeyboardInterrupt the file raises itself becomes an error about the file: a SIGINT that arrives while
    it runs is the user's, and propagates."""
    import signal

    import fivar
    # Python's own Ctrl-C handler, as in a terminal: a process started in the background inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_cases(tmp_path, fivar)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_cases(tmp_path, fivar):
    f = tmp_path / "slow.py"
    f.write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n" +
                 _GOOD.format(name="slow"))
    with pytest.raises(KeyboardInterrupt):
        fivar.load(str(f))
    f2 = tmp_path / "raises.py"
    f2.write_text("raise KeyboardInterrupt\n")
    with pytest.raises(fivar.FivarSpecError, match="raised KeyboardInterrupt"):
        fivar.load(str(f2))


def test_explain_without_a_gpu_or_an_arch_says_so(runner, monkeypatch):
    """Without a GPU and without --arch, the answer is FA2 everywhere; the first line says it is that case and how
    to ask about a GPU's, and the verbose rules give why."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
    r = runner.invoke(main, ["show", "alibi", "--explain"])
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    assert first.startswith("no GPU visible and no target arch (--arch 9.0a"), first
    assert "single_prefill fa2" in first and "fa3" not in first, first
    r = runner.invoke(main, ["show", "alibi", "--explain", "--arch", "9.0a"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith("no GPU visible: as on sm90 (--arch 9.0a)"), r.output
    assert "single_prefill fa3" in r.output.splitlines()[0], r.output
