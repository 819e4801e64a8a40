"""Trace inputs: plain text files, JSONL records, and image+text pairs for VL families.

- `.txt`: the whole file is one text; it is cut into prompts of `prompt_tokens` tokens.
- `.jsonl`: one JSON object per line with "text" and, for VL models, an optional "image" path
  (relative to the JSONL file). Long texts are cut like .txt files.
Every file is validated before any model work starts: a bad line is reported as FILE:LINE. Every
file read (data, images) must be a regular file of at most MAX_DATA_BYTES / MAX_IMAGE_BYTES: a FIFO
or a device (/dev/zero) would block or never end, so it is refused by name before it is read.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

from toolkit.errors import SpecPrefetchError

MAX_DATA_BYTES = 1 << 30    # one --data file: its text is held in memory whole
MAX_IMAGE_BYTES = 1 << 28   # one image of a JSONL record


@dataclasses.dataclass(frozen=True)
class Record:
    source: str           # file the record came from
    index: int            # record number inside that file
    text: str
    image: Path | None = None
    continuation: list[int] | None = None   # token ids decoded after the text instead of greedy decode


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


_DIR_HINT = {"--data": "; name .txt or .jsonl files"}


def open_input(path: Path | str, what: str = "--data", max_bytes: int = MAX_DATA_BYTES) -> BinaryIO:
    """`path` opened for reading once it is known to be a regular file of at most `max_bytes`.

    The path is checked before it is opened (a device is never opened) and the descriptor again
    after (opened non-blocking, so a FIFO put there meanwhile cannot hang the open): the file checked
    is the file read. Errors are one line, "WHAT PATH: ..." ("PATH: ..." when `what` is empty)."""
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    is_dir = f"{name}: is a directory{_DIR_HINT.get(what, ', not a regular file')}"

    def check(st: os.stat_result) -> None:
        if stat.S_ISDIR(st.st_mode):
            raise SpecPrefetchError(is_dir)
        if not stat.S_ISREG(st.st_mode):
            raise SpecPrefetchError(f"{name}: is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise SpecPrefetchError(f"{name}: {st.st_size} bytes, more than the {max_bytes >> 20} MiB an input "
                                    "file may hold; split it")

    try:
        check(os.stat(path))
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise SpecPrefetchError(f"{name}: file not found") from None
    except IsADirectoryError:
        raise SpecPrefetchError(is_dir) from None
    except OSError as e:
        raise SpecPrefetchError(f"{name}: cannot be read ({e.strerror or e})") from None
    try:
        check(os.fstat(fd))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _grew(path: Path, what: str, max_bytes: int) -> SpecPrefetchError:
    return SpecPrefetchError(f"{what} {path}: grew past the {max_bytes >> 20} MiB an input file may hold "
                             "while it was read")


def check_input(path: Path | str, what: str = "--data", max_bytes: int = MAX_DATA_BYTES) -> int:
    """The size of `path` once it is known to be a regular file of at most `max_bytes` (see
    open_input); nothing of it is read."""
    with open_input(path, what, max_bytes) as f:
        return os.fstat(f.fileno()).st_size


def file_sha256(path: Path) -> str:
    h, seen = hashlib.sha256(), 0
    try:
        with open_input(path) as f:
            while block := f.read(1 << 20):
                seen += len(block)
                if seen > MAX_DATA_BYTES:
                    raise _grew(path, "--data", MAX_DATA_BYTES)
                h.update(block)
    except OSError as e:
        raise SpecPrefetchError(f"--data {path}: cannot be read ({e.strerror or e})") from None
    return h.hexdigest()


def read_records(paths: list[Path], *, allow_images: bool) -> list[Record]:
    records: list[Record] = []
    for path in paths:
        path = Path(path)
        if path.suffix == ".jsonl":
            try:
                records.extend(_read_jsonl(path, allow_images))
            except OSError as e:
                raise SpecPrefetchError(f"--data {path}: cannot be read ({e.strerror or e})") from None
        elif path.suffix in (".txt", ".md", ".rst", ""):
            try:
                with open_input(path) as f:
                    raw = f.read(MAX_DATA_BYTES + 1)
                if len(raw) > MAX_DATA_BYTES:
                    raise _grew(path, "--data", MAX_DATA_BYTES)
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SpecPrefetchError(f"--data {path}: not UTF-8 text ({e})") from None
            except OSError as e:
                raise SpecPrefetchError(f"--data {path}: cannot be read ({e.strerror or e})") from None
            if not text.strip():
                raise SpecPrefetchError(f"--data {path}: file is empty")
            records.append(Record(str(path), 0, text))
        else:
            check_input(path)  # a missing file or a directory is named as such first
            raise SpecPrefetchError(f"--data {path}: unsupported file type {path.suffix!r} "
                                    "(expected .txt or .jsonl)")
    if not records:
        raise SpecPrefetchError("--data: no records found")
    return records


def _read_jsonl(path: Path, allow_images: bool) -> Iterator[Record]:
    seen = 0
    with open_input(path) as f:
        for n, raw in enumerate(f, 1):
            seen += len(raw)
            if seen > MAX_DATA_BYTES:
                raise _grew(path, "--data", MAX_DATA_BYTES)
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
                if not image.exists() or image.is_dir():
                    raise SpecPrefetchError(f"{path}:{n}: image {obj['image']!r} not found ({image})")
                check_input(image, f"{path}:{n}: image", MAX_IMAGE_BYTES)
                check_image_header(image, f"{path}:{n}: image")  # before any model loads: what the runners take
            cont = obj.get("continuation_ids")
            if cont is not None and (not isinstance(cont, list) or not cont
                                     or not all(type(t) is int and t >= 0 for t in cont)):
                raise SpecPrefetchError(f"{path}:{n}: \"continuation_ids\" must be a non-empty list of token ids "
                                        "(integers >= 0)")
            yield Record(str(path), n, obj["text"], image, cont)


MAX_IMAGE_PIXELS = 64 * 1000 * 1000  # refused from the header, before decoding (the native runner's cap too)
IMAGE_FORMATS = ("PNG", "JPEG", "MPO", "PPM")  # Pillow's names; MPO: a camera's multi-picture JPEG (its first
# picture); PPM: binary RGB (P6) at maxval 255 only (ppm_problem), the native runner's built-in format
_PPM_SPACE = b" \t\n\x0b\x0c\r"


def _is_netpbm(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            m = f.read(2)
    except OSError:
        return False
    return len(m) == 2 and m[:1] == b"P" and m[1:] in b"123456"


def ppm_problem(path: Path) -> str | None:
    """Why the native runner refuses a Netpbm file that Pillow opens, or None for a P6 PPM at maxval 255:
    its header read as android_runner/src/image.cpp's decode_ppm reads it (Pillow's reading, stricter where
    Pillow's is surprising: decimal digits only, no comment inside a number)."""
    with open(path, "rb") as f:
        magic = f.read(3)
        if magic[:2] == b"P6" and (len(magic) < 3 or magic[2] not in _PPM_SPACE):
            return "not a PNG, JPEG or PPM image (no whitespace after its P6)"  # the runner's words
        if magic[:2] != b"P6":
            kind = {b"P1": "PBM", b"P2": "PGM", b"P3": "plain PPM", b"P4": "PBM", b"P5": "PGM"}.get(magic[:2], "Netpbm")
            return f"a {kind} ({magic[:2].decode('latin-1')}); of the Netpbm formats only binary PPM (P6) is taken"
        values = []
        for what in ("width", "height", "maxval"):
            tok = b""
            while (c := f.read(1)) and not (c in _PPM_SPACE and tok):
                if c in _PPM_SPACE:
                    continue
                if c == b"#":
                    if tok:
                        return f"a corrupt PPM header (a comment inside its {what})"
                    while (d := f.read(1)) and d not in b"\r\n":
                        pass
                    continue
                if not c.isdigit() or len(tok) >= 10:
                    return f"a corrupt PPM header (its {what} is not a number of up to 10 digits)"
                tok += c
            if not tok:
                return f"a truncated PPM (the header ends before its {what})"
            values.append(int(tok))
    if values[2] != 255:
        return f"a PPM of maxval {values[2]}; only 8-bit PPMs (maxval 255) are taken"
    return None


