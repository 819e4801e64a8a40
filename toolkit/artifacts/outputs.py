"""Output artifacts assembled beside OUT and renamed to OUT only when complete.

Output directories are assembled in a work directory beside OUT (`atomic_directory`, or
`AtomicDirectory` for a writer that spans several calls): a resumable writer (trace) keeps
OUT.partial for the next run; any other writer uses a work directory unique to its process
(OUT.partial-PID-XXXXXXXX), removed on any failure. Single files (the expert store) go through
`atomic_output_file`. Each claims OUT first (toolkit.artifacts.kinds.claim_output) and holds the
destination lock while it writes (toolkit.artifacts.lock).

Sibling paths (OUT.partial, OUT.partial-PID-XXXXXXXX, OUT.rejected, OUT.old) are touched only when
they are the toolkit's own: a directory holding the marker `.specprefetch-work` (an empty
directory, written when the toolkit creates the work directory, and into OUT just before a commit
moves it aside as OUT.old; removed from OUT at commit, so a committed artifact never holds it; a
directory, so that file lists such as a bundle's manifest never see it). One without the marker
is never removed, renamed or written into: it is ignored where the writer does not need its name
and refused in one line ("... exists and was not made by specprefetch; move it away") where it
does.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from toolkit.artifacts.errors import disk_error, os_error
from toolkit.artifacts.kinds import claim_output
from toolkit.artifacts.lock import _Lock
from toolkit.errors import SpecPrefetchError, interrupt_on_signals, note_interrupt

def partial_dir(out: Path | str) -> Path:
    """Where a resumable writer assembles OUT: OUT.partial, beside it."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


def work_dir(out: Path | str) -> Path:
    """A work directory beside OUT unique to this process: OUT.partial-PID-XXXXXXXX."""
    out = Path(out)
    return out.with_name(f"{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")


def _stale_work_dirs(out: Path) -> list[Path]:
    pat = re.compile(re.escape(out.name) + r"\.partial-\d+-[0-9a-f]{8}")
    try:
        return [p for p in out.parent.iterdir() if pat.fullmatch(p.name)]
    except OSError:
        return []


def rejected_dir(out: Path | str) -> Path:
    """Where a refused OUT is kept for inspection: OUT.rejected, beside it."""
    out = Path(out)
    return out.with_name(out.name + ".rejected")


def _old_dir(out: Path) -> Path:
    return out.with_name(out.name + ".old")


WORK_MARK = ".specprefetch-work"  # inside a directory the toolkit made beside OUT (see the module doc)


def _mark(d: Path) -> None:
    """Mark `d` (a directory the toolkit made, or an OUT it is about to move aside) as its own."""
    (d / WORK_MARK).mkdir(exist_ok=True)


def _unmark(d: Path) -> None:
    with contextlib.suppress(OSError):
        (d / WORK_MARK).rmdir()


def _ours(p: Path) -> bool:
    """Whether `p` is a directory the toolkit made (it holds the marker); never for a symbolic link."""
    try:
        m = p / WORK_MARK
        return p.is_dir() and not p.is_symlink() and m.is_dir() and not m.is_symlink()
    except OSError:
        return False


def _present(p: Path) -> bool:
    return p.exists() or p.is_symlink()


def _not_ours(p: Path) -> SpecPrefetchError:
    return SpecPrefetchError(f"{p} exists and was not made by specprefetch; move it away")


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def _created_parents(path: Path) -> list[Path]:
    """The missing ancestors of `path`, outermost first (so a refused write can remove them)."""
    missing = []
    for a in path.parents:
        if a.exists() or a.is_symlink():
            break
        missing.append(a)
    return missing[::-1]


def _make_parent(out: Path) -> list[Path]:
    made = _created_parents(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, out) from None
    return made


def _remove_made(made: list[Path]) -> None:
    for d in reversed(made):
        with contextlib.suppress(OSError):
            d.rmdir()


_active: list[object] = []  # the writers now open in this process, outermost first


