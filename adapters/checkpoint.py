"""Adapter checkpoints: ADAPTER/adapter.safetensors (A, B) + ADAPTER/adapter.json.

The JSON ties the adapter to one model by its config hash; loading it against another model is an
error. The directory is assembled in a work directory beside it and renamed into place; an existing
directory is replaced only with overwrite=True and only if it is an adapter.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from adapters.lowrank import PrefetchAdapter
from adapters.reuse import ReuseTable, parse_next_visits
from toolkit import __version__
from toolkit.artifacts import atomic_directory, read_json, sha256_file, write_json_atomic
from toolkit.errors import SpecPrefetchError
from toolkit.jsonvalues import is_int
from toolkit.models.loader import ModelSpec

FORMAT = "specprefetch-adapter"
VERSION = 1


def save_adapter(adapter: PrefetchAdapter, out: Path, spec: ModelSpec, extra: dict[str, Any], *,
                 overwrite: bool = False, inputs: tuple = ()) -> Path:
    """Write ADAPTER (see the module doc). An existing `out` is replaced only with `overwrite` and
    only if it is an adapter; `out` must not be, hold or lie inside the model or any of `inputs`
    (toolkit.artifacts.claim_output). Assembled in a work directory and renamed when complete."""
    out = Path(out)
    with atomic_directory(out, overwrite=overwrite, kind="adapter",
                          inputs=(spec.path, *inputs)) as work:
        save_file({"A": adapter.A.detach().contiguous(), "B": adapter.B.detach().contiguous()},
                  str(work / "adapter.safetensors"))
        g = spec.geometry
        meta = {
            "format": FORMAT, "version": VERSION, "toolkit_version": __version__,
            "model": {"family": g.family, "config_hash": spec.config_hash, "path": str(spec.path),
                      "moe_layers": list(g.moe_layers), "num_experts": g.routing.num_experts,
                      "hidden_size": g.hidden_size},
            "horizons": list(adapter.horizons), "rank": adapter.rank, "cross_token": adapter.cross_token,
            "next_visits": adapter.next_visits, "pairs": [list(p) for p in adapter.pairs],
            "params": adapter.params(),
            "weights_sha256": sha256_file(work / "adapter.safetensors"),
            **extra,
        }
        write_json_atomic(work / "adapter.json", meta)
    return out


def adapter_reuse_table(adapter: Path, spec: ModelSpec):
    """An adapter's reuse table for `spec`'s model, from its metadata alone (its weights are not loaded):
    refused in one line for an adapter of another model (check_model) or one without a table (trained
    before it existed)."""
    adapter = Path(adapter)
    meta = read_adapter_meta(adapter)
    check_model(meta, adapter, spec)
    table = reuse_table(meta, adapter / "adapter.json")
    if table is None:
        raise SpecPrefetchError(f"{adapter / 'adapter.json'}: no reuse table (the adapter predates it): train it "
                                "again with `specprefetch train`")
    return table


def reuse_table(meta: dict[str, Any], file: Path):
    """The adapter's reuse table (toolkit/runtime/reuse.py), validated; None for an adapter without one."""
    d = meta.get("reuse")
    return None if d is None else ReuseTable.from_json(
        d, str(file), shape=(len(meta["model"]["moe_layers"]), meta["model"]["num_experts"]))


