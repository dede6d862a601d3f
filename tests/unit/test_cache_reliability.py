"""The JIT cache under stress: concurrent builders, killed builds, corrupted files, unwritable dirs.

One module is compiled for this whole file (8 processes race to build it; exactly one compiles); the other
tests damage it and check that fivar notices, logs, and repairs it with the least work (a relink or one
translation unit), never trusting a broken library.
"""
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fivar
from fivar.errors import FivarError
from fivar.jit import build as jb
from fivar.jit import locks, records
from fivar.jit.build import _sha256, gen_module

NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
requires_nvcc = pytest.mark.skipif(not os.path.exists(NVCC), reason="nvcc not installed: cannot compile CUDA here")

REPO = Path(__file__).resolve().parents[2]
N_PROCS = 8
TINY = '''"""A mask-only variant: one kernel instantiation (kCustom), the cheapest module to compile."""
from fivar import AttentionVariant


def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < 5


variant = AttentionVariant(name="reltiny", mask=mask)
'''
ARGS = dict(op="single_prefill", dtype="fp16", head_dim=64)

WORKER = r'''
import json, os, sys, time
import fivar
from fivar.jit.build import gen_module, _sha256
path, ready, go = sys.argv[1:4]
m = gen_module(fivar.load(path), op="single_prefill", dtype="fp16", head_dim=64)
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
kind = m.build()
print(json.dumps({"kind": kind, "uri": m.uri, "sha": _sha256(m.library_path), "pid": os.getpid()}))
'''


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "MAX_JOBS": "1"}


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("reltiny") / "reltiny.py"
    f.write_text(TINY)
    return f


def tiny_module(tiny_file):
    return gen_module(fivar.load(str(tiny_file)), **ARGS)


@pytest.fixture(scope="module")
def raced(tiny_file, tmp_path_factory):
    """8 processes build the same uncached module at the same instant (behind a file barrier)."""
    if not (os.path.exists(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"))):
        pytest.skip("nvcc not installed")
    m = tiny_module(tiny_file)
    assert not m.library_path.exists(), "the test run's JIT cache should be fresh"
    sync = tmp_path_factory.mktemp("barrier")
    go = sync / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tiny_file), str(sync / f"ready{i}"), str(go)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(N_PROCS)]
    deadline = time.time() + 240
    while sum((sync / f"ready{i}").exists() for i in range(N_PROCS)) < N_PROCS:
        assert time.time() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.05)
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return m, outs


def _events(uri, action="build"):
    con = records.connect()
    try:
        return dict(con.execute("SELECT kind, SUM(count) FROM events WHERE uri=? AND action=? GROUP BY kind",
                                (uri, action)))
    finally:
        con.close()


