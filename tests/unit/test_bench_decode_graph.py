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
    assert "--cuda-graph replays decode plans from CUDA graphs; it applies to --op decode only" in lines[0]
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
