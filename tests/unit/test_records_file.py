"""fivar's build records (fivar.jit.records) survive their file being removed under a running process: a
`fivar cache clear --records` in another shell, or a cache directory deleted and made again."""
import os

from fivar.jit import records


def _tables(con) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def test_a_records_file_removed_under_a_running_process_is_set_up_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    path = records.db_path()
    con = records.connect()
    assert {"events", "holders"} <= _tables(con)
    con.close()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.remove(f"{path}{suffix}")
    con = records.connect()  # the same process, the same path: before, the tables were taken as set up
    try:
        assert {"events", "holders"} <= _tables(con)
        assert con.execute("SELECT count(*) FROM events").fetchone()[0] == 0
    finally:
        con.close()