@requires_nvcc
@pytest.mark.nvcc
def test_eight_concurrent_builders_compile_exactly_once(raced):
    m, outs = raced
    kinds = sorted(o["kind"] for o in outs)
    assert kinds == ["cold"] + ["disk"] * (N_PROCS - 1), kinds
    assert {o["uri"] for o in outs} == {m.uri}
    # the records agree (written concurrently by 8 processes into one SQLite WAL database)
    assert _events(m.uri) == {"cold": 1, "disk": N_PROCS - 1}
    # no torn files: every process saw the same library, and it is the one the manifest vouches for
    man = json.loads(m.manifest_path.read_text())
    assert {o["sha"] for o in outs} == {man["so_sha256"]} == {_sha256(m.library_path)}
    assert m.manifest_ok()
    leftovers = [p for d in (m.gen_dir, m.build_dir) for p in d.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []
    for name, text in m.sources.items():
        assert (m.gen_dir / name).read_text() == text


def test_memory_hits_are_cheap_and_counted_without_touching_the_database(tiny_file):
    m = gen_module(fivar.load(str(tiny_file)), op="single_prefill", dtype="bf16", head_dim=64)
    sentinel = object()
    jb._loaded[m.uri] = sentinel  # as if loaded earlier in this process (no GPU needed)
    try:
        records.flush()
        con = records.connect()
        n_rows = con.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            assert m.load() is sentinel
        per_hit_us = (time.perf_counter() - t0) / n * 1e6
        assert m.build() == "memory"
        assert per_hit_us < 20, per_hit_us
        assert con.execute("SELECT COUNT(*) FROM events").fetchone()[0] == n_rows  # nothing written yet
        assert records.pending_memory_hits()[m.uri] == n + 1
        records.flush()
        row = con.execute("SELECT kind, count, action FROM events WHERE uri=? ORDER BY id DESC LIMIT 1",
                          (m.uri,)).fetchone()
        assert row == ("memory", n + 1, "load")
        assert m.uri not in records.pending_memory_hits()
        con.close()
    finally:
        jb._loaded.pop(m.uri, None)


KILLED_BUILD = r'''
import sys
import fivar
from fivar.jit.build import gen_module
m = gen_module(fivar.load(sys.argv[1]), op="single_prefill", dtype="fp16", head_dim=64)
m.build()
'''


def _wait_for(pred, timeout, what):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _build_processes(sid: int) -> dict[int, bytes]:
    """The live processes (pid -> command line) of the build started with setsid as `sid`: the builder, ninja, and
    the compilers ninja runs. Found by sid, not by process group: ninja gives each command a group of its own."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            state, _ppid, _pgrp, proc_sid = stat[stat.rindex(")") + 2:].split()[:4]
            if int(proc_sid) == sid and state != "Z":
                out[int(d.name)] = (d / "cmdline").read_bytes()
        except (OSError, ValueError):
            pass  # gone meanwhile
    return out


def _build_runs_nvcc(sid: int) -> bool:
    return any(t in cmd for cmd in _build_processes(sid).values() for t in (b"nvcc", b"cicc", b"ptxas"))


def _power_cut(sid: int) -> None:
    """SIGKILL every process of the build, again until none is left (a compiler may start another meanwhile)."""
    deadline = time.time() + 30
    while procs := _build_processes(sid):
        assert time.time() < deadline, f"the build's processes outlive SIGKILL: {procs}"
        for pid in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


@requires_nvcc
@pytest.mark.nvcc
def test_sigkill_midway_then_the_next_build_repairs_without_hanging(raced, tiny_file, caplog):
    m, _ = raced
    binding_obj = m.build_dir / f"{m.uri}_single_prefill_jit_binding.cuda.o"
    objs = sorted(m.build_dir.glob("*.cuda.o"))
    assert binding_obj in objs, objs
    # make the module need work: no library, no manifest, one object to recompile
    m.library_path.unlink()
    m.manifest_path.unlink()
    binding_obj.unlink()
    p = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(tiny_file)], env=_env(),
                         preexec_fn=os.setsid, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: _build_runs_nvcc(p.pid), 120, "nvcc to start in the doomed build")
        time.sleep(2)
    finally:
        _power_cut(p.pid)  # the builder, ninja and nvcc at once: a power cut for this build
    p.wait()
    assert not m.manifest_ok()
    # the dead builder held the build lock: it must be free now (flock dies with its process)
    t0 = time.perf_counter()
    with locks.build_lock(m.build_dir, wait=False) as free:
        assert free
    assert time.perf_counter() - t0 < 5
    m2 = tiny_module(tiny_file)
    with caplog.at_level(logging.WARNING, logger="fivar"):
        assert m2.build() == "cold"
    assert m2.manifest_ok()
    assert json.loads(m2.manifest_path.read_text())["so_sha256"] == _sha256(m2.library_path)
    assert _events(m.uri)["cold"] == 2


@requires_nvcc
@pytest.mark.nvcc
def test_truncated_library_is_detected_logged_and_relinked_only(raced, tiny_file, caplog):
    m, _ = raced
    m = tiny_module(tiny_file)
    assert m.build() in ("disk", "memory")
    size, sha = m.library_path.stat().st_size, _sha256(m.library_path)
    obj_mtimes = {p: p.stat().st_mtime_ns for p in m.build_dir.glob("*.o")}
    with open(m.library_path, "r+b") as f:
        f.truncate(size // 2)
    assert not m.manifest_ok()
    with caplog.at_level(logging.WARNING, logger="fivar"):
        assert m.build() == "cold"
    assert any("does not match its manifest" in r.getMessage() for r in caplog.records)
    assert m.library_path.stat().st_size == size and _sha256(m.library_path) == sha and m.manifest_ok()
    assert {p: p.stat().st_mtime_ns for p in m.build_dir.glob("*.o")} == obj_mtimes  # relinked, not recompiled


@requires_nvcc
@pytest.mark.nvcc
def test_manifest_hash_and_size_mismatches_are_caught(raced, tiny_file):
    from click.testing import CliRunner

    from fivar.cli import main
    m, _ = raced
    m = tiny_module(tiny_file)
    assert m.manifest_ok()
    man = json.loads(m.manifest_path.read_text())
    good = dict(man)
    # a hash mismatch: the load-time check (the library's hash, kept per file version) and verify both find it
    man["so_sha256"] = "0" * 64
    m.manifest_path.write_text(json.dumps(man))
    assert not m.manifest_ok()
    r = CliRunner().invoke(main, ["cache", "verify", "--json", m.uri])
    assert r.exit_code == 1
    bad = [x for x in json.loads(r.output) if x["uri"] == m.uri][0]
    assert any("sha256" in p for p in bad["problems"]) and not bad["fixed"]
    r = CliRunner().invoke(main, ["cache", "verify", "--fix", "--json", m.uri])
    assert r.exit_code == 0, r.output
    assert not m.library_path.exists() and not m.manifest_ok()
    assert m.build() == "cold" and m.manifest_ok()
    # a size mismatch fails the cheap check at once
    man = json.loads(m.manifest_path.read_text())
    man["so_size"] += 1
    m.manifest_path.write_text(json.dumps(man))
    assert not m.manifest_ok()
    assert m.build() == "cold"
    assert json.loads(m.manifest_path.read_text())["so_sha256"] == good["so_sha256"]
    r = CliRunner().invoke(main, ["cache", "verify", "--json", m.uri])  # other tests leave broken modules
    assert r.exit_code == 0, r.output


@requires_nvcc
@pytest.mark.nvcc
def test_deleted_generated_source_is_detected_regenerated_and_logged(raced, tiny_file, caplog):
    from click.testing import CliRunner

    from fivar.cli import main
    m, _ = raced
    m = tiny_module(tiny_file)
    src = m.gen_dir / "single_prefill_jit_binding.cu"
    src.unlink()
    assert m.build() == "disk"  # the library itself is intact: sources only matter for a rebuild
    r = CliRunner().invoke(main, ["cache", "verify", "--json", m.uri])
    mine = [x for x in json.loads(r.output) if x["uri"] == m.uri][0]
    assert any("single_prefill_jit_binding.cu" in p for p in mine["problems"]) and r.exit_code == 1
    m.library_path.unlink()  # now a rebuild is needed, and it needs that source
    with caplog.at_level(logging.WARNING, logger="fivar"):
        assert m.build() == "cold"
    assert any("single_prefill_jit_binding.cu was missing; regenerated" in r.getMessage() for r in caplog.records)
    assert src.read_text() == m.sources[src.name] and m.manifest_ok()


def test_unwritable_jit_cache_is_one_line_naming_dir_and_env_var(tiny_file, tmp_path, monkeypatch):
    from flashinfer.jit import env as jit_env
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache dir should be")
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", blocker / "cached_ops")
    monkeypatch.setattr(jit_env, "FLASHINFER_GEN_SRC_DIR", blocker / "generated")
    m = gen_module(fivar.load(str(tiny_file)), op="single_prefill", dtype="bf16", head_dim=128)
    with pytest.raises(FivarError) as info:
        m.build()
    msg = str(info.value)
    assert "\n" not in msg and str(blocker) in msg and "FLASHINFER_WORKSPACE_BASE" in msg


def test_full_jit_cache_is_one_line_naming_dir_and_env_var(tiny_file, monkeypatch):
    m = gen_module(fivar.load(str(tiny_file)), op="single_prefill", dtype="bf16", head_dim=256)
    spec = m.jit_spec()

    def full(*a, **k):
        raise RuntimeError("Ninja build failed. Ninja output:\n[1/3] nvcc ...\nfatal error: error writing "
                           "to /tmp/ccX.s: No space left on device\n")
    monkeypatch.setattr(spec, "build", full)
    with pytest.raises(FivarError) as info:
        m.build()
    msg = str(info.value)
    assert "\n" not in msg and "full" in msg and str(m.build_dir) in msg and "FLASHINFER_WORKSPACE_BASE" in msg
    assert "fivar bug" not in msg


def test_unwritable_fivar_cache_dir_never_breaks_a_build_but_cache_commands_say_so(tiny_file, tmp_path,
                                                                                  monkeypatch, caplog):
    from click.testing import CliRunner

    from fivar.cli import main
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(blocker / "fivar"))
    m = gen_module(fivar.load(str(tiny_file)), op="single_prefill", dtype="bf16", head_dim=64)
    monkeypatch.setattr(records, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="fivar"):
        records.record(m, "disk", 0.01)  # what build() calls after a hit: must not raise
    assert any("could not write build records" in r.getMessage() for r in caplog.records)
    with pytest.raises(FivarError) as info:
        records.db_path()
    msg = str(info.value)
    assert "\n" not in msg and str(blocker / "fivar") in msg and "FIVAR_CACHE_DIR" in msg
    r = CliRunner().invoke(main, ["cache", "stats"])
    flat = "".join(r.output.split())  # rich wraps long lines at 80 columns here
    assert r.exit_code == 1 and str(blocker / "fivar") in flat and "FIVAR_CACHE_DIR" in flat
