"""OS errors as one line: a full disk, a quota or a file-size limit (`disk_error`), or any other
OSError met while writing (`os_error`), becomes a SpecPrefetchError naming the path."""
from __future__ import annotations

import errno
from pathlib import Path

from toolkit.errors import SpecPrefetchError

_DISK_ERRNOS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file too large (over the file-size limit)"}


def disk_error(e: BaseException, path: Path | str,
               tail: str = "nothing was left under that name: free some space and run again"
               ) -> SpecPrefetchError | None:
    """A SpecPrefetchError naming `path` if `e` is a full disk, a quota or a file-size limit (as
    an OSError, or as the message of a native writer's own exception type); else None."""
    if isinstance(e, SpecPrefetchError):
        return None
    what = _DISK_ERRNOS.get(getattr(e, "errno", None))
    text = str(e)
    if what is None:
        if "No space left on device" in text:
            what = "disk full"
        elif "Disk quota exceeded" in text:
            what = "disk quota exceeded"
        elif "File too large" in text:
            what = "file too large (over the file-size limit)"
    if what is None:
        return None
    return SpecPrefetchError(f"{what} while writing {path}; {tail}")


def os_error(e: OSError, path: Path | str) -> SpecPrefetchError:
    """One line for an OSError met while writing `path` (full disk, a directory where a file is
    meant or the reverse, permissions, ...)."""
    d = disk_error(e, path)
    if d is not None:
        return d
    where = e.filename if getattr(e, "filename", None) else path
    if isinstance(e, IsADirectoryError):
        return SpecPrefetchError(f"{where}: is a directory, a file is needed there")
    if isinstance(e, NotADirectoryError):
        return SpecPrefetchError(f"{where}: a path component is a file, not a directory")
    if isinstance(e, PermissionError):
        return SpecPrefetchError(f"{where}: permission denied")
    return SpecPrefetchError(f"cannot write {where}: {e.strerror or e}")
