"""`fivar cache ...` and `fivar build --prewarm/--jobs/--launcher`, against an isolated cache.

No compiles: entries are real fivar modules (real URIs, sources, manifests) whose library is a stand-in file,
which is all the cache commands look at. FlashInfer's cache dirs and FIVAR_CACHE_DIR point into tmp_path.
"""
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import fivar
from fivar import FivarError
from fivar.cli import main
from fivar.jit import prewarm, records, store
from fivar.jit.build import _sha256, gen_module
from fivar.jit import toolchain

VARIANT = '''from fivar import AttentionVariant, tanh


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return 20.0 * tanh(score / 20.0)


variant = AttentionVariant(name="cachev", logits=logits)
'''
KIB = 1024


@pytest.fixture
def iso(tmp_path, monkeypatch):
    from flashinfer.jit import env as jit_env
    root = tmp_path / "ws" / ".cache" / "flashinfer"
    ws = root / jit_env.FLASHINFER_WORKSPACE_DIR.relative_to(jit_env.FLASHINFER_CACHE_DIR)
    monkeypatch.setattr(jit_env, "FLASHINFER_CACHE_DIR", root)
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", ws / "cached_ops")
    monkeypatch.setattr(jit_env, "FLASHINFER_GEN_SRC_DIR", ws / "generated")
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path / "fivar"))
    monkeypatch.setenv("FIVAR_CONFIG_DIR", str(tmp_path / "config"))  # no signing key, no trusted key
    vdir = tmp_path / "variants"
    vdir.mkdir()
    (vdir / "cachev.py").write_text(VARIANT)
    monkeypatch.setenv("FIVAR_VARIANT_PATH", str(vdir))
    return root, ws, vdir / "cachev.py"


def write_malformed_records(uri: str) -> None:
    """Build records with wrong-typed columns (a text count, a blob time, a text pid) for module `uri`."""
    from fivar.jit import records
    con = records.connect()
    con.execute("INSERT INTO events (time, action, uri, kind, count, seconds) "
                "VALUES ('yesterday', 'build', ?, 'cold', 'many', 'slow')", (uri,))
    con.execute("INSERT INTO events (time, action, uri, kind, count, seconds) "
                "VALUES (X'00ff', 'load', ?, 'disk', 1, 0)", (uri,))
    con.execute("INSERT INTO holders VALUES (?, ?, 'not a pid', 'now')", (uri, records.HOST))
    con.close()


def fake_built(m, size=1000, age_s=0.0):
    """A module whose library is a stand-in of `size` bytes, with a real manifest written by fivar."""
    m.jit_spec()  # writes the generated sources
    m.build_dir.mkdir(parents=True, exist_ok=True)
    m.library_path.write_bytes(os.urandom(size))
    m.write_manifest(12.5)
    if age_s:
        man = json.loads(m.manifest_path.read_text())
        man["created"] = time.time() - age_s
        m.manifest_path.write_text(json.dumps(man))
    assert m.manifest_ok()
    return m


def module(vfile, dtype="bf16", head_dim=128):
    return gen_module(fivar.load(str(vfile)), op="single_prefill", dtype=dtype, head_dim=head_dim)


def invoke(*args):
    r = CliRunner().invoke(main, list(args))
    return r


def as_json(*args):
    r = invoke(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)  # warnings go to stderr


def test_ls_size_provenance_hits_and_staleness(iso):
    root, ws, vfile = iso
    m = fake_built(module(vfile), size=100 * KIB)
    # the same module left behind by an older FlashInfer
    old_dir = root / "0.6.0" / ws.name / "cached_ops" / m.uri
    old_dir.mkdir(parents=True)
    man = json.loads(m.manifest_path.read_text())
    (old_dir / f"{m.uri}.so").write_bytes(b"x" * 10)
    (old_dir / "fivar_manifest.json").write_text(json.dumps({**man, "flashinfer": "0.6.0"}))
    # an interrupted build: objects, no manifest
    broken = ws / "cached_ops" / "fivar_cachev_fa2_single_prefill_fp16_hd64_000000000000"
    broken.mkdir(parents=True)
    (broken / "x.cuda.o").write_bytes(b"o" * 50)
    records.record_many([(m, "disk", 0.01)] * 3)
    for _ in range(5):
        records.memory_hit(m)

    rows = as_json("cache", "ls")
    by = {(r["uri"], r["flashinfer"]): r for r in rows}
    assert len(rows) == 3
    cur = by[(m.uri, toolchain.flashinfer_version())]
    assert cur["stale"] is False and cur["hits"] == 8 and cur["compile_seconds"] == 12.5
    assert cur["size_bytes"] >= 100 * KIB + sum(len(t) for t in m.sources.values())
    assert (cur["variant"], cur["op"], cur["dtype"], cur["head_dim"], cur["target"]) == \
        ("cachev", "single_prefill", "bf16", 128, "fa2")
    assert cur["last_use"] and time.time() - cur["last_use"] < 60
    old = by[(m.uri, "0.6.0")]
    assert old["stale"] is True and any("flashinfer 0.6.0" in r for r in old["stale_reasons"])
    br = by[(broken.name, None)]
    assert br["stale"] is True and "no manifest" in br["stale_reasons"][0] and br["size_bytes"] == 50

    # edit the variant: its module is now stale (it renders another URI); revert: fresh again
    vfile.write_text(VARIANT.replace("20.0", "25.0"))
    cur = [r for r in as_json("cache", "ls") if r["uri"] == m.uri and r["flashinfer"] != "0.6.0"][0]
    assert cur["stale"] is True and "' was edited (now renders" in cur["stale_reasons"][0]
    vfile.write_text(VARIANT)
    cur = [r for r in as_json("cache", "ls") if r["uri"] == m.uri and r["flashinfer"] != "0.6.0"][0]
    assert cur["stale"] is False
    r = invoke("cache", "ls")
    assert r.exit_code == 0 and "stale" in r.output and "3 module(s)" in r.output


