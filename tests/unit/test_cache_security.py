"""Nothing in the cache runs: a hostile archive, a planted file or a swapped Triton twin executes no code.

The payload of every case writes a sentinel file when executed; each test asserts the sentinel never appears
after every command that reads the cache (import, ls, show, prune --stale --dry-run, verify), and that the
commands say what is wrong instead.
"""
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from test_cache_cli import VARIANT, as_json, fake_built, invoke, iso, module  # noqa: F401 - the fixture

import fivar
from fivar.jit import triton_module

REPO = Path(__file__).resolve().parents[2]


def payload(sentinel: Path) -> bytes:
    """A variant file that also does what an attacker wants (here: leaves a sentinel file)."""
    return (f"open({str(sentinel)!r}, 'w').write('ran')\n" + VARIANT).encode()


def _hostile_archive(src: Path, dst: Path, uri: str, sentinel: Path, manifest_variant_file: str,
                     variant: str = "cachev") -> Path:
    """The exploit: a copy of a real export whose manifest names, as its variant file, a .py the archive ships
    under generated/<uri>/."""
    with tarfile.open(src) as s, tarfile.open(dst, "w:gz") as d:
        for mem in s.getmembers():
            data = s.extractfile(mem).read()
            if mem.name == f"cached_ops/{uri}/fivar_manifest.json":
                data = json.dumps({**json.loads(data), "variant_file": manifest_variant_file,
                                   "variant": variant}).encode()
            mem.size = len(data)
            d.addfile(mem, io.BytesIO(data))
        info = tarfile.TarInfo(f"generated/{uri}/{variant}.py")
        body = payload(sentinel)
        info.size = len(body)
        d.addfile(info, io.BytesIO(body))
    return dst


def _every_reader(uri: str) -> dict:
    """Run every cache command that reads manifests; return their outputs by name."""
    out = {}
    for name, args in {"ls": ["cache", "ls", "--json"], "show": ["cache", "show", uri, "--json"],
                       "prune": ["cache", "prune", "--stale", "--dry-run", "--json"],
                       "verify": ["cache", "verify", "--json"]}.items():
        r = invoke(*args)
        assert "Traceback" not in r.output, r.output
        out[name] = r
    return out


def test_an_archive_that_ships_a_variant_file_is_refused_and_nothing_runs(iso, tmp_path):
    root, ws, vfile = iso
    m = fake_built(module(vfile))
    sentinel = tmp_path / "SENTINEL"
    good = tmp_path / "good.tar.gz"
    as_json("cache", "keygen")  # signed by a trusted key: the whole module imports
    as_json("cache", "export", str(good))
    as_json("cache", "clear", "--yes")
    planted = ws / "generated" / m.uri / "cachev.py"
    evil = _hostile_archive(good, tmp_path / "evil.tar.gz", m.uri, sentinel, str(planted))
    r = invoke("cache", "import", str(evil))
    assert r.exit_code == 1 and "cachev.py" in r.output and "refusing to import" in r.output, r.output
    assert not planted.exists() and not m.library_path.exists()  # refused whole: nothing unpacked
    _every_reader(m.uri)
    assert not sentinel.exists()
    # the same archive without the payload imports (the archive format itself is fine)
    assert as_json("cache", "import", str(good))["imported"] == [m.uri]
    _every_reader(m.uri)
    assert not sentinel.exists()


