"""The one lock protocol of a module, kept in the module's own build directory.

- `<build dir>/.fivar.lock`, exclusive: whoever creates, replaces or deletes the module's files holds it (a
  single build, each module of a prewarm until its manifest is written, `cache clear/prune/import`,
  `verify --fix`). Evictors and prewarms only ever *try* it, and skip a module whose lock is held.
- `<build dir>/.fivar.hold`, shared: every process that loaded the library holds it until it exits (the
  kernel drops it with the process, so a crash leaves no stale holder). An evictor that holds the build
  lock and cannot take the hold lock exclusively knows a live process has the module mapped, whatever its
  FIVAR_CACHE_DIR or user.

Both are flock(2) locks on files in the directory they protect: deleting the directory (clear, prune) unlinks
them, so after taking one a process checks that the file it locked is still the one at that path, and starts
over if not (it locked a file an evictor just removed).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

BUILD_LOCK = ".fivar.lock"
HOLD_LOCK = ".fivar.hold"

_holds: dict[str, int] = {}  # build dir -> fd of this process's shared hold lock (kept open until exit)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _lock(path: Path, op: int, create: bool) -> int | None:
    """An fd holding flock `op` on `path` (re-taken if the file was replaced meanwhile); None when
    non-blocking and held elsewhere, or when the file is absent and `create` is off (or cannot be made)."""
    while True:
        try:
            if create:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            else:
                fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            if create:
                continue  # the directory was removed between mkdir and open: make it again
            return None
        except OSError:
            if create:
                raise
            return None
        try:
            fcntl.flock(fd, op)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # an evictor deleted the file we waited on: lock the one at the path now
        if not create:
            return None


@contextlib.contextmanager
def build_lock(build_dir: Path, wait: bool = True):
    """Hold the module's build lock for the block. Yields True, or False at once when `wait` is off and
    another process holds it."""
    fd = _lock(Path(build_dir) / BUILD_LOCK, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB), create=True)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def build_lock_held(build_dir: Path) -> bool:
    """Whether another process holds the build lock now (False where there is no lock file; creates none)."""
    fd = _lock(Path(build_dir) / BUILD_LOCK, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
    if fd is not None:
        os.close(fd)
        return False
    return (Path(build_dir) / BUILD_LOCK).exists()


def hold(build_dir: Path) -> bool:
    """Take this process's shared hold on a module it is about to load, kept until the process exits.

    Waits while an evictor holds it exclusively (then the caller re-checks that the library is still there).
    False where the hold file cannot be made (a read-only prebuilt cache: nothing can evict from it either)."""
    key = str(build_dir)
    if key in _holds:
        return True
    path = Path(build_dir) / HOLD_LOCK
    try:
        fd = _lock(path, fcntl.LOCK_SH, create=True)
    except OSError:
        fd = _lock(path, fcntl.LOCK_SH, create=False)  # read-only: an existing hold file still works
    if fd is None:
        return False
    os.set_inheritable(fd, False)
    _holds[key] = fd
    return True


def release_hold(build_dir: Path) -> None:
    fd = _holds.pop(str(build_dir), None)
    if fd is not None:
        os.close(fd)


def holders_present(build_dir: Path) -> bool:
    """Whether a live process (this one included) holds the module: its hold lock cannot be taken
    exclusively. No hold file: nobody ever loaded it since it was built."""
    if str(build_dir) in _holds:
        return True
    fd = _lock(Path(build_dir) / HOLD_LOCK, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
    if fd is None:
        return (Path(build_dir) / HOLD_LOCK).exists()
    os.close(fd)
    return False


@contextlib.contextmanager
def evict_lock(build_dir: Path):
    """For clear/prune/import/verify --fix: yields None with the build lock and the hold lock both held
    exclusively (nobody builds it, nobody has it loaded), or a one-line reason it must be left alone."""
    with build_lock(build_dir, wait=False) as free:
        if not free:
            yield "its build lock is held (a build is running)"
            return
        if str(build_dir) in _holds:
            yield f"held by this process (pid {os.getpid()})"
            return
        path = Path(build_dir) / HOLD_LOCK
        fd = _lock(path, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
        if fd is None and path.exists():
            yield "held by a live process that loaded it (its hold lock is taken)"
            return
        try:
            yield None
        finally:
            if fd is not None:
                os.close(fd)