# (dotted key, check, what it must be) for every field load_adapter reads
_FIELDS: list[tuple[str, Callable[[Any], bool], str]] = [
    ("model", lambda v: isinstance(v, dict), "an object"),
    ("model.config_hash", lambda v: isinstance(v, str), "a string"),
    ("model.moe_layers", lambda v: isinstance(v, list) and len(v) > 0 and all(is_int(x) for x in v),
     "a non-empty list of integers"),
    ("model.num_experts", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("model.hidden_size", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("horizons", lambda v: isinstance(v, list) and len(v) > 0 and all(is_int(x) and 1 <= x <= 4 for x in v),
     "a non-empty list of integers in 1..4"),
    ("rank", lambda v: is_int(v) and v > 0, "a positive integer"),
    ("cross_token", lambda v: isinstance(v, bool), "true or false"),
    ("weights_sha256", lambda v: isinstance(v, str), "a string"),
]


def check_meta(meta: Any, file: Path) -> None:
    """Refuse an adapter.json that is not what save_adapter writes, naming the file and the field."""
    if not isinstance(meta, dict):
        raise SpecPrefetchError(f"{file}: malformed adapter config: not a JSON object")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise SpecPrefetchError(f"{file}: not a version-{VERSION} specprefetch adapter "
                                f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
    for key, ok, what in _FIELDS:
        parent, _, name = key.rpartition(".")
        d = meta[parent] if parent else meta
        if name not in d:
            raise SpecPrefetchError(f"{file}: malformed adapter config: {key!r} is missing")
        if not ok(d[name]):
            raise SpecPrefetchError(f"{file}: malformed adapter config: {key!r} must be {what}, "
                                    f"not {json.dumps(d[name])[:60]}")
    meta_next_visits(meta, file)


def meta_next_visits(meta: dict[str, Any], file: Path) -> int:
    """How many next visits the adapter's heads predict per layer (adapters/reuse.py, parse_next_visits: an
    older adapter's 'next_visit' true is one). More than none only with cross_token."""
    nv, key, what = parse_next_visits(meta)
    if nv is None or (nv and not meta["cross_token"]):
        raise SpecPrefetchError(f"{file}: malformed adapter config: {key!r} must be {what} (more than none only "
                                f"with cross_token), not {json.dumps(meta.get(key))[:60]}")
    return nv


def read_adapter_meta(path: Path) -> dict[str, Any]:
    """ADAPTER/adapter.json, validated: a missing, unparsable or malformed file is a
    SpecPrefetchError naming it and what is wrong (use this, never read the JSON directly)."""
    path = Path(path)
    if not path.is_dir():
        raise SpecPrefetchError(f"adapter directory not found: {path}")
    f = path / "adapter.json"
    _regular_file(f, "adapter config")
    try:
        meta = read_json(f, "adapter config")
    except (ValueError, RecursionError) as e:  # past JSON's syntax: a 5000-digit number, deep nesting
        raise SpecPrefetchError(f"adapter config {f} is not valid JSON: {type(e).__name__}: {e}") from None
    check_meta(meta, f)
    return meta


def _regular_file(f: Path, what: str) -> None:
    """A FIFO or a directory at the name would hang the read or fail it with another error type."""
    if (f.exists() or f.is_symlink()) and not f.is_file():
        raise SpecPrefetchError(f"{f}: not a regular file (the {what} must be one)")


def _pairs(num_layers: int, horizons: list[int], cross_token: bool, next_visits: int) -> int:
    """How many (layer, horizon) pairs an adapter of this shape has (without allocating its weights)."""
    return len(PrefetchAdapter(num_layers=num_layers, hidden_size=1, num_experts=1, horizons=tuple(horizons),
                               rank=1, cross_token=cross_token, next_visits=next_visits).pairs)


def check_model(meta: dict[str, Any], path: Path, spec: ModelSpec) -> None:
    """Refuse (one line) an adapter's metadata (read_adapter_meta) trained for another model than `spec`:
    its config hash, and the sizes it is built with (the config hash alone is a claim)."""
    m = meta["model"]
    if m["config_hash"] != spec.config_hash:
        raise SpecPrefetchError(
            f"{path}: adapter was trained for model config {m['config_hash']} "
            f"({m.get('family')}), not {spec.config_hash} ({spec.path})")
    g = spec.geometry
    have = (list(m["moe_layers"]), m["num_experts"], m["hidden_size"])
    want = (list(g.moe_layers), g.routing.num_experts, g.hidden_size)
    if have != want:
        raise SpecPrefetchError(
            f"{path / 'adapter.json'}: adapter for MoE layers {have[0]}, {have[1]} experts, hidden size "
            f"{have[2]}; model {spec.path} has {want[0]}, {want[1]}, {want[2]} (corrupt adapter.json)")


def load_adapter(path: Path, spec: ModelSpec | None = None) -> tuple[PrefetchAdapter, dict[str, Any]]:
    """Load and validate an adapter; with `spec`, refuse one trained for another model."""
    path = Path(path)
    meta = read_adapter_meta(path)
    m = meta["model"]
    if spec is not None:
        check_model(meta, path, spec)
    weights = path / "adapter.safetensors"
    if not weights.exists() and not weights.is_symlink():
        raise SpecPrefetchError(f"{weights}: missing")
    _regular_file(weights, "adapter weights")
    if sha256_file(weights) != meta.get("weights_sha256"):
        raise SpecPrefetchError(f"{weights}: checksum mismatch (corrupt or modified)")
    try:
        t = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise SpecPrefetchError(f"{weights}: unreadable ({e})") from None
    if not {"A", "B"} <= set(t):
        raise SpecPrefetchError(f"{weights}: expected tensors A and B, found {sorted(t)}")
    # the shapes adapter.json implies, compared with the file's before anything of that size is allocated
    nv = meta_next_visits(meta, path / "adapter.json")
    P = _pairs(len(m["moe_layers"]), meta["horizons"], meta["cross_token"], nv)
    want_a, want_b = (P, meta["rank"], m["hidden_size"]), (P, m["num_experts"], meta["rank"])
    if tuple(t["A"].shape) != want_a or tuple(t["B"].shape) != want_b:
        raise SpecPrefetchError(f"{weights}: tensor shapes {tuple(t['A'].shape)}, {tuple(t['B'].shape)} "
                                f"do not match adapter.json ({want_a}, {want_b})")
    if not (t["A"].is_floating_point() and t["B"].is_floating_point()):
        raise SpecPrefetchError(f"{weights}: tensors A and B must be floating point, not {t['A'].dtype}, "
                                f"{t['B'].dtype}")
    adapter = PrefetchAdapter(num_layers=len(m["moe_layers"]), hidden_size=m["hidden_size"],
                              num_experts=m["num_experts"], horizons=tuple(meta["horizons"]),
                              rank=meta["rank"], cross_token=meta["cross_token"],
                              next_visits=nv)
    adapter.A.data.copy_(t["A"])
    adapter.B.data.copy_(t["B"])
    adapter.eval()
    return adapter, meta
