"""The toolkit's cache (~/.cache/specprefetch: profiles, stores, runners, models): its place, and building
an entry once, a second process waiting for the first instead of racing it."""
from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path
from typing import Callable

from toolkit.artifacts.lock import lock_path
from toolkit.errors import SpecPrefetchError


def profile_dir() -> Path:
    """The device profiles' directory ($SPECPREFETCH_PROFILES, default ~/.cache/specprefetch/profiles); its
    parent holds the rest of the cache."""
    return Path(os.environ.get("SPECPREFETCH_PROFILES", Path.home() / ".cache" / "specprefetch" / "profiles"))


def being_written(path: Path) -> bool:
    """Whether another process holds the write lock of `path` now (a lock file left behind by a
    killed process is not held)."""
    try:
        fd = os.open(lock_path(path), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases a lock we took
    return False


def build_once(path: Path, build: Callable[[], object], *, done: Callable[[Path], bool], progress: bool) -> None:
    """Run `build` (which writes `path` atomically, refusing one that exists) unless `done(path)`; where
    another process is writing `path` meanwhile, wait for it instead of racing it."""
    waited = False
    while not done(path):
        if not being_written(path):  # else another process is at it: wait, do not build it a second time
            try:
                build()
                continue
            except SpecPrefetchError:
                if done(path):  # another process finished it first
                    break
                if not being_written(path):
                    raise
        if not waited and progress:
            print(f"waiting for another specprefetch process building {path}", file=sys.stderr)
        waited = True
        time.sleep(0.5)
