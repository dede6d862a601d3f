"""The module lock protocol under races: prewarms, single builds, clear, prune, import and verify --fix at once.

Compiles are faked (`install_fake_compiler`): FlashInfer's ninja entry points are replaced by a stand-in that
links each module's library the way a linker does (written in place, in chunks) and appends the step to
ninja's log, as ninja does once a step ends. So the race logic (locks, manifests per module, what a concurrent
process deletes or rebuilds) runs in seconds on a CPU; one real nvcc race closes the file (marked nvcc).
Every compile is appended to a shared log, so "compiled exactly once" is counted, not inferred.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cache_cli import as_json, fake_built, invoke, iso, module  # noqa: F401 - the fixture

from fivar.jit import build as jb
from fivar.jit import locks, records

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SPECS = [("fp16", 64), ("bf16", 64), ("fp16", 128)]


def install_fake_compiler(delay: float = 0.3, compiles_log: str | None = None, gate: str | None = None,
                          after_link=None):
    """Replace FlashInfer's build_jit_specs and JitSpecNvcc.build, and fivar's batch runner, by a stand-in compiler;
    returns the function that restores them.

    Each module takes `delay` seconds, then its library is written in place in four chunks and ninja's log gets
    the link step. `gate`: a file whose existence the compiler waits for before the first module (a build
    held midway). `after_link(spec)`: called after each module's log line (a test's probe)."""
    import random

    import types

    from filelock import FileLock
    from flashinfer.jit import core
    from flashinfer.jit import env as jit_env

    from fivar.jit import progress
    compiles_log = compiles_log or os.environ.get("FAKE_COMPILES_LOG")
    gate = gate or os.environ.get("FAKE_GATE")

    def compile_one(spec):
        t_start = time.time()
        time.sleep(delay)
        out = jit_env.FLASHINFER_JIT_DIR / spec.name / f"{spec.name}.so"
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:  # a linker writes its output in place, not atomically
            for _ in range(4):
                f.write(random.randbytes(2048))
                f.flush()
                time.sleep(delay / 8)
        end = time.time()
        log = jit_env.FLASHINFER_JIT_DIR / ".ninja_log"
        line = f"{int(t_start * 1000)}\t{int(end * 1000)}\t{out.stat().st_mtime_ns}\t{out.resolve()}\tfake\n"
        with open(log, "a") as f:
            f.write(line)
        if compiles_log:
            with open(compiles_log, "a") as f:
                f.write(f"{spec.name} {os.getpid()}\n")
        if after_link is not None:
            after_link(spec)

    def wait_gate():
        while gate and not os.path.exists(gate):
            time.sleep(0.02)

    def build_jit_specs(specs, verbose=False, skip_prebuilt=True):
        tmp = jit_env.FLASHINFER_JIT_DIR / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        with FileLock(tmp / "flashinfer_jit.lock", thread_local=False):  # as FlashInfer's: one ninja at a time
            wait_gate()
            for spec in specs:
                compile_one(spec)

    def build(self, verbose=None, need_lock=False):
        wait_gate()
        compile_one(self)

    def run_ninja_batch(ninja_files, libraries, *args, **kwargs):  # fivar's own batch runner (build_many)
        wait_gate()
        for lib in libraries:
            compile_one(types.SimpleNamespace(name=Path(lib).stem))
    saved = core.build_jit_specs, core.JitSpecNvcc.build, progress.run_ninja_batch

    def restore():  # an in-process caller puts every entry point back, fivar's batch runner too
        core.build_jit_specs, core.JitSpecNvcc.build, progress.run_ninja_batch = saved
    core.build_jit_specs = build_jit_specs
    core.JitSpecNvcc.build = build
    progress.run_ninja_batch = run_ninja_batch
    return restore


def load_with_fake_compiler(m):
    """m.load() with compiles faked, then everything the load held or kept let go (hold, loaded-module memo)."""
    restore = install_fake_compiler(delay=0.01)
    try:
        m.load()
    finally:
        restore()
        locks.release_hold(m.build_dir)
        jb._loaded.pop(m.uri, None)


WORKER = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import test_cache_races as t
t.install_fake_compiler(delay=float(os.environ.get("FAKE_DELAY", "0.3")))
import fivar
from fivar.jit.build import build_many, gen_module
mode, vfile, ready, go, specs = sys.argv[2:7]
mods = [gen_module(fivar.load(vfile), "single_prefill", "fa2", dt, hd) for dt, hd in json.loads(specs)]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
if mode == "prewarm":
    res = build_many(mods, parallel=True)
else:
    res = [(m.build(), 0.0) for m in mods]
print("RESULT " + json.dumps({m.uri: kind for m, (kind, _) in zip(mods, res)}), flush=True)
'''


def _env(tmp_path, **extra):
    root = tmp_path / "ws"
    return {**os.environ, "PYTHONPATH": str(REPO), "FLASHINFER_WORKSPACE_BASE": str(root),
            "FIVAR_CACHE_DIR": str(tmp_path / "fivar"), "FAKE_COMPILES_LOG": str(tmp_path / "compiles.log"),
            "FIVAR_VARIANT_PATH": str(tmp_path / "variants"), **extra}


def _start(tmp_path, mode, specs, tag, env):
    return subprocess.Popen([sys.executable, "-c", WORKER, str(HERE), mode, str(tmp_path / "variants" / "cachev.py"),
                             str(tmp_path / f"ready-{tag}"), str(tmp_path / "go"), json.dumps(specs)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _barrier(tmp_path, procs, tags):
    deadline = time.time() + 300
    while not all((tmp_path / f"ready-{t}").exists() for t in tags):
        assert time.time() < deadline, "workers never got ready"
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, [p.communicate() for p in dead]
        time.sleep(0.05)
    (tmp_path / "go").touch()


def _finish(procs, rebuilds_expected=False):
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err and (rebuilds_expected or "rebuilding" not in err), err[-3000:]
        outs.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]))
    return outs


def _compiles(tmp_path) -> list[str]:
    log = tmp_path / "compiles.log"
    return [ln.split()[0] for ln in log.read_text().splitlines()] if log.exists() else []


def _mods(vfile):
    return [module(vfile, dt, hd) for dt, hd in SPECS]


def test_concurrent_prewarms_and_builds_compile_each_module_once_and_keep_its_compile_time(iso, tmp_path):
    """Three prewarms of the same modules (in different orders) and two single builds (the first module prewarm p0
    takes, and one it takes later), released at one instant: every module is compiled exactly once, no process
    deletes another's fresh library, every manifest is valid, and the compile time recorded is the compile's, not a
    later hit's."""
    _, ws, vfile = iso
    env = _env(tmp_path, FAKE_DELAY="0.4")
    orders = [SPECS, SPECS[::-1], SPECS[1:] + SPECS[:1]]
    procs = [_start(tmp_path, "prewarm", o, f"p{i}", env) for i, o in enumerate(orders)]
    procs += [_start(tmp_path, "build", [SPECS[i]], f"b{i}", env) for i in range(2)]
    _barrier(tmp_path, procs, ["p0", "p1", "p2", "b0", "b1"])
    outs = _finish(procs)
    mods = _mods(vfile)
    compiled = _compiles(tmp_path)
    assert sorted(compiled) == sorted(m.uri for m in mods), compiled  # each once, none twice
    for m in mods:
        assert m.manifest_ok(), m.uri  # none lost
        assert sum(o.get(m.uri) == "cold" for o in outs) == 1  # exactly one process says it compiled it
        man = json.loads(m.manifest_path.read_text())
        assert man["compile_seconds"] >= 0.4, man  # the compile's time, not a hit's
    con = records.connect()
    try:
        cold = dict(con.execute("SELECT uri, COUNT(*) FROM events WHERE kind='cold' GROUP BY uri").fetchall())
        secs = dict(con.execute("SELECT uri, MIN(seconds) FROM events WHERE kind='cold' GROUP BY uri").fetchall())
    finally:
        con.close()
    assert cold == {m.uri: 1 for m in mods} and all(s >= 0.4 for s in secs.values()), (cold, secs)
    rows = {r["uri"]: r for r in as_json("cache", "ls", "--no-stale-check")}
    assert all(rows[m.uri]["compile_seconds"] >= 0.4 for m in mods)


