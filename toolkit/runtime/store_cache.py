"""The default expert store of a model directory: built once into the cache, keyed by the model's
config hash and the sha256 of its weight shards (a fine-tune never picks up the base model's store),
and shared safely between processes (a second one waits for the one building it)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from toolkit.artifacts import lock_path
from toolkit.errors import SpecPrefetchError
from toolkit.models.spec import ModelSpec
from toolkit.runtime.expert_store import ExpertStore, build_store
from toolkit.runtime.fingerprint import weights_fingerprint
from toolkit.runtime.profiles import profile_dir


def default_store_path(spec: ModelSpec, dtype: str, *, progress: bool = False) -> Path:
    """The cached store of these weights in `dtype`: keyed by the config hash and the sha256 of the
    weight shards, so a fine-tune with the same config never picks up the base model's store."""
    digest = weights_fingerprint(spec, progress=progress)["digest"]
    return profile_dir().parent / "stores" / f"{spec.config_hash}-{digest[:16]}-{dtype}.spx"


def cached_store(spec: ModelSpec, dtype: str, *, progress: bool = True) -> ExpertStore:
    """The default store of a model directory: built once into the cache, then reused. A second
    process building the same store meanwhile is waited for, not raced."""
    path = default_store_path(spec, dtype, progress=progress)
    waited = False
    while not path.is_file():
        try:
            build_store(spec, path, dtype, progress=progress, option="the expert store cache")
        except SpecPrefetchError:
            if path.is_file():  # another process finished it first
                break
            if not _writing(path):
                raise
            if not waited and progress:
                print(f"waiting for another specprefetch process building {path}", file=sys.stderr)
            waited = True
            time.sleep(0.5)
    try:
        return ExpertStore(path, spec)
    except SpecPrefetchError as e:
        raise SpecPrefetchError(f"{e} (a cached store: delete it and it is rebuilt)") from None


def _writing(path: Path) -> bool:
    """Whether another process holds the write lock of `path` now (a lock file left behind by a
    killed process is not held)."""
    import fcntl
    import os

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
