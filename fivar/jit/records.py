"""A record of every build and load, in an embedded SQLite database (FIVAR_CACHE_DIR/records.sqlite).

Each row says what it took to get a module's library: `cold` (nvcc ran), `disk` (a library built earlier,
trusted through its manifest) or `memory` (already loaded in this process), with the seconds it took, the
toolchain (arch, FlashInfer, nvcc, torch), host and pid. `fivar cache ls|show|stats|prune` read it.

Cost model, deliberately asymmetric:

- `cold` and `disk` build events are written at once, one short transaction each (WAL mode, a busy
  timeout, so any number of processes can write at the same time; a writer waits for the lock instead of
  failing). Their cost (1-2 ms in a fresh process) is noise next to a compile.
- Load events (and their holder rows) are handed to a background writer thread instead: a fresh process
  that loads a module from disk would otherwise spend longer on the transaction (3-7 ms) than on the
  dlopen (about 1 ms). They are written moments later; `flush()` (which every reader in `fivar cache`
  calls first, and atexit) waits for them. Another process's `fivar cache prune` cannot see a holder row
  that is still queued; prune does not rely on it (the hold lock in the module's directory is taken before
  the library is opened).
  A forked child writes synchronously (it may leave through os._exit, which skips atexit).
- `memory` hits happen on every attention call (`module_for(...).load()`), so they never touch the
  database on the hot path: `memory_hit(uri)` only bumps a per-process counter (well under a microsecond).
  The counters are written as one aggregated row per URI (`kind='memory'`, `count=N`) when the process
  exits (atexit), and at most once a minute when a hit notices the minute has passed. A process killed
  with SIGKILL loses at most a minute of memory-hit counts; that only affects hit statistics.
- Loads also record a *holder* row (uri, host, pid), which `fivar cache ls/show` display. Whether a module
  is in use is decided by its own directory, not by these rows (a process may record under another
  FIVAR_CACHE_DIR): a loading process holds the module's hold lock until it exits (fivar.jit.locks).

Recording never breaks a build: every error here is logged as a warning (once per process) and
swallowed.
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import sqlite3
import threading
import time
from pathlib import Path

log = logging.getLogger("fivar")

FLUSH_INTERVAL_S = 60.0
BUSY_TIMEOUT_S = 30.0
SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    action TEXT NOT NULL,          -- build | load
    uri TEXT NOT NULL,
    variant TEXT, target TEXT, op TEXT, dtype TEXT, head_dim INTEGER,
    kind TEXT NOT NULL,            -- cold | disk | memory
    count INTEGER NOT NULL DEFAULT 1,
    seconds REAL NOT NULL DEFAULT 0,
    arch TEXT, flashinfer TEXT, nvcc TEXT, torch TEXT,
    host TEXT, pid INTEGER
);
CREATE INDEX IF NOT EXISTS events_uri ON events(uri, time);
CREATE INDEX IF NOT EXISTS events_time ON events(time);
CREATE TABLE IF NOT EXISTS holders (
    uri TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, time REAL NOT NULL,
    PRIMARY KEY (uri, host, pid)
);
"""

_mem_hits: dict[str, list] = {}  # uri -> [count, last_time, module fields tuple]
_last_flush = time.monotonic()
_warned = False
_lock = threading.Lock()
_schema_ready: set[str] = set()
HOST = socket.gethostname()


def db_path() -> Path:
    from ..cache import cache_dir
    return cache_dir() / "records.sqlite"


def connect(path: Path | None = None) -> sqlite3.Connection:
    """A connection with WAL journaling and a 30 s busy timeout (concurrent writers wait, not fail)."""
    path = Path(path or db_path())
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        con = None
        # a file removed since this process set it up (`cache clear --records`, a deleted cache dir) comes back
        # empty: set it up again, or the next write finds no table
        fresh = not path.exists()
        try:
            con = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
            con.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            if fresh or str(path) not in _schema_ready:
                _set_up(con, path)
            break
        except sqlite3.OperationalError as e:
            # Switching a new database to WAL needs an exclusive lock; while other processes create the same
            # file, SQLite can answer "locked" at once instead of waiting (it will not wait where waiting
            # could deadlock), so start over with a fresh connection.
            if con is not None:
                con.close()
            if _is_busy(e) and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            raise _unusable(path, e) from None
        except sqlite3.DatabaseError as e:  # not a database, a directory, unreadable
            if con is not None:
                con.close()
            raise _unusable(path, e) from None
    con.execute("PRAGMA synchronous=NORMAL")
    return con


def _set_up(con: sqlite3.Connection, path: Path) -> None:
    mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode.lower() != "wal":  # e.g. a filesystem without shared memory: still correct, just slower
        log.debug("fivar records: journal_mode is %s at %s", mode, path)
    con.executescript(SCHEMA)
    _schema_ready.add(str(path))


def _is_busy(e: sqlite3.OperationalError) -> bool:
    return "locked" in str(e) or "busy" in str(e)


