"""A bundle's manifest: its format, the registry of targets, and validating and opening a bundle.

`validate_bundle` checks everything a manifest claims except the graphs (every file's size and
sha256, no extra files, the model config and geometry, routing, parity summary, KV layers, the
expert store, the adapter); `open_bundle` validates a bundle and opens its graphs through its
target's backend. `export.bundle.inspect_bundle` adds the target's graph checks and a summary.

Targets (export/*_target.py) implement export.target.Target; this module sits above them (it
dispatches to them), and they import nothing from here or from export.bundle.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator

from export.executorch_target import ExecuTorchTarget
from export.qaihub_target import QaiHubTarget
from export.qnn_target import QnnTarget
from export.target import Target, bundle_file
from toolkit import __version__
from toolkit.artifacts import read_json, sha256_file
from adapters.checkpoint import check_model, read_adapter_meta
from adapters.reuse import ReuseTable, parse_next_visits
from toolkit.errors import SpecPrefetchError
from toolkit.jsonvalues import is_int, is_number
from toolkit.models.loader import inspect_model_dir
from toolkit.runtime.expert_store import ExpertStore

FORMAT = "specprefetch-bundle"
VERSION = 1
# every target, by its --target name (in the order `--target` lists them)
TARGETS: dict[str, Target] = {t.NAME: t for t in (ExecuTorchTarget(), QnnTarget(), QaiHubTarget())}
REQUIRED = ("target", "model", "graphs", "files", "kv", "routing", "runtime", "quantization", "predictor")
VERSIONED = ("torch", "transformers", "executorch", "torchao", "onnx", "onnxruntime", "onnxruntime-qnn", "qai-hub")

__all__ = ["FORMAT", "VERSION", "TARGETS", "Target", "get_target", "bundle_file", "versions", "sizes",
           "read_manifest", "validate_bundle", "open_bundle", "malformed", "check_store_record"]


def get_target(name: str) -> Target:
    """The target called `name` (a `--target` value, or a manifest's `target`)."""
    tgt = TARGETS.get(name) if isinstance(name, str) else None
    if tgt is None:
        raise SpecPrefetchError(f"--target {name!r}: choose from {', '.join(TARGETS)}")
    return tgt


def versions() -> dict[str, str]:
    """The installed versions of the packages a bundle's files depend on."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"specprefetch": __version__}
    for pkg in VERSIONED:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def sizes(files: dict[str, Any]) -> dict[str, int]:
    """Bytes per top-level part of the bundle (graphs, model, experts.spx, ...)."""
    out: dict[str, int] = {}
    for rel, meta in files.items():
        part = rel.split("/")[0]
        out[part] = out.get(part, 0) + meta["size"]
    return out


def read_manifest(path: Path | str) -> tuple[Path, dict[str, Any]]:
    """(manifest.json's path, its content) of the bundle directory `path`; not validated."""
    path = Path(path)
    if not path.is_dir():
        raise SpecPrefetchError(f"{path}: not a bundle directory")
    mf = path / "manifest.json"
    if mf.is_symlink():
        raise SpecPrefetchError(f"{mf}: a symbolic link; a bundle's manifest must be a file inside the bundle")
    if not mf.exists():
        raise SpecPrefetchError(f"{mf}: missing (not a specprefetch bundle)")
    if not mf.is_file():
        raise SpecPrefetchError(f"{mf}: not a file (not a specprefetch bundle)")
    try:
        return mf, read_json(mf, "bundle manifest")
    except OSError as e:
        raise SpecPrefetchError(f"{mf}: cannot read it ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:  # past JSON's syntax: a 5000-digit number, deep nesting
        raise SpecPrefetchError(f"bundle manifest {mf} is not valid JSON ({e})") from None


@contextlib.contextmanager
def malformed(mf: Path) -> Iterator[None]:
    """A manifest missing a field or holding one of the wrong type is an error naming it."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        raise SpecPrefetchError(f"{mf}: malformed manifest ({type(e).__name__}: {e})") from None


def _check_images(mf: Path, m: dict[str, Any], g) -> None:
    """kv.rope, and graphs.vision of a bundle that takes images: the fields the runners read, of the right
    types and consistent (images need M-RoPE layer graphs; the size, grid and tokens agree)."""
    rope = m["kv"].get("rope", "1d")
    if rope not in ("1d", "mrope"):
        raise SpecPrefetchError(f"{mf}: kv.rope is {json.dumps(rope)[:40]}: expected \"1d\" or \"mrope\"")
    v = m["graphs"].get("vision") if isinstance(m["graphs"], dict) else None
    if v is None:
        return
    where = f"{mf}: graphs.vision"
    if not isinstance(v, dict) or not isinstance(v.get("preprocess"), dict):
        raise SpecPrefetchError(f"{where} must be a JSON object with a preprocess object")
    hint = " (a bundle exported before this field existed: export it again)"
    if rope != "mrope":
        raise SpecPrefetchError(f"{where} is present but kv.rope is {rope!r}: image prompts need M-RoPE layer graphs")
    p = v["preprocess"]

    def ints(obj, key, n=None, lo=0, hi=1 << 40):
        x = obj.get(key)
        xs = x if n is not None else [x]
        if (n is not None and (not isinstance(x, list) or len(x) != n)) or \
                not all(type(e) is int and lo <= e <= hi for e in xs):
            name = f"preprocess.{key}" if obj is p else key
            raise SpecPrefetchError(f"{where}.{name} is {json.dumps(x)[:40]}, expected "
                                    + (f"{n} integers" if n is not None else "an integer") + f" in {lo}..{hi}"
                                    + (hint if key not in obj and key in ("min_pixels", "max_pixels") else ""))
        return x
    size, grid = ints(v, "image_size", 2, 1, 1 << 14), ints(v, "grid_thw", 3, 1, 1 << 12)
    tokens = ints(v, "tokens", None, 1, 1 << 20)
    ints(v, "deepstack_layers", None, 0, g.num_layers)
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        ints(v, key, None, 0, g.vocab_size - 1)
    patch, merge = ints(p, "patch_size", None, 1, 1024), ints(p, "merge_size", None, 1, 64)
    ints(p, "temporal_patch_size", None, 1, 64)
    lo, hi = ints(p, "min_pixels", None, 1), ints(p, "max_pixels", None, 1)
    for key in ("image_mean", "image_std"):
        x = p.get(key)
        if not (isinstance(x, list) and len(x) == 3 and all(is_number(e) and (key == "image_mean" or e != 0)
                                                             for e in x)):
            raise SpecPrefetchError(f"{where}.preprocess.{key} must list 3 finite numbers"
                                    + (", none zero" if key == "image_std" else ""))
    if not (is_number(p.get("rescale_factor")) and p["rescale_factor"] > 0):
        raise SpecPrefetchError(f"{where}.preprocess.rescale_factor must be a finite number above 0")
    if v.get("precision", "fp32") not in ("fp32", "fp16"):  # absent: a bundle from before the field (ExecuTorch, fp32)
        raise SpecPrefetchError(f"{where}.precision is {json.dumps(v['precision'])[:40]}: "
                                "expected \"fp32\" or \"fp16\"")
    files = m["graphs"].get("files")  # QNN bundles: a graph per file; ExecuTorch: the program's methods
    methods = list(files) if isinstance(files, dict) else m["graphs"].get("methods")
    if p.get("resize") != "bicubic" or not isinstance(methods, list) or v.get("method") not in methods:
        raise SpecPrefetchError(f"{where}: preprocess.resize must be \"bicubic\" and method one of graphs.methods "
                                "(graphs.files in a QNN bundle)")
    if grid[0] != 1 or grid[1] * patch != size[0] or grid[2] * patch != size[1] or size[0] % (patch * merge) \
            or size[1] % (patch * merge) or (grid[1] // merge) * (grid[2] // merge) != tokens \
            or not lo <= size[0] * size[1] <= hi:
        raise SpecPrefetchError(f"{where}: image_size, grid_thw, patch and merge sizes, tokens and the pixel "
                                "bounds disagree")


def validate_bundle(path: Path | str, *, hash_store: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Validate a bundle, all but its graphs (the target's `check_graphs` does those).

    Returns (manifest, notes); notes name version differences that are not errors. Any problem is
    a SpecPrefetchError naming the file. `hash_store=False` checks the expert store's size and
    index but not its sha256 (opening a bundle to run it: at phone scale the store is many GiB, and
    every blob's CRC is checked as it is read)."""
    path = Path(path)
    mf, m = read_manifest(path)
    with malformed(mf):
        return m, _validate(path, mf, m, hash_store)


def _validate(path: Path, mf: Path, m: Any, hash_store: bool = True) -> list[str]:
    if not isinstance(m, dict):
        raise SpecPrefetchError(f"{mf}: not a JSON object")
    if m.get("format") != FORMAT:
        raise SpecPrefetchError(f"{mf}: format {m.get('format')!r}, expected {FORMAT!r}")
    if m.get("version") != VERSION:
        raise SpecPrefetchError(f"{mf}: bundle version {m.get('version')!r}; this toolkit reads version {VERSION}")
    for key in REQUIRED:
        if key not in m:
            raise SpecPrefetchError(f"{mf}: missing field {key!r}")
    if not isinstance(m["target"], str) or m["target"] not in TARGETS:
        raise SpecPrefetchError(f"{mf}: target {m['target']!r} is not a target this toolkit knows "
                                f"({', '.join(TARGETS)})")
    for key in ("model", "kv", "routing", "runtime", "quantization", "predictor"):
        if not isinstance(m[key], dict):
            raise SpecPrefetchError(f"{mf}: field {key!r} must be a JSON object")
    if not isinstance(m.get("parity"), dict):
        raise SpecPrefetchError(f"{mf}: field 'parity' must be a JSON object (the parity summary)")
    for key in ("dense", "experts", "expert_graph"):  # what inspect and export print
        if not isinstance(m["quantization"].get(key), str):
            raise SpecPrefetchError(f"{mf}: quantization.{key} must be a string, not "
                                    f"{json.dumps(m['quantization'].get(key))[:40]}")
    files = m["files"]
    if not isinstance(files, dict) or not files:
        raise SpecPrefetchError(f"{mf}: 'files' must map paths to sizes and hashes")
    root = path.resolve()
    for rel, meta in files.items():
        p = bundle_file(path, files, rel, "file")
        try:
            inside = p.resolve().is_relative_to(root)
        except (RuntimeError, OSError) as e:  # a symbolic link loop
            raise SpecPrefetchError(f"{p}: cannot resolve it ({e})") from None
        if not inside:
            raise SpecPrefetchError(f"{mf}: file {rel!r} resolves outside the bundle")
        if not p.is_file():
            raise SpecPrefetchError(f"{p}: listed in the manifest but missing")
        size = p.stat().st_size
        if size != meta["size"]:
            raise SpecPrefetchError(f"{p}: {size} bytes, the manifest says {meta['size']} (truncated or modified)")
        if (hash_store or rel != m["runtime"]["expert_store"]) and sha256_file(p) != meta["sha256"]:
            raise SpecPrefetchError(f"{p}: sha256 mismatch (tampered or corrupt)")
    extra = [str(p.relative_to(path)) for p in path.rglob("*")
             if p.is_file() and str(p.relative_to(path)) != "manifest.json" and str(p.relative_to(path)) not in files]
    if extra:
        raise SpecPrefetchError(f"{path}: files not in the manifest: {', '.join(sorted(extra)[:5])}")
    # the manifest's own claims, checked against hashed content
    cfg_file = bundle_file(path, files, m["model"]["config"], "model config")
    spec = inspect_model_dir(cfg_file.parent, config_only_ok=True)
    if spec.config_hash != m["model"]["config_hash"]:
        raise SpecPrefetchError(f"{mf}: model config hash {m['model']['config_hash']}, but {cfg_file} hashes to "
                                f"{spec.config_hash}")
    g = spec.geometry
    want_model = {"family": g.family, "num_layers": g.num_layers, "moe_layers": list(g.moe_layers),
                  "hidden_size": g.hidden_size, "vocab_size": g.vocab_size,
                  "num_experts": g.routing.num_experts, "top_k": g.routing.top_k}
    for k, v in want_model.items():
        if m["model"][k] != v:
            raise SpecPrefetchError(f"{mf}: model.{k} is {m['model'][k]!r}, {cfg_file} says {v!r}")
    for k, v in dataclasses.asdict(g.routing).items():
        if m["routing"][k] != v:
            raise SpecPrefetchError(f"{mf}: routing.{k} is {m['routing'][k]!r}, {cfg_file} says {v!r}")
    for rel in m["tokenizer"]:
        bundle_file(path, files, rel, "tokenizer file")
    parity_file = bundle_file(path, files, "parity.json", "parity report")
    try:
        parity = read_json(parity_file, "parity report")
    except (ValueError, RecursionError) as e:  # past JSON's syntax: a 5000-digit number, deep nesting
        raise SpecPrefetchError(f"parity report {parity_file} is not valid JSON ({e})") from None
    if not isinstance(parity, dict):
        raise SpecPrefetchError(f"{parity_file}: not a JSON object")
    if not parity.get("passed") or any(m["parity"][k] != parity[k] for k in m["parity"] if k in parity):
        raise SpecPrefetchError(f"{mf}: parity summary does not match {parity_file} (or parity did not pass)")
    _check_runtime(mf, m, g)
    _check_images(mf, m, g)
    if len(m["kv"]["layers"]) != g.num_layers:
        raise SpecPrefetchError(f"{mf}: kv.layers lists {len(m['kv']['layers'])} layers, the model has {g.num_layers}")
    notes = []
    installed = versions()
    for pkg, want in m.get("versions", {}).items():
        have = installed.get(pkg)
        if have is not None and have != want and pkg in ("executorch", "onnxruntime-qnn", "onnxruntime"):
            notes.append(f"built with {pkg} {want}, {have} installed here")
    store_path = bundle_file(path, files, m["runtime"]["expert_store"], "expert store")
    with ExpertStore(store_path, spec) as store:
        if (store.num_layers, store.num_experts) != (len(g.moe_layers), g.routing.num_experts):
            raise SpecPrefetchError(f"{store_path}: {store.num_layers} layers x {store.num_experts} experts, the "
                                    f"model has {len(g.moe_layers)} x {g.routing.num_experts}")
        check_store_record(store, m, mf)
    if m["predictor"].get("adapter"):
        ad = bundle_file(path, files, "adapter/adapter.json", "adapter config")
        meta = read_adapter_meta(ad.parent)  # the validated reader: a malformed file is named as such
        check_model(meta, ad.parent, spec)   # the bundle's model (its config hash checked above) and sizes
        bundle_file(path, files, "adapter/adapter.safetensors", "adapter weights")
    if m["predictor"].get("reuse") is not None:  # the reuse eviction's table, as the runners read it
        ReuseTable.from_json(m["predictor"]["reuse"], f"{mf}: predictor.reuse",
                             shape=(len(g.moe_layers), g.routing.num_experts))
    nv = manifest_next_visits(m, mf)
    rows = m["predictor"].get("preds_rows") or {}
    L = len(g.moe_layers)
    for layer in (g.moe_layers if nv else ()):
        hs = rows.get(str(layer)) if isinstance(rows, dict) else None
        missing = [j * L for j in range(1, nv + 1) if not (isinstance(hs, list) and j * L in hs)]
        if missing:
            raise SpecPrefetchError(f"{mf}: predictor.next_visits is {nv} but predictor.preds_rows[\"{layer}\"] "
                                    f"lacks horizon {missing[0]} (its next visits' rows: {L}..{nv * L})")
    return notes


def manifest_next_visits(m: dict[str, Any], mf: Path) -> int:
    """How many next visits the bundle's preds rows predict per layer (horizons L, 2L, ...; adapters/reuse.py,
    parse_next_visits: an older bundle's predictor.next_visit true is one)."""
    nv, key, what = parse_next_visits(m["predictor"])
    if nv is None:
        raise SpecPrefetchError(f"{mf}: predictor.{key} must be {what}")
    return nv


def check_store_record(store: ExpertStore, m: dict[str, Any], mf: Path) -> None:
    """The bundle's store is the one it was exported with: its source weights' digest and the sha256
    of its header, index (every blob's CRC-32) and metadata are the manifest's. Cheap (the blobs are
    not read), so it holds when the store's own sha256 is skipped; a store of other weights with the
    same config and size is refused naming the cause."""
    rt = m["runtime"]
    want_src, want_index = rt.get("expert_store_source"), rt.get("expert_store_index_sha256")
    if not isinstance(want_src, str) or not isinstance(want_index, str):
        raise SpecPrefetchError(f"{mf}: runtime.expert_store_source / expert_store_index_sha256 missing (a bundle "
                                "exported before specprefetch recorded its store's identity): export it again")
    have_src = store.meta["source"]["digest"]
    if have_src != want_src:
        raise SpecPrefetchError(f"{store.path}: expert store built from other weights (source digest "
                                f"{have_src[:16]}...) than the bundle was exported with ({want_src[:16]}..., "
                                f"{m['model'].get('source')}): another store was put in its place; export again")
    if store.index_sha256 != want_index:
        raise SpecPrefetchError(f"{store.path}: the expert store's index is not the one the bundle was exported "
                                "with (sha256 of its header, index and metadata differs): rebuilt or replaced; "
                                "export again")


def _check_runtime(mf: Path, m: dict[str, Any], g: Any) -> None:
    """The runtime defaults a runner takes from the manifest are in range (the native runner
    refuses the same values): a bundle with a negative pool or a zero window is not valid."""
    rt, n_moe, E = m["runtime"], len(g.moe_layers), g.routing.num_experts
    pool = rt["pool_mib"]
    if not is_number(pool) or not 0 < pool <= 2**24:
        raise SpecPrefetchError(f"{mf}: runtime.pool_mib is {pool!r}; it must be a number above 0 (MiB, at most 2^24)")
    s = rt.get("scheduler", {})
    if not isinstance(s, dict):
        raise SpecPrefetchError(f"{mf}: runtime.scheduler must be a JSON object")
    checks = {
        "window": (lambda v: is_int(v) and 1 <= v <= n_moe, f"an integer 1..{n_moe} (MoE layers ahead)"),
        "queue_depth": (lambda v: is_int(v) and 1 <= v <= 1 << 20, "an integer of at least 1"),
        "min_confidence": (lambda v: is_number(v) and 0 <= v <= 1, "a probability in [0, 1]"),
        "candidate_threshold": (lambda v: is_number(v) and 0 <= v <= 1, "a probability in [0, 1]"),
        LEGACY_THRESHOLD: (lambda v: is_number(v) and 0 <= v <= 1, "a probability in [0, 1]"),
        "step_budget_bytes": (lambda v: v is None or (is_int(v) and v >= 0), "null or a byte count >= 0"),
        "candidates": (lambda v: v is None or (is_int(v) and 1 <= v <= E), f"null or an integer 1..{E}"),
        "prefetch": (lambda v: isinstance(v, bool), "true or false"),
    }
    for key, (ok, want) in checks.items():
        if key in s and not ok(s[key]):
            raise SpecPrefetchError(f"{mf}: runtime.scheduler.{key} is {s[key]!r}; it must be {want}")
    max_seq = m["kv"].get("max_seq")
    if not is_int(max_seq) or max_seq < 2:
        raise SpecPrefetchError(f"{mf}: kv.max_seq is {max_seq!r}; it must be an integer of at least 2")


SCHEDULER_DEFAULTS = ("window", "queue_depth", "min_confidence", "candidate_threshold", "step_budget_kib")
# bundles exported before the rename call candidate_threshold "floor" (both engines read either)
LEGACY_THRESHOLD = "floor"


def scheduler_defaults(m: dict[str, Any]) -> dict[str, Any]:
    """The scheduler settings a bundle was exported with (runtime.scheduler, validated by
    _check_runtime), as RunConfig fields: what both engines run a bundle with unless told otherwise
    (the native runner reads the same fields: android_runner/src/bundle.cpp)."""
    s = m["runtime"].get("scheduler", {})
    out = {k: s[k] for k in ("window", "queue_depth") if k in s}
    out.update({k: float(s[k]) for k in ("min_confidence", "candidate_threshold") if k in s})
    if "candidate_threshold" not in s and LEGACY_THRESHOLD in s:
        out["candidate_threshold"] = float(s[LEGACY_THRESHOLD])
    if s.get("step_budget_bytes"):  # null or 0: unbounded; whole KiB, rounded down (as the native runner)
        out["step_budget_kib"] = int(s["step_budget_bytes"]) // 1024
    return out


def open_bundle(path: Path | str) -> tuple[dict[str, Any], Any]:
    """(manifest, backend running the bundle's graphs) of a validated bundle.

    The manifest and every file are checked as `validate_bundle` does (the graphs are not
    re-checked against their signatures: opening them through the target's backend loads them);
    then the bundle's target opens its backend."""
    path = Path(path)
    m, _ = validate_bundle(path, hash_store=False)
    with malformed(path / "manifest.json"):
        return m, get_target(m["target"]).open_backend(path, m)
