"""What an existing path is, and whether a command may write an artifact there.

Every command that writes goes through one rule (`claim_output`): an existing output is replaced
only with --overwrite, and then only if it is an artifact of the writer's own kind (a bundle, an
adapter, a trace, a store, a model for `tiny`; `artifact_kind` recognises each by its own marker),
and never when it is, holds or lies inside an input of the same command (`check_inputs`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

from toolkit.errors import SpecPrefetchError

# Each artifact's own marker. Kept here as literals (this module is imported by the modules that
# define them); tests/test_artifacts.py checks they match the writers' constants.
BUNDLE_FORMAT = "specprefetch-bundle"      # BUNDLE/manifest.json "format" (export.manifest.FORMAT)
TRACE_FORMAT = "specprefetch-trace"        # TRACE/manifest.json "format" (toolkit.traces.format.FORMAT)
ADAPTER_FORMAT = "specprefetch-adapter"    # ADAPTER/adapter.json "format" (adapters.checkpoint.FORMAT)
STORE_MAGIC = b"SPXSTORE"                  # first bytes of an expert store (expert_store.MAGIC)
KINDS = ("bundle", "adapter", "trace", "store", "model", "report", "pictures", "vision tower")
_ARTICLE = {"bundle": "a bundle", "adapter": "an adapter", "trace": "a trace", "store": "an expert store",
            "model": "a model checkpoint", "report": "a report",
            "pictures": "pictures (toolkit/embedded/pictures.py)",
            "vision tower": "a vision tower (toolkit/embedded/vl.py)"}
VISION_TOWER_NAME = "embedded-vl"  # TOWER/vl.json "name" (toolkit.models.embedded_vl.NAME)
_REPORT_SUFFIXES = (".json", ".md", ".png")
_ARTIFACT_JSON = {"config.json", "manifest.json", "adapter.json", "progress.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "preprocessor_config.json", "model.safetensors.index.json"}

def _json_field(path: Path, key: str) -> Any:
    """`key` of the JSON object in `path`, or None where there is none (no file, too large, not JSON)."""
    try:
        if path.is_file() and path.stat().st_size < 64 << 20:
            obj = json.loads(path.read_text(encoding="utf-8"))
            return obj.get(key) if isinstance(obj, dict) else None
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
            fmt = _json_field(p / "manifest.json", "format")
            if fmt == BUNDLE_FORMAT:
                return "bundle"
            if fmt == TRACE_FORMAT:
                return "trace"
            if _json_field(p / "adapter.json", "format") == ADAPTER_FORMAT:
                return "adapter"
            if (p / "config.json").is_file():
                return "model"
            if _json_field(p / "vl.json", "name") == VISION_TOWER_NAME:
                return "vision tower"
            if (p / "pairs.jsonl").is_file() and all(
                    q.name == "pairs.jsonl" or re.fullmatch(r"p\d+\.png", q.name) for q in p.iterdir()):
                return "pictures"
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


def check_inputs(out: Path, inputs: Iterable[Any], option: str) -> None:
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
    check_inputs(out, inputs, option)
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise SpecPrefetchError(f"{option} {out} already exists; pass --overwrite to replace it")
    if _is_empty_dir(out) and kind != "store":
        return
    if artifact_kind(out) != kind:
        raise SpecPrefetchError(f"{option} {out} is {_describe(out)}, not {_ARTICLE.get(kind, kind)}: "
                                f"--overwrite replaces only {_ARTICLE.get(kind, kind)}; choose another path")
