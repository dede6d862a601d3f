"""Manifests are validated on read (one validator, a schema version) and libraries are checked by content.

A malformed manifest ([1, 2], null, wrong field types, not JSON) is reported in one line by `build` and every
`cache` command, `verify --fix` repairs it, `import` refuses it. A library corrupted without changing its
size (nor, here, its mtime) is caught by its sha256 and rebuilt, never served; the hash is taken once per
version of the file.
"""
import json
import logging
import os

import pytest
from test_cache_cli import as_json, fake_built, invoke, iso, module  # noqa: F401 - the fixture

from fivar.jit import build as jb
from fivar.jit import manifest as manifests

MALFORMED = {
    "list": "[1, 2]",
    "null": "null",
    "not-json": "{oops",
    "deep": "[" * 100000,  # past the JSON reader's depth: a RecursionError, not a ValueError
    "string": '"fivar"',
    "types": None,  # a real manifest with wrong field types (filled in per module)
    "schema": None,  # a schema this fivar does not know
}


def _malform(m, case):
    man = json.loads(m.manifest_path.read_text())
    text = {"types": json.dumps({**man, "head_dim": "128", "so_size": 1.5, "sources": "x.cu", "options": []}),
            "schema": json.dumps({**man, "schema": 99})}.get(case) or MALFORMED[case]
    m.manifest_path.write_text(text)


def _fake_compiler(monkeypatch, compiled):
    """JitSpecNvcc.build as a stand-in linker: a fresh library, the module's name noted."""
    import flashinfer.jit.core as core
    from flashinfer.jit import env as jit_env

    def build(self, verbose=None, need_lock=False):
        out = jit_env.FLASHINFER_JIT_DIR / self.name / f"{self.name}.so"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(os.urandom(3000))
        compiled.append(self.name)
    monkeypatch.setattr(core.JitSpecNvcc, "build", build)


def test_the_validator_names_what_is_wrong():
    good = {"schema": 2, "uri": "fivar_x_fa2_single_prefill_bf16_hd128_0123456789ab", "variant": "x",
            "op": "single_prefill", "dtype": "bf16", "head_dim": 128, "so_size": 1, "so_mtime_ns": 1,
            "so_sha256": "0" * 64, "sources": ["a.cu"], "cuda_cflags": ["-O3"]}
    assert manifests.problems(good) == []
    assert manifests.problems([1, 2]) == ["not a JSON object (a list)"]
    assert manifests.problems(None) == ["not a JSON object (a NoneType)"]
    assert manifests.problems({**good, "head_dim": True}) == ["field 'head_dim' is a bool, expected int"]
    assert manifests.problems({**good, "so_size": "1"}) == ["field 'so_size' is a str, expected int"]
    assert "field 'cuda_cflags' is missing" in manifests.problems({k: v for k, v in good.items()
                                                                    if k != "cuda_cflags"})
    assert manifests.problems({k: v for k, v in good.items() if k not in ("cuda_cflags", "schema")}) == []  # v1
    assert "not C++/CUDA sources" in manifests.problems({**good, "sources": ["evil.py"]})[0]
    assert "not C++/CUDA sources" in manifests.problems({**good, "sources": ["../x.cu"]})[0]
    assert "schema 3" in manifests.problems({**good, "schema": 3})[0]
    with pytest.raises(manifests.ManifestError, match="not JSON"):
        manifests.parse("{")
    with pytest.raises(manifests.ManifestError, match="nested too deeply"):
        manifests.parse("[" * 100000)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_every_cache_command_reports_a_malformed_manifest_and_verify_fix_repairs_it(iso, case):
    _, ws, vfile = iso
    m, ok = fake_built(module(vfile, "fp16", 64)), fake_built(module(vfile, "bf16", 64))
    _malform(m, case)
    assert not m.manifest_ok() and ok.manifest_ok()
    for args in (["ls"], ["ls", "--no-stale-check"], ["show", m.uri], ["stats"], ["verify"],
                 ["prune", "--stale", "--dry-run"], ["prune", "--older-than", "30d"], ["prune", "--max-size", "1G"],
                 ["export", str(ws / "x.tar.gz")]):
        r = invoke("cache", *args, "--json")
        assert "Traceback" not in r.output and not isinstance(r.exception, AttributeError), (args, r.output)
        assert r.exit_code in (0, 1), (args, r.output)
    row = next(r for r in as_json("cache", "ls") if r["uri"] == m.uri)
    assert row["stale"] is True and "malformed manifest" in row["stale_reasons"][0], row
    r = invoke("cache", "verify", "--json")
    bad = {x["uri"]: x for x in json.loads(r.output)}
    assert r.exit_code == 1 and "malformed manifest" in bad[m.uri]["problems"][0] and bad[ok.uri]["ok"]
    # --fix removes the module (manifest, library, sources): the next build makes it again
    r = invoke("cache", "verify", "--fix", "--json")
    assert r.exit_code == 0 and {x["uri"]: x["fixed"] for x in json.loads(r.output)} == {m.uri: True, ok.uri: False}
    assert not m.manifest_path.exists() and not m.library_path.exists() and ok.manifest_ok()
    assert all(x["ok"] for x in as_json("cache", "verify"))


