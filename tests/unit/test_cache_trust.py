"""Who a shared cache archive's native code is trusted from (`fivar cache keygen / trust / export --sign /
import`), and the import's limits: size caps, staging left by a killed import, full and read-only disks.

Real archives with real ed25519 keys, built in tmp dirs from real fivar modules whose library is random bytes
(the cache commands never look inside it). Each machine is a FIVAR_CONFIG_DIR of its own.
"""
import errno
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import sqlite3
import tarfile
import time

import pytest
from test_cache_cli import as_json, fake_built, write_malformed_records, invoke, iso, module  # noqa: F401 - the fixture

from fivar import trust
from fivar.jit import locks, records

SENTINEL_VARIANT = '''open({sentinel!r}, "w").write("ran")
from fivar import AttentionVariant


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score


variant = AttentionVariant(name="evilv", logits=logits)
'''


def one_line(r) -> str:
    assert r.exit_code == 1 and "Traceback" not in r.output and (
        r.exception is None or isinstance(r.exception, SystemExit)), (r.output, repr(r.exception))
    assert r.output.startswith("error:"), r.output
    return " ".join(r.output.split())


def machine(monkeypatch, tmp_path, name):
    """Switch to another machine's config dir (its keys and trusted keys)."""
    d = tmp_path / f"config-{name}"
    monkeypatch.setenv("FIVAR_CONFIG_DIR", str(d))
    return d


def forge(src, dst, edits=None, index="update", sign_with=None, extra=None):
    """A copy of an export with members replaced (name suffix -> bytes, or a function of the old bytes).

    index: 'update' lists the new sha256/size of every member (what a forger does); 'keep' leaves the index
    and its signature as they were. sign_with: a private key file that signs the new index (else unsigned)."""
    edits = edits or {}
    with tarfile.open(src) as s:
        items = [(m, s.extractfile(m).read()) for m in s.getmembers()]
    out = []
    for mem, data in items:
        for suffix, new in edits.items():
            if mem.name.endswith(suffix):
                data = new(data) if callable(new) else new
        out.append((mem, data))
    if extra:
        out.append((tarfile.TarInfo(extra[0]), extra[1]))
    if index == "update":
        meta = json.loads(next(d for m, d in out if m.name == "fivar_export.json"))
        meta["files"] = {m.name: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)}
                         for m, d in out if m.name not in ("fivar_export.json", "fivar_export.sig")}
        blob = json.dumps(meta).encode()
        out = [(m, blob if m.name == "fivar_export.json" else d) for m, d in out if m.name != "fivar_export.sig"]
        if sign_with:
            out.append((tarfile.TarInfo("fivar_export.sig"), trust.sign(blob, sign_with)[0]))
    with tarfile.open(dst, "w:gz") as d:
        for mem, data in out:
            mem.size = len(data)
            d.addfile(mem, io.BytesIO(data))
    return dst


def swapped_manifest(uri, new_so):
    def edit(data):
        man = json.loads(data)
        return json.dumps({**man, "so_sha256": hashlib.sha256(new_so).hexdigest(), "so_size": len(new_so)}).encode()
    return edit


def swapped_index(uri, new_so):
    def edit(data):
        meta = json.loads(data)
        for e in meta["entries"]:
            if e["uri"] == uri:
                e["so_sha256"] = hashlib.sha256(new_so).hexdigest()
        return json.dumps(meta).encode()
    return edit


