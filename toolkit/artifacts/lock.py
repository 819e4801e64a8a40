"""The destination lock: while it writes, every writer holds an exclusive lock on its destination
(a hidden .OUT.lock beside it, removed when done), so a second process writing the same OUT is
refused with one line instead of sharing the work directory. `waiting_lock`: the same file's lock, waited for
(builds and downloads of a cache entry, which a second process should reuse rather than refuse)."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from toolkit.artifacts.errors import os_error
from toolkit.errors import SpecPrefetchError

def lock_path(out: Path | str) -> Path:
    out = Path(out)
    return out.with_name(f".{out.name}.lock")


class _Lock:
    """An exclusive flock on .OUT.lock; re-entrant within one process; the file is removed on release."""
    held: dict[str, "_Lock"] = {}

    def __init__(self, path: Path, fd: int):
        self.path, self.fd, self.count = path, fd, 1

    @classmethod
    def acquire(cls, out: Path, option: str) -> "_Lock":
        path = lock_path(out)
        key = str(path.resolve())
        if key in cls.held:  # the same process (an earlier writer not yet released): share it
            lk = cls.held[key]
            lk.count += 1
            return lk
        for _ in range(50):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise os_error(e, path) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise SpecPrefetchError(f"{option} {out}: another specprefetch process is writing {out}; "
                                        "wait for it to finish (or stop it) and run again") from None
            try:  # the holder before us may have removed the file after we opened it: retry
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                lk = cls(path, fd)
                cls.held[key] = lk
                return lk
            os.close(fd)
        raise SpecPrefetchError(f"{option} {out}: cannot take the lock {path}")

    def release(self) -> None:
        self.count -= 1
        if self.count > 0 or self.fd < 0:
            return
        self.held.pop(str(self.path.resolve()), None)
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still locked: nobody can hold the file we remove
        os.close(self.fd)
        self.fd = -1


@contextlib.contextmanager
def waiting_lock(path: Path):
    """An exclusive lock on `path`.lock (beside it) for the duration: one build or download of a cache
    entry or output directory at a time, across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(path), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
