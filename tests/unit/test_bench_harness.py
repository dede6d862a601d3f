"""The benchmark harness on the CPU: statistics, work counting, the report schema, the plot, and that a
contender failing its check is reported as failed and never timed."""
import json
import math
import re

import pytest
import torch

import fivar
from fivar.bench.contenders import Contender, document_indptr, make_problem, scalar_params
from fivar.errors import FivarError
from fivar.bench.harness import evaluate, validate, work
from fivar.bench.timing import Timing, attention_flops, decode_kv_bytes
from fivar.bench.work import attention_bytes, kept_fraction
from fivar.testing import compare


def test_timing_median_and_spread():
    t = Timing([3.0, 1.0, 2.0, 10.0])
    assert t.median == 2.5 and t.spread == (1.0, 10.0)


def test_flops_noncausal_causal_and_gqa():
    assert attention_flops(4, 4, 2, 8, False) == 4 * 16 * 2 * 8
    # causal, bottom-right aligned: rows see 1, 2, 3, 4 keys
    assert attention_flops(4, 4, 2, 8, True) == 4 * 10 * 2 * 8
    # append: 2 queries over 5 keys see 4 and 5 keys
    assert attention_flops(2, 5, 1, 1, True) == 4 * 9
    # GQA does not change FLOPs (q heads do the work), but it does change bytes
    assert attention_bytes(4, 4, 8, 2, 16) == 2 * 16 * (2 * 4 * 8 + 2 * 4 * 2)
    assert decode_kv_bytes([10, 20], 8, 128) == 2 * 30 * 8 * 128 * 2


@pytest.mark.parametrize("causal", [False, True])
def test_documents_as_requests_compute_the_document_mask(causal):
    """`stock` for the document mask runs each document as its own request: plain attention per document,
    concatenated (float64), must be the variant's reference on the packed sequence."""
    torch.manual_seed(7)
    v = fivar.load("document_mask")
    n, h, d = 203, 3, 16
    doc_ids = v.example(num_qo_heads=h, num_kv_heads=h, batch_size=1, max_len=n, device="cpu")["doc_ids"]
    doc_ids[0, 150:] += 1  # at least two documents whatever the draw
    indptr = document_indptr(doc_ids[0])
    assert indptr[0] == 0 and indptr[-1] == n and bool((indptr.diff() > 0).all())
    assert indptr.numel() - 1 == len(torch.unique(doc_ids[0]))
    q, k, val = (torch.randn(n, h, d, dtype=torch.float64) for _ in range(3))
    pieces = []
    for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist()):
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) / d ** 0.5
        if causal:
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        pieces.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), val[a:b]))
    ref = v.reference(q.float(), k.float(), val.float(), causal=causal, doc_ids=doc_ids)
    torch.testing.assert_close(torch.cat(pieces).float(), ref, rtol=1e-5, atol=1e-5)


def test_document_indptr_edges():
    assert document_indptr(torch.zeros(5, dtype=torch.int32)).tolist() == [0, 5]
    assert document_indptr(torch.arange(4, dtype=torch.int32)).tolist() == [0, 1, 2, 3, 4]


def test_kept_fraction_of_masks():
    sw = fivar.load("sliding_window")
    f = kept_fraction(sw, {"window": 16}, qo_len=256, kv_len=256, num_qo_heads=2, num_kv_heads=1, causal=True)
    exact = sum(min(16, i + 1) for i in range(256)) / sum(i + 1 for i in range(256))
    assert abs(f - exact) < 0.02
    assert kept_fraction(fivar.load("softcap"), {}, qo_len=8, kv_len=8, num_qo_heads=1, num_kv_heads=1,
                         causal=False) == 1.0


def test_param_sets_a_scalar_and_the_work_counted_follows_it():
    """`fivar bench --param window=W`: the problem runs W, not the example's 128, and useful flops count the keys
    W keeps (exactly: causal rows keep min(W, i + 1) keys)."""
    sw = fivar.load("sliding_window")
    S = 192
    for w in (7, 40):
        params = scalar_params(sw, [f" window = {w}"])
        assert params == {"window": w} and type(params["window"]) is int
        p = make_problem(sw, "prefill", S, 1, (2, 1), 16, torch.float32, True, device="cpu", params=params)
        assert p.params["window"] == w and p.tensors["q"].shape == (S, 2, 16) and p.tensors["q"].std() > 0.5
        flops, _ = work(sw, p)
        exact = 4 * 2 * 16 * sum(min(w, i + 1) for i in range(S))
        assert flops == pytest.approx(exact, rel=0.03), (w, flops, exact)
    default = make_problem(sw, "prefill", S, 1, (2, 1), 16, torch.float32, True, device="cpu")
    assert default.params["window"] == sw.params["window"].default
    assert scalar_params(fivar.load("softcap"), ["softcap=12.5"]) == {"softcap": 12.5}


