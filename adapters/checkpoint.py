"""Adapter checkpoints: ADAPTER/adapter.safetensors (A, B) + ADAPTER/adapter.json.

The JSON ties the adapter to one model by its config hash; loading it against another model is an
error. The directory is written as ADAPTER.partial and renamed into place.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from adapters.lowrank import PrefetchAdapter
from toolkit import __version__
from toolkit.artifacts import read_json, sha256_file, write_json_atomic
from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import ModelSpec

FORMAT = "specprefetch-adapter"
VERSION = 1


def save_adapter(adapter: PrefetchAdapter, out: Path, spec: ModelSpec, extra: dict[str, Any]) -> Path:
    out = Path(out)
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    save_file({"A": adapter.A.detach().contiguous(), "B": adapter.B.detach().contiguous()},
              str(work / "adapter.safetensors"))
    g = spec.geometry
    meta = {
        "format": FORMAT, "version": VERSION, "toolkit_version": __version__,
        "model": {"family": g.family, "config_hash": spec.config_hash, "path": str(spec.path),
                  "moe_layers": list(g.moe_layers), "num_experts": g.routing.num_experts,
                  "hidden_size": g.hidden_size},
        "horizons": list(adapter.horizons), "rank": adapter.rank, "cross_token": adapter.cross_token,
        "pairs": [list(p) for p in adapter.pairs],
        "params": adapter.params(),
        "weights_sha256": sha256_file(work / "adapter.safetensors"),
        **extra,
    }
    write_json_atomic(work / "adapter.json", meta)
    if out.exists():
        shutil.rmtree(out)
    work.rename(out)
    return out


def load_adapter(path: Path, spec: ModelSpec | None = None) -> tuple[PrefetchAdapter, dict[str, Any]]:
    """Load and validate an adapter; with `spec`, refuse one trained for another model."""
    path = Path(path)
    if not path.is_dir():
        raise SpecPrefetchError(f"adapter directory not found: {path}")
    meta = read_json(path / "adapter.json", "adapter config")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise SpecPrefetchError(f"{path / 'adapter.json'}: not a version-{VERSION} specprefetch adapter "
                                f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
    if spec is not None and meta["model"]["config_hash"] != spec.config_hash:
        raise SpecPrefetchError(
            f"{path}: adapter was trained for model config {meta['model']['config_hash']} "
            f"({meta['model']['family']}), not {spec.config_hash} ({spec.path})")
    weights = path / "adapter.safetensors"
    if not weights.exists():
        raise SpecPrefetchError(f"{weights}: missing")
    if sha256_file(weights) != meta.get("weights_sha256"):
        raise SpecPrefetchError(f"{weights}: checksum mismatch (corrupt or modified)")
    try:
        t = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise SpecPrefetchError(f"{weights}: unreadable ({e})") from None
    m = meta["model"]
    adapter = PrefetchAdapter(num_layers=len(m["moe_layers"]), hidden_size=m["hidden_size"],
                              num_experts=m["num_experts"], horizons=tuple(meta["horizons"]),
                              rank=meta["rank"], cross_token=meta["cross_token"])
    if tuple(t["A"].shape) != tuple(adapter.A.shape) or tuple(t["B"].shape) != tuple(adapter.B.shape):
        raise SpecPrefetchError(f"{weights}: tensor shapes {tuple(t['A'].shape)}, {tuple(t['B'].shape)} "
                                f"do not match adapter.json")
    adapter.A.data.copy_(t["A"])
    adapter.B.data.copy_(t["B"])
    adapter.eval()
    return adapter, meta