class AtomicDirectory:
    """A directory assembled in a work directory (`work`) and renamed to OUT only by `commit()`.

    Args:
        out: the final directory.
        overwrite: an existing OUT of `kind` may be replaced (at commit); see `claim_output`.
        resume: keep an existing OUT.partial (the caller resumes from what it holds; `resumed`
            says whether there was one); the work directory is then OUT.partial. One the toolkit
            did not make (no marker) is refused. Otherwise the work directory is unique to this
            process (OUT.partial-PID-XXXXXXXX) and stale ones (and a stale OUT.partial) are
            removed if the toolkit made them (others are left alone).
        kind: what is written ("bundle", "adapter", "trace", "model", ...).
        inputs: the command's inputs, which OUT must not be, hold or lie inside.

    The destination is locked (.OUT.lock) from here until commit(), discard(), keep_as() or
    release(); a second process is refused. `commit()` moves an existing OUT aside (OUT.old),
    renames the work directory to OUT, then deletes the old one: a complete OUT is on disk at every
    moment but the two renames. A crash between them leaves OUT.old, which the next
    AtomicDirectory for OUT moves back. OUT.old (like every sibling) is touched only if the toolkit
    made it (see the module doc): when OUT must be moved aside, a user's own OUT.old is refused.
    """

    def __init__(self, out: Path | str, *, overwrite: bool, resume: bool = False, kind: str,
                 inputs: Iterable[Any] = (), option: str = "--out"):
        self.out = Path(out)
        self.overwrite, self.kind, self.option = overwrite, kind, option
        self.inputs = tuple(inputs)
        self.resumable = resume
        self._lock: _Lock | None = None
        claim_output(self.out, kind=kind, overwrite=overwrite, inputs=self.inputs, option=option)
        self._made = made = _make_parent(self.out)
        try:
            self._lock = _Lock.acquire(self.out, option)
        except BaseException:
            _remove_made(made)
            raise
        try:
            old = _old_dir(self.out)
            if not _present(self.out) and _ours(old):
                os.rename(old, self.out)  # an interrupted commit: the previous OUT is still complete
                _unmark(self.out)
            claim_output(self.out, kind=kind, overwrite=overwrite, inputs=self.inputs, option=option)
            if _present(self.out) and _present(old) and not _ours(old):
                raise _not_ours(old)  # commit would need the name to move OUT aside: say so now
            for stale in _stale_work_dirs(self.out):  # left by killed processes: we hold the lock
                if _ours(stale):
                    _remove(stale)
            if resume:
                self.work = partial_dir(self.out)
                self.resumed = _present(self.work)
                if self.resumed and not _ours(self.work):
                    raise _not_ours(self.work)
                if not self.resumed:
                    self.work.mkdir()
                    _mark(self.work)
            else:
                self.resumed = False
                if _ours(partial_dir(self.out)):
                    _remove(partial_dir(self.out))
                self.work = work_dir(self.out)
                self.work.mkdir()
                _mark(self.work)
        except BaseException as e:
            self.release()
            _remove_made(made)
            if isinstance(e, OSError):
                raise os_error(e, self.out) from None
            raise

    def commit(self) -> Path:
        """Rename the (complete) work directory to OUT, replacing an existing OUT; returns OUT."""
        try:
            old = _old_dir(self.out)
            replacing = _present(self.out)
            if _ours(old):
                _remove(old)  # left by a commit that died after its second rename
            elif replacing and _present(old):
                raise _not_ours(old)
            if replacing:
                claim_output(self.out, kind=self.kind, overwrite=self.overwrite, inputs=self.inputs,
                             option=self.option)
                _mark(self.out)  # so that OUT.old, if left by a crash, is known to be ours
                try:
                    os.rename(self.out, old)
                except BaseException:
                    _unmark(self.out)
                    raise
            os.rename(self.work, self.out)
            _unmark(self.out)
            if replacing:
                _remove(old)
        finally:
            self.release()
        return self.out

    def restart(self) -> None:
        """Empty the work directory (the toolkit's own: made or checked here) to start afresh."""
        for p in list(self.work.iterdir()):
            if p.name != WORK_MARK:
                _remove(p)
        _mark(self.work)

    def discard(self) -> None:
        """Remove the work directory (and the parents of OUT made for it); OUT is untouched."""
        try:
            _remove(self.work)
        finally:
            self.release()
            if not self.out.exists():
                _remove_made(self._made)

    def keep_as(self, dest: Path | str) -> Path:
        """Move the work directory to `dest` (replacing it if the toolkit made it) for inspection;
        OUT is untouched. A `dest` the toolkit did not make is left alone: the work directory is
        removed and that is an error."""
        dest = Path(dest)
        try:
            if _present(dest):
                if not _ours(dest):
                    _remove(self.work)
                    raise _not_ours(dest)
                _remove(dest)
            if self.work.exists():
                os.rename(self.work, dest)
        finally:
            self.release()
        return dest

    def release(self) -> None:
        """Give up the lock on OUT (the work directory stays as it is). Idempotent."""
        lk, self._lock = self._lock, None
        if lk is not None:
            lk.release()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.release()


