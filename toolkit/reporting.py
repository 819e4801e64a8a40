"""Reports people compare: JSON + a Markdown table + a PNG plot beside it, written all or nothing.

The one way every report with a table and a plot is written (eval, simulate, eviction-bounds and the
benches: `bench cpu|gpu|llama.cpp`, `runner bench`, `device bench`): the command's `markdown(result)`
and `plot(result, path)` (drawn on `figure()`, written by `save_figure`) handed to `write_report`.

`write_report` writes the three files under temporary names beside their final ones and renames
them into place only once all three are complete: a full disk, a file-size limit, an error in the
plot, Ctrl-C or SIGTERM leaves none of them (and an earlier report under the same name as it was),
and the error names the file that could not be written.

Where the file goes is the command's claim (`toolkit.artifacts.claim_report`, made before any
work): a claimed JSON report carries the marker `"specprefetch_report": "<command>"` (first key)
that lets a later `--overwrite` know it for a report of the same command, and the claim is checked
again just before writing. Every writer here (`write_report`, `write_json_report`,
`write_text_report`) writes a FIFO or a character device (`--json /dev/null`) in place, opened and
written, never renamed over, and then writes no .md / .png beside it; a block device or a socket
is refused. Unclaimed calls (library use) write what they are given, as before.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable

from toolkit.artifacts import (REPORT_KEY, ReportClaim, atomic_write_text, atomic_write_with, disk_error, os_error,
                               report_claim, special_kind)
from toolkit.errors import SpecPrefetchError, interrupt_on_signals


def figure(figsize: tuple[float, float], nrows: int = 1, ncols: int = 1, **kwargs):
    """A matplotlib figure and its axes (`plt.subplots`) on the Agg backend, no display needed: what
    every report's plot draws on before `save_figure` writes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=figsize, **kwargs)


def save_figure(fig, path: Path | str) -> None:
    """Lay out, write (atomically, as PNG) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        atomic_write_with(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    finally:
        plt.close(fig)


def _root_cause(e: BaseException) -> BaseException:
    """The OS error under the SpecPrefetchError a nested atomic write raised, if any."""
    seen = 0
    while isinstance(e, SpecPrefetchError) and e.__cause__ is not None and seen < 8:
        e, seen = e.__cause__, seen + 1
    return e


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


IN_PLACE = ("a FIFO", "a character device")


def _claimed(path: Path, result: Any) -> tuple[ReportClaim | None, Any]:
    """The command's claim on `path` (checked again now) and the result with its marker."""
    claim = report_claim(path)
    if claim is None:
        return None, result
    claim.recheck()
    if claim.marked and isinstance(result, dict):
        result = {REPORT_KEY: claim.kind, **{k: v for k, v in result.items() if k != REPORT_KEY}}
    return claim, result


def _in_place(path: Path) -> bool:
    """Whether `path` is written in place (a FIFO or a character device); a block device or a
    socket is refused."""
    what = special_kind(path)
    if what is None:
        return False
    if what not in IN_PLACE:
        raise SpecPrefetchError(f"{path}: is {what}; a report is written to a regular file, a FIFO or a "
                                "character device such as /dev/null")
    return True


def write_in_place(path: Path | str, data: bytes) -> None:
    """Open a FIFO or a character device and write `data` to it: no temporary file, no rename (a
    device node or a FIFO stays what it is). A FIFO waits for its reader, as any writer would."""
    import stat

    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise os_error(e, path) from None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # replaced by a regular file since it was checked
            raise SpecPrefetchError(f"{path}: became a regular file while the command ran; nothing was written")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BrokenPipeError:
        raise SpecPrefetchError(f"{path}: its reader closed it before the report was written") from None
    except OSError as e:
        raise os_error(e, path) from None
    finally:
        os.close(fd)


def write_json_report(path: Path | str, obj: Any) -> Path:
    """A JSON report (`run`, `device list`, a device profile): the claim's marker added, written
    atomically, or in place to a FIFO or a character device. Returns the path."""
    path = Path(path)
    _, obj = _claimed(path, obj)
    text = json.dumps(obj, indent=1, sort_keys=False) + "\n"
    if _in_place(path):
        write_in_place(path, text.encode("utf-8"))
    else:
        atomic_write_text(path, text)
    return path


def write_text_report(path: Path | str, text: str) -> Path:
    """A text report (an events log): written atomically, or in place to a FIFO or a character
    device, by the command's claim. Returns the path."""
    path = Path(path)
    _claimed(path, None)
    if _in_place(path):
        write_in_place(path, text.encode("utf-8"))
    else:
        atomic_write_text(path, text)
    return path


def write_report(result: dict[str, Any], json_path: Path | str, markdown: Callable[[dict], str],
                 plot: Callable[[dict, Path], None]) -> tuple[Path, Path]:
    """RESULT.json, RESULT.md (the table) and RESULT.png (the plot); returns (md, png).

    All or nothing: see the module doc. A FIFO or a character device given as RESULT.json gets the
    JSON alone, in place (the md and png returned are then not written)."""
    json_path = Path(json_path)
    md = json_path.with_suffix(".md")
    png = json_path.with_suffix(".png")
    _, result = _claimed(json_path, result)
    if _in_place(json_path):
        write_in_place(json_path, (json.dumps(result, indent=1, sort_keys=False) + "\n").encode("utf-8"))
        return md, png
    finals = (json_path, md, png)
    for f in finals:
        if f.is_dir():
            raise SpecPrefetchError(f"{f}: is a directory; the report needs a file name there")
        if special_kind(f, follow=False) is not None:
            raise SpecPrefetchError(f"{f}: is {special_kind(f, follow=False)}; the report {json_path} writes a "
                                    "regular file there")
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, json_path) from None
    tag = secrets.token_hex(4)
    tmp = {f: f.with_name(f".{f.stem}.{tag}.tmp{f.suffix}") for f in finals}
    done: list[Path] = []
    current = json_path
    with interrupt_on_signals():
        try:
            tmp[json_path].write_text(json.dumps(result, indent=1, sort_keys=False) + "\n", encoding="utf-8")
            current = md
            tmp[md].write_text(markdown(result), encoding="utf-8")
            current = png
            plot(result, tmp[png])
            for f in finals:
                current = f
                if tmp[f].exists():
                    _fsync(tmp[f])
            for f in finals:  # renames: no new data is written past this point
                current = f
                if tmp[f].exists():
                    os.replace(tmp[f], f)
                    done.append(f)
        except BaseException as e:
            for t in tmp.values():
                t.unlink(missing_ok=True)
            for f in done:  # never leave a new JSON beside an old (or no) plot
                f.unlink(missing_ok=True)
            cause = _root_cause(e)
            tail = (f"no report was written ({json_path.name}, {md.name} and {png.name} are as they "
                    "were): free some space and run again")
            err = disk_error(cause, current, tail=tail)
            if err is not None:
                raise err from e
            if isinstance(cause, OSError) and not isinstance(e, SpecPrefetchError):
                raise SpecPrefetchError(f"{os_error(cause, current)}; no report was written") from e
            raise
    return md, png