@pytest.mark.parametrize("name,item,text", [
    ("sliding_window", "window=1k", "'window' is declared int, got '1k'"),
    ("sliding_window", "window", "expected NAME=VALUE"),
    ("sliding_window", "=3", "expected NAME=VALUE"),
    ("sliding_window", "windw=3", "'windw' is not a param; its scalar params: window"),
    ("softcap", "softcap=nan", "parameter 'softcap' must be finite, got nan"),
    ("softcap", "softcap=-inf", "parameter 'softcap' must be finite, got -inf"),
    ("sliding_window", "window=4294967296", "parameter 'window' = 4294967296 does not fit the kernels' 32-bit"),
    ("document_mask", "doc_ids=1", "'doc_ids' is a tensor param (only scalars can be set here)"),
    ("relative_bias", "max_distance=100", "'max_distance' sizes tensor param 'bias' (qo_head, 2*max_distance+1)"),
])
def test_a_bad_param_names_the_variant_and_the_param(name, item, text):
    with pytest.raises(FivarError, match=f"variant '{name}'.*{re.escape(text)}"):
        scalar_params(fivar.load(name), [item])


def test_a_call_refuses_a_non_finite_scalar_as_bench_does():
    """The check `--param` uses is the one every call makes (fivar.runtime.params.checked_scalar)."""
    q, k, v = torch.randn(5, 2, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    softcap = fivar.load("softcap")
    for bad in (math.inf, math.nan):
        with pytest.raises(FivarError, match="variant 'softcap': parameter 'softcap' must be finite"):
            softcap.reference(q, k, v, softcap=bad)
    assert torch.isfinite(softcap.reference(q, k, v, softcap=7.0)).all()


def _cpu_problem():
    v = fivar.load("softcap")
    q, k, vv = torch.randn(48, 4, 16), torch.randn(48, 2, 16), torch.randn(48, 2, 16)
    ref = v.reference(q, k, vv, softcap=10.0)
    return v, q, k, vv, ref


def test_failing_contender_is_reported_not_timed_and_errors_are_caught():
    v, q, k, vv, ref = _cpu_problem()
    good = Contender("good", lambda: v.reference(q, k, vv, softcap=10.0))
    wrong = Contender("wrong", lambda: v.reference(q, k, vv, softcap=10.0) * 1.05 + 0.01)

    def broken():
        raise RuntimeError("kernel exploded")
    bad = Contender("broken", broken)
    check = lambda c: compare("softcap", c.name, c.fn(), ref, torch.float16)  # noqa: E731
    rows = evaluate([good, wrong, bad], check, flops=1e6, nbytes=1e5, seqlen=48, rounds=2, device="cpu",
                    ceilings={"bf16_matmul_tflops": 100.0, "copy_tb_per_s": 1.0})
    by = {r.contender: r for r in rows}
    assert by["good"].status == "ok" and len(by["good"].samples_ms) == 2 and by["good"].median_ms > 0
    assert by["wrong"].status == "failed" and by["wrong"].samples_ms == [] and by["wrong"].median_ms is None
    assert by["broken"].status == "error" and "kernel exploded" in by["broken"].check["error"]
    assert math.isclose(by["good"].tflops, 1e6 / by["good"].median_ms / 1e9)
    assert math.isclose(by["good"].pct_of_copy, 100 * by["good"].tb_per_s / 1.0)


class FakeClock:
    """Stands in for the `time` module in fivar.bench.timing: time passes only when a contender runs."""
    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now

    perf_counter = time

    def work(self, ms, out):
        def fn():
            self.now += ms / 1e3
            return out
        return fn


def _fake_clock(monkeypatch):
    import types

    from fivar.bench import timing
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(time=clock.time, perf_counter=clock.perf_counter))
    return clock


def test_ratios_are_within_one_run(monkeypatch):
    v, q, k, vv, ref = _cpu_problem()
    clock = _fake_clock(monkeypatch)
    fast, slow = Contender("fast", clock.work(1.0, ref)), Contender("slow", clock.work(3.0, ref))
    check = lambda c: compare("softcap", c.name, c.fn(), ref, torch.float16)  # noqa: E731
    rows = evaluate([fast, slow], check, flops=1.0, nbytes=1.0, seqlen=48, rounds=3, device="cpu", ceilings=None)
    by = {r.contender: r for r in rows}
    assert len(by["fast"].samples_ms) == len(by["slow"].samples_ms) == 3
    assert by["fast"].median_ms == pytest.approx(1.0) and by["slow"].median_ms == pytest.approx(3.0)
    assert by["fast"].ratio_vs["slow"] == pytest.approx(by["slow"].median_ms / by["fast"].median_ms)


