"""What builds say while they run, and each module's own compile seconds from ninja's log (fivar.jit.progress).

No nvcc: a fake ninja (a script that writes ninja's log and status lines, and waits on the test between steps)
drives the batch; the real ninja, with `touch` for a compiler, checks the order it runs a batch's edges in."""
import functools
import io
import json
import random
import shutil
import stat
import sys
import types

import pytest

import fivar
from fivar.jit import build as jb
from fivar.jit import progress, records
from fivar.jit.build import gen_module


@pytest.fixture
def iso(tmp_path, monkeypatch):
    """FlashInfer's JIT folders and fivar's records in tmp_path."""
    from flashinfer.jit import env as jit_env
    ws = tmp_path / "ws"
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", ws / "cached_ops")
    monkeypatch.setattr(jit_env, "FLASHINFER_GEN_SRC_DIR", ws / "generated")
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path / "fivar"))
    jb._loaded.clear()
    return ws


def _entry(start_ms, end_ms, path, mtime=1):
    return f"{start_ms}\t{end_ms}\t{mtime}\t{path}\t0123456789abcdef"


def test_module_times_sum_each_modules_own_edges_of_this_run(tmp_path):
    """A module's seconds are the sum of its own units and link in this run, whenever in the run they happened; an
    entry already in the log before the run (an earlier build) is not this run's, and other folders' are not its."""
    rng = random.Random()
    a, b, other = tmp_path / "mod_a", tmp_path / "mod_b", tmp_path / "other"
    old = _entry(0, 99000, a / "mod_a_k0.cuda.o", mtime=5)  # rebuilt below: the later entry counts
    before = progress.parse_ninja_log("# ninja log v7\n" + old + "\n" + _entry(0, 7000, b / "mod_b_k.cuda.o"))
    late = rng.randrange(600_000, 900_000)  # far into the run: a span from the run's start would be ~15 minutes
    a_units = [rng.randrange(1000, 90_000) for _ in range(3)]
    lines = ["# ninja log v7", old, _entry(0, 7000, b / "mod_b_k.cuda.o")]  # b's unit: not rebuilt this run
    lines += [_entry(late + i, late + i + d, a / f"mod_a_k{i}.cuda.o", mtime=9) for i, d in enumerate(a_units)]
    lines += [_entry(late + 95_000, late + 96_250, a / "mod_a.so", mtime=9),
              _entry(1, 50_000, other / "x.cuda.o"), "garbage line", "1\t2\tx\ty"]
    times = progress.module_times(progress.parse_ninja_log("\n".join(lines)), {"mod_a": a, "mod_b": b,
                                                                              "mod_c": tmp_path / "mod_c"}, before)
    assert set(times) == {"mod_a"}
    t = times["mod_a"]
    assert t.linked and t.units == 3
    assert t.seconds == pytest.approx(sum(a_units) / 1000 + 1.25)
    # without the log as it was before the run, the earlier entry of an output built again is not counted twice
    assert progress.module_times(progress.parse_ninja_log("\n".join(lines)), {"mod_a": a})["mod_a"].units == 3
    assert progress.module_times({}, {"mod_a": a}) == {}


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja not installed")
@pytest.mark.parametrize("ordered", [True, False])
def test_a_batch_links_each_module_before_the_next_modules_units(tmp_path, ordered):
    """ninja starts the ready edge with the longest chain after it first, so without fivar's order edges every
    link waits for the last unit of the whole batch (no module is usable, or reported, until the end); with them
    each module is linked right after its own units (one job: ninja's order is then fully determined)."""
    rng = random.Random()
    mods = [f"m{i}" for i in range(rng.randrange(3, 6))]
    files, libs = [], []
    for name in mods:
        d = tmp_path / name
        d.mkdir()
        units = [d / f"u{k}.o" for k in range(rng.randrange(1, 4))]
        text = ["rule cc", "  command = touch $out", "rule link", "  command = touch $out"]
        text += [f"build {u}: cc" for u in units] + [f"build {d / (name + '.so')}: link {' '.join(map(str, units))}",
                                                     f"default {d / (name + '.so')}", ""]
        (d / "build.ninja").write_text("\n".join(text))
        files.append(d / "build.ninja")
        libs.append(d / f"{name}.so")
    statuses = []
    progress.run_ninja_batch(files, libs if ordered else [], tmp_path, tmp_path / "batch.ninja", jobs=1,
                             on_status=lambda f, t, r: statuses.append((f, t)))
    order = [line.split("\t")[3] for line in (tmp_path / ".ninja_log").read_text().splitlines()[1:]]
    order = [p for p in order if not p.startswith(".fivar_order_")]
    mod_of = {p: p.split("/")[-2] for p in order}
    linked_before_next = all(order.index(str(lib)) < min(order.index(p) for p in order if mod_of[p] == mods[i + 1])
                             for i, lib in enumerate(libs[:-1]))
    assert linked_before_next == ordered
    assert all(lib.exists() for lib in libs)
    assert statuses and statuses[-1][0] == statuses[-1][1]  # ninja's own count of edges, read as they finish