def _unusable(path: Path, e: sqlite3.DatabaseError) -> Exception:
    try:
        from ..errors import FivarError  # here: the module itself imports only the standard library
    except ImportError:  # loaded standalone, outside the package
        FivarError = RuntimeError
    if isinstance(e, sqlite3.OperationalError) and _is_busy(e):
        return FivarError(f"fivar's build records {path} stayed locked by another process for {BUSY_TIMEOUT_S:g} s ({e}); "
                          f"retry, or set FIVAR_CACHE_DIR to another directory")
    return FivarError(f"fivar's build records {path} cannot be opened ({e}); move it away (fivar starts a new "
                      f"one) or set FIVAR_CACHE_DIR to another directory")


def _toolchain() -> dict:
    from . import toolchain
    out = {}
    for key, fn in (("arch", toolchain.arch_tag), ("flashinfer", toolchain.flashinfer_version),
                    ("nvcc", toolchain.nvcc_version)):
        try:
            out[key] = fn()
        except Exception:
            out[key] = None
    try:
        import torch
        out["torch"] = torch.__version__
    except Exception:
        out["torch"] = None
    return out


def _fields(module) -> tuple:
    return (module.uri, getattr(module.variant, "name", None), module.target, module.op, module.dtype,
            module.head_dim)


def _warn(what: str, e: BaseException) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("fivar: could not write build records (%s): %s: %s; builds are unaffected",
                    what, type(e).__name__, e)


