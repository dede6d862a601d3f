"""`fivar bench --op decode --cuda-graph` and the decode suite's graph and FP8 cases, as far as they go without a GPU:
the CLI's refusals and the case list (`python -m fivar.bench --suite decode --list`)."""
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fivar.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("op", ["prefill", "batch-prefill", "train"])
def test_cuda_graph_is_refused_off_decode_in_one_line(op):
    r = CliRunner().invoke(main, ["bench", "softcap", "--op", op, "--cuda-graph"])
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert ("--cuda-graph replays decode and verify plans from CUDA graphs; it applies to --op decode and --op "
            "verify only") in lines[0]
    assert f"--op {op}" in lines[0]


def test_cuda_graph_with_compile_is_refused():
    r = CliRunner().invoke(main, ["bench", "softcap", "--op", "decode", "--cuda-graph", "--compile", "--arch", "9.0a"])
    assert r.exit_code == 1 and "shape a timed run only" in " ".join(r.output.split()), r.output


def test_decode_suite_lists_graph_and_fp8_cases():
    out = subprocess.run([sys.executable, "-m", "fivar.bench", "--suite", "decode", "--list"], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split("\t") for line in out.splitlines() if line.startswith("decode\t")]
    graph = {r[1]: r[2] for r in rows if " graph " in r[1]}
    for name in ("softcap", "sliding_window"):
        for batch in (1, 8, 64):
            assert graph[f"{name} decode graph {batch}x4096"] == "baseline=stock-graph"
        assert [r[2] for r in rows if r[1] == f"{name} decode fp8 32x8192"] == ["baseline=stock"]


def test_graph_and_fp8_cases_shape_and_modules():
    from fivar.bench.suites import cases_of
    cases = {c.name: c for c in cases_of("decode")}
    fp8 = cases["softcap decode fp8 32x8192"]
    assert fp8.shape["kv_dtype"] == "fp8_e4m3" and fp8.shape["batch"] == 32
    mods = fp8.modules()
    assert {m.op for m in mods} == {"batch_decode", "batch_prefill"} and all("_kvfp8e4m3_" in m.uri for m in mods)
    assert cases["softcap decode graph 64x4096"].shape["batch"] == 64
    assert "kv_dtype" not in cases["softcap decode graph 1x4096"].shape


def test_a_replayed_contender_keeps_what_its_graph_reads_alive(monkeypatch):
    """A CUDA graph holds raw addresses only: the replaying callable must keep the captured callable (and so the
    plan or wrapper owning the buffers the graph reads) alive, or those buffers are freed and handed on while the
    graph still uses them. Checked with CUDA's graph API stood in for on the CPU."""
    import contextlib
    import gc
    import types
    import weakref

    import torch

    from fivar.bench import contenders
    fake_stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: fake_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: fake_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())

    class Plan:  # the owner of the buffers a captured run reads
        def run(self):
            return torch.ones(2)

    def make():
        plan = Plan()
        return contenders._replayed(lambda: plan.run()), weakref.ref(plan)

    replay, plan_ref = make()
    gc.collect()
    assert plan_ref() is not None, "the captured plan was freed while its graph can still be replayed"
    assert torch.equal(replay(), torch.ones(2))
    del replay
    gc.collect()
    assert plan_ref() is None  # and it goes with the graph
