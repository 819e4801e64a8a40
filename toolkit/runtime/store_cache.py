"""The default expert store of a model directory: built once into the cache, keyed by the model's
config hash and the sha256 of its weight shards (a fine-tune never picks up the base model's store),
and shared safely between processes (a second one waits for the one building it)."""
from __future__ import annotations

from pathlib import Path

from toolkit.artifacts import build_once
from toolkit.errors import SpecPrefetchError
from toolkit.models.spec import ModelSpec
from toolkit.runtime.expert_store import ExpertStore, build_store
from toolkit.runtime.fingerprint import weights_fingerprint
from toolkit.runtime.profiles import profile_dir


def default_store_path(spec: ModelSpec, dtype: str, *, progress: bool = False) -> Path:
    """The cached store of these weights in `dtype`: keyed by the config hash and the sha256 of the
    weight shards, so a fine-tune with the same config never picks up the base model's store."""
    digest = weights_fingerprint(spec, progress=progress)["digest"]
    return profile_dir().parent / "stores" / f"{spec.config_hash}-{digest[:16]}-{dtype}.spx"


def cached_store(spec: ModelSpec, dtype: str, *, progress: bool = True) -> ExpertStore:
    """The default store of a model directory: built once into the cache, then reused. A second
    process building the same store meanwhile is waited for, not raced."""
    path = default_store_path(spec, dtype, progress=progress)
    build_once(path, lambda: build_store(spec, path, dtype, progress=progress, option="the expert store cache"),
               done=Path.is_file, progress=progress)
    try:
        return ExpertStore(path, spec)
    except SpecPrefetchError as e:
        raise SpecPrefetchError(f"{e} (a cached store: delete it and it is rebuilt)") from None
