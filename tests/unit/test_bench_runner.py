"""The benchmark runner on the CPU with a fake timer: the row schema, ratios within a run, check before time (a
wrong contender is never timed), errors that do not stop a run, the results file per GPU, and the render."""
import json
import math
from pathlib import Path

import pytest
import torch

import fivar

from fivar.bench import render as R
from fivar.bench.contenders import Contender
from fivar.bench.runner import (ROW_FIELDS, Case, Measurement, Options, Prepared, add_ratios, gpu_slug, ratio, run,
                                select, validate_row)
from fivar.bench.timing import Timing
from fivar.testing import compare

ENV = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "550.1", "flashinfer": "0.7.2", "torch": "2.x", "triton": "3.x",
       "fivar": "0.1.0", "commit": "abc", "date": "2026-01-02T03:04:05Z", "run": "r1"}
CPU = Options(rounds=2, device="cpu")


class FakeTimer:
    """Times each contender at a fixed, known median and records what it was asked to time."""
    def __init__(self, ms):
        self.ms, self.asked = ms, []

    def __call__(self, fns):
        self.asked.append(sorted(fns))
        return {n: Timing([self.ms[n] * 0.9, self.ms[n], self.ms[n] * 1.2]) for n in fns}


def _case(name, contenders, ref, flops=4e9, nbytes=2e6, baseline="stock", suite="attention"):
    def prepare():
        return Prepared(contenders, lambda c: compare("v", c.name, c.fn(), ref, torch.float16), flops=flops,
                        nbytes=nbytes)
    return Case(suite, name, "prefill", {"seqlen": 64}, prepare, baseline=baseline)


def _calls():
    calls = {}

    def counted(name, fn):
        def f():
            calls[name] = calls.get(name, 0) + 1
            return fn()
        return f
    return calls, counted


def test_rows_schema_ratios_and_check_before_time(tmp_path):
    ref = torch.randn(64, 4, 16)
    calls, counted = _calls()
    cs = [Contender("fivar-fa3", counted("fivar-fa3", lambda: ref.clone())),
          Contender("stock", counted("stock", lambda: ref.clone()), "stock logits_soft_cap"),
          Contender("wrong", counted("wrong", lambda: ref * 1.1 + 0.05))]
    timer = FakeTimer({"fivar-fa3": 1.0, "stock": 2.5, "wrong": 0.1})
    rows = run([_case("softcap S=64", cs, ref)], CPU, tmp_path, build=False, log=lambda s: None, timer=timer,
               env=ENV)
    assert (tmp_path / "h100.jsonl").exists()
    on_disk = [json.loads(x) for x in (tmp_path / "h100.jsonl").read_text().splitlines()]
    assert on_disk == json.loads(json.dumps(rows))
    for r in on_disk:
        validate_row(r)
        assert tuple(r) == ROW_FIELDS and r["gpu"] == ENV["gpu"] and r["suite"] == "attention"
    assert timer.asked == [["fivar-fa3", "stock"]]  # the wrong one was never handed to the timer
    assert calls["wrong"] == 1  # called once, by its check
    by = {(r["contender"], r["metric"]): r for r in on_disk}
    assert by[("wrong", "ms")]["check"] == "fail" and by[("wrong", "ms")]["value"] is None
    assert by[("wrong", "ms")]["detail"]["rel_err"] > 0.01 and ("wrong", "tflops_useful") not in by
    assert by[("fivar-fa3", "ms")]["value"] == 1.0 and by[("fivar-fa3", "ms")]["ratio"] == pytest.approx(2.5)
    assert by[("fivar-fa3", "tflops_useful")]["value"] == pytest.approx(4e9 / 1.0 / 1e9)
    assert by[("fivar-fa3", "tflops_useful")]["ratio"] == pytest.approx(2.5)  # same direction for a rate
    assert by[("fivar-fa3", "tbps_useful")]["value"] == pytest.approx(2e6 / 1.0 / 1e9)
    assert by[("stock", "ms")]["ratio"] == 1.0 and by[("stock", "ms")]["baseline"] == "stock"
    assert by[("fivar-fa3", "ms")]["detail"]["spread_ms"] == [0.9, 1.2]
    assert by[("stock", "ms")]["label"] == "stock logits_soft_cap"


def test_a_crash_or_a_broken_case_is_an_error_row_and_the_run_goes_on(tmp_path):
    ref = torch.randn(8, 2, 16)

    def boom():
        raise RuntimeError("kernel exploded")

    def bad_prepare():
        raise ValueError("plan failed")
    cases = [_case("a", [Contender("fivar", boom), Contender("stock", lambda: ref.clone())], ref),
             Case("attention", "b", "prefill", {}, bad_prepare, baseline="stock"),
             _case("c", [Contender("fivar", lambda: ref.clone()), Contender("stock", lambda: ref.clone())], ref)]
    lines = []
    rows = run(cases, CPU, tmp_path, build=False, log=lines.append, timer=FakeTimer({"fivar": 1.0, "stock": 1.0}),
               env=ENV)
    for r in rows:
        validate_row(r)
    a = [r for r in rows if r["case"] == "a" and r["contender"] == "fivar"]
    assert len(a) == 1 and a[0]["check"] == "error" and "kernel exploded" in a[0]["detail"]["error"]
    b = [r for r in rows if r["case"] == "b"]
    assert len(b) == 1 and b[0]["check"] == "error" and "plan failed" in b[0]["detail"]["error"]
    assert any(r["case"] == "c" and r["check"] == "pass" for r in rows)
    assert sum(line.startswith("[attention] ") for line in lines) == 3  # a line per case as it goes
    assert any("fivar ERROR" in line and "kernel exploded" in line for line in lines)