def _insert(con, rows: list[tuple]) -> None:
    con.executemany(
        "INSERT INTO events(time, action, uri, variant, target, op, dtype, head_dim, kind, count, seconds,"
        " arch, flashinfer, nvcc, torch, host, pid) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)


def record(module, kind: str, seconds: float, action: str = "build", holder: bool = False,
           background: bool = False) -> None:
    """Record one build or load (kind 'memory' is counted in process, see the module docstring)."""
    if kind == "memory":
        memory_hit(module)
        return
    record_many([(module, kind, seconds)], action=action, holder=holder, background=background)


def record_many(items: list[tuple], action: str = "build", holder: bool = False, background: bool = False) -> None:
    """Record (module, kind, seconds) triples in one transaction; never raises. `background`: hand the
    transaction to the writer thread (see the module docstring) instead of waiting for it."""
    try:
        rows, now, tc, pid = [], time.time(), _toolchain(), os.getpid()
        for module, kind, seconds in items:
            if kind == "memory":
                memory_hit(module)
                continue
            rows.append((now, action, *_fields(module), kind, 1, float(seconds), tc["arch"], tc["flashinfer"],
                         tc["nvcc"], tc["torch"], HOST, pid))
        if not rows and not holder:
            return
        holders = [(m.uri, HOST, pid, now) for m, _, _ in items] if holder else []
        path = db_path()  # now: FIVAR_CACHE_DIR may change before the writer thread gets to it
        if background and _submit(rows, holders, path):
            return
        _write(rows, holders, path)
    except Exception as e:  # noqa: BLE001 - records must never break a build
        _warn("build/load event", e)


#: Held around every transaction this process makes, and across fork(): a child must not inherit SQLite's
#: internal locks taken by the writer thread mid-transaction.
_db_lock = threading.Lock()
_writes: queue.Queue = queue.Queue()
_writer: threading.Thread | None = None
#: A forked child writes at once: it may end in os._exit (multiprocessing does), which skips atexit.
_sync_only = False
WRITER_WAIT_S = 60.0


def _write(rows: list[tuple], holders: list[tuple], path: Path | None = None) -> None:
    try:
        with _db_lock:
            con = connect(path)
            try:
                con.execute("BEGIN IMMEDIATE")
                _insert(con, rows)
                con.executemany("INSERT OR REPLACE INTO holders(uri, host, pid, time) VALUES (?,?,?,?)", holders)
                con.execute("COMMIT")
            finally:
                con.close()
    except Exception as e:  # noqa: BLE001
        _warn("build/load event", e)


def _write_loop(q: queue.Queue) -> None:
    while True:
        item = q.get()
        try:
            _write(*item)
        finally:
            q.task_done()


def _submit(rows: list[tuple], holders: list[tuple], path: Path) -> bool:
    """Queue a transaction for the writer thread (started on first use). False: write it yourself."""
    global _writer
    if _sync_only:
        return False
    with _lock:
        if _writer is None:
            t = threading.Thread(target=_write_loop, args=(_writes,), name="fivar-records", daemon=True)
            try:
                t.start()
            except RuntimeError:  # no threads left, or the interpreter is shutting down
                return False
            _writer = t
    _writes.put((rows, holders, path))
    return True


def _wait_for_writer(timeout: float = WRITER_WAIT_S) -> None:
    q = _writes
    deadline = time.monotonic() + timeout
    with q.all_tasks_done:
        while q.unfinished_tasks:
            left = deadline - time.monotonic()
            if left <= 0:
                _warn("load events", TimeoutError(f"{q.unfinished_tasks} still queued after {timeout:.0f} s"))
                return
            q.all_tasks_done.wait(left)


def _before_fork() -> None:
    _db_lock.acquire()


def _after_fork_in_parent() -> None:
    _db_lock.release()


def _after_fork_in_child() -> None:
    """No writer thread survives a fork: start over, write synchronously from now on, and leave what was
    queued, and the memory-hit counts so far, to the parent."""
    global _writes, _writer, _lock, _db_lock, _sync_only
    _writes, _writer, _lock, _db_lock, _sync_only = queue.Queue(), None, threading.Lock(), threading.Lock(), True
    for entry in _mem_hits.values():
        entry[0] = 0


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def memory_hit(module) -> None:
    """Count an in-process hit. No I/O: a dict update, plus a flush at most once a minute."""
    entry = _mem_hits.get(module.uri)
    if entry is None:
        _mem_hits[module.uri] = entry = [0, 0.0, _fields(module)]
    entry[0] += 1
    now = time.monotonic()
    entry[1] = now
    if now - _last_flush > FLUSH_INTERVAL_S:
        flush()


def pending_memory_hits() -> dict[str, int]:
    return {uri: e[0] for uri, e in _mem_hits.items() if e[0]}


def flush() -> None:
    """Write the aggregated memory-hit counters (one row per URI) and reset them, and wait for the writer
    thread to finish what it was handed; never raises."""
    global _last_flush
    if _writer is not None:
        _wait_for_writer()
    with _lock:
        _last_flush = time.monotonic()
        pending = [(uri, e[0], e[1], e[2]) for uri, e in _mem_hits.items() if e[0]]
        if not pending:
            return
        for uri, *_ in pending:
            _mem_hits[uri][0] = 0
    try:
        tc, pid = _toolchain(), os.getpid()
        wall = time.time() - time.monotonic()  # monotonic -> wall clock
        rows = [(mono + wall, "load", *fields, "memory", count, 0.0, tc["arch"], tc["flashinfer"], tc["nvcc"],
                 tc["torch"], HOST, pid) for uri, count, mono, fields in pending]
    except Exception as e:  # noqa: BLE001
        _warn("memory-hit counters", e)
        return
    _write(rows, [])


atexit.register(flush)


# ----------------------------------------------------------------------------------------------- queries

def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return False
    return True


def live_holders(con, uri: str) -> list[int]:
    """Pids on this host that loaded `uri` and are still running (rows of other hosts count as live
    unless older than a day: fivar cannot check a pid on another machine)."""
    out = []
    for host, pid, t in con.execute("SELECT host, pid, time FROM holders WHERE uri=?", (uri,)):
        if host == HOST:
            if pid_alive(pid):  # this process too: it has the library mapped
                out.append(pid)
        elif time.time() - t < 86400:
            out.append(pid)
    return out


def forget_dead_holders(con) -> int:
    dead = [(uri, pid) for uri, host, pid in con.execute("SELECT uri, host, pid FROM holders")
            if host == HOST and not pid_alive(pid)]
    con.executemany("DELETE FROM holders WHERE uri=? AND host=? AND pid=?", [(u, HOST, p) for u, p in dead])
    return len(dead)


def usage(con) -> dict[str, dict]:
    """uri -> {hits, colds, last_use, compile_seconds}: hits of the copy on disk now (since its latest cold
    build, so a module evicted and rebuilt starts again from 0), the seconds of that build, cold builds ever."""
    out: dict[str, dict] = {}
    # SQLite takes a bare column (seconds) from the row that MAX() picked: the latest build's
    for uri, colds, last_built, secs in con.execute(
            "SELECT uri, SUM(count), MAX(time), seconds FROM events WHERE kind = 'cold' GROUP BY uri"):
        out[uri] = {"hits": 0, "colds": colds, "last_use": last_built or 0.0, "compile_seconds": secs}
    for uri, n, last in con.execute(
            "SELECT e.uri, SUM(e.count), MAX(e.time) FROM events e LEFT JOIN (SELECT uri, MAX(time) AS built "
            "FROM events WHERE kind = 'cold' GROUP BY uri) c ON c.uri = e.uri "
            "WHERE e.kind != 'cold' AND (c.built IS NULL OR e.time >= c.built) GROUP BY e.uri"):
        u = out.setdefault(uri, {"hits": 0, "colds": 0, "last_use": 0.0, "compile_seconds": None})
        u["hits"] = n
        u["last_use"] = max(u["last_use"], last or 0.0)
    return out


def compile_seconds_of(op: str, target: str, limit: int = 25) -> list[float]:
    """The compile seconds of the latest `limit` cold builds of modules of this op and target (what a module built
    on its own is expected to take, fivar.jit.progress); [] when there are none or the records cannot be read."""
    try:
        flush()
        con = connect()
        try:
            return [s for (s,) in con.execute(
                "SELECT seconds FROM events WHERE kind = 'cold' AND op = ? AND target = ? AND seconds > 0 "
                "ORDER BY time DESC LIMIT ?", (op, target, limit))]
        finally:
            con.close()
    except Exception:  # noqa: BLE001 - an estimate must never break a build
        return []