def test_a_failed_batch_raises_with_ninjas_output(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "build.ninja").write_text("rule bad\n  command = echo nope-from-the-compiler && false\n"
                                                f"build {tmp_path}/m/m.so: bad\n")
    if shutil.which("ninja") is None:
        pytest.skip("ninja not installed")
    with pytest.raises(RuntimeError, match="(?s)Ninja build failed.*nope-from-the-compiler"):
        progress.run_ninja_batch([tmp_path / "m" / "build.ninja"], [tmp_path / "m" / "m.so"], tmp_path,
                                 tmp_path / "batch.ninja")


FAKE_NINJA = r'''#!{python}
"""A stand-in for ninja: runs PLAN's steps, writing ninja's log in -C's folder and a status line per edge."""
import json, os, sys, time
PLAN = json.loads({plan!r})
work = sys.argv[sys.argv.index("-C") + 1]
log = os.path.join(work, ".ninja_log")
if not os.path.exists(log):
    open(log, "w").write("# ninja log v7\n")
total = sum(len(s["edges"]) for s in PLAN if "edges" in s)
done = 0
for step in PLAN:
    if "wait_for" in step:  # the test creates the file once it has seen the line it waits for
        deadline = time.time() + 60
        while not os.path.exists(step["wait_for"]):
            if time.time() > deadline:
                print("fake ninja: gave up waiting for", step["wait_for"], flush=True)
                sys.exit(3)
            time.sleep(0.01)
        continue
    for start, end, path in step["edges"]:
        if path.endswith(".so"):
            open(path, "wb").write(os.urandom(64))
        with open(log, "a") as f:
            f.write(f"{{start}}\t{{end}}\t{{time.time_ns()}}\t{{path}}\t0123456789abcdef\n")
        done += 1
        print(f"[fivar {{done}}/{{total}} {{step['running']}}] compiling {{os.path.basename(path)}}", flush=True)
'''


