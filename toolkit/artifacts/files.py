"""Atomic files: a file is written to a temporary name in the same directory and renamed into place.

Every file that crosses a boundary (trace shard, manifest, adapter, expert store, bundle, report) is
written this way, so a crash, Ctrl-C or SIGTERM never leaves a half-written file under the final
name. A full disk (or a file-size limit) becomes a SpecPrefetchError naming the path
(toolkit.artifacts.errors). A device node, a FIFO or a socket is never renamed over (`special_kind`).
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from toolkit.artifacts.errors import disk_error, os_error
from toolkit.errors import SpecPrefetchError


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync and rename it into place.

    This writes a file inside a directory the caller owns (a work directory, a report): it claims
    nothing. For a single-file artifact given by the user (--out FILE) use `atomic_output_file`."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise SpecPrefetchError(f"{path}: is a directory, a file is needed there")
    _refuse_special(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise os_error(e, path) from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o644)  # mkstemp makes 0600; artifacts are meant to be shared
        _refuse_special(path)  # made while we wrote: still never renamed over
        os.replace(tmp_path, path)
    except BaseException as e:
        tmp_path.unlink(missing_ok=True)
        # writers in native code (safetensors) report ENOSPC in their own exception types
        d = disk_error(e, path)
        if d is not None:
            raise d from e
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
            raise os_error(e, path) from e
        raise


def special_kind(path: Path | str, *, follow: bool = True) -> str | None:
    """What a path that is neither a regular file nor a directory is ("a FIFO", "a character
    device", "a block device", "a socket"); None for a regular file, a directory, a symbolic link
    (with follow=False) or a path that does not exist."""
    import stat

    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except (OSError, ValueError):
        return None
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return None


def _refuse_special(path: Path) -> None:
    """An atomic rename never replaces a device node, a FIFO or a socket with a regular file."""
    what = special_kind(path, follow=False)
    if what is not None:
        raise SpecPrefetchError(f"{path}: is {what}, not a regular file; it is never replaced by a file")


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json_atomic(path: Path | str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def atomic_write_with(path: Path | str, writer: Callable[[Path], None]) -> None:
    """Let `writer(tmp)` produce the file (e.g. safetensors.save_file), then rename it in."""
    with atomic_path(path) as tmp:
        writer(tmp)