def _final_name(e: BaseException, d: AtomicDirectory) -> Path:
    """The file an error names, as it would have been under OUT (the work directory is gone)."""
    name = getattr(e, "filename", None)
    if name:
        with contextlib.suppress(ValueError, TypeError):
            return d.out / Path(name).relative_to(d.work)
    return d.out


def _interrupt_note(e: BaseException, me: object, text: str) -> None:
    """Say what an interrupted outermost writer left behind (see toolkit.errors.interrupted_message)."""
    if isinstance(e, KeyboardInterrupt) and _active and _active[0] is me:
        note_interrupt(e, text)


@contextlib.contextmanager
def atomic_directory(out: Path | str, *, overwrite: bool, resume: bool = False,
                     keep_on: tuple[type[BaseException], ...] = (), kind: str,
                     inputs: Iterable[Any] = (), option: str = "--out") -> Iterator[Path]:
    """Yield a work directory to fill; on success rename it to OUT (see AtomicDirectory).

    On an exception (Ctrl-C and SIGTERM included) OUT is untouched and the exception propagates
    (a full disk as a SpecPrefetchError naming OUT); the work directory is
    - moved to OUT.rejected if the exception is one of `keep_on` (a result refused by a check,
      kept for inspection; a later success removes it); an OUT.rejected the toolkit did not make
      is refused before anything is written, and never removed;
    - kept as OUT.partial with `resume` (the next run resumes from it);
    - removed otherwise.
    """
    with interrupt_on_signals():
        d = AtomicDirectory(out, overwrite=overwrite, resume=resume, kind=kind, inputs=inputs, option=option)
        if keep_on and _present(rejected_dir(d.out)) and not _ours(rejected_dir(d.out)):
            d.discard()  # the refused result would need that name
            raise _not_ours(rejected_dir(d.out))
        _active.append(d)
        try:
            try:
                yield d.work
            except BaseException as e:
                if keep_on and isinstance(e, keep_on):
                    d.keep_as(rejected_dir(d.out))
                elif not resume:
                    d.discard()
                    _interrupt_note(e, d, f"nothing was written to {d.out} and no partial work was kept")
                else:
                    d.release()
                    _interrupt_note(e, d, f"nothing was written to {d.out}; the partial work in {d.work} "
                                          "was kept and the same command resumes it")
                err = disk_error(e, _final_name(e, d))
                if err is not None:
                    raise err from e
                if isinstance(e, SpecPrefetchError) and not isinstance(e, keep_on) and str(d.work) in str(e):
                    # a nested writer named a file in the work directory, which is gone: name it under OUT
                    msg = str(e).replace(str(d.work), str(d.out))
                    try:
                        renamed = type(e)(msg)
                    except TypeError:
                        renamed = SpecPrefetchError(msg)
                    raise renamed from e
                raise
            d.commit()
        finally:
            d.release()
            _active.remove(d)
    if keep_on and _ours(rejected_dir(d.out)):
        _remove(rejected_dir(d.out))  # superseded by the complete OUT


@contextlib.contextmanager
def atomic_output_file(out: Path | str, *, kind: str, overwrite: bool, inputs: Iterable[Any] = (),
                       option: str = "--out") -> Iterator[Path]:
    """Claim OUT (a single-file artifact, e.g. an expert store), lock it, and yield a temporary
    path beside it; on success the file is fsynced and renamed to OUT, on any exception (Ctrl-C
    and SIGTERM included) it is removed and OUT is untouched (a full disk becomes a
    SpecPrefetchError naming OUT)."""
    out = Path(out)
    claim_output(out, kind=kind, overwrite=overwrite, inputs=inputs, option=option)
    with interrupt_on_signals():
        with _output_file(out, kind, overwrite, inputs, option) as tmp:
            yield tmp


@contextlib.contextmanager
def _output_file(out: Path, kind: str, overwrite: bool, inputs: Iterable[Any], option: str) -> Iterator[Path]:
    made = _make_parent(out)
    try:
        lock = _Lock.acquire(out, option)
    except BaseException:
        _remove_made(made)
        raise
    me = object()
    _active.append(me)
    tmp: Path | None = None
    try:
        claim_output(out, kind=kind, overwrite=overwrite, inputs=inputs, option=option)
        try:
            fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        except OSError as e:
            raise os_error(e, out) from None
        os.close(fd)
        tmp = Path(name)
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
        tmp = None
    except BaseException as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if not out.exists():
            _remove_made(made)
        _interrupt_note(e, me, f"nothing was written to {out} and no partial file was kept")
        err = disk_error(e, out)
        if err is not None:
            raise err from e
        raise
    finally:
        _active.remove(me)
        lock.release()
