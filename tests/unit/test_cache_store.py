"""The cache model (fivar.jit.store, integrity, archive) without the command line: it returns data, prints
nothing, hands warnings to its caller, and the `fivar cache` commands print what it returns."""
import logging
import random
from pathlib import Path

import fivar
from fivar.jit import integrity, records, store

from test_cache_cli import as_json, fake_built, write_malformed_records, iso, module  # noqa: F401 - the fixture
from test_import_layers import PACKAGE, _every_import

MODEL = ("store", "integrity", "archive")


def test_the_cache_model_imports_no_command_line_and_no_console():
    for name in MODEL:
        path = PACKAGE / "jit" / f"{name}.py"
        imports = _every_import(path.read_text(), f"fivar.jit.{name}")
        ui = sorted(m for m in imports if m.split(".")[0] in ("click", "rich") or m == "fivar.console"
                    or m == "fivar.cli" or m.startswith("fivar.cli."))
        assert not ui, f"fivar.jit.{name} imports {ui}"
        assert "print(" not in path.read_text()


def test_prune_returns_what_the_command_prints_and_prints_nothing(iso, capsys):
    _, _, vfile = iso
    rng = random.Random()
    hours = rng.sample(range(1, 40), 4)  # +0.25 h: no age sits on a rounding edge of "Nh ago"
    mods = [fake_built(module(vfile, dtype, hd), size=rng.randrange(100, 5000), age_s=(h + 0.25) * 3600)
            for (dtype, hd), h in zip([("bf16", 128), ("bf16", 64), ("fp16", 128), ("fp16", 64)], hours)]
    cut = rng.choice(hours)
    old = sorted(m.uri for m, h in zip(mods, hours) if h >= cut)
    data = store.prune(older_than=f"{cut * 3600}s", dry_run=True)
    assert capsys.readouterr() == ("", "")
    assert sorted(r["uri"] for r in data["evicted"]) == old and not data["skipped"]
    assert data["freed_bytes"] == sum(store.find(u).size for u in old)
    assert all(m.manifest_ok() for m in mods)  # a dry run
    cli = as_json("cache", "prune", "--older-than", f"{cut * 3600}s", "--dry-run")
    assert [(r["uri"], r["size_bytes"]) for r in cli["evicted"]] == \
        [(r["uri"], r["size_bytes"]) for r in data["evicted"]]


def test_malformed_records_warn_the_caller_once_or_the_fivar_logger(iso, capsys, caplog, monkeypatch):
    _, _, vfile = iso
    m = fake_built(module(vfile))
    write_malformed_records(m.uri)
    monkeypatch.setattr(store, "_records_warned", [])
    got = []
    for _ in range(2):
        (e,) = store.annotate(store.scan_entries(), check_stale=False, warn=got.append)
        assert e.uri == m.uri and e.hits == 0
    assert capsys.readouterr() == ("", "")
    assert len(got) == 1 and got[0].startswith("warning: fivar's build records hold malformed rows")
    monkeypatch.setattr(store, "_records_warned", [])
    with caplog.at_level(logging.WARNING, logger="fivar"):
        store.annotate(store.scan_entries(), check_stale=False)
    assert capsys.readouterr() == ("", "")
    assert [r.getMessage() for r in caplog.records if r.name == "fivar"] == got


def test_untrusted_roots_name_fivars_cache_dir_without_creating_it(iso, tmp_path, monkeypatch):
    where = tmp_path / f"not-yet-{random.randrange(1 << 30)}" / "fivar"
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(where))
    roots = integrity.untrusted_roots()
    assert Path(where).resolve() in roots and not where.exists()
    assert integrity.inside(where / "variants" / "v.py", roots)
    assert not integrity.inside(Path(fivar.__file__), roots)
