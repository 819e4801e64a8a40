"""Trace inputs: plain text files, JSONL records, and image+text pairs for VL families.

- `.txt`: the whole file is one text; it is cut into prompts of `prompt_tokens` tokens.
- `.jsonl`: one JSON object per line with "text" and, for VL models, an optional "image" path
  (relative to the JSONL file). Long texts are cut like .txt files.
Every file is validated before any model work starts: a bad line is reported as FILE:LINE.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Iterator

from toolkit.errors import SpecPrefetchError


@dataclasses.dataclass(frozen=True)
class Record:
    source: str           # file the record came from
    index: int            # record number inside that file
    text: str
    image: Path | None = None


def file_sha256(path: Path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as e:
        raise SpecPrefetchError(f"--data {path}: cannot be read ({e.strerror or e})") from None


def read_records(paths: list[Path], *, allow_images: bool) -> list[Record]:
    records: list[Record] = []
    for path in paths:
        path = Path(path)
        if not path.exists():
            raise SpecPrefetchError(f"--data {path}: file not found")
        if path.is_dir():
            raise SpecPrefetchError(f"--data {path}: is a directory; name .txt or .jsonl files")
        if path.suffix == ".jsonl":
            try:
                records.extend(_read_jsonl(path, allow_images))
            except OSError as e:
                raise SpecPrefetchError(f"--data {path}: cannot be read ({e.strerror or e})") from None
        elif path.suffix in (".txt", ".md", ".rst", ""):
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise SpecPrefetchError(f"--data {path}: not UTF-8 text ({e})") from None
            except OSError as e:
                raise SpecPrefetchError(f"--data {path}: cannot be read ({e.strerror or e})") from None
            if not text.strip():
                raise SpecPrefetchError(f"--data {path}: file is empty")
            records.append(Record(str(path), 0, text))
        else:
            raise SpecPrefetchError(f"--data {path}: unsupported file type {path.suffix!r} "
                                    "(expected .txt or .jsonl)")
    if not records:
        raise SpecPrefetchError("--data: no records found")
    return records


def _read_jsonl(path: Path, allow_images: bool) -> Iterator[Record]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SpecPrefetchError(f"{path}:{n}: not UTF-8 text ({e})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecPrefetchError(f"{path}:{n}: invalid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise SpecPrefetchError(f"{path}:{n}: each line must be an object with a \"text\" string")
            image = None
            if obj.get("image") is not None:
                if not isinstance(obj["image"], str) or not obj["image"]:
                    raise SpecPrefetchError(f"{path}:{n}: \"image\" must be a file name (a string)")
                if not allow_images:
                    raise SpecPrefetchError(f"{path}:{n}: has an \"image\" but the model is not a "
                                            "vision-language family")
                image = (path.parent / obj["image"]).resolve()
                if not image.is_file():
                    raise SpecPrefetchError(f"{path}:{n}: image {obj['image']!r} not found ({image})")
            yield Record(str(path), n, obj["text"], image)