def test_a_prewarm_writes_each_manifest_as_soon_as_its_module_is_linked(iso):
    """The second module links only once the first one's manifest is valid: a prewarm that wrote manifests at
    the end of the ninja run would leave the first module without one for the whole run."""
    _, ws, vfile = iso
    mods = _mods(vfile)
    seen = []

    def after_link(spec):
        m = next(x for x in mods if x.uri == spec.name)
        deadline = time.time() + 10
        while not m.manifest_ok() and time.time() < deadline:
            time.sleep(0.02)
        seen.append((spec.name, m.manifest_ok()))
    restore = install_fake_compiler(delay=0.05, after_link=after_link)
    try:
        done = []
        res = jb.build_many(mods, parallel=True, on_done=lambda m, k, s: done.append(m.uri))
    finally:
        restore()
    assert [k for k, _ in res] == ["cold"] * len(mods)
    assert seen == [(m.uri, True) for m in mods], seen
    assert done == [m.uri for m in mods]  # reported one by one, in link order


def test_clear_prune_verify_and_import_during_a_prewarm_leave_its_modules_alone(iso, tmp_path):
    """While a prewarm holds its modules' locks (midway through its ninja run), clear, prune, verify --fix and
    import skip those modules and say so; the prewarm then finishes with every module valid."""
    _, ws, vfile = iso
    # an export of one of the modules, to import while it is being built
    m0 = fake_built(module(vfile, *SPECS[0]))
    archive = tmp_path / "one.tar.gz"
    as_json("cache", "keygen")  # signed and trusted: the import would take the library
    as_json("cache", "export", str(archive))
    as_json("cache", "clear", "--yes")
    assert not m0.build_dir.exists()
    env = _env(tmp_path, FAKE_DELAY="0.2", FAKE_GATE=str(tmp_path / "gate"))
    p = _start(tmp_path, "prewarm", SPECS, "p", env)
    _barrier(tmp_path, [p], ["p"])
    mods = _mods(vfile)
    deadline = time.time() + 120
    while not all(locks.build_lock_held(m.build_dir) for m in mods):
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    try:
        res = as_json("cache", "prune", "--stale")  # no manifest yet, lock held: being built, not stale
        assert res["evicted"] == [] and all(locks.build_lock_held(m.build_dir) for m in mods), res
        for args in (["clear", "--yes"], ["prune", "--older-than", "0s"]):
            res = as_json("cache", *args)
            kept = res.get("kept", res.get("skipped"))
            assert sorted(r["uri"] for r in kept) == sorted(m.uri for m in mods), (args, res)
            assert all("build lock is held" in r["skipped"] for r in kept), res
        r = invoke("cache", "verify", "--fix", "--json")
        assert all(x.get("building") and not x["fixed"] for x in json.loads(r.output)), r.output
        res = as_json("cache", "import", str(archive))
        assert res["imported"] == [] and res["skipped"][0]["uri"] == m0.uri, res
        assert "build lock is held" in res["skipped"][0]["skipped"]
    finally:
        (tmp_path / "gate").touch()
    _finish([p])
    assert all(m.manifest_ok() for m in mods)
    assert sorted(_compiles(tmp_path)) == sorted(m.uri for m in mods)
    # now free: clear takes them all
    assert sorted(r["uri"] for r in as_json("cache", "clear", "--yes")["removed"]) == sorted(m.uri for m in mods)


