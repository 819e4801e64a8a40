"""Single report files: the same rule as for artifacts, for every --json, --events and profile written.

A report is recognised by its own marker (`report_kind`) and claimed before any work
(`claim_report`); the claim (`ReportClaim`) is what `toolkit.reporting` writes by.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from toolkit.artifacts.files import special_kind
from toolkit.artifacts.kinds import _ARTICLE, _ARTIFACT_JSON, artifact_kind, check_inputs
from toolkit.errors import SpecPrefetchError

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
        check_inputs(f, inputs, option)
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
