"""Atomic writes, checksums and config hashes shared by every artifact the toolkit produces.

Every file that crosses a boundary (trace shard, manifest, adapter, expert store, bundle) is written
to a temporary name in the same directory and renamed into place, so a crash or Ctrl-C never leaves a
half-written file under the final name. A full disk becomes a SpecPrefetchError naming the path.
Every output directory (trace, adapter, bundle) is assembled as OUT.partial and renamed to OUT only
when complete, through one helper: `atomic_directory` (or `AtomicDirectory` for a writer that spans
several calls); an existing OUT is replaced only then, so a complete OUT is always on disk.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
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


def partial_dir(out: Path | str) -> Path:
    """Where OUT is assembled: OUT.partial, beside it."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


def rejected_dir(out: Path | str) -> Path:
    """Where a refused OUT is kept for inspection: OUT.rejected, beside it."""
    out = Path(out)
    return out.with_name(out.name + ".rejected")


def _old_dir(out: Path) -> Path:
    return out.with_name(out.name + ".old")


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


class AtomicDirectory:
    """A directory assembled at OUT.partial (`work`) and renamed to OUT only by `commit()`.

    Args:
        out: the final directory.
        overwrite: an existing OUT is replaced at commit; without it, an existing OUT is an error
            raised here, before anything is written.
        resume: keep an existing OUT.partial (the caller resumes from what it holds; `resumed`
            says whether there was one); otherwise any leftover OUT.partial is removed and an
            empty one made.

    `commit()` moves an existing OUT aside (OUT.old), renames the work directory to OUT, then
    deletes the old one: a complete OUT is on disk at every moment but the two renames. A crash
    between them leaves OUT.old, which the next AtomicDirectory for OUT moves back.
    """

    def __init__(self, out: Path | str, *, overwrite: bool, resume: bool = False):
        self.out = Path(out)
        self.work = partial_dir(self.out)
        self.overwrite = overwrite
        old = _old_dir(self.out)
        if old.is_dir() and not self.out.exists() and not self.out.is_symlink():
            os.rename(old, self.out)  # an interrupted commit: the previous OUT is still complete
        if self.out.exists() or self.out.is_symlink():
            if not self.out.is_dir():
                raise SpecPrefetchError(f"{self.out}: exists and is not a directory")
            if not overwrite:
                raise SpecPrefetchError(f"--out {self.out} already exists; pass --overwrite to replace it")
        self.resumed = resume and self.work.is_dir() and not self.work.is_symlink()
        if not self.resumed:
            _remove(self.work)
            self.work.mkdir(parents=True)

    def commit(self) -> Path:
        """Rename the (complete) work directory to OUT, replacing an existing OUT; returns OUT."""
        old = _old_dir(self.out)
        _remove(old)
        if self.out.exists() or self.out.is_symlink():
            if not self.overwrite:
                raise SpecPrefetchError(f"--out {self.out} already exists; pass --overwrite to replace it")
            os.rename(self.out, old)
        os.rename(self.work, self.out)
        _remove(old)
        return self.out

    def discard(self) -> None:
        """Remove the work directory; OUT is untouched."""
        _remove(self.work)

    def keep_as(self, dest: Path | str) -> Path:
        """Move the work directory to `dest` (replacing it) for inspection; OUT is untouched."""
        dest = Path(dest)
        _remove(dest)
        if self.work.exists():
            os.rename(self.work, dest)
        return dest


@contextlib.contextmanager
def atomic_directory(out: Path | str, *, overwrite: bool, resume: bool = False,
                     keep_on: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """Yield OUT.partial to fill; on success rename it to OUT (see AtomicDirectory).

    On an exception (Ctrl-C included) OUT is untouched and the exception propagates; the work
    directory is
    - moved to OUT.rejected if the exception is one of `keep_on` (a result refused by a check,
      kept for inspection; a later success removes it);
    - kept as it is with `resume` (the next run resumes from it);
    - removed otherwise.
    """
    d = AtomicDirectory(out, overwrite=overwrite, resume=resume)
    try:
        yield d.work
    except BaseException as e:
        if keep_on and isinstance(e, keep_on):
            d.keep_as(rejected_dir(d.out))
        elif not resume:
            d.discard()
        raise
    d.commit()
    if keep_on:
        _remove(rejected_dir(d.out))  # superseded by the complete OUT


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
