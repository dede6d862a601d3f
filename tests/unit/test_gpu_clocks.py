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
if "clocks_event_reasons" in args and "REFUSE_NEW" in __import__("os").environ:
    print("Field \"clocks_event_reasons.active\" is not a valid field to query."); sys.exit(2)
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


@pytest.mark.parametrize("old_driver", [False, True])
def test_trace_reads_the_clock_of_a_window(fake_smi, monkeypatch, old_driver):
    if old_driver:  # a driver that knows only clocks_throttle_reasons
        monkeypatch.setenv("REFUSE_NEW", "1")
    with ClockTrace(interval_ms=10) as trace:
        t0 = time.time()
        time.sleep(0.4)
        t1 = time.time()
    assert trace.error is None
    got = trace.during(t0, t1)
    assert got["n"] >= 5
    assert min(fake_smi) <= got["mhz"] <= max(fake_smi)
    assert 600 <= got["watts"] <= 607 and got["celsius"] == 61
    assert got["reasons"] == ["0x0000000000000004"]
    assert trace.during(t1 + 60, t1 + 61) == {"n": 0}


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
