"""`fivar bench NAME --op verify|mixed` on the CPU: which serving-suite cases and contenders it hands the bench runner,
what it refuses in one line, how it prints and writes the rows (the runner stubbed: nothing is timed), and the
suite's listing of its mixed-step cases."""
import json

import pytest
from click.testing import CliRunner

from fivar.bench import contenders, runner
from fivar.cli import main


@pytest.fixture
def ran(monkeypatch):
    """Stub the GPU and the runner: record what the command runs, answer with a row per contender."""
    import torch
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def run(cases, opts, results_dir=None, build=True, log=print, timer=None, env=None):
        seen.update(cases=cases, rounds=opts.rounds, selected=contenders.SELECTED.get(), results_dir=results_dir)
        rows = []
        for c in cases:
            for i, name in enumerate(("stock", "fivar-fa3")):
                rows.append({"case": c.name, "contender": name, "metric": "ms", "value": 1.0 + i, "check": "pass",
                             "ratio": 1.0 / (1.0 + i), "baseline": "stock", "detail": {}})
            rows.append({"case": c.name, "contender": "triton", "metric": "ms", "value": None, "check": "error",
                         "ratio": None, "baseline": "stock", "detail": {"error": "RuntimeError: boom"}})
        return rows
    monkeypatch.setattr(runner, "run", run)
    return seen


def _invoke(*args):
    r = CliRunner().invoke(main, ["bench", *args])
    return r, " ".join(r.output.split())


def test_verify_runs_the_suites_verify_cases_of_the_variant(ran):
    r, out = _invoke("softcap", "--op", "verify", "--rounds", "3")
    assert r.exit_code == 0, r.output
    names = [c.name for c in ran["cases"]]
    assert names == [f"softcap verify {form} {n} x32 ctx8192" for n in (8, 16, 64) for form in ("chain", "tree")]
    assert all(c.op == "verify" and c.suite == "serving" for c in ran["cases"])
    assert ran["rounds"] == 3 and ran["results_dir"] is not None  # not the curated results file
    assert ran["selected"] == {"fivar", "fivar-fa3", "fivar-fa2", "fivar-fa3-planned", "fivar-causal", "stock", "triton",
                               "flex"}
    assert contenders.SELECTED.get() is None  # reset after the run
    assert "softcap verify tree 64" in out and "FAILED" not in out and "error" in out and "0.50x vs stock" in out


def test_mixed_runs_the_mixed_cases_with_the_contenders_asked_for(ran, tmp_path):
    path = tmp_path / "rows.json"
    r, _ = _invoke("document_mask", "--op", "mixed", "--vs", "triton", "--json", str(path))
    assert r.exit_code == 0, r.output
    names = [c.name for c in ran["cases"]]
    assert names == ["document_mask mixed 2 chunks + 30 decodes x32 ctx8192",
                     "document_mask mixed 4 chunks + 28 decodes x32 ctx8192",
                     "document_mask mixed 4 x 2048 + 64 decodes x68 ctx8192"]
    assert ran["cases"][1].shape["chunks"] == [[0, 512], [2048, 1024], [4096, 1536], [6144, 2048]]
    assert ran["cases"][2].shape["batch"] == 68 and ran["cases"][2].shape["decodes"] == 64
    assert all(c.shape["page_size"] == 16 and c.shape["heads"] == "32/8" and c.op == "mixed" for c in ran["cases"])
    assert ran["selected"] == {"fivar", "fivar-fa3", "fivar-fa2", "fivar-fa3-planned", "fivar-causal", "triton"}
    rows = json.loads(path.read_text())
    assert len(rows) == 9 and {r["case"] for r in rows} == set(names)


def test_verify_with_cuda_graph_adds_the_replayed_steps(ran):
    r, _ = _invoke("sliding_window", "--op", "verify", "--cuda-graph", "--vs", "stock")
    assert r.exit_code == 0, r.output
    names = [c.name for c in ran["cases"]]
    plain = [f"sliding_window verify {form} {n} x32 ctx8192" for n in (8, 16, 64) for form in ("chain", "tree")]
    graph = [f"sliding_window verify graph {form} {n} x32 ctx8192" for n in (8, 16, 64) for form in ("chain", "tree")]
    assert names == plain + graph
    assert all(c.shape.get("cuda_graph") for c in ran["cases"][6:]) and not any(c.shape.get("cuda_graph")
                                                                              for c in ran["cases"][:6])
    assert {"fivar-graph", "stock-graph"} <= ran["selected"]
    r, out = _invoke("sliding_window", "--op", "mixed", "--cuda-graph")
    assert r.exit_code == 1 and "--op decode and --op verify only" in out


def test_params_set_on_the_command_line_reach_the_cases(ran):
    r, _ = _invoke("sliding_window", "--op", "mixed", "--param", "window=64")
    assert r.exit_code == 0, r.output
    assert all(c.shape["params"] == {"window": 64} for c in ran["cases"])


@pytest.mark.parametrize("args,words", [
    (["--seqlens", "64"], ("--op verify", "--seqlens", "drop it")),
    (["--batch", "4", "--causal"], ("--batch, --causal", "drop them")),
    (["--vs", "sdpa"], ("no SDPA contender",)),
    (["--param", "windw=3"], ("windw",)),
])
def test_options_the_serving_cases_ignore_are_refused(ran, args, words):
    r, out = _invoke("sliding_window", "--op", "verify", *args)
    assert r.exit_code == 1 and all(w in out for w in words), r.output
    assert "cases" not in ran  # nothing ran


def test_the_serving_suite_lists_its_mixed_cases_without_a_gpu(capsys):
    assert runner.main(["--suite", "serving", "--list", "--case", "*mixed*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split("\t")[1] for line in lines]
    for variant in ("softcap", "sliding_window", "gpt_oss", "document_mask"):
        for label, decodes in (("2 chunks", 30), ("4 chunks", 28)):
            assert f"{variant} mixed {label} + {decodes} decodes x32 ctx8192" in names
    assert all("baseline=('stock', 'flex', 'triton')" in line for line in lines)