def test_staleness_renders_a_module_the_way_it_was_built(iso, monkeypatch):
    """Modules built with non-default rendering options (FA3 exp2 split, FA2 CTA-tile split) are fresh whatever
    this process's environment says, and still go stale when their variant is edited."""
    from fivar.codegen.fa3 import CTA_TILE_ENV, EXP2_EMULATION_ENV, SCHEDULE_ENV, exp2_split
    _, _, vfile = iso
    v = fivar.load(str(vfile))
    with exp2_split(8):
        fa3_8 = fake_built(gen_module(v, op="single_prefill", target="fa3"))
    fa3_default = fake_built(gen_module(v, op="single_prefill", target="fa3"))
    fa2_split = fake_built(gen_module(v, op="single_prefill", split_cta_tiles=True))
    assert len({fa3_8.uri, fa3_default.uri}) == 2 and fa3_8.options["exp2_emulated_of_8"] == 8
    assert fa2_split.options["split_cta_tiles"] is True
    fa3_tile = fake_built(gen_module(v, op="single_prefill", target="fa3", cta_tile="128x176,128x64"))
    assert fa3_tile.options["cta_tile"] == "128x176,128x64"
    fa2_threads = fake_built(gen_module(v, op="batch_prefill", nvcc_split_compile=True))
    fa3_persistent = fake_built(gen_module(v, op="single_prefill", target="fa3", schedule="persistent"))
    monkeypatch.setenv(EXP2_EMULATION_ENV, "3")  # a process that would render FA3 modules another way
    monkeypatch.setenv(CTA_TILE_ENV, "128x160")
    monkeypatch.setenv(SCHEDULE_ENV, "grid,persistent")
    monkeypatch.setenv("FIVAR_NVCC_SPLIT_COMPILE", "1")  # and FA2 modules without nvcc's --split-compile,
    monkeypatch.setenv("FIVAR_PIN_KV_TILES", "0")  # with FlashInfer's run-time KV tiles
    monkeypatch.setenv("FIVAR_SKIP_UNUSED_HEADERS", "0")  # and <cuda/pipeline>
    monkeypatch.setenv("FIVAR_NVCC_PARALLEL_PASSES", "0")  # and nvcc's passes one after the other
    assert fa2_split.options["pin_kv_tiles"] and fa2_split.options["skip_unused_headers"]
    mine = {fa3_8.uri, fa3_default.uri, fa2_split.uri, fa3_tile.uri, fa2_threads.uri, fa3_persistent.uri}
    rows = [r for r in as_json("cache", "ls") if r["uri"] in mine]
    assert len(rows) == 6 and all(r["stale"] is False for r in rows), rows
    vfile.write_text(VARIANT.replace("20.0", "25.0"))
    rows = [r for r in as_json("cache", "ls") if r["uri"] in mine]
    assert len(rows) == 6 and all(r["stale"] is True and "' was edited (now renders" in r["stale_reasons"][0] for r in rows), rows


def test_option_labels_tell_apart_modules_of_one_variant():
    assert store._option_labels({"split_cta_tiles": True, "nvcc_split_compile": False}) == [
        "cta-split", "no-split-compile"]
    assert store._option_labels({"split_cta_tiles": False, "nvcc_split_compile": True, "tile_list": False}) == []
    assert store._option_labels({"nvcc_parallel_passes": False}) == ["serial-passes"]
    assert store._option_labels({"cta_tile": "flashinfer", "schedule": "grid,persistent"}) == [
        "tile flashinfer", "schedule grid,persistent"]
    assert store._option_labels({"schedule": "grid"}) == []


def test_a_manifest_of_an_older_schema_is_stale_and_pruned(iso):
    """Module names changed with manifest schema 2, so a module recorded by an older fivar (schema 1: no
    `schema`, no `cuda_cflags`) can never be loaded again: stale, whatever else it records, and
    `prune --stale` removes it while a current module of the same variant stays."""
    _, _, vfile = iso
    v = fivar.load(str(vfile))
    old = fake_built(gen_module(v, op="single_prefill"))
    current = fake_built(gen_module(v, op="batch_prefill"))
    man = json.loads(old.manifest_path.read_text())
    del man["schema"], man["cuda_cflags"]
    old.manifest_path.write_text(json.dumps(man))
    rows = {r["uri"]: r for r in as_json("cache", "ls")}
    assert rows[old.uri]["stale"] is True, rows[old.uri]
    assert rows[old.uri]["stale_reasons"] == ["built by an older fivar (manifest schema 1)"]
    assert rows[current.uri]["stale"] is False, rows[current.uri]
    r = invoke("cache", "prune", "--stale")
    assert r.exit_code == 0, r.output
    assert not old.build_dir.exists() and current.manifest_ok()
    assert [row["uri"] for row in as_json("cache", "ls")] == [current.uri]