def test_a_prewarm_killed_midway_loses_nothing_it_finished_and_the_next_build_completes_it(iso, tmp_path):
    """SIGKILL after the first module is linked: that module keeps a valid manifest (written as it finished);
    the rest rebuild on the next prewarm, and nothing is served half-written."""
    _, ws, vfile = iso
    mods = _mods(vfile)
    env = _env(tmp_path, FAKE_DELAY="1.0")
    p = _start(tmp_path, "prewarm", SPECS, "k", env)
    _barrier(tmp_path, [p], ["k"])
    deadline = time.time() + 120
    while not mods[0].manifest_ok():
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert mods[0].manifest_ok() and not any(m.manifest_ok() for m in mods[1:])
    q = _start(tmp_path, "prewarm", SPECS, "k2", {**env, "FAKE_DELAY": "0.1"})
    (tmp_path / "go").unlink()
    _barrier(tmp_path, [q], ["k2"])
    out = _finish([q], rebuilds_expected=True)[0]  # the half-linked library is dropped, with a warning
    assert out[mods[0].uri] == "disk" and all(out[m.uri] == "cold" for m in mods[1:])
    assert all(m.manifest_ok() for m in mods)


def test_prune_sees_a_holder_that_recorded_in_another_fivar_cache_dir(iso, tmp_path):
    """A process that loaded a module under another FIVAR_CACHE_DIR (so no record here) holds it: prune keeps it
    until that process exits."""
    _, ws, vfile = iso
    m = fake_built(module(vfile), age_s=86400 * 3)
    code = ("import sys, time, tvm_ffi, fivar\ntvm_ffi.load_module = lambda path: object()\n"
            "from fivar.jit.build import gen_module\n"
            "m = gen_module(fivar.load(sys.argv[1]), 'single_prefill', 'fa2', 'bf16', 128)\n"
            "m.load(); print('loaded', flush=True); time.sleep(120)\n")
    env = _env(tmp_path, FIVAR_CACHE_DIR=str(tmp_path / "other-fivar-cache"))
    holder = subprocess.Popen([sys.executable, "-c", code, str(vfile)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "loaded", holder.stderr.read()[-2000:]
        res = as_json("cache", "prune", "--older-than", "1d")
        assert res["evicted"] == [] and "held by live process" in res["skipped"][0]["skipped"], res
        assert "kept" in invoke("cache", "clear", "--yes").output or m.manifest_ok()
        assert m.manifest_ok()
    finally:
        holder.kill()
        holder.wait()
    res = as_json("cache", "prune", "--older-than", "1d")
    assert [r["uri"] for r in res["evicted"]] == [m.uri] and not m.build_dir.exists()


def test_a_load_after_an_eviction_rebuilds_instead_of_failing(iso, monkeypatch):
    """The hold is taken before the last check: a module evicted between a disk hit and the load is built
    again (here: faked), not dlopened from a deleted path."""
    _, ws, vfile = iso
    m = fake_built(module(vfile))
    loaded = []
    import tvm_ffi
    monkeypatch.setattr(tvm_ffi, "load_module", lambda path: loaded.append(Path(path).read_bytes()) or object())
    real_hold = locks.hold

    def hold_after_eviction(build_dir):  # clear runs between the disk hit and the hold
        if not loaded and m.manifest_ok():
            assert invoke("cache", "clear", "--yes").exit_code == 0
        return real_hold(build_dir)
    monkeypatch.setattr(locks, "hold", hold_after_eviction)
    load_with_fake_compiler(m)
    assert m.manifest_ok() and len(loaded) == 1 and loaded[0] == m.library_path.read_bytes()


FUSION = ('from fivar import FusionVariant\n\nvariant = FusionVariant(name="cachefuse", norm="rmsnorm", '
          'norm_scope="row", dtype="fp16")\n')


@pytest.mark.nvcc
def test_two_real_prewarms_race_on_the_smallest_modules(tmp_path):
    """Two `fivar build --prewarm` processes with nvcc, same workspace, released together: each module is
    compiled once, both succeed, every library is an ELF file its manifest describes. The modules are a row fusion's
    (one nvcc unit each, the cheapest real modules: the lock protocol is the attention modules' own, FivarModule)."""
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        pytest.skip("nvcc not installed")
    vdir = tmp_path / "variants"
    vdir.mkdir()
    (vdir / "cachefuse.py").write_text(FUSION)
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "ws"),
           "FIVAR_CACHE_DIR": str(tmp_path / "fivar"), "FIVAR_VARIANT_PATH": str(vdir), "MAX_JOBS": "2",
           "FLASHINFER_CUDA_ARCH_LIST": "9.0a", "COLUMNS": "250"}
    args = [sys.executable, "-m", "fivar", "build", "cachefuse", "--prewarm", "--targets", "fusion",
            "--dtypes", "fp16,bf16"]
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert not any("rebuilding" in o for o in outs), outs
    code = ("import json, fivar\nfrom fivar.fusion.build import gen_fusion_module\n"
            "ms = [gen_fusion_module(fivar.load('cachefuse'), dt) for dt in ('fp16', 'bf16')]\n"
            "print(json.dumps([[m.uri, m.manifest_ok(), m.library_path.read_bytes()[:4].hex()] for m in ms]))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    state = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(ok and head == "7f454c46" for _, ok, head in state), state
    import sqlite3
    con = sqlite3.connect(str(tmp_path / "fivar" / "records.sqlite"))
    cold = dict(con.execute("SELECT uri, COUNT(*) FROM events WHERE kind='cold' GROUP BY uri").fetchall())
    assert cold == {uri: 1 for uri, _, _ in state}, cold