def test_an_unsigned_archive_with_a_swapped_library_never_gets_it_loaded(iso, tmp_path):
    """The reproduced exploit: another .so with its own sha256 in manifest and index. Unsigned, so only its
    sources are imported: no library on disk, no disk hit, verify and ls do not call it ok."""
    _, ws, vfile = iso
    m = fake_built(module(vfile))
    good = tmp_path / "good.tar.gz"
    assert as_json("cache", "export", str(good))["signed_by"] is None  # no key on this machine
    as_json("cache", "clear", "--yes")
    evil_so = os.urandom(4096)
    evil = forge(good, tmp_path / "evil.tar.gz", {f"{m.uri}.so": evil_so,
                                                  f"{m.uri}/fivar_manifest.json": swapped_manifest(m.uri, evil_so),
                                                  "fivar_export.json": swapped_index(m.uri, evil_so)})
    res = as_json("cache", "import", str(evil))
    assert res["trust"] == "unsigned" and res["imported"] == [] and res["sources_only"] == [m.uri]
    assert not m.library_path.exists() and not m.manifest_path.exists() and not m.manifest_ok()
    assert all((m.gen_dir / n).read_text() == t for n, t in m.sources.items())  # its sources are ours anyway
    rows = [r for r in as_json("cache", "ls") if r["uri"] == m.uri]
    assert rows and rows[0]["stale"] is True and "rebuilds on next use" in rows[0]["stale_reasons"][0]
    r = invoke("cache", "verify", "--json")
    assert r.exit_code == 1 and not json.loads(r.stdout)[0]["ok"]


def test_a_swapped_library_in_a_signed_archive_fails_one_line_and_a_resigned_one_is_untrusted(iso, tmp_path,
                                                                                            monkeypatch):
    _, ws, vfile = iso
    m = fake_built(module(vfile))
    key = as_json("cache", "keygen")
    good = tmp_path / "good.tar.gz"
    assert as_json("cache", "export", str(good))["signed_by"] == key["fingerprint"]
    evil_so = os.urandom(m.library_path.stat().st_size)  # same size: only its hash tells
    as_json("cache", "clear", "--yes")
    swap = {f"{m.uri}.so": evil_so, f"{m.uri}/fivar_manifest.json": swapped_manifest(m.uri, evil_so),
            "fivar_export.json": swapped_index(m.uri, evil_so)}
    # the index and signature as they were: the member no longer matches the signed sha256
    flat = one_line(invoke("cache", "import", str(forge(good, tmp_path / "a.tar.gz", {f"{m.uri}.so": evil_so},
                                                        index="keep"))))
    assert f"{m.uri}.so does not match its sha256 in the archive's index" in flat
    # the index rewritten to match, the old signature kept: it no longer verifies
    forged = forge(good, tmp_path / "b.tar.gz", swap, index="update")
    with tarfile.open(good) as g, tarfile.open(forged) as f, tarfile.open(tmp_path / "c.tar.gz", "w:gz") as d:
        for mem in f.getmembers():
            d.addfile(mem, f.extractfile(mem))
        sig = g.getmember("fivar_export.sig")
        d.addfile(sig, g.extractfile(sig))
    flat = one_line(invoke("cache", "import", str(tmp_path / "c.tar.gz")))
    assert "signature does not match the archive's index" in flat
    # signed anew by the forger's own key: valid, but not a key trusted here -> sources only
    with monkeypatch.context() as mp:
        machine(mp, tmp_path, "forger")
        forger_key = as_json("cache", "keygen")["private_key"]
    resigned = forge(good, tmp_path / "d.tar.gz", swap, sign_with=forger_key)
    res = as_json("cache", "import", str(resigned))
    assert res["trust"] == "untrusted" and res["signer"] != key["fingerprint"] and res["sources_only"] == [m.uri]
    assert not m.library_path.exists() and not m.manifest_ok()
    for bad in ("a", "b", "c"):
        assert not list((ws / "cached_ops").glob(".import-*")), bad
    # the genuine archive still imports whole
    assert as_json("cache", "import", str(good))["imported"] == [m.uri] and m.manifest_ok()


