"""Reports people compare: JSON + a Markdown table + a PNG plot beside it, written all or nothing.

`write_report` writes the three files under temporary names beside their final ones and renames
them into place only once all three are complete: a full disk, a file-size limit, an error in the
plot, Ctrl-C or SIGTERM leaves none of them (and an earlier report under the same name as it was),
and the error names the file that could not be written.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable

from toolkit.artifacts import atomic_write_with, disk_error, os_error
from toolkit.errors import SpecPrefetchError, interrupt_on_signals


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


def write_report(result: dict[str, Any], json_path: Path | str, markdown: Callable[[dict], str],
                 plot: Callable[[dict, Path], None]) -> tuple[Path, Path]:
    """RESULT.json, RESULT.md (the table) and RESULT.png (the plot); returns (md, png).

    All or nothing: see the module doc."""
    json_path = Path(json_path)
    md = json_path.with_suffix(".md")
    png = json_path.with_suffix(".png")
    finals = (json_path, md, png)
    for f in finals:
        if f.is_dir():
            raise SpecPrefetchError(f"{f}: is a directory; the report needs a file name there")
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
