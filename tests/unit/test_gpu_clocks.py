"""fivar.bench.gpu_clocks against a stand-in nvidia-smi that prints known clocks, and time_interleaved's per-sample
hook on the CPU."""
import os
import random
import stat
import time

import pytest

from fivar.bench.gpu_clocks import ClockTrace
from fivar.bench.timing import time_interleaved

FAKE_SMI = r'''#!/usr/bin/env python3
import datetime, sys, time
args = " ".join(sys.argv[1:])
import os
if "clocks_event_reasons" in args and "REFUSE_NEW" in os.environ:
    print("Field \"clocks_event_reasons.active\" is not a valid field to query."); sys.exit(2)
gpu = sys.argv[sys.argv.index("-i") + 1]
if gpu not in os.environ.get("FAKE_SMI_IDS", gpu).split(","):
    print(f"No devices were found matching {{gpu}}"); sys.exit(6)
loop = any(a.startswith("-lms") for a in sys.argv)
mhz = [int(x) for x in "{mhz}".split(",")]
i = 0
while True:
    stamp = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{{stamp}}, {{mhz[i % len(mhz)]}}, {{600 + i % 7}}.5, 61, 0x0000000000000004", flush=True)
    if i % 5 == 4:
        print("garbage, [N/A], line", flush=True)
    i += 1
    if not loop:
        break
    time.sleep(0.01)
'''


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    mhz = [random.choice((1755, 1830, 1980)) for _ in range(3)]
    exe = tmp_path / "nvidia-smi"
    exe.write_text(FAKE_SMI.format(mhz=",".join(map(str, mhz))))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return mhz


def _wait_for(condition, limit_s: float = 60.0):
    """Poll until `condition()` holds (the fake nvidia-smi answers at its own pace), at most `limit_s` seconds."""
    end = time.time() + limit_s
    while not condition() and time.time() < end:
        time.sleep(0.02)


@pytest.mark.parametrize("old_driver", [False, True])
def test_trace_reads_the_clock_of_a_window(fake_smi, monkeypatch, old_driver):
    if old_driver:  # a driver that knows only clocks_throttle_reasons
        monkeypatch.setenv("REFUSE_NEW", "1")
    with ClockTrace(interval_ms=10) as trace:
        t0 = time.time()
        _wait_for(lambda: trace.during(t0, time.time())["n"] >= 5)  # samples, not seconds: a loaded box is slow
        t1 = time.time()
    assert trace.error is None
    got = trace.during(t0, t1)
    assert got["n"] >= 5
    assert min(fake_smi) <= got["mhz"] <= max(fake_smi)
    assert 600 <= got["watts"] <= 607 and got["celsius"] == 61
    assert got["reasons"] == ["0x0000000000000004"]
    assert trace.during(t1 + 60, t1 + 61) == {"n": 0}


def test_trace_takes_the_first_id_nvidia_smi_answers_for(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_IDS", "0")
    with ClockTrace(interval_ms=10, gpus=("GPU-1234", "0")) as trace:
        _wait_for(lambda: trace.samples)
    assert trace.gpu == "0" and trace.error is None and trace.samples
    monkeypatch.setenv("FAKE_SMI_IDS", "7")
    with ClockTrace(interval_ms=10, gpus=("GPU-1234", "0")) as trace:
        pass
    assert trace.gpu is None and not trace.samples
    assert "-i GPU-1234: No devices were found matching GPU-1234" in trace.error and "-i 0:" in trace.error


def test_trace_without_nvidia_smi_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with ClockTrace() as trace:
        pass
    assert trace.error == "nvidia-smi not found" and trace.during(0, time.time()) == {"n": 0}


def test_time_interleaved_reports_every_sample_with_its_predecessor():
    names = [f"c{i}" for i in range(random.randint(2, 4))]
    seen = []
    out = time_interleaved({n: (lambda: sum(range(100))) for n in names}, rounds=3, warmup_ms=1, rep_ms=2,
                           device="cpu", on_sample=lambda *a: seen.append(a))
    assert len(seen) == 3 * len(names)
    assert seen[0][1] is None and all(seen[i][1] == seen[i - 1][0] for i in range(1, len(seen)))
    assert all(t0 <= t1 for _, _, t0, t1, _ in seen)
    for n in names:
        assert [ms for name, _, _, _, ms in seen if name == n] == out[n].samples_ms


def test_clock_report_ratios(tmp_path):
    import importlib.util
    import json
    spec = importlib.util.spec_from_file_location("clock_report", "benchmarks/tools/clock_report.py")
    clock_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(clock_report)
    fa3_ms, flex_ms = random.uniform(5, 9), random.uniform(15, 25)
    fa3_mhz, flex_mhz = random.uniform(1400, 1700), random.uniform(1750, 1980)
    sample = lambda ms, mhz, after: dict(ms=ms, after=after, n=3, mhz=mhz, watts=690.0, celsius=60,  # noqa: E731
                                         reasons=["0x0000000000000004"])
    row = dict(variant="softcap", S=16384, causal=False, ms={"fivar_fa3": fa3_ms, "flex": flex_ms}, samples={
        "fivar_fa3": [sample(fa3_ms * 0.97, fa3_mhz, "flex"), sample(fa3_ms, fa3_mhz, "fivar_fa3"),
                      sample(fa3_ms * 1.02, fa3_mhz, None)],
        "flex": [sample(flex_ms, flex_mhz, "fivar_fa3")]})
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"variants_vs_flex": [row]}))
    line = next(x for x in clock_report.report(str(path)).splitlines() if x.strip().startswith("fivar_fa3"))
    cols = line.split()
    assert float(cols[1]) == pytest.approx(fa3_ms, abs=1e-3) and float(cols[2]) == pytest.approx(fa3_mhz, abs=0.5)
    assert float(cols[4]) == pytest.approx(fa3_ms * 0.97, abs=1e-3)  # after flex
    assert float(cols[5]) == pytest.approx(fa3_ms * 1.01, abs=1e-3)  # median of the others
    assert float(cols[6]) == pytest.approx(flex_ms / fa3_ms, abs=5e-3)
    assert float(cols[7]) == pytest.approx(flex_ms / fa3_ms * flex_mhz / fa3_mhz, abs=5e-3)


def test_time_sustained_times_each_contender_alone_for_its_span():
    from fivar.bench.timing import time_sustained
    sleeps = {f"c{i}": random.uniform(0.002, 0.006) for i in range(3)}
    seen = []
    out = time_sustained({n: (lambda s=s: time.sleep(s)) for n, s in sleeps.items()}, seconds=0.3, settle_s=0.05,
                         bin_ms=30, device="cpu", on_sample=lambda *a: seen.append(a))
    names = [a[0] for a in seen]
    blocks = [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]
    assert blocks == list(dict.fromkeys(names))  # each contender in one block
    assert set(names) == set(sleeps)
    for n, s in sleeps.items():
        spans = [(t0, t1) for name, _, t0, t1, _ in seen if name == n]
        assert spans[-1][1] - spans[0][0] >= 0.3 - 0.05
        assert out[n].median == pytest.approx(s * 1e3, rel=0.5, abs=3.0)
        assert len(out[n].samples_ms) == len(spans) >= 3