def test_staleness_tells_an_edited_variant_from_changed_code_generation(iso):
    """Same variant file, another rendering (here: the manifest says it was built at another exp2 split than the
    library it describes, as a module of a fivar with other defaults would): stale, and the reason says the
    variant is unchanged. A manifest without the variant file's hash says it cannot tell."""
    _, _, vfile = iso
    m = fake_built(gen_module(fivar.load(str(vfile)), op="single_prefill", target="fa3"))
    man = json.loads(m.manifest_path.read_text())
    assert man["variant_file_sha256"] and man["options"]["exp2_emulated_of_8"] == 2
    m.manifest_path.write_text(json.dumps({**man, "options": {**man["options"], "exp2_emulated_of_8": 5}}))
    row = [r for r in as_json("cache", "ls") if r["uri"] == m.uri][0]
    assert row["stale"] is True and "unchanged but fivar's code generation changed" in row["stale_reasons"][0]
    del man["variant_file_sha256"]
    m.manifest_path.write_text(json.dumps({**man, "options": {**man["options"], "exp2_emulated_of_8": 5}}))
    row = [r for r in as_json("cache", "ls") if r["uri"] == m.uri][0]
    assert "was edited, or fivar's code generation changed" in row["stale_reasons"][0]


def test_background_load_records_are_written_by_flush_and_survive_fork(iso):
    """Load events go through the writer thread: flush() waits for them; a forked child (no writer thread
    of its own at the fork) records its loads too."""
    _, _, vfile = iso
    m = fake_built(module(vfile))
    records.record_many([(m, "disk", 0.01)], action="load", holder=True, background=True)
    pid = os.fork()
    if pid == 0:  # child: its own load, then a flush (SIGALRM ends a child whose flush would hang)
        import signal
        signal.alarm(20)
        code = 0
        try:
            records.record_many([(m, "disk", 0.03)], action="load", holder=True, background=True)
            records.flush()
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    records.flush()
    con = records.connect()
    try:
        rows = sorted(con.execute("SELECT pid, seconds FROM events WHERE uri=? AND action='load'", (m.uri,)))
        holders = sorted(p for (p,) in con.execute("SELECT pid FROM holders WHERE uri=?", (m.uri,)))
    finally:
        con.close()
    assert rows == sorted([(os.getpid(), 0.01), (pid, 0.03)]) and holders == sorted([os.getpid(), pid])


def test_show_gives_manifest_files_and_events(iso):
    _, _, vfile = iso
    m = fake_built(module(vfile))
    records.record_many([(m, "cold", 42.0)])
    records.record_many([(m, "disk", 0.02)], action="load", holder=True, background=True)  # as load() does
    d = as_json("cache", "show", m.uri[:-6])  # a unique prefix is enough (and the reader waits for the writer)
    assert d["uri"] == m.uri and d["manifest"]["so_sha256"] == _sha256(m.library_path)
    assert [(e["action"], e["kind"]) for e in d["events"]] == [("load", "disk"), ("build", "cold")]
    assert d["live_holders"] == [os.getpid()]  # this process recorded a load and is alive
    assert any(f.endswith(f"{m.uri}.so") for f in d["files"]) and \
        any(f.endswith("single_prefill_config.inc") for f in d["files"])
    r = invoke("cache", "show", "fivar_nope")
    assert r.exit_code == 1 and "no fivar module" in r.output


def test_stats_hit_rate_and_compile_distribution_over_a_window(iso):
    _, _, vfile = iso
    m = module(vfile)
    records.record_many([(m, "cold", 10.0), (m, "cold", 30.0)] + [(m, "disk", 0.01)] * 3)
    for _ in range(5):
        records.memory_hit(m)
    records.flush()
    con = records.connect()
    con.execute("INSERT INTO events(time, action, uri, variant, kind, count, seconds) VALUES (?,?,?,?,?,?,?)",
                (time.time() - 20 * 86400, "build", m.uri, "cachev", "cold", 1, 999.0))
    con.close()
    s = as_json("cache", "stats", "--window", "7d")
    assert (s["cold"], s["disk_hits"], s["memory_hits"]) == (2, 3, 5)
    assert s["hit_rate"] == pytest.approx(8 / 10)
    cs = s["compile_seconds"]
    assert (cs["count"], cs["total"], cs["min"], cs["max"]) == (2, 40.0, 10.0, 30.0)
    assert s["per_variant"][0]["variant"] == "cachev" and s["per_variant"][0]["cold"] == 2
    s = as_json("cache", "stats", "--window", "30d")
    assert s["cold"] == 3 and s["compile_seconds"]["max"] == 999.0
    assert invoke("cache", "stats", "--window", "soon").exit_code == 1
    r = invoke("cache", "stats", "--window", "7")  # 7 what? a unit is required
    assert r.exit_code == 1 and "a number and a unit" in r.output


def test_unreadable_records_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path))
    (tmp_path / "records.sqlite").write_text("not a database")
    r = CliRunner().invoke(main, ["cache", "--arch", "9.0a", "stats"])
    assert r.exit_code == 1 and f"fivar's build records {tmp_path / 'records.sqlite'} cannot be opened" in r.output
    assert "FIVAR_CACHE_DIR" in r.output and "Traceback" not in r.output


def test_records_retry_a_lock_sqlite_does_not_wait_for(tmp_path, monkeypatch):
    """Creating the database in several processes at once: SQLite can refuse the switch to WAL at once
    (waiting could deadlock); connect starts over instead of failing or calling the file unreadable."""
    real, refusals = records._set_up, []

    def refuse_twice(con, path):
        if len(refusals) < 2:
            refusals.append(path)
            raise records.sqlite3.OperationalError("database is locked")
        real(con, path)
    monkeypatch.setattr(records, "_set_up", refuse_twice)
    con = records.connect(tmp_path / "r.sqlite")
    assert len(refusals) == 2 and con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 0
    con.close()