def test_a_trusted_signed_archive_imports_its_libraries_until_the_key_is_removed(iso, tmp_path, monkeypatch):
    _, ws, vfile = iso
    m = fake_built(module(vfile), size=5000 + int.from_bytes(os.urandom(1), "little"))
    so = m.library_path.read_bytes()
    machine(monkeypatch, tmp_path, "builder")
    key = as_json("cache", "keygen")
    assert oct(os.stat(key["private_key"]).st_mode & 0o777) == "0o600"
    archive = tmp_path / "mods.tar.gz"
    as_json("cache", "export", str(archive))
    as_json("cache", "clear", "--yes")

    machine(monkeypatch, tmp_path, "server")  # trusts nobody yet
    res = as_json("cache", "import", str(archive))
    assert res["trust"] == "untrusted" and res["sources_only"] == [m.uri] and not m.library_path.exists()
    r = invoke("cache", "import", str(archive))
    assert "not trusted here" in " ".join(r.output.split()) and "build here on first use" in " ".join(r.output.split())
    assert as_json("cache", "trust", key["public_key"])["trusted"] == key["fingerprint"]
    res = as_json("cache", "import", str(archive))
    assert res["trust"] == "trusted" and res["imported"] == [m.uri]
    assert m.library_path.read_bytes() == so and m.manifest_ok() and m.build() == "disk"
    man = json.loads(m.manifest_path.read_text())
    assert man["provenance"] == {"kind": "signed", "signer": key["fingerprint"]}
    row = [r for r in as_json("cache", "ls") if r["uri"] == m.uri][0]
    assert row["stale"] is False and row["provenance"]["kind"] == "signed"
    assert json.loads(invoke("cache", "verify", "--json").stdout)[0]["ok"]
    # the key is no longer trusted: its library is not loaded (rebuilt), verify says why
    as_json("cache", "trust", "--remove", key["fingerprint"][:12])
    assert not m.manifest_ok()
    r = invoke("cache", "verify", "--json")
    assert r.exit_code == 1 and "no longer trusted" in " ".join(json.loads(r.stdout)[0]["problems"])


def test_trust_unsigned_imports_libraries_with_a_loud_warning(iso, tmp_path):
    _, ws, vfile = iso
    m = fake_built(module(vfile))
    so = m.library_path.read_bytes()
    archive = tmp_path / "mods.tar.gz"
    as_json("cache", "export", str(archive))
    as_json("cache", "clear", "--yes")
    r = invoke("cache", "import", str(archive), "--trust-unsigned", "--json")
    assert r.exit_code == 0 and "WARNING" in r.stderr and "unsigned" in r.stderr, r.output
    assert json.loads(r.stdout)["imported"] == [m.uri]
    assert m.library_path.read_bytes() == so and m.manifest_ok() and m.build() == "disk"
    assert json.loads(m.manifest_path.read_text())["provenance"] == {"kind": "unsigned"}
    row = [r for r in as_json("cache", "ls") if r["uri"] == m.uri][0]
    assert row["stale"] is None and "unsigned archive" in row["stale_reasons"][0]


def test_a_manifest_naming_another_variant_is_refused_and_never_runs_it(iso, tmp_path):
    """The manifest's variant field chose which ./variants file `cache ls` executed. In a signed archive it is
    covered by the signed index; forged consistently and imported with --trust-unsigned it must still name the
    variant its URI was rendered from; and a manifest already on disk naming another variant runs nothing."""
    _, ws, vfile = iso
    sentinel = tmp_path / "SENTINEL"
    (vfile.parent / "evilv.py").write_text(SENTINEL_VARIANT.format(sentinel=str(sentinel)))
    m = fake_built(module(vfile))
    as_json("cache", "keygen")
    good = tmp_path / "good.tar.gz"
    as_json("cache", "export", str(good))
    as_json("cache", "clear", "--yes")
    renamed = {f"{m.uri}/fivar_manifest.json": lambda d: json.dumps({**json.loads(d), "variant": "evilv"}).encode()}
    flat = one_line(invoke("cache", "import", str(forge(good, tmp_path / "a.tar.gz", renamed, index="keep"))))
    assert re.search(r"fivar_manifest.json'? (does not match its sha256 in|is another size than) the archive's index",
                     flat), flat
    both = {**renamed, "fivar_export.json": lambda d: json.dumps(
        {**json.loads(d), "entries": [{**e, "variant": "evilv"} for e in json.loads(d)["entries"]]}).encode()}
    flat = one_line(invoke("cache", "import", str(forge(good, tmp_path / "b.tar.gz", both)), "--trust-unsigned"))
    assert "names variant 'evilv'" in flat and "not the module its URI names" in flat
    assert not m.build_dir.exists() and not m.gen_dir.exists()
    # on disk already (planted, or imported by an older fivar): ls, show, verify and prune --stale run nothing
    as_json("cache", "import", str(good))
    man = json.loads(m.manifest_path.read_text())
    m.manifest_path.write_text(json.dumps({**man, "variant": "evilv", "variant_file": str(vfile.parent / "evilv.py")}))
    for args in (["ls", "--json"], ["show", m.uri, "--json"], ["prune", "--stale", "--dry-run", "--json"],
                 ["verify", "--json"]):
        r = invoke("cache", *args)
        assert "Traceback" not in r.output, r.output
    assert not sentinel.exists()
    row = [r for r in as_json("cache", "ls") if r["uri"] == m.uri][0]
    assert row["stale"] is None and "is not a module of it" in row["stale_reasons"][0]
    assert "tampered" in " ".join(json.loads(invoke("cache", "verify", "--json").stdout)[0]["problems"])


