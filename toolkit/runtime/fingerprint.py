"""Which weights an expert store was built from: the sha256 of every source shard.

A store holds a copy (possibly quantised) of a checkpoint's routed experts, so it is only valid for
the very weights it was built from. Two checkpoints with the same config (a base model and its
fine-tune) have identical configs, shard names, shard sizes and even identical safetensors headers:
only the tensor bytes differ. So the store records the full sha256 of each source shard
(`weights_fingerprint`), and every open of the store for a model compares them with that model's
shards (`check_weights`).

Hashing a large checkpoint takes a while (~1-2 GB/s), so hashes are cached in
`~/.cache/specprefetch/weights-sha256.json` (beside the profiles and stores directories), keyed by
the file's resolved path and identity: device, inode, size, mtime_ns and ctime_ns. Any write to a
file, a copy or a rename-into-place changes at least one of these (ctime cannot be set by tools
that preserve mtime), so a stale hash is never used; a hit costs one stat. An unreadable or
unwritable cache is ignored (the hash is then computed each time).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from toolkit.artifacts import write_json_atomic
from toolkit.errors import SpecPrefetchError

CACHE_NAME = "weights-sha256.json"
MAX_CACHE_ENTRIES = 512
CHUNK = 8 << 20


def cache_path() -> Path:
    from toolkit.runtime.profiles import profile_dir

    return profile_dir().parent / CACHE_NAME


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _load_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(key: str, ident: list[int], digest: str) -> None:
    """Best effort: read, add, write atomically (a concurrent writer may win; that costs a rehash)."""
    path = cache_path()
    data = _load_cache()
    data.pop(key, None)
    data[key] = {"id": ident, "sha256": digest}
    while len(data) > MAX_CACHE_ENTRIES:  # oldest first (dicts keep insertion order)
        data.pop(next(iter(data)))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, data)
    except (OSError, SpecPrefetchError):
        pass


def file_sha256(path: Path | str, *, progress: bool = False) -> str:
    """The sha256 of a file's bytes, from the cache when the file is unchanged since it was hashed."""
    path = Path(path)
    try:
        key = str(path.resolve())
        with open(path, "rb") as f:
            before = _identity(os.fstat(f.fileno()))
            hit = _load_cache().get(key)
            if isinstance(hit, dict) and hit.get("id") == before and isinstance(hit.get("sha256"), str):
                return hit["sha256"]
            h = hashlib.sha256()
            bar = None
            if progress and before[2] > (256 << 20):
                from tqdm import tqdm

                bar = tqdm(total=before[2], desc=f"sha256 {path.name}", unit="B", unit_scale=True, leave=False)
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                h.update(view[:n])
                if bar is not None:
                    bar.update(n)
            if bar is not None:
                bar.close()
            after = _identity(os.fstat(f.fileno()))
    except OSError as e:
        raise SpecPrefetchError(f"{path}: cannot read the weights to check them ({e.strerror or e})") from None
    digest = h.hexdigest()
    if after == before:  # not written to while we read it
        _save_cache(key, before, digest)
    return digest


def _digest(files: list[dict[str, Any]]) -> str:
    canon = json.dumps([[f["name"], f["size"], f["sha256"]] for f in files], separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def _shard_name(spec, p: Path) -> str:
    """A shard's name as the fingerprint records it: relative to the model directory."""
    try:
        return str(p.relative_to(spec.path))
    except ValueError:
        return p.name


def weights_fingerprint(spec, *, progress: bool = False) -> dict[str, Any]:
    """{"files": [{"name", "size", "sha256"}, ...], "digest"} of a model directory's weight shards
    (names relative to the model directory, in the order the loader lists them)."""
    if not spec.weight_files:
        raise SpecPrefetchError(f"{spec.path}: no weight files to fingerprint")
    files = []
    for p in spec.weight_files:
        p = Path(p)
        name = _shard_name(spec, p)
        try:
            size = p.stat().st_size
        except OSError as e:
            raise SpecPrefetchError(f"{p}: cannot read the weights to check them ({e.strerror or e})") from None
        files.append({"name": name, "size": size, "sha256": file_sha256(p, progress=progress)})
    return {"files": files, "digest": _digest(files)}


def valid_record(rec: Any) -> bool:
    """Whether `rec` has the shape weights_fingerprint returns (a store's metadata.source)."""
    try:
        return (isinstance(rec, dict) and isinstance(rec["digest"], str) and isinstance(rec["files"], list)
                and bool(rec["files"]) and all(isinstance(f["name"], str) and isinstance(f["size"], int)
                                               and isinstance(f["sha256"], str) for f in rec["files"])
                and _digest(rec["files"]) == rec["digest"])
    except (KeyError, TypeError):
        return False


def weights_mismatch(recorded: dict[str, Any], spec, *, progress: bool = False) -> str | None:
    """None when `spec`'s weight shards are exactly the recorded ones, else what differs (a phrase).
    Names and sizes are compared first, so a different checkpoint is usually told without hashing."""
    mine = []
    for p in spec.weight_files:
        mine.append((_shard_name(spec, Path(p)), Path(p)))
    want = {f["name"]: f for f in recorded["files"]}
    if sorted(n for n, _ in mine) != sorted(want):
        return (f"its shards are {', '.join(sorted(want))}, the model's are "
                f"{', '.join(sorted(n for n, _ in mine)) or 'none'}")
    for name, p in mine:
        try:
            size = p.stat().st_size
        except OSError as e:
            raise SpecPrefetchError(f"{p}: cannot read the weights to check them ({e.strerror or e})") from None
        if size != want[name]["size"]:
            return f"{name} is {size} bytes, the store's source was {want[name]['size']}"
    for name, p in mine:
        if file_sha256(p, progress=progress) != want[name]["sha256"]:
            return f"{name} has other contents (sha256) than the store's source"
    return None