def test_records_locked_for_good_say_so(tmp_path, monkeypatch):
    db = tmp_path / "r.sqlite"
    holder = records.sqlite3.connect(str(db), isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    monkeypatch.setattr(records, "BUSY_TIMEOUT_S", 0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(FivarError, match="stayed locked by another process for 0.3 s") as e:
            records.connect(db)
        assert 0.3 <= time.monotonic() - t0 < 5 and "move it away" not in str(e.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    records.connect(db).close()  # and once the lock is gone, it opens


@pytest.mark.parametrize("text,size", [("500M", 500 << 20), ("1.5GiB", 3 << 29), (".5k", 512), ("2g", 2 << 30),
                                       ("4096", 4096)])
def test_sizes(text, size):
    assert store.parse_size(text) == size


@pytest.mark.parametrize("text", ["1.2.3G", ".", "G", "-1M", "5X"])
def test_unreadable_sizes_are_one_line(text):
    with pytest.raises(FivarError, match=f"cannot read size {re.escape(repr(text))}"):
        store.parse_size(text)


def _hold_lock(path, shared=False):
    """Another process holding flock on `path` (a module's .fivar.lock, or shared: its .fivar.hold)."""
    p = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                          "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                          f"fcntl.flock(fd, fcntl.{'LOCK_SH' if shared else 'LOCK_EX'}); print('locked', flush=True)\n"
                          "time.sleep(120)", str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_verify_leaves_a_build_in_progress_alone(iso):
    """A module whose build holds its lock is reported as being built, not broken, and --fix never deletes a
    library while that lock is held (the build may be writing it); once the lock is free, --fix does."""
    _, ws, vfile = iso
    building, corrupt = fake_built(module(vfile, "bf16", 64)), fake_built(module(vfile, "fp16", 64))
    building.manifest_path.unlink()  # linked, manifest not yet written
    man = json.loads(corrupt.manifest_path.read_text())
    corrupt.manifest_path.write_text(json.dumps({**man, "so_sha256": "0" * 64}))
    lockers = [_hold_lock(m.build_dir / ".fivar.lock") for m in (building, corrupt)]
    try:
        r = invoke("cache", "verify", "--fix", "--json")
        rows = {x["uri"]: x for x in json.loads(r.output)}
        assert rows[building.uri]["building"] and rows[building.uri]["ok"]
        assert not rows[corrupt.uri]["fixed"] and "build lock is held" in rows[corrupt.uri]["problems"][-1]
        assert r.exit_code == 1 and building.library_path.exists() and corrupt.library_path.exists()
    finally:
        for p in lockers:
            p.kill()
            p.wait()
    r = invoke("cache", "verify", "--fix", "--json", corrupt.uri)
    assert r.exit_code == 0 and json.loads(r.output)[0]["fixed"] and not corrupt.library_path.exists()


def test_prune_lru_by_size_and_age_never_evicting_live_or_locked(iso):
    _, ws, vfile = iso
    # five modules, 100 KiB libraries, least recently used first: a (held), b (being built), c, d, e
    ms = [fake_built(module(vfile, dt, hd), size=100 * KIB, age_s=age) for (dt, hd), age in zip(
        [("bf16", 64), ("bf16", 128), ("bf16", 256), ("fp16", 64), ("fp16", 128)],
        [5 * 86400, 4 * 86400, 3 * 86400, 2 * 3600, 60])]
    a, b, c, d, e = ms
    sizes = {r["uri"]: r["size_bytes"] for r in as_json("cache", "ls", "--no-stale-check")}
    # a loads in a process that recorded nothing in this FIVAR_CACHE_DIR: its hold lock alone says in use
    holder = _hold_lock(a.build_dir / ".fivar.hold", shared=True)
    con = records.connect()
    con.execute("INSERT INTO holders(uri, host, pid, time) VALUES (?,?,?,?)", (a.uri, records.HOST, holder.pid,
                                                                            time.time()))
    con.close()
    locker = _hold_lock(b.build_dir / ".fivar.lock")
    try:
        limit = sum(sizes.values()) - sizes[c.uri] - sizes[d.uri] // 2  # evicting c alone is not enough
        dry = as_json("cache", "prune", "--max-size", str(limit), "--dry-run")
        assert [r["uri"] for r in dry["evicted"]] == [c.uri, d.uri]
        # the least recently used two could not go, and say why
        assert {r["uri"]: r["skipped"][:10] for r in dry["skipped"]} == {a.uri: "held by li", b.uri: "its build "}
        assert all(m.library_path.exists() for m in ms)  # a dry run deletes nothing
        res = as_json("cache", "prune", "--max-size", str(limit))
        assert [r["uri"] for r in res["evicted"]] == [c.uri, d.uri]
        assert res["freed_bytes"] == sizes[c.uri] + sizes[d.uri]
        assert not c.build_dir.exists() and not c.gen_dir.exists() and not d.build_dir.exists()
        assert a.manifest_ok() and b.manifest_ok() and e.manifest_ok()
        # by age: a and b are old enough, but one is held by a live process and one is being built
        res = as_json("cache", "prune", "--older-than", "1d")
        assert res["evicted"] == []
        skipped = {r["uri"]: r["skipped"] for r in res["skipped"]}
        assert str(holder.pid) in skipped[a.uri] and "lock" in skipped[b.uri]
    finally:
        holder.kill()
        holder.wait()
        locker.kill()
        locker.wait()
    # both gone now (a killed holder is dead, a killed builder's lock is released): evictable
    res = as_json("cache", "prune", "--older-than", "1d")
    assert sorted(r["uri"] for r in res["evicted"]) == sorted([a.uri, b.uri])
    assert e.manifest_ok() and not a.build_dir.exists()
    con = records.connect()
    assert con.execute("SELECT COUNT(*) FROM holders WHERE pid=?", (holder.pid,)).fetchone()[0] == 0
    con.close()
    assert invoke("cache", "prune").exit_code == 1  # nothing to go by


def test_export_clear_import_round_trip_and_refusals(iso, tmp_path, monkeypatch):
    _, ws, vfile = iso
    m1, m2 = fake_built(module(vfile, "bf16", 128)), fake_built(module(vfile, "fp16", 64))
    shas = {m.uri: _sha256(m.library_path) for m in (m1, m2)}
    out = tmp_path / "mods.tar.gz"
    as_json("cache", "keygen")  # exports are signed with it, and it is trusted here
    ex = as_json("cache", "export", str(out))
    assert sorted(ex["modules"]) == sorted(shas)
    with tarfile.open(out) as tar:
        meta = json.loads(tar.extractfile("fivar_export.json").read())
        names = tar.getnames()
    assert (meta["arch"], meta["flashinfer"], meta["nvcc"]) == \
        (toolchain.arch_tag(), toolchain.flashinfer_version(), toolchain.nvcc_version())
    assert f"cached_ops/{m1.uri}/{m1.uri}.so" in names and f"generated/{m1.uri}/single_prefill_config.inc" in names
    assert not any(n.endswith(".o") or n.endswith("build.ninja") for n in names)

    cl = as_json("cache", "clear", "--yes")
    assert sorted(r["uri"] for r in cl["removed"]) == sorted(shas)
    assert not m1.manifest_ok() and not m1.gen_dir.exists()
    im = as_json("cache", "import", str(out))
    assert sorted(im["imported"]) == sorted(shas)
    for m in (m1, m2):
        assert m.manifest_ok() and _sha256(m.library_path) == shas[m.uri]
        assert m.build() == "disk"  # the imported module is a hit: no compile
        assert all((m.gen_dir / n).read_text() == t for n, t in m.sources.items())
    assert sorted(as_json("cache", "import", str(out))["already_present"]) == sorted(shas)

    # edit the variant: both modules are stale (nothing loads them), so they stay out unless asked for
    vfile.write_text(VARIANT.replace("20.0", "25.0"))
    r = invoke("cache", "export", str(tmp_path / "none.tar.gz"))
    assert r.exit_code != 0 and "2 stale: --include-stale packs them" in r.output
    assert not (tmp_path / "none.tar.gz").exists()
    ex = as_json("cache", "export", str(tmp_path / "all.tar.gz"), "--include-stale")
    assert sorted(ex["modules"]) == sorted(shas) and ex["stale"] == []
    from fivar import registry
    registry._loaded.pop(vfile.resolve(), None)  # this process loaded the file before the edit
    fresh = fake_built(module(vfile, "bf16", 128))  # the edited variant's own module
    ex = as_json("cache", "export", str(tmp_path / "fresh.tar.gz"))
    assert ex["modules"] == [fresh.uri] and sorted(s["uri"] for s in ex["stale"]) == sorted(shas)
    assert all("was edited" in s["reasons"][0] for s in ex["stale"])
    vfile.write_text(VARIANT)
    registry._loaded.pop(vfile.resolve(), None)
    for d in (fresh.library_path.parent, fresh.gen_dir):  # out of the round trip below
        shutil.rmtree(d)

    # another toolchain's export is refused, naming both sides
    bad = tmp_path / "other.tar.gz"
    with tarfile.open(out) as src, tarfile.open(bad, "w:gz") as dst:
        for mem in src.getmembers():
            if mem.name == "fivar_export.sig":  # unsigned: an edited index would fail its signature first
                continue
            data = src.extractfile(mem).read()
            if mem.name == "fivar_export.json":
                data = json.dumps({**json.loads(data), "flashinfer": "0.0.1", "nvcc": "12.4.131"}).encode()
                mem.size = len(data)
            import io
            dst.addfile(mem, io.BytesIO(data))
    r = invoke("cache", "import", str(bad))
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and "flashinfer 0.0.1" in flat and f"flashinfer {toolchain.flashinfer_version()}" in flat
    assert "nvcc 12.4.131" in flat and "mismatch: flashinfer, nvcc" in flat

    # a machine that cannot tell its arch is told how to name one, not that it "has arch None"
    with monkeypatch.context() as mp:
        mp.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
        mp.setattr(toolchain, "arch_tag", lambda: None)
        r = invoke("cache", "import", str(out))
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and "arch is unknown" in flat and "fivar cache --arch 9.0a" in flat and "None" not in flat

    # a member outside the two trees is refused before anything is written
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(out) as src, tarfile.open(evil, "w:gz") as dst:
        for mem in src.getmembers():
            dst.addfile(mem, src.extractfile(mem))
        info = tarfile.TarInfo(f"cached_ops/{m1.uri}/../../../escape.txt")
        info.size = 1
        dst.addfile(info, __import__("io").BytesIO(b"x"))
    r = invoke("cache", "import", str(evil))
    assert r.exit_code == 1 and "unexpected member" in r.output
    assert not (ws.parent / "escape.txt").exists()


def _rewritten(src_path, dst_path, meta_edit=None, member_edit=None, extra=None, consistent_index=True):
    """A copy of an export with its metadata (a function of the dict; raw bytes when it returns bytes) or one
    member's bytes replaced, or with one more member (name, bytes). Its signature is dropped; with
    `consistent_index` the index lists the edited members' new sha256 and size (what a careful forger does), so
    the checks behind the index are reached."""
    with tarfile.open(src_path) as src:
        items = [(mem, src.extractfile(mem).read()) for mem in src.getmembers() if mem.name != "fivar_export.sig"]
    if member_edit:
        items = [(mem, member_edit[1] if mem.name.endswith(member_edit[0]) else data) for mem, data in items]
    if extra:
        items.append((tarfile.TarInfo(extra[0]), extra[1]))
    meta = json.loads(next(data for mem, data in items if mem.name == "fivar_export.json"))
    if consistent_index:
        meta["files"] = {mem.name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                         for mem, data in items if mem.name != "fivar_export.json"}
    if meta_edit:
        meta = meta_edit(meta)
    with tarfile.open(dst_path, "w:gz") as dst:
        for mem, data in items:
            if mem.name == "fivar_export.json":
                data = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
            mem.size = len(data)
            dst.addfile(mem, io.BytesIO(data))
    return dst_path


@pytest.mark.parametrize("case,match", [
    ("meta-list", "is not a JSON object"),
    ("meta-deep", "is not a fivar cache export"),
    ("sig-deep", "the signature file is malformed"),
    ("entries-int", "malformed entries"),
    ("entry-no-uri", "malformed entries"),
    ("uri-path", "malformed entries"),
    ("manifest-garbage", "malformed manifest: not JSON.*nothing was imported"),
    ("manifest-list", r"malformed manifest: not a JSON object \(a list\).*nothing was imported"),
    ("manifest-null", r"malformed manifest: not a JSON object \(a NoneType\)"),
    ("manifest-deep", "malformed manifest: not JSON.*nested too deeply.*nothing was imported"),
    ("manifest-types", "field 'head_dim' is a str, expected int.*field 'sources' is a dict"),
    ("python-member", "is not a library, manifest or C.*refusing to import"),
    ("extra-source", "are not the ones its manifest lists"),
    ("edited-source", "do not hash to its URI"),
    ("second-sha", "corrupt .*nothing was imported"),
])
@pytest.mark.parametrize("trust_unsigned", [True, False])
def test_a_malformed_export_is_refused_whole(iso, tmp_path, case, match, trust_unsigned):
    """A damaged export is one line, and it imports nothing: no half-imported module, no module of a good entry,
    whether its libraries would be imported (--trust-unsigned) or only its sources."""
    _, ws, vfile = iso
    m1, m2 = fake_built(module(vfile, "bf16", 128)), fake_built(module(vfile, "fp16", 64))
    out = tmp_path / "mods.tar.gz"
    man2 = json.loads(m2.manifest_path.read_text())
    as_json("cache", "export", str(out))
    as_json("cache", "clear", "--yes")
    edits = {
        "meta-list": dict(meta_edit=lambda m: [m]),
        # nested past the JSON reader's depth: a RecursionError, not a ValueError, from json.loads
        "meta-deep": dict(meta_edit=lambda m: b"[" * 100000),
        "sig-deep": dict(extra=("fivar_export.sig", b"[" * 60000)),
        "entries-int": dict(meta_edit=lambda m: {**m, "entries": 5}),
        "entry-no-uri": dict(meta_edit=lambda m: {**m, "entries": [{"so_sha256": "0"}]}),
        "uri-path": dict(meta_edit=lambda m: {**m, "entries": [{**m["entries"][0], "uri": "a/b"}]}),
        "manifest-garbage": dict(member_edit=(f"{m2.uri}/fivar_manifest.json", b"{not json")),
        "manifest-list": dict(member_edit=(f"{m2.uri}/fivar_manifest.json", b"[1, 2]")),
        "manifest-null": dict(member_edit=(f"{m2.uri}/fivar_manifest.json", b"null")),
        "manifest-deep": dict(member_edit=(f"{m2.uri}/fivar_manifest.json", b"[" * 100000)),
        "manifest-types": dict(member_edit=(f"{m2.uri}/fivar_manifest.json", json.dumps(
            {**man2, "head_dim": "64", "sources": {}}).encode())),
        "python-member": dict(extra=(f"generated/{m2.uri}/payload.py", b"open('/tmp/x', 'w')")),
        "extra-source": dict(extra=(f"generated/{m2.uri}/more.cuh", b"// not in the manifest")),
        "edited-source": dict(member_edit=(f"{m2.uri}/{sorted(m2.sources)[0]}", b"// edited")),
        "second-sha": dict(meta_edit=lambda m: {**m, "entries": [m["entries"][0], {**m["entries"][1],
                                                                                  "so_sha256": "0" * 64}]}),
    }
    bad = _rewritten(out, tmp_path / "bad.tar.gz", **edits[case])
    flag = ["--trust-unsigned"] if trust_unsigned else []
    r = invoke("cache", "import", str(bad), *flag)
    assert r.exit_code == 1 and re.search(match, " ".join(r.output.split())), r.output
    assert "Traceback" not in r.output
    assert not m1.library_path.exists() and not m2.library_path.exists()
    assert not m1.gen_dir.exists() and not m2.gen_dir.exists()
    assert not list((m1.build_dir.parent).glob(".import-*"))  # no staging left behind
    done = as_json("cache", "import", str(out), *flag)  # the good one still does
    assert sorted(done["imported" if trust_unsigned else "sources_only"]) == sorted([m1.uri, m2.uri])


def test_records_survive_concurrent_writers(tmp_path):
    """Several processes appending at once (WAL + busy timeout): no lost rows, no 'database is locked'."""
    db = tmp_path / "r.sqlite"
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('rec', {str(Path(records.__file__))!r})\n"
        "rec = importlib.util.module_from_spec(spec); spec.loader.exec_module(rec)\n"
        "for i in range(200):\n"
        "    con = rec.connect(sys.argv[1]); con.execute('BEGIN IMMEDIATE')\n"
        "    rec._insert(con, [(0.0, 'build', 'u', 'v', 'fa2', 'op', 'bf16', 64, 'disk', 1, 0.0,"
        " None, None, None, None, 'h', i)])\n"
        "    con.execute('COMMIT'); con.close()\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(db)], stderr=subprocess.PIPE, text=True)
             for _ in range(6)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    con = records.connect(db)
    assert con.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 1200
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()


def test_default_jobs_is_min_of_cores_and_a_half_and_memory(monkeypatch):
    monkeypatch.setattr(prewarm.toolchain, "cpu_count", lambda: 16)
    monkeypatch.setattr(prewarm, "mem_available", lambda: 10 * prewarm.GIB)
    assert prewarm.default_jobs()[0] == 3
    monkeypatch.setattr(prewarm, "mem_available", lambda: 1 * prewarm.GIB)
    assert prewarm.default_jobs()[0] == 1
    monkeypatch.setattr(prewarm, "mem_available", lambda: 200 * prewarm.GIB)
    assert prewarm.default_jobs() == (24, "min(1.5 x 16 cores, 200.0 GiB available / 3 GiB per nvcc job)")
    monkeypatch.setattr(prewarm, "mem_available", lambda: None)
    assert prewarm.default_jobs()[0] == 24
    monkeypatch.setattr(prewarm.toolchain, "cpu_count", lambda: 1)
    assert prewarm.default_jobs()[0] == 1
    monkeypatch.setattr(prewarm.toolchain, "cpu_count", lambda: 16)
    monkeypatch.setattr(prewarm, "mem_available", lambda: 200 * prewarm.GIB)
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.delenv("FLASHINFER_JIT_PREBUILD_MAX_JOBS", raising=False)
    assert prewarm.configure_jobs(None)[0] == 24 and os.environ["MAX_JOBS"] == "24"
    assert prewarm.configure_jobs(5)[0] == 5 and os.environ["FLASHINFER_JIT_PREBUILD_MAX_JOBS"] == "5"


def test_build_prewarm_progress_jobs_and_summary(iso, monkeypatch):
    _, _, vfile = iso
    mods = [fake_built(module(vfile, dt, 64)) for dt in ("fp16", "bf16")]
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(prewarm, "mem_available", lambda: 4 * prewarm.GIB)  # room for one nvcc job
    r = invoke("build", "cachev", "--prewarm", "--ops", "single_prefill", "--targets", "fa2", "--dtypes", "fp16,bf16",
               "--head-dims", "64")
    assert r.exit_code == 0, r.output
    assert "all 2 module(s) up to date" in r.output and os.environ["MAX_JOBS"] == "1"
    assert "built " not in r.output  # not a terminal: a line per module compiled, and none was
    assert r.output.count("hit (disk)") == 2
    assert sorted(k for (k,) in records.connect().execute("SELECT kind FROM events")) == ["disk", "disk"]
    assert all(m.manifest_ok() for m in mods)


def test_launcher_lands_in_build_ninja(iso, tmp_path, monkeypatch):
    _, _, vfile = iso
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "fakecache"
    fake.write_text("#!/bin/sh\nexec \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("FLASHINFER_NVCC_LAUNCHER", raising=False)
    monkeypatch.delenv("FLASHINFER_CXX_LAUNCHER", raising=False)
    assert prewarm.configure_launcher("fakecache") == str(fake)
    m = module(vfile)
    m.jit_spec().write_ninja()
    text = (m.build_dir / "build.ninja").read_text()
    assert f"nvcc_launcher = {fake}" in text and f"cxx_launcher = {fake}" in text
    assert "$nvcc_launcher $nvcc" in text
    assert module(vfile).uri == m.uri  # a launcher does not change what is built
    r = invoke("build", "cachev", "--launcher", "no-such-launcher-xyz")
    assert r.exit_code == 1 and "no-such-launcher-xyz" in r.output and "not found" in r.output


@pytest.mark.parametrize("c", list(" \t\n`$;&|<>()'\"\\*?[]:"))
def test_a_launcher_path_holding_shell_syntax_is_refused_before_anything_runs(iso, tmp_path, monkeypatch, c):
    """FlashInfer writes the launcher's path unquoted into build.ninja, whose commands /bin/sh runs: a path with
    shell or ninja syntax is one line naming it, exported nowhere, and nothing is compiled."""
    import flashinfer.jit.core as core
    _, _, vfile = iso
    bindir = tmp_path / "bin"
    bindir.mkdir()
    evil = bindir / f"cc{c}touch PWNED{c}x"
    evil.write_text("#!/bin/sh\nexec \"$@\"\n")
    evil.chmod(0o755)
    for var in ("FLASHINFER_NVCC_LAUNCHER", "FLASHINFER_CXX_LAUNCHER"):
        monkeypatch.delenv(var, raising=False)
    compiled = []
    monkeypatch.setattr(core.JitSpecNvcc, "build", lambda self, *a, **k: compiled.append(self.name))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FivarError, match=r"compiler launcher .*PWNED.*holds .*install it") as e:
        prewarm.configure_launcher(str(evil))
    assert "\n" not in str(e.value)
    r = invoke("build", "cachev", "--ops", "single_prefill", "--targets", "fa2", "--dtypes", "fp16",
               "--head-dims", "64", "--launcher", str(evil))
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and r.output.startswith("error:") and "Traceback" not in r.output, r.output
    assert "compiler launcher" in flat and "unquoted into build.ninja" in flat, r.output
    assert compiled == [] and not list(tmp_path.rglob("PWNED*")) and not list(tmp_path.rglob("build.ninja"))
    assert "FLASHINFER_NVCC_LAUNCHER" not in os.environ and "FLASHINFER_CXX_LAUNCHER" not in os.environ


def test_nvcc_version_is_cached_per_binary_and_asked_again_when_nvcc_changes(tmp_path, monkeypatch):
    """The nvcc version goes into every URI; fivar keeps it on disk so a fresh process does not run nvcc,
    but a replaced nvcc (another size or mtime) must be asked again, or a stale library would load."""
    home, calls = tmp_path / "cuda", tmp_path / "calls"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"

    def install(version: str, mtime_ns: int):
        nvcc.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'Cuda compilation tools, release 13.0, V{version}'\n")
        nvcc.chmod(0o755)
        os.utime(nvcc, ns=(mtime_ns, mtime_ns))

    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path / "fivar"))
    ask = lambda: (toolchain.nvcc_version.cache_clear(), toolchain.nvcc_version())[1]  # noqa: E731
    runs = lambda: len(calls.read_text().splitlines()) if calls.exists() else 0  # noqa: E731
    try:
        install("13.0.88", 1_000_000_000_000_000_000)
        assert ask() == "13.0.88" and runs() == 1
        assert ask() == "13.0.88" and runs() == 1  # a "fresh process": answered from disk
        install("13.1.05", 1_000_000_000_500_000_000)  # an upgrade in place: same size, new mtime
        assert ask() == "13.1.05" and runs() == 2
    finally:
        toolchain.nvcc_version.cache_clear()


def test_bad_files_and_archs_get_one_line_not_a_traceback(iso, tmp_path):
    _, _, vfile = iso
    fake_built(module(vfile))
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(os.urandom(64))
    good = tmp_path / "good.tar.gz"
    assert invoke("cache", "export", str(good)).exit_code == 0
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for args, says in ((("cache", "import", str(junk)), f"{junk} is not a readable fivar cache export"),
                       (("cache", "import", str(cut)), f"{cut} is not a readable fivar cache export"),
                       (("cache", "export", str(tmp_path / "no_such_dir" / "x.tar.gz")), "is not a writable directory"),
                       (("cache", "--arch", "bogus", "ls"), "--arch='bogus': expected CUDA archs"),
                       (("build", "cachev", "--arch", "9"), "--arch='9': expected CUDA archs")):
        r = invoke(*args)
        flat = " ".join(r.output.split())
        assert r.exit_code != 0 and says in flat and "Traceback" not in flat, (args, r.output)
        assert r.exception is None or isinstance(r.exception, SystemExit), (args, repr(r.exception))
    assert not list((tmp_path).glob("**/.x.tar.gz.*.tmp"))


def test_without_an_arch_staleness_is_unknown_and_prune_stale_refuses(iso, monkeypatch):
    """With no arch to render for, a module cannot be compared with its variant: `?`, never "stale" (which
    `prune --stale` would delete)."""
    _, _, vfile = iso
    m = fake_built(module(vfile))
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(toolchain, "ensure_arch_env", lambda: (_ for _ in ()).throw(fivar.FivarError("no GPU")))
    (row,) = as_json("cache", "ls")
    assert row["stale"] is None and row["stale_reasons"][0].startswith("unknown: no arch")
    r = invoke("cache", "prune", "--stale")
    assert r.exit_code == 1 and "cannot tell which modules are stale" in r.output
    assert m.manifest_ok()
    r = invoke("cache", "ls")
    assert r.exit_code == 0 and "?: unknown: no arch or nvcc" in r.output


def test_ls_finds_a_truncated_library_and_counts_hits_of_the_copy_on_disk(iso):
    _, _, vfile = iso
    m = fake_built(module(vfile), size=4 * KIB)
    records.record_many([(m, "cold", 30.0)])
    records.record_many([(m, "disk", 0.01)] * 4)
    (row,) = as_json("cache", "ls")
    assert row["hits"] == 4 and row["compile_seconds"] == 12.5 and row["stale"] is False
    # evicted and rebuilt: the new copy's build time, and no hits yet
    time.sleep(0.01)
    records.record_many([(m, "cold", 20.0)])
    con = records.connect()
    assert records.usage(con)[m.uri] == {"hits": 0, "colds": 2, "last_use": pytest.approx(time.time(), abs=30),
                                         "compile_seconds": 20.0}
    con.close()
    records.record_many([(m, "disk", 0.01)])
    assert as_json("cache", "ls")[0]["hits"] == 1
    with open(m.library_path, "r+b") as f:
        f.truncate(1000)
    (row,) = as_json("cache", "ls")
    assert row["stale"] is True and row["stale_reasons"] == [f"library size 1000 != manifest {4 * KIB} (truncated?)"]


def test_ls_tells_apart_modules_that_differ_only_in_fa3_options(iso):
    _, _, vfile = iso
    v = fivar.load(str(vfile))
    for bounded in (True, False):
        fake_built(gen_module(v, op="single_prefill", target="fa3", bounded_softmax=bounded))
    from fivar.jit.store import scan_entries
    labels = sorted(e.provenance for e in scan_entries())
    assert len(set(labels)) == 2 and sum("bounded" in t for t in labels) == 1, labels
    assert all("exp2/8=" in t and "tile " in t for t in labels), labels


def test_cuda_home_is_the_toolkit_holding_the_runtime_not_a_wrapper_dir(tmp_path, monkeypatch):
    """FlashInfer takes CUDA_HOME, else the directory above `which nvcc`; an nvcc on PATH that is a link or a
    wrapper outside the toolkit sent the linker to the wrong lib64 (`cannot find -lcudart`)."""
    kit = tmp_path / "cuda-13.0"
    (kit / "bin").mkdir(parents=True)
    (kit / "lib64").mkdir()
    (kit / "lib64" / "libcudart.so").write_bytes(b"")
    (kit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (kit / "bin" / "nvcc").chmod(0o755)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(kit / "bin" / "nvcc")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert toolchain.cuda_home() == str(kit)
    toolchain.ensure_cuda_home()
    assert os.environ["CUDA_HOME"] == str(kit)
    monkeypatch.setenv("CUDA_HOME", "/somewhere/else")  # an explicit setting always wins
    toolchain.ensure_cuda_home()
    assert toolchain.cuda_home() == "/somewhere/else"
