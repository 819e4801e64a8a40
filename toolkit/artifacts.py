"""Atomic writes, checksums and config hashes shared by every artifact the toolkit produces.

Every file that crosses a boundary (trace shard, manifest, adapter, expert store, bundle) is written
to a temporary name in the same directory and renamed into place, so a crash or Ctrl-C never leaves a
half-written file under the final name. A full disk becomes a SpecPrefetchError naming the path.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from toolkit.errors import SpecPrefetchError


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o644)  # mkstemp makes 0600; artifacts are meant to be shared
        os.replace(tmp_path, path)
    except BaseException as e:
        tmp_path.unlink(missing_ok=True)
        # writers in native code (safetensors) report ENOSPC in their own exception types
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            raise SpecPrefetchError(f"disk full while writing {path}; nothing was left under that "
                                    "name: free some space and run again") from e
        raise


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


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_json(path: Path | str, what: str) -> Any:
    """Read a JSON file; a missing or malformed file is an error that names it."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecPrefetchError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecPrefetchError(f"{what} {path} is not valid JSON: {e}") from None


def config_hash(config: dict) -> str:
    """A stable hash of a model config: the key that ties traces and adapters to one model.

    Keys that do not change the model's function (names, dtype hints, versions) are left out, so a
    checkpoint re-saved by another transformers version keeps its hash.
    """
    volatile = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
                "use_cache", "output_router_logits", "_attn_implementation_autoset",
                "_experts_implementation", "experts_implementation"}

    def clean(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: clean(v) for k, v in sorted(o.items()) if k not in volatile}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o

    blob = json.dumps(clean(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