@pytest.mark.parametrize("case", ["list", "null", "types", "deep"])
def test_build_over_a_malformed_manifest_rebuilds_with_one_warning(iso, monkeypatch, caplog, case):
    _, ws, vfile = iso
    m = fake_built(module(vfile, "fp16", 64))
    _malform(m, case)
    compiled = []
    _fake_compiler(monkeypatch, compiled)
    with caplog.at_level(logging.WARNING, logger="fivar"):
        assert m.build() == "cold"
    assert compiled == [m.uri] and m.manifest_ok()
    assert any("malformed manifest" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    man = json.loads(m.manifest_path.read_text())
    assert man["schema"] == manifests.SCHEMA_VERSION and man["cuda_cflags"] == m.cuda_cflags


@pytest.mark.parametrize("case", ["list", "deep"])
def test_fivar_build_cli_over_a_malformed_manifest_is_not_a_traceback(iso, monkeypatch, case):
    _, ws, vfile = iso
    m = fake_built(module(vfile, "fp16", 64))
    _malform(m, case)
    compiled = []
    _fake_compiler(monkeypatch, compiled)
    r = invoke("build", "cachev", "--ops", "single_prefill", "--targets", "fa2", "--dtypes", "fp16",
               "--head-dims", "64")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert compiled == [m.uri] and m.manifest_ok()
    assert f"compiled {m.uri}" in r.output  # not a terminal: one line per module compiled


def test_a_same_size_corrupted_library_is_caught_and_rebuilt_never_served(iso, monkeypatch, caplog):
    _, ws, vfile = iso
    m = fake_built(module(vfile, "fp16", 64), size=4096)
    st = m.library_path.stat()
    data = bytearray(m.library_path.read_bytes())
    data[100] ^= 0xFF
    m.library_path.write_bytes(bytes(data))
    os.utime(m.library_path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    assert m.library_path.stat().st_size == st.st_size and m.library_path.stat().st_mtime_ns == st.st_mtime_ns
    assert not m.manifest_ok()
    compiled = []
    _fake_compiler(monkeypatch, compiled)
    import tvm_ffi
    served = []
    monkeypatch.setattr(tvm_ffi, "load_module", lambda p: served.append(open(p, "rb").read()) or object())
    try:
        with caplog.at_level(logging.WARNING, logger="fivar"):
            m.load()
    finally:
        jb._loaded.pop(m.uri, None)
        from fivar.jit import locks
        locks.release_hold(m.build_dir)
    assert compiled == [m.uri] and served == [m.library_path.read_bytes()] and served[0] != bytes(data)
    assert any("does not hash to its manifest" in r.getMessage() for r in caplog.records)
    verify = as_json("cache", "verify")
    assert all(x["ok"] for x in verify)


def test_the_library_hash_is_taken_once_per_version_of_the_file(iso, monkeypatch):
    _, ws, vfile = iso
    m = fake_built(module(vfile, "fp16", 64), size=4096)  # its build hashed it: no second hash
    calls = []
    from fivar.jit import module as jm
    real = jm._sha256
    monkeypatch.setattr(jm, "_sha256", lambda p: calls.append(p) or real(p))
    jb._verified.clear()
    for _ in range(5):
        assert m.manifest_ok()
    assert calls == []  # a fresh process reads the stamp beside the library
    (m.build_dir / ".fivar.verified").unlink()
    jb._verified.clear()
    assert m.manifest_ok() and m.manifest_ok() and len(calls) == 1  # hashed once, then remembered
    os.utime(m.library_path)  # a new version (mtime): hashed again, and its mtime no longer matches anyway
    assert not m.manifest_ok()