def test_ratio_direction_and_missing_baseline():
    assert ratio("ms", 2.0, 4.0) == 2.0 and ratio("tflops_useful", 300.0, 100.0) == 3.0
    assert ratio("s", 10.0, 5.0) == 0.5 and ratio("ms", None, 1.0) is None and ratio("ms", 1.0, None) is None
    rows = [{"contender": "fivar", "metric": "ms", "value": 1.0, "check": "pass"},
            {"contender": "stock", "metric": "ms", "value": None, "check": "fail"}]
    assert [r["ratio"] for r in add_ratios(rows, "stock")] == [None, None]  # a failed baseline gives no ratio


def test_measured_cases_get_ratios_too(tmp_path):
    m = [Measurement("fivar", "s", 30.0), Measurement("flashinfer", "s", 60.0), Measurement("fivar", "hit_us", 2.0)]
    case = Case("compile", "softcap fa2 cold build", "build", {}, lambda: Prepared(measure=lambda: m),
                baseline="flashinfer")
    rows = run([case], CPU, tmp_path, build=False, log=lambda s: None, env=ENV)
    by = {(r["contender"], r["metric"]): r for r in rows}
    assert by[("fivar", "s")]["ratio"] == 2.0 and by[("fivar", "hit_us")]["ratio"] is None


def test_a_case_draws_the_same_inputs_on_every_run(tmp_path):
    """A case's random inputs (document lengths, tables) are the same from run to run, and differ between cases."""
    import torch

    def case(name):
        return Case("compile", name, "build", {}, lambda: Prepared(measure=lambda: [
            Measurement("fivar", "s", float(torch.rand(())))]))
    got = []
    for n in ("a", "a", "b"):
        torch.rand(3)  # whatever ran before moves the global generator
        got.append(run([case(n)], CPU, tmp_path, build=False, log=lambda s: None, env=ENV)[0]["value"])
    assert got[0] == got[1] != got[2]


@pytest.mark.parametrize("name,slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
                                       ("cpu", "cpu")])
def test_gpu_slug(name, slug):
    assert gpu_slug(name) == slug


def test_every_suite_lists_its_cases_without_a_gpu():
    from fivar.bench.suites import SUITES, cases_of
    for suite in SUITES:
        for quick in (False, True):
            cases = cases_of(suite, quick=quick)
            names = [c.name for c in cases]
            assert cases and len(set(names)) == len(names) and all(c.suite == suite for c in cases)
    assert len(cases_of("attention")) == 7 * 3 * 2 and len(cases_of("zoo")) == 2 * 12
    assert [c.name for c in select(cases_of("attention"), ["softcap prefill S=8192*"])] == [
        "softcap prefill S=8192 full", "softcap prefill S=8192 causal"]


def _synthetic(path, gpu="NVIDIA H200"):
    rows = []
    for run_, date, fivar_ms in (("old", "2026-01-01T00:00:00Z", 9.0), ("new", "2026-02-01T00:00:00Z", 1.0)):
        for contender, ms in (("fivar-fa3", fivar_ms), ("stock", 2.0)):
            rows.append({**ENV, "gpu": gpu, "run": run_, "date": date, "suite": "zoo", "case": "gemma2_local prefill",
                         "op": "prefill", "shape": {}, "contender": contender, "label": "", "metric": "ms",
                         "value": ms, "check": "pass", "detail": {}})
    rows.append({**ENV, "gpu": gpu, "run": "new", "date": "2026-02-01T00:00:00Z", "suite": "zoo",
                 "case": "gemma2_local prefill", "op": "prefill", "shape": {}, "contender": "flex", "label": "",
                 "metric": "ms", "value": None, "check": "fail", "detail": {"rel_err": 0.5}})
    for contender, ms, check in (("fivar-fa3", None, "fail"), ("stock", 2.0, "pass")):  # fivar fails this one
        rows.append({**ENV, "gpu": gpu, "run": "new", "date": "2026-02-01T00:00:00Z", "suite": "zoo",
                     "case": "chunked prefill", "op": "prefill", "shape": {}, "contender": contender, "label": "",
                     "metric": "ms", "value": ms, "check": check, "detail": {"rel_err": 0.5} if ms is None else {}})
    rows.append({**ENV, "gpu": gpu, "run": "new", "date": "2026-02-01T00:00:00Z", "suite": "zoo",  # could not prepare
                 "case": "window prefill", "op": "prefill", "shape": {}, "contender": "*", "label": "",
                 "metric": "ms", "value": None, "check": "error", "detail": {"error": "illegal memory access"}})
    rows.append({**ENV, "gpu": gpu, "run": "new", "date": "2026-02-01T00:00:00Z", "suite": "fusions", "case": "rms",
                 "op": "add_rmsnorm", "shape": {}, "contender": "fivar", "label": "", "metric": "tbps_useful",
                 "value": 3.1, "check": "pass", "detail": {}})
    for r in rows:
        r.setdefault("ratio", None)
    add_ratios([r for r in rows if r["run"] == "new" and r["suite"] == "zoo"], "stock")
    add_ratios([r for r in rows if r["run"] == "old"], "stock")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")


