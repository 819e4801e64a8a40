"""Atomic writes, output claims, locks, checksums and config hashes shared by every artifact.

Every file that crosses a boundary (trace shard, manifest, adapter, expert store, bundle, report) is
written to a temporary name in the same directory and renamed into place, so a crash, Ctrl-C or
SIGTERM never leaves a half-written file under the final name. A full disk (or a file-size limit)
becomes a SpecPrefetchError naming the path.

Every command that writes goes through one rule (`claim_output`): an existing output is replaced
only with --overwrite, and then only if it is an artifact of the writer's own kind (a bundle, an
adapter, a trace, a store, a model for `tiny`; `artifact_kind` recognises each by its own marker),
and never when it is, holds or lies inside an input of the same command.

Output directories are assembled in a work directory beside OUT and renamed to OUT only when
complete (`atomic_directory`, or `AtomicDirectory` for a writer that spans several calls): a
resumable writer (trace) keeps OUT.partial for the next run; any other writer uses a work
directory unique to its process (OUT.partial-PID-XXXXXXXX), removed on any failure. Single files
(the expert store) go through `atomic_output_file`. While it writes, every writer holds an
exclusive lock on its destination (a hidden .OUT.lock beside it, removed when done), so a second
process writing the same OUT is refused with one line instead of sharing the work directory.

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
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from toolkit.errors import SpecPrefetchError, interrupt_on_signals, note_interrupt

# Each artifact's own marker. Kept here as literals (this module is imported by the modules that
# define them); tests/test_hardening_writes.py checks they match the writers' constants.
BUNDLE_FORMAT = "specprefetch-bundle"      # BUNDLE/manifest.json "format" (export.manifest.FORMAT)
TRACE_FORMAT = "specprefetch-trace"        # TRACE/manifest.json "format" (toolkit.traces.format.FORMAT)
ADAPTER_FORMAT = "specprefetch-adapter"    # ADAPTER/adapter.json "format" (adapters.checkpoint.FORMAT)
STORE_MAGIC = b"SPXSTORE"                  # first bytes of an expert store (expert_store.MAGIC)
KINDS = ("bundle", "adapter", "trace", "store", "model", "report")
_ARTICLE = {"bundle": "a bundle", "adapter": "an adapter", "trace": "a trace", "store": "an expert store",
            "model": "a model checkpoint", "report": "a report"}
_REPORT_SUFFIXES = (".json", ".md", ".png")
_ARTIFACT_JSON = {"config.json", "manifest.json", "adapter.json", "progress.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "preprocessor_config.json", "model.safetensors.index.json"}

# -- OS errors as one line ------------------------------------------------------------------

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


# -- atomic files -----------------------------------------------------------------------------

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


# -- what an existing path is, and whether a command may write there ---------------------------

def _json_format(path: Path) -> Any:
    try:
        if path.is_file() and path.stat().st_size < 64 << 20:
            obj = json.loads(path.read_text(encoding="utf-8"))
            return obj.get("format") if isinstance(obj, dict) else None
    except (OSError, ValueError):
        pass
    return None


def _is_json_object(path: Path) -> bool:
    try:
        if path.is_file() and path.stat().st_size < 64 << 20:
            return isinstance(json.loads(path.read_text(encoding="utf-8")), dict)
    except (OSError, ValueError):
        pass
    return False


def artifact_kind(path: Path | str) -> str | None:
    """What an existing path is, by its own marker: "bundle" (manifest.json of format
    specprefetch-bundle), "trace" (manifest.json of format specprefetch-trace), "adapter"
    (adapter.json of format specprefetch-adapter), "store" (a file starting with the store's magic),
    "model" (a directory holding config.json), "report" (RESULT.json/.md/.png beside a RESULT.json
    holding a JSON object); None for anything else, an empty directory, a symbolic link or a path
    that does not exist."""
    p = Path(path)
    try:
        if p.is_symlink() or not p.exists():
            return None
        if p.is_dir():
            fmt = _json_format(p / "manifest.json")
            if fmt == BUNDLE_FORMAT:
                return "bundle"
            if fmt == TRACE_FORMAT:
                return "trace"
            if _json_format(p / "adapter.json") == ADAPTER_FORMAT:
                return "adapter"
            if (p / "config.json").is_file():
                return "model"
            return None
        if not p.is_file():
            return None
        with open(p, "rb") as f:
            if f.read(len(STORE_MAGIC)) == STORE_MAGIC:
                return "store"
        if (p.suffix in _REPORT_SUFFIXES and p.name not in _ARTIFACT_JSON
                and artifact_kind(p.parent) is None and _is_json_object(p.with_suffix(".json"))):
            return "report"
    except OSError:
        return None
    return None


def _describe(p: Path) -> str:
    kind = artifact_kind(p)
    if kind is not None:
        return _ARTICLE[kind]
    if p.is_symlink():
        return "a symbolic link"
    if p.is_dir():
        return "a directory that is not a specprefetch artifact"
    return "a file that is not a specprefetch artifact"


def _is_empty_dir(p: Path) -> bool:
    try:
        return p.is_dir() and not p.is_symlink() and not any(p.iterdir())
    except OSError:
        return False


def _check_inputs(out: Path, inputs: Iterable[Any], option: str) -> None:
    o = out.resolve()
    for inp in inputs:
        if inp is None:
            continue
        i = Path(inp).resolve()
        if o == i:
            raise SpecPrefetchError(f"{option} {out} is an input of this command; write elsewhere")
        if o.is_relative_to(i):
            raise SpecPrefetchError(f"{option} {out} is inside {inp}, which is an input of this command; "
                                    "write elsewhere")
        if i.is_relative_to(o):
            raise SpecPrefetchError(f"{option} {out} holds {inp}, which is an input of this command; "
                                    "write elsewhere")


def claim_output(out: Path | str, *, kind: str, overwrite: bool, inputs: Iterable[Any] = (),
                 option: str = "--out") -> None:
    """Refuse (one-line SpecPrefetchError) unless an artifact of `kind` may be written to `out`.

    `out` equal to, inside or holding one of `inputs` is refused; an absent `out` is fine; an
    existing one needs `overwrite` and then must be an artifact of `kind` (or an empty
    directory). Nothing is created or changed here."""
    out = Path(out)
    _check_inputs(out, inputs, option)
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise SpecPrefetchError(f"{option} {out} already exists; pass --overwrite to replace it")
    if _is_empty_dir(out) and kind != "store":
        return
    if artifact_kind(out) != kind:
        raise SpecPrefetchError(f"{option} {out} is {_describe(out)}, not {_ARTICLE.get(kind, kind)}: "
                                f"--overwrite replaces only {_ARTICLE.get(kind, kind)}; choose another path")


# -- single report files: the same rule, for every --json, --events and profile written --------------

REPORT_KEY = "specprefetch_report"       # a JSON report's marker: {"specprefetch_report": "<command>", ...}
EVENTS_MAGIC = b"# specprefetch-events "  # an events log's first line (toolkit.runtime.events, events.cpp)
REPORT_SIBLINGS = (".md", ".png")         # the table and the plot written beside RESULT.json
_UNMARKED = {"events": "an events log", "profile": "a device profile"}  # recognised by their own content


def _report_article(kind: str) -> str:
    return _UNMARKED.get(kind, f"{'an' if kind[:1] in 'aeiou' else 'a'} `{kind}` report")


def report_kind(path: Path | str) -> str | None:
    """Which report an existing regular file is, by its own marker: the command named by the
    top-level "specprefetch_report" key of a JSON report; "events" for an events log (first line
    `# specprefetch-events ...`); "profile" for a device profile (a JSON object with "name" and
    "flash_bw"). None for anything else, a symbolic link or a path that does not exist."""
    p = Path(path)
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size >= 64 << 20:
            return None
        with open(p, "rb") as f:
            head = f.read(len(EVENTS_MAGIC))
            if head == EVENTS_MAGIC:
                return "events"
            obj = json.loads((head + f.read()).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get(REPORT_KEY), str):
        return obj[REPORT_KEY]
    if isinstance(obj.get("flash_bw"), dict) and isinstance(obj.get("name"), str):
        return "profile"
    return None


def _describe_file(p: Path) -> str:
    """What an existing path that is not the report wanted is, for the refusal."""
    if p.is_symlink():
        return "a symbolic link"
    kind = report_kind(p)
    if kind is not None:
        return _report_article(kind)
    what = artifact_kind(p)
    if what in ("store", "bundle", "trace", "adapter", "model"):
        return _ARTICLE[what]
    if p.name in _ARTIFACT_JSON or p.name == "adapter.json":
        return f"an artifact's own file ({p.name})"
    if p.suffix == ".safetensors":
        return "a safetensors weights file"
    if p.suffix == ".json":
        return "a JSON file that is not a report written by specprefetch"
    return "a file that is not a report written by specprefetch"


def _holding_artifact(out: Path) -> tuple[Path, str] | None:
    """The nearest existing directory above `out` that is a bundle, trace, adapter or model
    checkpoint (config.json beside safetensors weights): a report is never written into one."""
    for a in out.absolute().parents:
        try:
            if not a.is_dir():
                continue
            kind = artifact_kind(a)
            if kind == "model" and not (any(a.glob("*.safetensors"))
                                        or (a / "model.safetensors.index.json").is_file()):
                kind = None  # a folder that merely holds a config.json
        except OSError:
            continue
        if kind in ("bundle", "trace", "adapter", "model"):
            return a, kind
    return None


class ReportClaim:
    """A report file a command will write (`claim_report`): where, what kind, and how."""

    def __init__(self, path: Path, kind: str, option: str, overwrite: bool, inputs: tuple,
                 siblings: tuple[Path, ...], special: str | None, beside: tuple["ReportClaim", ...]):
        self.path, self.kind, self.option, self.overwrite = path, kind, option, overwrite
        self.inputs, self.siblings, self.special, self.beside = inputs, siblings, special, beside

    @property
    def marked(self) -> bool:
        """Whether the JSON carries the "specprefetch_report" key (events logs and device profiles
        are recognised by their own content)."""
        return self.kind not in _UNMARKED

    def files(self) -> tuple[Path, ...]:
        """Every file this claim writes: the report and, for a regular file, its siblings."""
        return (self.path,) if self.special else (self.path, *self.siblings)

    def recheck(self) -> None:
        """The same checks again, just before writing (the path may have changed during the work)."""
        _check_report(self.path, kind=self.kind, overwrite=self.overwrite, inputs=self.inputs,
                      option=self.option, suffixes=tuple(s.suffix for s in self.siblings), beside=self.beside)


_claims: dict[str, ReportClaim] = {}


def _key(path: Path | str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _check_report(out: Path, *, kind: str, overwrite: bool, inputs: tuple, option: str,
                  suffixes: tuple[str, ...], beside: tuple[ReportClaim, ...]) -> tuple[tuple[Path, ...], str | None]:
    siblings = tuple(out.with_suffix(x) for x in suffixes)
    if out in siblings or out.suffix in suffixes:
        raise SpecPrefetchError(f"{option} {out}: the report's {'/'.join(suffixes)} files are written beside "
                                f"it under the same name; give the report a .json name")
    if out.is_dir():
        raise SpecPrefetchError(f"{option} {out}: is a directory; the report needs a file name there")
    special = special_kind(out)
    if special in ("a block device", "a socket"):
        raise SpecPrefetchError(f"{option} {out}: is {special}; a report is written to a regular file, a FIFO "
                                "or a character device such as /dev/null")
    for other in beside:  # two outputs of one command never share a file
        mine = {_key(f) for f in ((out,) if special else (out, *siblings))}
        for f in other.files():
            if _key(f) in mine and not (special == "a character device" and other.special == special):
                raise SpecPrefetchError(f"{option} {out} and {other.option} {other.path} name the same file "
                                        f"({f}); give each output its own path")
    files = (out,) if special else (out, *siblings)
    for f in files:
        _check_inputs(f, inputs, option)
    if special:
        return (), special  # written in place: never renamed over, no .md/.png beside it
    held = _holding_artifact(out)
    if held is not None:
        raise SpecPrefetchError(f"{option} {out} is inside {held[0]}, which is {_ARTICLE[held[1]]}: a report is "
                                "never written into another artifact; write elsewhere")
    present = out.exists() or out.is_symlink()
    if present:
        if out.is_symlink() or report_kind(out) != kind:
            raise SpecPrefetchError(f"{option} {out} is {_describe_file(out)}: {option} replaces only "
                                    f"{_report_article(kind)} written by specprefetch; choose another path")
        if not overwrite:
            raise SpecPrefetchError(f"{option} {out} already exists; pass --overwrite to replace it")
    for s in siblings:
        if not (s.exists() or s.is_symlink()):
            continue
        if s.is_dir() and not s.is_symlink():
            raise SpecPrefetchError(f"{s}: is a directory; the report {out} writes a file there")
        if s.is_symlink() or special_kind(s) is not None:
            raise SpecPrefetchError(f"{s} is {special_kind(s) or 'a symbolic link'}; the report {out} writes a "
                                    "regular file there; move it away or choose another path")
        if not present:
            raise SpecPrefetchError(f"{s} exists without its report {out}, so it is not known to be one: "
                                    f"move it away or choose another {option}")
    return siblings, None


def claim_report(out: Path | str, *, kind: str, overwrite: bool, inputs: Iterable[Any] = (),
                 option: str = "--json", siblings: tuple[str, ...] = REPORT_SIBLINGS,
                 beside: Iterable[ReportClaim] = ()) -> ReportClaim:
    """Refuse (one-line SpecPrefetchError) unless the report `kind` (the command's name, "events"
    or "profile") may be written to the file `out`, with its `siblings` (.md, .png) beside it; the
    claim is then what `toolkit.reporting` writes by (the marker, in place or atomic).

    - A FIFO or a character device (/dev/null) is written in place, with no .md/.png and no
      --overwrite needed; a block device or a socket is refused.
    - OUT and its siblings are never an input of the command (equal to, inside or holding one
      of `inputs`), never inside another artifact (a bundle, trace, adapter or model directory)
      and never another output of the same command (`beside`).
    - An existing OUT needs `overwrite` and must be a report of the same `kind` (its marker,
      `report_kind`); anything else is refused even with `overwrite`. Its .md/.png are replaced
      only together with it: one present without its report is refused.

    Checked before any work; nothing is created or changed here."""
    out = Path(out)
    inputs = tuple(i for i in inputs if i is not None)
    beside = tuple(beside)
    sibs, special = _check_report(out, kind=kind, overwrite=overwrite, inputs=inputs, option=option,
                                  suffixes=tuple(siblings), beside=beside)
    claim = ReportClaim(out, kind, option, overwrite, inputs, tuple(out.with_suffix(x) for x in siblings),
                        special, beside)
    _claims[_key(out)] = claim
    return claim


def report_claim(path: Path | str) -> ReportClaim | None:
    """The claim made for `path` by the running command, if any."""
    return _claims.get(_key(path))


def release_report_claims() -> None:
    """Forget every claim (the command is over)."""
    _claims.clear()


# -- the destination lock -------------------------------------------------------------------------

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


# -- output directories ----------------------------------------------------------------------

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
    except OSError as e:  # a directory, no permission, an I/O error
        raise SpecPrefetchError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecPrefetchError(f"{what} {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise SpecPrefetchError(f"{what} {path} is not valid JSON: nested too deeply") from None
    except ValueError as e:   # e.g. an integer past Python's 4300-digit conversion limit
        raise SpecPrefetchError(f"{what} {path} is not valid JSON: {' '.join(str(e).split())[:160]}") from None


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