def test_a_library_imported_before_archives_were_signed_is_rebuilt_not_loaded(iso, tmp_path):
    _, ws, vfile = iso
    m = fake_built(module(vfile))
    man = json.loads(m.manifest_path.read_text())
    man.pop("provenance")
    m.manifest_path.write_text(json.dumps({**man, "imported_from": "/tmp/old.tar.gz", "imported": time.time()}))
    assert not m.manifest_ok()
    r = invoke("cache", "verify", "--json")
    assert r.exit_code == 1 and "never checked" in " ".join(json.loads(r.stdout)[0]["problems"])
    assert json.loads(invoke("cache", "verify", "--fix", "--json").stdout)[0]["fixed"]
    assert not m.library_path.exists()
    # a manifest that claims a provenance fivar never writes is malformed
    fake_built(m)
    man = json.loads(m.manifest_path.read_text())
    m.manifest_path.write_text(json.dumps({**man, "provenance": {"kind": "trusted-by-me"}}))
    assert not m.manifest_ok() and "provenance" in m.read_manifest()[1]


@pytest.mark.parametrize("case", ["library", "source", "total"])
def test_members_over_their_cap_are_refused_before_a_byte_is_written(iso, tmp_path, case):
    """A few KB of gzip can claim gigabytes: the sizes in the tar headers are checked before anything is
    unpacked."""
    _, ws, vfile = iso
    m = fake_built(module(vfile), size=64 * 1024 + int.from_bytes(os.urandom(2), "little"))
    good = tmp_path / "good.tar.gz"
    as_json("cache", "export", str(good))
    as_json("cache", "clear", "--yes")
    args, archive = [], good
    if case == "library":
        args = ["--max-member-size", "64K", "--trust-unsigned"]
    elif case == "total":
        args = ["--max-total-size", "32K"]
    else:  # a 64 MiB + 1 header of zeros: about 64 KB of gzip
        big = sorted(n for n in m.sources if n.endswith(".cuh") or n.endswith(".inc"))[0]
        archive = forge(good, tmp_path / "bomb.tar.gz", {f"{m.uri}/{big}": bytes((64 << 20) + 1)})
        assert archive.stat().st_size < 1 << 20
    flat = one_line(invoke("cache", "import", str(archive), *args))
    assert ("add up to more than 32.0 KiB" if case == "total" else "cap on a " + case) in flat, flat
    assert "nothing was written" in flat
    assert not m.build_dir.exists() and not m.gen_dir.exists()
    assert not list((ws / "cached_ops").glob(".import-*"))