def _open_checked(path: Path, what: str):
    """The image at `path` opened lazily (its header read, no pixels decoded), refused in one line unless a PNG
    or JPEG within MAX_IMAGE_PIXELS (checked here, not by Pillow's own decompression-bomb limit)."""
    from PIL import Image, UnidentifiedImageError

    bomb, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        im = Image.open(path)
    except FileNotFoundError:
        raise SpecPrefetchError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise SpecPrefetchError(f"{what} {path}: a directory, not an image file") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        bad = ppm_problem(path) if _is_netpbm(path) else None  # the runner's words for a header it refuses
        raise SpecPrefetchError(f"{what} {path}: {bad or f'not a readable PNG, JPEG or PPM image ({e})'}") from None
    finally:
        Image.MAX_IMAGE_PIXELS = bomb
    if im.format not in IMAGE_FORMATS:
        why = f"a {im.format or 'unknown'} image; PNG, JPEG and PPM are taken (as the native runner decodes them)"
    elif im.format == "PPM" and (bad := ppm_problem(path)):
        why = bad
    elif im.width * im.height > MAX_IMAGE_PIXELS:
        why = f"{im.width}x{im.height} pixels, over the {MAX_IMAGE_PIXELS // 10**6} megapixels an image may have"
    else:
        why = None
    if why is not None:
        im.close()
        raise SpecPrefetchError(f"{what} {path}: {why}")
    return im


def check_image_header(path, what: str) -> None:
    """An image's format and size from its header only (no pixels decoded): what `open_image` refuses."""
    _open_checked(Path(path), what).close()


def open_image(path, what: str = "--image"):
    """An image file as RGB (Pillow), one-line errors naming the file (`what`: the option or record that named
    it). PNG, JPEG (a camera's MPO JPEG: its first picture) and PPM (P6, maxval 255) only, as the native runner
    decodes; over MAX_IMAGE_PIXELS refused from the header."""
    path = Path(path)
    im = _open_checked(path, what)
    try:
        with im:
            im.load()
            return im.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise SpecPrefetchError(f"{what} {path}: not a readable PNG, JPEG or PPM image ({e})") from None