def _fake_ninja(tmp_path, plan):
    path = tmp_path / "fake_ninja"
    path.write_text(FAKE_NINJA.format(python=sys.executable, plan=json.dumps(plan)))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_batch_reports_each_module_as_it_is_linked_with_its_own_seconds_and_a_heartbeat(iso, tmp_path,
                                                                                         monkeypatch):
    """A line per module as ninja's log shows it linked, while the batch still runs (the fake ninja goes on only
    once the test has seen it), with the seconds its own edges took (not the time since the batch began: the
    second module's edges end 15 minutes into ninja's run); a heartbeat while nothing finishes; the manifests and
    the build records keep the same seconds."""
    rng = random.Random()
    a, b = (gen_module(fivar.load(n), op="single_prefill", target="fa2") for n in ("softcap", "alibi"))
    for m in (a, b):
        m.jit_spec()
    units = {m.uri: [str(m.build_dir / f"{m.uri}_{p.stem}.cuda.o") for p in m.jit_spec().sources] for m in (a, b)}
    t_a = [rng.randrange(2000, 60_000) for _ in units[a.uri]] + [rng.randrange(100, 3000)]
    late = 900_000
    t_b = [rng.randrange(2000, 60_000) for _ in units[b.uri]] + [rng.randrange(100, 3000)]
    go_a, go_beat = tmp_path / "go_a", tmp_path / "go_beat"
    plan = [{"running": 2, "edges": [[0, d, p] for d, p in zip(t_a, units[a.uri] + [str(a.library_path)])]},
            {"wait_for": str(go_a)}, {"wait_for": str(go_beat)},
            {"running": 1, "edges": [[late - d, late, p] for d, p in zip(t_b, units[b.uri] + [str(b.library_path)])]}]
    monkeypatch.setattr(jb, "_ninja_batch", functools.partial(jb._ninja_batch, ninja=_fake_ninja(tmp_path, plan)))
    lines = []

    def write(line):
        lines.append(line)
        if line.startswith(f"built {a.uri}"):
            go_a.touch()
        if line.startswith("... 1/2 modules done"):
            go_beat.touch()
    reporter = progress.BatchProgress([a, b], write, heartbeat_s=0.05)
    results = jb.build_many([a, b], progress=reporter)

    assert [k for k, _ in results] == ["cold", "cold"]
    own_a, own_b = sum(t_a) / 1000, sum(t_b) / 1000
    assert results[0][1] == pytest.approx(own_a) and results[1][1] == pytest.approx(own_b)
    built = [ln for ln in lines if not ln.startswith("... ")]  # heartbeats may also come before the first edge
    assert len(built) == 2 and built[0].startswith(f"built {a.uri}, {own_a:.1f} s of compile (1/2, ")
    assert built[1].startswith(f"built {b.uri}, {own_b:.1f} s of compile (2/2, ")
    beat = next(i for i, ln in enumerate(lines) if ln.startswith("... 1/2"))
    assert lines.index(built[0]) < beat < lines.index(built[1])
    assert lines[beat].startswith(f"... 1/2 modules done, {len(units[a.uri])}/{len(units[a.uri]) + len(units[b.uri])} "
                                  "units done, 2 compiling, ")
    for m, own in ((a, own_a), (b, own_b)):
        assert m.manifest_ok() and m.read_manifest()[0]["compile_seconds"] == pytest.approx(own, abs=1e-3)
    con = records.connect()
    try:
        usage = records.usage(con)
    finally:
        con.close()
    assert usage[a.uri]["compile_seconds"] == pytest.approx(own_a) and usage[b.uri]["compile_seconds"] == \
        pytest.approx(own_b)
    assert reporter.summary().startswith("2/2 module(s) ready, 2 compiled, in ")