def test_render_latest_run_per_case_and_readme_markers(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    _synthetic(res / "h200.jsonl")
    doc, readme = tmp_path / "docs" / "results.md", tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:begin -->\nstale table\n<!-- results:end -->\noutro\n")
    R.render(res, doc, readme, log=lambda s: None)
    text = doc.read_text()
    assert "## NVIDIA H200 (`h200.jsonl`)" in text and "### zoo" in text and "### fusions" in text
    assert text.index("### zoo") < text.index("### fusions")
    assert "| gemma2_local prefill | fivar-fa3 | 1 ms | - | 2.00x | pass |" in text
    assert "9 ms" not in text  # the older run of the case is not shown
    assert "| gemma2_local prefill | flex | - | - | - | fail: rel err 0.5 |" in text
    assert "3.1 TBPS" in text
    out = readme.read_text()
    assert out.startswith("intro\n<!-- results:begin -->\n") and out.endswith("<!-- results:end -->\noutro\n")
    # the cases fivar does not pass (a baseline's failure is in the full tables only)
    assert "stale table" not in out and "| NVIDIA H200 | zoo | 3 | 2 | 2.00x | 2.00x |" in out


def test_render_leaves_a_readme_without_markers_alone(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    _synthetic(res / "h100.jsonl", gpu="NVIDIA H100 80GB HBM3")
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    said = []
    R.render(res, tmp_path / "results.md", readme, log=said.append)
    assert readme.read_text() == "no markers here\n" and any("no <!-- results:begin -->" in s for s in said)
    assert (tmp_path / "results.md").read_text().count("### zoo") == 1


def test_validate_row_refuses_a_value_on_a_failed_check():
    row = {k: None for k in ROW_FIELDS}
    row.update(check="fail", contender="x", value=1.0)
    with pytest.raises(ValueError, match="did not pass its check has no value"):
        validate_row(row)
    row.update(check="maybe")
    with pytest.raises(ValueError, match="check must be one of"):
        validate_row(row)
    row.update(check="pass", value=math.nan)
    with pytest.raises(ValueError, match="needs a value"):
        validate_row(row)


def test_clock_trace_puts_each_contenders_clock_in_its_row(tmp_path):
    """The default timer's samples are matched to the trace by their wall-clock spans (a stand-in trace here)."""
    class Trace:
        def __init__(self):
            self.asked = []

        def during(self, t0, t1):
            self.asked.append((t0, t1))
            return {"n": 2, "mhz": 1500.0 + len(self.asked), "watts": 600.0, "celsius": 50, "reasons": []}
    ref = torch.randn(8, 2, 16)
    trace = Trace()
    opts = Options(rounds=3, warmup_ms=0.5, rep_ms=1.0, device="cpu", clocks=trace)
    cs = [Contender("fivar", lambda: ref.clone()), Contender("stock", lambda: ref.clone()),
          Contender("wrong", lambda: -ref)]
    rows = run([_case("c", cs, ref)], opts, tmp_path, build=False, log=lambda s: None, env=ENV)
    by = {(r["contender"], r["metric"]): r for r in rows}
    assert len(trace.asked) == 2 * 3 and all(t0 <= t1 for t0, t1 in trace.asked)  # a span per timed sample
    for name in ("fivar", "stock"):
        assert 1500 < by[(name, "ms")]["detail"]["mhz"] <= 1506 and by[(name, "ms")]["detail"]["watts"] == 600.0
        assert "mhz" not in by[(name, "tflops_useful")]["detail"]
    assert "mhz" not in by[("wrong", "ms")]["detail"]


def test_prebuild_builds_every_cases_modules_once_in_one_batch(monkeypatch):
    """One parallel build of the union of the cases' modules (deduplicated by URI, only those not on disk); a
    case whose modules cannot be listed, or a build that raises, is logged and the run goes on."""
    from fivar.bench import runner
    from fivar.jit import build as jb

    class Mod:
        def __init__(self, uri, ok=False):
            self.uri, self.ok = uri, ok

        def manifest_ok(self):
            return self.ok
    a, b, c = Mod("a"), Mod("b"), Mod("c", ok=True)
    batches = []

    def build_many(mods, parallel=True):
        batches.append(([m.uri for m in mods], parallel))
        raise RuntimeError("nvcc died")
    monkeypatch.setattr(jb, "build_many", build_many)
    monkeypatch.setattr("fivar.jit.prewarm.configure_jobs", lambda jobs: (3, "test"))

    def unlistable():
        raise OSError("no arch")
    cases = [Case("s", "x", "prefill", {}, None, modules=lambda: [a, b]),
             Case("s", "y", "prefill", {}, None, modules=lambda: [b, c]),
             Case("s", "z", "prefill", {}, None, modules=unlistable)]
    said = []
    runner.prebuild(cases, log=said.append)
    assert batches == [(["a", "b"], True)]
    assert any("z: cannot list its modules" in s for s in said) and any("nvcc died" in s for s in said)


def test_prebuild_warms_every_cases_stock_modules_side_by_side(monkeypatch):
    """After the fivar modules, each case's stock warm-up runs once, in threads that overlap (FlashInfer builds
    different modules at once); one that raises is logged and the others still run."""
    import threading
    from fivar.bench import runner
    monkeypatch.setattr("fivar.jit.prewarm.configure_jobs", lambda jobs: (3, "test"))
    barrier, ran = threading.Barrier(3, timeout=10), []

    def warm(name, fail=False):
        def run():
            barrier.wait()  # all three at once, or the barrier breaks and the test fails
            ran.append(name)
            if fail:
                raise RuntimeError("ninja failed")
        return run
    cases = [Case("s", n, "prefill", {}, None, warm_stock=warm(n, fail=n == "y")) for n in ("x", "y", "z")]
    cases.append(Case("s", "plain", "prefill", {}, None))  # no stock contender
    said = []
    runner.prebuild(cases, log=said.append)
    assert sorted(ran) == ["x", "y", "z"]
    assert any("y: stock warm-up: RuntimeError: ninja failed" in s for s in said)
    assert any("stock FlashInfer modules of 3 case(s) warm" in s for s in said)


@pytest.mark.parametrize("memory_bound,expect", [(None, "pct_of_matmul"), (True, "pct_of_copy")])
def test_a_case_is_judged_against_one_ceiling(memory_bound, expect):
    from fivar.bench.harness import Row
    from fivar.bench.runner import timed_rows
    row = Row(64, "fivar", "", "ok", {"rel_err": 0.0, "max_err": 0.0}, [2.0], 2.0, (2.0, 2.0))
    rows = timed_rows([row], Prepared(flops=8e9, nbytes=4e9, memory_bound=memory_bound),
                      {"bf16_matmul_tflops": 800.0, "copy_tb_per_s": 4.0})
    by = {r["metric"]: r["value"] for r in rows}
    assert by["tflops_useful"] == pytest.approx(4.0) and by["tbps_useful"] == pytest.approx(2.0)
    assert {"pct_of_matmul", "pct_of_copy"} & set(by) == {expect}
    assert by[expect] == pytest.approx(0.5 if expect == "pct_of_matmul" else 50.0)


def test_compile_suite_turns_a_compile_time_report_into_rows(monkeypatch, tmp_path):
    """The compile suite runs `python -m fivar.bench.compile_time` in its own process (stood in for here) and
    reports both builds, the ratio against FlashInfer's, and the hits; a failed process is one error row."""
    import subprocess as sp

    from fivar.bench.suites import compile as suite
    report = {"fivar_units": 3, "flashinfer_units": 6, "flashinfer_uri": "fi_uri", "jobs": 24, "cores": 16,
              "nvcc": "13.0", "arch": "90a", "fivar_cold_s": 20.0, "fivar_cold_cpu_s": 50.0, "flashinfer_cold_s": 50.0,
              "flashinfer_cold_cpu_s": 150.0, "fivar_longest_unit_s": 12.0, "fivar_longest_unit": "a_mask_0.cuda.o",
              "fivar_unit_s": {"a_mask_0.cuda.o": 12.0, "b.cuda.o": 3.0}, "flashinfer_longest_unit_s": 48.0,
              "flashinfer_longest_unit": "mask_0.cuda.o", "in_process_hit_us": 1.5, "in_process_hit_what": "load()",
              "fresh_process_disk_hit_ms": 12.0, "fresh_process": {"import_s": 1.0}}
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        out = cmd[cmd.index("--json") + 1]
        Path(out).write_text(json.dumps(report))
        return sp.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(suite.subprocess, "run", fake_run)
    case = [c for c in suite.cases() if "fa2" in c.name][0]
    rows = run([case], CPU, tmp_path, build=False, log=lambda s: None, env=ENV)
    assert seen[0][1:3] == ["-m", "fivar.bench.compile_time"] and seen[0][seen[0].index("--target") + 1] == "fa2"
    by = {(r["contender"], r["metric"]): r for r in rows}
    assert by[("fivar", "s")]["value"] == 20.0 and by[("fivar", "s")]["ratio"] == 2.5
    assert by[("fivar", "cpu_s")]["ratio"] == 3.0 and by[("flashinfer", "s")]["ratio"] == 1.0
    assert by[("fivar", "hit_us")]["value"] == 1.5 and by[("fivar", "hit_ms")]["value"] == 12.0
    assert by[("fivar", "unit_s")]["value"] == 12.0 and by[("fivar", "unit_s")]["ratio"] == 4.0
    assert by[("fivar", "unit_s")]["detail"]["unit"] == "a_mask_0.cuda.o"
    assert by[("flashinfer", "unit_s")]["value"] == 48.0
    for r in rows:
        validate_row(r)

    def failing_run(cmd, **kw):
        return sp.CompletedProcess(cmd, 1, "", "Traceback ...\nRuntimeError: nvcc not found")
    monkeypatch.setattr(suite.subprocess, "run", failing_run)
    rows = run([case], CPU, tmp_path, build=False, log=lambda s: None, env=ENV)
    assert len(rows) == 1 and rows[0]["check"] == "error" and "nvcc not found" in rows[0]["detail"]["error"]


def test_compile_time_reads_each_units_seconds_from_ninjas_log(tmp_path):
    """The longest unit bounds a module's cold build on a host with a core per unit: read per object file from the
    log ninja keeps in the module's build folder (start and end in ms; the link and other outputs are not units)."""
    from fivar.bench.compile_time import unit_seconds
    (tmp_path / ".ninja_log").write_text("# ninja log v7\n"
                                         "0\t41500\t1\t/ws/m/single_prefill_sm90_kernel_mask_0.cuda.o\tab\n"
                                         "10\t30010\t1\tsingle_prefill_sm90_jit_binding.cuda.o\tcd\n"
                                         "41500\t42700\t1\t/ws/m/m.so\tef\nbroken line\n")
    assert unit_seconds(tmp_path) == {"single_prefill_sm90_kernel_mask_0.cuda.o": 41.5,
                                      "single_prefill_sm90_jit_binding.cuda.o": 30.0}
    assert unit_seconds(tmp_path / "missing") == {}


def _cold_start_reports():
    build = {"variant": "local_global", "modules": 3, "build_s": 90.0, "build_cpu_s": 600.0, "targets": ["fa2", "fa3"],
             "module_s": {"m_fa3": 88.0, "m_fa2_prefill": 30.0, "m_fa2_decode": 12.0}, "jobs": 24, "cores": 16,
             "arch": "90a", "nvcc": "13.0"}
    first = {"variant": "local_global", "target": "fa3", "first_result_s": 4.0, "first_ran": "triton",
             "build_done_s": 91.0, "in_use_s": 91.5, "modules": 1, "max_diff": 0.01, "shape": {"seqlen": 4096}}
    flex = {"variant": "local_global", "first_call_s": 18.0, "block_mask_s": 0.5, "second_call_ms": 1.0,
            "shape": {"seqlen": 4096}}
    return {"build": build, "first-prefill": first, "flex": flex}


def _stand_in_children(monkeypatch, suite, reports: dict, gpu: bool) -> list:
    """The compile suite's child processes answered from `reports` (by mode; read at each call), the GPU there or
    not: the (mode, variant file) each call asked for, in order."""
    asked = []

    def fake_child(mode, file, timeout_s):
        asked.append((mode, Path(file).name))
        return reports[mode]
    monkeypatch.setattr(suite, "_child", fake_child)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    return asked


@pytest.mark.parametrize("gpu", [True, False])
def test_compile_suite_compares_a_cold_first_training_step_with_flexs(monkeypatch, tmp_path, gpu):
    """Each not-bundled variant's cold first training step and Flex's, each from a child process of its own (stood
    in for), as rows with the ratio against Flex; a failed contender is its error row alone; no GPU, no rows."""
    from fivar.bench.suites import compile as suite
    step = {"variant": "local_global", "first_step_s": 30.0, "second_step_ms": 9.0, "shape": {"seqlen": 4096}}
    reports = {"first-train": step, "flex-train": dict(step, first_step_s=45.0, second_step_ms=20.0)}
    asked = _stand_in_children(monkeypatch, suite, reports, gpu)
    cases = [c for c in suite.cases() if c.op == "cold_train"]
    assert [c.shape["variant"] for c in cases] == list(suite.COLD_VARIANTS) and all(c.baseline == "flex" for c in cases)
    rows = run(cases[:1], CPU, tmp_path, build=False, log=lambda s: None, env=ENV)
    if not gpu:
        assert rows == [] and asked == []
        return
    for r in rows:
        validate_row(r)
    by = {r["contender"]: r for r in rows}
    assert asked == [("first-train", "local_global.py"), ("flex-train", "local_global.py")]
    assert by["fivar first step"]["value"] == 30.0 and by["fivar first step"]["ratio"] == 1.5
    assert by["flex"]["ratio"] == 1.0 and by["fivar first step"]["detail"]["second_step_ms"] == 9.0
    reports["flex-train"] = {"error": "flex-train: RuntimeError: inductor failed"}
    rows = run(cases[:1], CPU, tmp_path, build=False, log=lambda s: None, env=ENV)
    by = {r["contender"]: r for r in rows}
    assert by["flex"]["check"] == "error" and by["fivar first step"]["value"] == 30.0


@pytest.mark.parametrize("gpu", [True, False])
def test_compile_suite_compares_a_cold_fivar_build_and_first_call_with_flexs_first_call(monkeypatch, tmp_path, gpu):
    """Each not-bundled variant is one case: its cold `fivar build`, cold first prefill and Flex's first call, each
    from a child process of its own (stood in for), as rows with ratios against Flex; without a GPU the first
    calls have no rows and nothing runs them."""
    from fivar.bench.suites import compile as suite
    reports = _cold_start_reports()
    asked = _stand_in_children(monkeypatch, suite, reports, gpu)
    cases = [c for c in suite.cases() if c.op == "cold_start"]
    assert [c.shape["variant"] for c in cases] == list(suite.COLD_VARIANTS) and all(c.baseline == "flex" for c in cases)
    for name in suite.COLD_VARIANTS:  # written as a user would, not bundled
        from fivar.registry import variant_files
        assert (suite.variants_dir() / f"{name}.py").is_file() and name not in variant_files()
    rows = run(cases[:1], CPU, tmp_path, build=False, log=lambda s: None, env=ENV)
    for r in rows:
        validate_row(r)
    by = {(r["contender"], r["metric"]): r for r in rows}
    assert by[("fivar build", "s")]["value"] == 90.0 and by[("fivar build", "cpu_s")]["value"] == 600.0
    assert by[("fivar build", "s")]["detail"]["module_s"] == reports["build"]["module_s"]
    assert by[("fivar build", "s")]["label"].startswith("3 modules (fa2+fa3)")
    if not gpu:
        assert asked == [("build", "local_global.py")] and set(by) == {("fivar build", "s"), ("fivar build", "cpu_s")}
        assert by[("fivar build", "s")]["ratio"] is None  # no Flex row to compare with
        return
    assert [m for m, _ in asked] == ["build", "first-prefill", "flex"]
    assert by[("fivar first call", "s")]["value"] == 4.0 and by[("fivar first call", "s")]["ratio"] == 4.5
    assert by[("fivar first call", "s")]["detail"]["ran_on"] == "triton"
    assert by[("fivar fa3 in use", "s")]["value"] == 91.5 and by[("flex", "s")]["ratio"] == 1.0
    assert by[("fivar build", "s")]["ratio"] == pytest.approx(0.2)
    assert by[("flex", "s")]["detail"]["block_mask_s"] == 0.5

    reports["flex"] = {"error": "flex: RuntimeError: inductor failed"}  # one contender's failure: its row only
    rows = run(cases[:1], CPU, tmp_path, build=False, log=lambda s: None, env=ENV)
    by = {(r["contender"], r["metric"]): r for r in rows}
    assert by[("flex", "s")]["check"] == "error" and "inductor failed" in by[("flex", "s")]["detail"]["error"]
    assert by[("fivar build", "s")]["check"] == "pass" and by[("fivar build", "s")]["ratio"] is None


def test_compile_time_build_mode_builds_what_fivar_build_builds(monkeypatch):
    """--mode build takes `fivar build NAME`'s module set (on sm_90a: FA3 prefill, FA2 decode), each once, in one
    parallel build, and reports each module's own seconds; a module that was not cold is an error, not a row."""
    from fivar.bench import compile_time as ct
    from fivar.bench.suites import compile as suite
    from fivar.runtime.build_set import DEFAULT_OPS, build_modules
    from fivar.jit import build as jb
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    calls = []

    def fake_build_many(mods, parallel=False, **kw):
        calls.append(([m.uri for m in mods], parallel))
        return [("cold", 1.0 + i) for i in range(len(mods))]
    monkeypatch.setattr(jb, "build_many", fake_build_many)
    for name in suite.COLD_VARIANTS:
        file = str(suite.variants_dir() / f"{name}.py")
        res = ct.measure_build_set(file, log=lambda s: None)
        expect = list(dict.fromkeys(m.uri for m in build_modules([fivar.load(file)], ["auto"], DEFAULT_OPS, ["bf16"],
                                                                    [128])))
        assert calls[-1] == (expect, True) and res["modules"] == len(expect) == len(res["module_s"])
        assert list(res["module_s"]) == expect and res["targets"] == ["fa2", "fa3"]
        assert all("_fa2_" in u for u in expect if "decode" in u) and any("_fa3_" in u for u in expect)
    monkeypatch.setattr(jb, "build_many", lambda mods, **kw: [("disk", 0.0)] * len(mods))
    with pytest.raises(RuntimeError, match="already built in a fresh cache"):
        ct.measure_build_set(file, log=lambda s: None)


def test_compile_time_first_calls_skip_without_a_gpu(tmp_path, monkeypatch):
    """The first-call modes need a GPU: without one they report why, exit 0 and run nothing."""
    from fivar.bench import compile_time as ct
    from fivar.bench.suites import compile as suite
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    file = str(suite.variants_dir() / "biased_softcap.py")
    for mode in ("first-prefill", "flex"):
        assert "needs a CUDA GPU" in ct.MODES[mode](file)["skipped"]
    # main() picks fresh caches through the environment (restored after the test) and refuses to run once FlashInfer
    # is imported (it fixes its folders then): as its own process would be
    for var in ("FLASHINFER_WORKSPACE_BASE", "FIVAR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var))
    monkeypatch.delitem(__import__("sys").modules, "flashinfer", raising=False)
    out = tmp_path / "flex.json"
    assert ct.main(["--mode", "flex", "--file", file, "--json", str(out)]) == 0
    assert "needs a CUDA GPU" in json.loads(out.read_text())["skipped"]


def test_train_rows_are_results_rows_with_ratios_against_flex():
    from fivar.bench.runner import validate_row
    from fivar.bench.suites import cases_of
    from fivar.bench.train import result_rows
    common = dict(variant="alibi", op="train", seqlen=8192, heads="32/8", head_dim=128, causal=True, dtype="bfloat16")
    bench = [dict(common, contender="fivar", ms=8.0, ms_spread=[7.9, 8.1], tflops=240.0, vs_fivar=None),
             dict(common, contender="flex", ms=12.0, ms_spread=[11.9, 12.2], tflops=160.0, vs_fivar=0.004),
             dict(common, contender="sdpa", ms=None, tflops=None, error="RuntimeError: no kernel")]
    env = {"gpu": "NVIDIA H100", "commit": "abc", "date": "2026-01-01T00:00:00Z", "run": "r1"}
    rows = result_rows(bench, env)
    for r in rows:
        validate_row(r)
    ms = {r["contender"]: r for r in rows if r["metric"] == "ms"}
    assert ms["fivar"]["ratio"] == pytest.approx(1.5) and ms["flex"]["ratio"] == pytest.approx(1.0)
    assert ms["sdpa"]["check"] == "error" and ms["sdpa"]["value"] is None
    assert ms["flex"]["detail"]["grad_rel_err_vs_fivar"] == 0.004
    assert {r["case"] for r in rows} == {"alibi train S=8192 causal"}
    assert [c.name for c in cases_of("train")][0] == "softcap train S=8192 causal"
    # Flex could not compile the learnable tensor's gradient: the ratio is against Flex with it frozen
    bench[1] = dict(common, contender="flex", ms=None, tflops=None, error="InductorError: ...")
    bench.append(dict(common, contender="flex-frozen", ms=6.0, ms_spread=[5.9, 6.1], tflops=320.0, vs_fivar=0.003))
    ms = {r["contender"]: r for r in result_rows(bench, env) if r["metric"] == "ms"}
    assert ms["fivar"]["ratio"] == pytest.approx(0.75) and ms["fivar"]["baseline"] == "flex-frozen"
    # gradients that disagree beyond bf16 noise: fivar's rows fail and carry no number (NaN disagrees too)
    for err in (0.08, float("nan")):
        bench[-1]["vs_fivar"] = err
        rows = result_rows(bench, env)
        for r in rows:
            validate_row(r)
        fivar_rows = [r for r in rows if r["contender"] == "fivar"]
        assert fivar_rows and all(r["check"] == "fail" and r["value"] is None for r in fivar_rows)


def test_zoo_cases_warm_their_stock_contenders_only(monkeypatch):
    """A case's stock warm-up builds the stock contenders it times (FlashInfer's modules), with the case's own stock
    mapping at a small shape, and none of fivar's."""
    import types

    import torch
    from fivar.bench.suites import _attention, zoo
    calls = []
    params = {"window": 4096, "softcap": 50.0, "chunk": 8192, "doc_ids": torch.zeros(1, 256, dtype=torch.int32)}
    monkeypatch.setattr(_attention, "make_problem", lambda v, op, n, *a, **kw: types.SimpleNamespace(params=params))
    monkeypatch.setattr(_attention, "contenders",
                        lambda v, p, wanted, stock, fivar: calls.append((v.name, wanted, stock, fivar)) or [])
    cases = {c.name: c for c in zoo.cases()}
    cases["gemma2_local prefill S=8192"].warm_stock()
    name, wanted, stock, fivar = calls[-1]
    assert (name, wanted, fivar) == ("gemma2_local", ["stock", "stock-fa2", "plain"], False)
    assert stock.kwargs == {"window_left": 4095, "logits_soft_cap": 50.0}
    cases["t5_buckets prefill S=8192"].warm_stock()  # no stock equivalent: plain attention, the yardstick
    assert calls[-1][1:] == (["stock", "stock-fa2", "plain"], None, False)
    cases["llama4_chunked decode 32x32768"].warm_stock()
    assert calls[-1][1] == ["stock"] and calls[-1][2].kwargs == {"window_left": 255}  # (256 - 1) % 8192


def test_train_cases_prebuild_the_fa3_forward_on_sm90_only(monkeypatch):
    """The runner's parallel prebuild covers the FA3 modules v.attention's default forward runs on sm90 (the
    KV-range form's batch prefill for a scanned mask), and nothing where the forward is Triton's."""
    from fivar.bench.suites import _attention, cases_of
    by = {c.name.split()[0]: c for c in cases_of("train")}
    monkeypatch.setattr(_attention, "_sm90", lambda: False)
    assert all(c.modules() == [] for c in by.values())
    monkeypatch.setattr(_attention, "_sm90", lambda: True)
    soft, doc = by["softcap"].modules(), by["document_mask"].modules()
    assert soft and all("_fa3_single_prefill_" in m.uri for m in soft)
    assert doc and all("_fa3_batch_prefill" in m.uri for m in doc)


def _selected_contenders(op, wanted, chosen, monkeypatch, **plans):
    """contenders() of `document_mask` (a scanned mask) on a pretend sm90, with fresh random CPU inputs, under
    --contender `chosen` (None: all); `plans` replace the variant's plan_* methods."""
    import random

    import fivar
    from fivar.bench import contenders as C
    v = fivar.load("document_mask")
    assert v.scans_mask  # on sm90 its FA3 KV-range form is planned as the contenders are made
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    for name, fn in plans.items():
        monkeypatch.setattr(v, name, fn)
    p = C.make_problem(v, op, random.choice((32, 48, 64)), 2, (2, 1), 16, torch.float32, random.random() < 0.5,
                       device="cpu")
    token = C.SELECTED.set(chosen)
    try:
        return [c.name for c in C.contenders(v, p, wanted)]
    finally:
        C.SELECTED.reset(token)


def test_contender_selection_makes_only_the_named_contenders_and_plans_nothing_else(monkeypatch):
    """`--contender triton`: only the Triton twin is made; the eager FA3 plan, stock FlashInfer's planned wrappers,
    Flex's compile and fivar's batch/decode plans of the contenders left out never run."""
    import types

    import fivar.flex
    from fivar.bench import contenders as C
    planned = []
    plan = lambda *a, **k: planned.append(k.get("backend")) or types.SimpleNamespace(  # noqa: E731
        run=lambda *a: None, target="fa3")
    # every contender: the FA3 plan is made (so the check below can fail)
    assert _selected_contenders("prefill", ["triton"], None, monkeypatch, plan_ragged=plan) == [
        "fivar-fa3", "fivar-fa2", "fivar-fa3-planned", "triton"]
    assert planned == ["fa3"]

    def never(*a, **k):
        raise AssertionError("a contender left out was made")
    for name in ("stock_documents",):
        monkeypatch.setattr(C, name, never)
    monkeypatch.setattr(fivar.flex, "flex_attention_fn", never)
    planned.clear()
    wanted = ["stock", "stock-fa2", "triton", "flex", "sdpa", "plain"]
    assert _selected_contenders("prefill", wanted, frozenset({"triton"}), monkeypatch, plan_ragged=plan) == ["triton"]
    assert planned == []
    assert _selected_contenders("batch-prefill", ["stock", "triton"], frozenset({"triton"}), monkeypatch,
                                plan_ragged=never) == ["triton"]
    assert _selected_contenders("decode", ["stock", "call", "graph", "triton"], frozenset({"tri*"}), monkeypatch,
                                plan_decode=never) == ["triton"]


def test_main_sets_the_contender_selection_for_its_run_only(monkeypatch, capsys):
    from fivar.bench import runner
    from fivar.bench.contenders import SELECTED
    assert runner.main(["--suite", "masks", "--contender", "triton", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed and all(line.startswith("masks\t") for line in listed)  # --list still lists every case
    seen = []
    monkeypatch.setattr(runner, "_run_cases", lambda args, cases, ap: seen.append(SELECTED.get()) or 0)
    runner.main(["--suite", "masks", "--contender", "triton", "--contender", "fivar-fa*"])
    runner.main(["--suite", "masks"])
    assert seen == [frozenset({"triton", "fivar-fa*"}), None] and SELECTED.get() is None


def test_the_stock_warm_up_threads_see_the_contender_selection():
    """warm_stock runs each case's warm-up in a thread of a pool, which starts from an empty context: the
    selection must reach it, or `--contender triton` would still build every stock FlashInfer module."""
    from fivar.bench import contenders as C
    from fivar.bench.runner import warm_stock
    seen = []
    cases = [Case("zoo", f"c{i}", "prefill", {}, lambda: None,
                  warm_stock=lambda: seen.append((C.SELECTED.get(), C.selected("stock")))) for i in range(3)]
    token = C.SELECTED.set(frozenset({"triton"}))
    try:
        warm_stock(cases, log=lambda s: None)
    finally:
        C.SELECTED.reset(token)
    assert seen == [(frozenset({"triton"}), False)] * 3


def test_the_prebuild_builds_only_the_selected_contenders_modules(monkeypatch):
    """`--contender` reaches the runner's parallel prebuild: a case builds the fivar modules of its selected
    contenders only (none for `triton`), so a run of the Triton twin compiles nothing with nvcc."""
    from fivar.bench import contenders as C
    from fivar.bench.suites import _attention, cases_of
    monkeypatch.setattr(_attention, "_sm90", lambda: True)
    doc = next(c for c in cases_of("attention") if c.name.startswith("document_mask prefill"))  # a scanned mask
    dec = next(c for c in cases_of("zoo") if c.op == "decode")

    def under(chosen, case):
        token = C.SELECTED.set(chosen)
        try:
            return sorted({f"{m.target}_{m.op}" for m in case.modules()})
        finally:
            C.SELECTED.reset(token)
    every = under(None, doc)
    assert {s.split("_")[0] for s in every} == {"fa2", "fa3"}
    assert under(frozenset({"triton"}), doc) == [] and under(frozenset({"triton", "stock"}), dec) == []
    assert under(frozenset({"fivar-fa2"}), doc) == [s for s in every if s.startswith("fa2_")]
    assert under(frozenset({"fivar-fa3-planned"}), doc) == ["fa3_batch_prefill"]
    assert under(None, dec) and under(frozenset({"fivar"}), dec) == under(None, dec)