@pytest.mark.parametrize("name_on_path", [True, False])
def test_a_planted_variant_file_in_the_cache_is_never_executed(iso, tmp_path, name_on_path):
    """The archive's files already on disk (planted by hand, or imported by an older fivar): ls, show, prune
    --stale --dry-run and verify load no file a manifest names; staleness is undecidable, verify says tampered."""
    root, ws, vfile = iso
    m = fake_built(module(vfile))
    sentinel = tmp_path / "SENTINEL"
    variant = "cachev" if name_on_path else "evilv"
    planted = m.gen_dir / f"{variant}.py"
    planted.write_bytes(payload(sentinel))
    man = json.loads(m.manifest_path.read_text())
    m.manifest_path.write_text(json.dumps({**man, "variant_file": str(planted), "variant": variant}))
    outs = _every_reader(m.uri)
    assert not sentinel.exists()
    row = next(r for r in json.loads(outs["ls"].output) if r["uri"] == m.uri)
    assert row["stale"] is None, row
    reason = row["stale_reasons"][0]
    if name_on_path:
        assert "inside fivar's or FlashInfer's cache" in reason and "never loaded" in reason
    else:
        # the name is not the URI's variant, so nothing is looked up by it
        assert "is not a module of it" in reason and "no variant is looked up" in reason
    assert json.loads(outs["prune"].output)["evicted"] == []  # undecidable is not stale
    verified = json.loads(outs["verify"].output)
    assert outs["verify"].exit_code == 1
    problems = " ".join(verified[0]["problems"])
    assert "variant file inside the cache" in problems and f"{variant}.py" in problems and "tampered" in problems
    # verify --fix removes the whole tampered module; nothing ran on the way
    fixed = json.loads(invoke("cache", "verify", "--fix", "--json").output)
    assert fixed[0]["fixed"] and not m.gen_dir.exists() and not m.build_dir.exists()
    assert not sentinel.exists()


def test_a_search_path_inside_the_cache_is_not_searched(iso, tmp_path, monkeypatch):
    root, ws, vfile = iso
    m = fake_built(module(vfile))
    sentinel = tmp_path / "SENTINEL"
    inside = m.gen_dir / "variants"
    inside.mkdir()
    (inside / "cachev.py").write_bytes(payload(sentinel))
    monkeypatch.setenv("FIVAR_VARIANT_PATH", str(inside))  # the only directory with this name: the cache's
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # no ./variants
    row = next(r for r in as_json("cache", "ls") if r["uri"] == m.uri)
    assert row["stale"] is None and "not on the variant search path" in row["stale_reasons"][0]
    assert not sentinel.exists()


def test_the_triton_twin_executes_what_it_rendered_not_the_file_in_the_cache(tmp_path, monkeypatch):
    """A file with the twin's very name, planted (or swapped in) in fivar's cache dir, is never imported."""
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path / "fivar"))
    (tmp_path / "twinv.py").write_text(VARIANT.replace('"cachev"', '"twinv"'))
    v = fivar.load(str(tmp_path / "twinv.py"))
    from fivar.codegen.triton import render_attention
    text = render_attention(v)
    name = triton_module.module_name(v, text)
    sentinel = tmp_path / "SENTINEL"
    planted = tmp_path / "fivar" / "triton" / f"{name}.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
    monkeypatch.setattr(triton_module, "_write", lambda n, t: planted)  # a swap right after the write
    mod = triton_module.load_triton_module(v)
    assert not sentinel.exists()
    assert hasattr(mod, "prefill") and mod.__file__ == str(planted)
    import inspect
    assert inspect.getsource(mod) == text  # what Triton reads is the rendered text too


def test_a_fresh_process_rewrites_a_tampered_twin_and_runs_the_rendered_one(tmp_path):
    cache = tmp_path / "fivar"
    (tmp_path / "twinv2.py").write_text(VARIANT.replace('"cachev"', '"twinv2"'))
    code = ("import fivar, sys\nfrom fivar.jit import triton_module\n"
            f"v = fivar.load({str(tmp_path / 'twinv2.py')!r})\n"
            "m = triton_module.load_triton_module(v)\nprint(m.__file__)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "FIVAR_CACHE_DIR": str(cache), "TRITON_INTERPRET": "1"}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    path = Path(first.stdout.strip().splitlines()[-1])
    rendered = path.read_text()
    sentinel = tmp_path / "SENTINEL"
    path.write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n" + rendered)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert not sentinel.exists() and path.read_text() == rendered