def test_staging_left_by_a_killed_import_is_shown_and_cleaned(iso, tmp_path):
    _, ws, vfile = iso
    m = fake_built(module(vfile))
    archive = tmp_path / "mods.tar.gz"
    as_json("cache", "export", str(archive))
    ops = ws / "cached_ops"
    dead = ops / ".import-fivar_killed-abc123"  # its lock file is there, nobody holds it
    (dead / "cached_ops").mkdir(parents=True)
    (dead / "cached_ops" / "x.so").write_bytes(os.urandom(100))
    (dead / locks.BUILD_LOCK).touch()
    old = ops / ".import-fivar_older-def456"  # killed before it locked: old
    old.mkdir()
    os.utime(old, (time.time() - 3600,) * 2)
    live = ops / ".import-fivar_live-ghi789"  # an import running now
    live.mkdir()
    with locks.build_lock(live):
        rows = json.loads(invoke("cache", "verify", "--json").stdout)
        staging = sorted(r["uri"] for r in rows if r.get("staging"))
        assert staging == sorted([dead.name, old.name])
        rows = json.loads(invoke("cache", "verify", "--fix", "--json").stdout)
        assert all(r["fixed"] for r in rows if r.get("staging"))
        assert not dead.exists() and not old.exists() and live.exists()
        dead.mkdir()
        (dead / locks.BUILD_LOCK).touch()
        as_json("cache", "import", str(archive))  # an import cleans up first
        assert not dead.exists() and live.exists()
    assert json.loads(invoke("cache", "verify", "--json").stdout)[0]["ok"]


def _raiser(code, real=None, after=0):
    """A stand-in for an os/shutil function that fails with `code` (after `after` calls to `real`)."""
    calls = [0]

    def f(*args, **kwargs):
        calls[0] += 1
        if real is not None and calls[0] <= after:
            return real(*args, **kwargs)
        raise OSError(code, os.strerror(code), str(args[0]) if args else None)
    return f


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_export_on_a_full_or_read_only_disk_is_one_line_and_leaves_no_temp_file(iso, tmp_path, monkeypatch, code):
    _, ws, vfile = iso
    fake_built(module(vfile), size=200 * 1024)
    out = tmp_path / "exports"
    out.mkdir()
    (out / "mods.tar.gz").write_bytes(b"the previous export")
    # the gzip stream fails midway through the archive
    monkeypatch.setattr(gzip.GzipFile, "write", _raiser(code, gzip.GzipFile.write, after=3))
    flat = one_line(invoke("cache", "export", str(out / "mods.tar.gz")))
    monkeypatch.undo()
    assert ("no space left" if code == errno.ENOSPC else "read-only file system") in flat
    assert sorted(p.name for p in out.iterdir()) == ["mods.tar.gz"]
    assert (out / "mods.tar.gz").read_bytes() == b"the previous export"