def test_a_module_built_on_its_own_says_what_why_and_how_long_before_and_after(iso, monkeypatch, capsys):
    """First use of a module inside a call: a line on stderr before ninja starts (the module, why, and the median of
    recorded builds of the same op and target), one when it is done; its own seconds from its ninja log."""
    rng = random.Random()
    m = gen_module(fivar.load("softcap"), op="single_prefill", target="fa2")
    spec = m.jit_spec()
    unit_ms = [rng.randrange(1000, 40_000) for _ in spec.sources]
    link_ms = rng.randrange(100, 2000)
    seen_before_build = []

    def fake_build(*args, **kwargs):  # FlashInfer runs a lone module's ninja in its build folder
        seen_before_build.append(capsys.readouterr().err)
        m.build_dir.mkdir(parents=True, exist_ok=True)
        log = ["# ninja log v7"] + [_entry(0, d, m.build_dir / f"{m.uri}_{p.stem}.cuda.o") for d, p in
                                    zip(unit_ms, spec.sources)]
        (m.build_dir / ".ninja_log").write_text("\n".join(log + [_entry(50_000, 50_000 + link_ms, m.library_path)]))
        m.library_path.write_bytes(b"\x7fELF" + bytes(rng.randrange(256) for _ in range(64)))
    monkeypatch.setattr(type(spec), "build", lambda self, *a, **k: fake_build())

    # earlier builds of fa2 single prefill (another variant) and of other ops/targets, which must not count
    similar = [rng.uniform(5, 60) for _ in range(rng.choice([3, 5]))]
    other = gen_module(fivar.load("alibi"), op="single_prefill", target="fa2")
    decode = gen_module(fivar.load("alibi"), op="batch_decode", target="fa2")
    records.record_many([(other, "cold", s) for s in similar] + [(decode, "cold", 999.0), (other, "disk", 0.001)])

    assert m.build() == "cold"
    before = seen_before_build[0].strip().splitlines()
    median = sorted(similar)[len(similar) // 2]
    assert before == [f"fivar: compiling {m.uri} (variant 'softcap', first use of this module); expected about "
                      f"{median:.0f} s of compile (median of {len(similar)} recorded fa2 single_prefill build(s))"]
    own = (sum(unit_ms) + link_ms) / 1000
    after = capsys.readouterr().err.strip().splitlines()
    assert len(after) == 1 and after[0].startswith(f"fivar: compiled {m.uri} in ")
    assert after[0].endswith(f" s ({own:.1f} s of compile over its {len(spec.sources)} unit(s) and link)")
    assert m.read_manifest()[0]["compile_seconds"] == pytest.approx(own, abs=1e-3)
    assert records.compile_seconds_of("single_prefill", "fa2")[0] == pytest.approx(own)


def test_with_nothing_recorded_the_first_line_says_there_is_no_estimate(iso):
    m = gen_module(fivar.load("softcap"), op="batch_decode", target="fa2")
    assert progress.expected_text(m) == "no earlier fa2 batch_decode build recorded to estimate from"


def test_heartbeat_only_after_a_quiet_interval_and_never_with_a_live_bar():
    now = [100.0]
    lines = []
    mods = [types.SimpleNamespace(uri=f"u{i}") for i in range(3)]
    r = progress.BatchProgress(mods, lines.append, heartbeat_s=30, clock=lambda: now[0])
    r.batch_started(9)
    r.units(4, running=3)
    now[0] += 29
    r.tick()
    assert lines == []
    now[0] += 2
    r.tick()
    assert lines == ["... 0/3 modules done, 4/9 units done, 3 compiling, 31 s"]
    r.module_done(mods[1], "cold", 12.34)
    r.module_done(mods[1], "cold", 12.34)  # once per module
    r.module_done(types.SimpleNamespace(uri="up-to-date"), "disk", 0.0)  # not one of the modules to build
    assert lines[1:] == ["built u1, 12.3 s of compile (1/3, 31 s elapsed)"]
    now[0] += 29
    r.tick()
    assert len(lines) == 2  # the module line reset the quiet interval
    quiet = progress.BatchProgress(mods, lines.append, heartbeat_s=30, clock=lambda: now[0], heartbeat=False)
    now[0] += 100
    quiet.tick()
    assert len(lines) == 2


def test_build_progress_in_a_log_has_no_cursor_movement_and_ends_with_a_summary():
    """Not a terminal (CI, a cluster job's log): plain lines, one per module, then the summary."""
    from rich.console import Console

    from fivar.jit.prewarm import live_progress
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    mods = [types.SimpleNamespace(uri=f"fivar_m{i}", manifest_ok=lambda: False) for i in range(2)]
    with live_progress(mods, console, enabled=True) as reporter:
        for m in mods:
            reporter.module_done(m, "cold", 3.0)
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    got = text.strip().splitlines()
    assert got[0].startswith("built fivar_m0, 3.0 s of compile (1/2, ")
    assert got[1].startswith("built fivar_m1, 3.0 s of compile (2/2, ")
    assert got[2].startswith("2/2 module(s) ready, 2 compiled, in ") and "wall" in got[2]
    with live_progress([types.SimpleNamespace(uri="x", manifest_ok=lambda: True)], console) as reporter:
        assert reporter is None  # nothing to build: nothing to report


def test_order_edges_escape_paths_for_ninja():
    assert progress.order_edges([]) == []
    lines = progress.order_edges(["/a b/c:d$.so", "/x.so"])
    assert "build .fivar_order_0: fivar_order /a$ b/c$:d$$.so" in lines
    assert "build .fivar_order_2: fivar_order /x.so .fivar_order_1" in lines and lines[-1] == "default .fivar_order_3"

