"""Hashes: a file's SHA-256 checksum and the stable hash of a model config."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()



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