@pytest.mark.parametrize("where", ["staging", "install"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_import_on_a_full_or_read_only_disk_is_one_line_and_half_writes_nothing(iso, tmp_path, monkeypatch,
                                                                                where, code):
    _, ws, vfile = iso
    m1, m2 = fake_built(module(vfile, "bf16", 128)), fake_built(module(vfile, "fp16", 64))
    as_json("cache", "keygen")
    archive = tmp_path / "mods.tar.gz"
    as_json("cache", "export", str(archive))
    as_json("cache", "clear", "--yes")
    with monkeypatch.context() as mp:
        if where == "staging":
            mp.setattr(shutil, "copyfileobj", _raiser(code, shutil.copyfileobj, after=2))
        else:  # the second module's move into place
            mp.setattr(os, "replace", _raiser(code, os.replace, after=len(m1.sources) + 1))
        flat = one_line(invoke("cache", "import", str(archive)))
    assert ("no space left" if code == errno.ENOSPC else "read-only file system") in flat
    whole = [m for m in (m1, m2) if m.manifest_ok()]
    for m in (m1, m2):
        if m not in whole:  # not imported: nothing of its library or manifest is left
            assert not m.library_path.exists() and not m.manifest_path.exists()
        assert not list(m.build_dir.glob(".*.tmp")) if m.build_dir.exists() else True
    assert not list((ws / "cached_ops").glob(".import-*"))
    assert sorted(as_json("cache", "import", str(archive))["imported"] +
                  [m.uri for m in whole]) == sorted([m1.uri, m2.uri])


@pytest.mark.parametrize("command", [["clear", "--yes"], ["prune", "--older-than", "0s"]])
def test_clear_and_prune_on_a_read_only_workspace_are_one_line_and_remove_nothing(iso, monkeypatch, command):
    _, ws, vfile = iso
    m = fake_built(module(vfile))
    with monkeypatch.context() as mp:
        for name in ("unlink", "rmdir", "remove"):
            mp.setattr(os, name, _raiser(errno.EROFS))
        mp.setattr(shutil, "rmtree", _raiser(errno.EROFS))
        flat = one_line(invoke("cache", *command))
    assert "read-only file system" in flat
    assert m.manifest_ok() and all((m.gen_dir / n).exists() for n in m.sources)


def test_clear_records_works_on_records_with_wrong_typed_columns(iso):
    _, ws, vfile = iso
    m = fake_built(module(vfile))
    write_malformed_records(m.uri)
    r = invoke("cache", "ls", "--json")
    assert r.exit_code == 0 and "malformed rows" in r.stderr, r.output
    res = as_json("cache", "clear", "--records", "--yes")
    assert [x["uri"] for x in res["removed"]] == [m.uri] and res["records_cleared"]
    con = sqlite3.connect(str(records.db_path()))
    assert con.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 0
    assert con.execute("SELECT COUNT(*) FROM holders").fetchone()[0] == 0
    con.close()


def test_keys_bad_files_are_one_line(iso, tmp_path):
    junk = tmp_path / "junk.pub"
    junk.write_text("ssh-rsa AAAA nothing")
    assert "is not a fivar public key" in one_line(invoke("cache", "trust", str(junk)))
    bad_key = tmp_path / "k.pem"
    bad_key.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    assert "not an unencrypted ed25519 private key" in one_line(
        invoke("cache", "export", str(tmp_path / "x.tar.gz"), "--sign", str(bad_key)))
    as_json("cache", "keygen")
    assert "already exists" in one_line(invoke("cache", "keygen"))
    assert len(as_json("cache", "trust", "--list")["trusted"]) == 1


@pytest.mark.parametrize("how", ["unsigned-import", "imported-before-signing"])
def test_loading_a_module_whose_library_came_from_an_untrusted_archive_builds_it_here(iso, tmp_path, monkeypatch,
                                                                                     how):
    """What `fivar build` / a first call does next: compile (faked here) and load that, never the foreign bytes."""
    from test_cache_races import load_with_fake_compiler

    import tvm_ffi
    _, ws, vfile = iso
    m = fake_built(module(vfile))
    good = tmp_path / "good.tar.gz"
    as_json("cache", "export", str(good))
    as_json("cache", "clear", "--yes")
    evil_so = os.urandom(4096)
    evil = forge(good, tmp_path / "evil.tar.gz", {f"{m.uri}.so": evil_so,
                                                  f"{m.uri}/fivar_manifest.json": swapped_manifest(m.uri, evil_so),
                                                  "fivar_export.json": swapped_index(m.uri, evil_so)})
    if how == "unsigned-import":
        as_json("cache", "import", str(evil))
    else:  # what an older fivar's import left: the archive's library and manifest, no provenance
        as_json("cache", "import", str(evil), "--trust-unsigned")
        man = json.loads(m.manifest_path.read_text())
        man.pop("provenance")
        m.manifest_path.write_text(json.dumps(man))
        assert m.library_path.read_bytes() == evil_so
    loaded = []
    monkeypatch.setattr(tvm_ffi, "load_module", lambda path: loaded.append(open(path, "rb").read()) or object())
    load_with_fake_compiler(m)
    assert loaded == [m.library_path.read_bytes()] and loaded[0] != evil_so
    assert json.loads(m.manifest_path.read_text())["provenance"] == {"kind": "build"}