def test_sustained_timing_times_each_passing_contender_alone(monkeypatch):
    """Structure, not speed: a fake clock makes each call take a known time; each passing contender is timed
    alone (its samples back to back, never interleaved), about one sample per 100 ms bin over 0.2 s; the failing
    one is never timed."""
    v, q, k, vv, ref = _cpu_problem()
    clock = _fake_clock(monkeypatch)
    fast, slow = Contender("fast", clock.work(1.0, ref)), Contender("slow", clock.work(4.0, ref))
    wrong = Contender("wrong", clock.work(0.5, ref * 2))
    check = lambda c: compare("softcap", c.name, c.fn(), ref, torch.float16)  # noqa: E731
    order = []
    from fivar.bench import timing
    real = timing.time_sustained
    monkeypatch.setattr(timing, "time_sustained", lambda fns, s, **kw: real(
        fns, s, **kw, on_sample=lambda name, prev, t0, t1, ms: order.append(name)))
    import fivar.bench.harness as harness
    monkeypatch.setattr(harness, "time_sustained", timing.time_sustained)
    rows = evaluate([fast, slow, wrong], check, flops=1.0, nbytes=1.0, seqlen=48, rounds=99, device="cpu",
                    ceilings=None, sustained_s=0.2)
    by = {r.contender: r for r in rows}
    assert by["wrong"].status == "failed" and not by["wrong"].samples_ms and "wrong" not in order
    for name in ("fast", "slow"):  # one sample per 100 ms bin over 0.2 s, not 99 rounds
        assert 2 <= len(by[name].samples_ms) <= 3, by[name].samples_ms
    assert sorted(set(order)) == ["fast", "slow"] and len([i for i in range(1, len(order)) if order[i] != order[i - 1]]) == 1
    assert by["fast"].median_ms == pytest.approx(1.0) and by["slow"].median_ms == pytest.approx(4.0)
    assert by["fast"].ratio_vs["slow"] == pytest.approx(4.0)


def _report(rows):
    from dataclasses import asdict
    return {"schema": "fivar.bench/1", "variant": "softcap", "op": "prefill", "gpu": "cpu", "versions": {},
            "config": {}, "ceilings": {"bf16_matmul_tflops": 100.0, "copy_tb_per_s": 1.0},
            "results": [asdict(r) for r in rows]}


def test_report_schema_and_plot(tmp_path):
    v, q, k, vv, ref = _cpu_problem()
    check = lambda c: compare("softcap", c.name, c.fn(), ref, torch.float16)  # noqa: E731
    rows = []
    for S in (48, 96):
        rows += evaluate([Contender("a", lambda: ref.clone()), Contender("b", lambda: ref * 2)], check,
                         flops=S * 1e4, nbytes=S * 1e3, seqlen=S, rounds=2, device="cpu",
                         ceilings={"bf16_matmul_tflops": 100.0, "copy_tb_per_s": 1.0})
    report = json.loads(json.dumps(_report(rows), default=str))
    validate(report)
    with pytest.raises(ValueError):
        validate({**report, "schema": "other"})
    tampered = json.loads(json.dumps(report))
    tampered["results"][1]["samples_ms"] = [1.0]  # "b" failed: it must not carry timings
    with pytest.raises(ValueError, match="must not have been timed"):
        validate(tampered)
    from fivar.bench.plot import plot
    out = tmp_path / "bench.png"
    plot(report, str(out))
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_without_gpu_is_a_clear_error():
    from click.testing import CliRunner

    from fivar.cli import main
    if torch.cuda.is_available():
        pytest.skip("GPU present")
    r = CliRunner().invoke(main, ["bench", "softcap", "--vs", "stock"])
    assert r.exit_code == 1 and "needs a CUDA GPU" in r.output


def test_bench_cli_checks_params_before_it_needs_a_gpu():
    from click.testing import CliRunner

    from fivar.cli import main
    r = CliRunner().invoke(main, ["bench", "sliding_window", "--param", "window=1024", "--param", "size=3"])
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and "variant 'sliding_window': --param 'size=3': 'size' is not a param" in flat, r.output
    r = CliRunner().invoke(main, ["bench", "llama_add_rmsnorm", "--param", "eps=1e-5"])
    assert r.exit_code == 1 and "'llama_add_rmsnorm' is a fusion; fivar bench times attention variants" in " ".join(
        r.output.split()), r.output
    r = CliRunner().invoke(main, ["bench", "softcap", "--compile", "--param", "softcap=3"])
    assert r.exit_code == 1 and "--param shape a timed run only" in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(main, ["bench", "softcap", "--sustained", "3", "--rounds", "5"])
    assert r.exit_code == 1 and "--sustained times each contender once, for SECONDS; --rounds" in " ".join(
        r.output.split()), r.output
    r = CliRunner().invoke(main, ["bench", "softcap", "--sustained", "0"])
    assert r.exit_code == 2 and "--sustained" in r.output, r.output
    r = CliRunner().invoke(main, ["bench", "softcap", "--compile", "--sustained", "2"])
    assert r.exit_code == 1 and "--sustained shape a timed run only" in " ".join(r.output.split()), r.output
