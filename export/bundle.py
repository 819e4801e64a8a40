"""`specprefetch export`: a phone-ready bundle directory, and `specprefetch inspect` to validate one.

    BUNDLE/
      manifest.json        format, model, quantization, target, SoC, KV layout, routing, runtime
                           defaults (pool budget, scheduler), graph signatures, versions, and every
                           file with its size and sha256
      model/               config.json, tokenizer files (what the runner needs to tokenize)
      graphs/              the dense step graphs: model.pte (ExecuTorch) or ONNX + QNN context
                           binaries (qnn, qai-hub)
      experts.spx          the expert store: experts stream from it, never inside a graph
      adapter/             the prefetch adapter checkpoint (its heads are also folded into graphs)
      host.safetensors     host-side routing tensors (DeepSeek-V3 selection bias), if any
      parity.json / .md    the parity report the bundle was accepted with

The bundle is assembled in BUNDLE.partial and renamed into place only after parity holds; a bundle
past tolerance is refused and its partial directory kept (renamed BUNDLE.rejected) for inspection.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
import time
from pathlib import Path
from typing import Any


from toolkit import __version__
from toolkit.artifacts import read_json, sha256_file, write_json_atomic
from toolkit.errors import SpecPrefetchError

FORMAT = "specprefetch-bundle"
VERSION = 1
TARGETS = ("executorch", "qnn", "qai-hub")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
               "chat_template.json", "preprocessor_config.json")


@dataclasses.dataclass
class ExportConfig:
    target: str = "executorch"
    quant: str | None = None          # default per target: fp32 (executorch), fp16 (qnn)
    experts: str = "fp16"             # expert store dtype
    soc: str = "SM8750"
    max_seq: int = 256
    pool_mib: float | None = None     # default: a quarter of the experts' bytes
    window: int = 2
    calibration: Path | None = None   # JSONL/txt; default: the embedded held-out text
    parity_prompts: int = 3
    prompt_tokens: int = 12
    decode_tokens: int = 8
    calibration_prompts: int = 4      # QDQ calibration (qnn a16w8 / a8w8)
    tolerance: dict[str, float] = dataclasses.field(default_factory=dict)
    qnn_path: str = "ort"             # "ort" (onnxruntime-qnn) or "executorch" (needs QAIRT SDK)
    hub_device: str = "Snapdragon 8 Elite QRD"
    hub_timeout_s: float = 15.0       # token / network / device checks and each job submission
    hub_job_timeout_s: float = 3600.0 # waiting for one compile job
    hub_profile: bool = True
    hub_client: Any = None            # the qai_hub module, or a double standing in for the service
    progress: bool = True


class ParityRefused(SpecPrefetchError):
    """The bundle's graphs are past tolerance; its directory was kept as OUT.rejected."""


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"specprefetch": __version__}
    for pkg in ("torch", "transformers", "executorch", "torchao", "onnx", "onnxruntime", "onnxruntime-qnn", "qai-hub"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def calibration_prompts(spec_tokenizer, path: Path | None, n: int, tokens: int) -> list[list[int]]:
    """The first `n` prompts of `tokens` tokens from a .jsonl/.txt file (records long enough)."""
    from toolkit.traces.data import read_records

    path = Path(path) if path else Path(__file__).resolve().parent.parent / "toolkit" / "embedded" / "heldout.jsonl"
    out = []
    for r in read_records([path], allow_images=False):
        ids = spec_tokenizer(r.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == n:
            return out
    raise SpecPrefetchError(f"--calibration {path}: only {len(out)} records of >= {tokens} tokens; need {n}")


def _target(name: str):
    if name == "executorch":
        from export import executorch_target
        return executorch_target
    if name == "qnn":
        from export import qnn_target
        return qnn_target
    if name == "qai-hub":
        from export import qaihub_target
        return qaihub_target
    raise SpecPrefetchError(f"--target {name!r}: choose from {', '.join(TARGETS)}")


def _log(cfg: ExportConfig, msg: str) -> None:
    if cfg.progress:
        from rich.console import Console
        Console(stderr=True).print(f"[bold]export[/bold] {msg}")


def export_bundle(model: str | Path, out: Path, cfg: ExportConfig, adapter: Path | None = None) -> dict[str, Any]:
    """Build, check and write a bundle; returns its manifest.

    Everything is assembled in OUT.partial (and a scratch directory, always removed); an existing
    OUT is only replaced once the new bundle is complete. On any failure, Ctrl-C included, the
    partial directory is removed, except after a parity refusal, which keeps it as OUT.rejected."""
    import tempfile

    from export.pipeline import Tolerance

    out = Path(out)
    tgt = _target(cfg.target)
    quant = cfg.quant or tgt.DEFAULT_QUANT
    if quant not in tgt.QUANTS:
        raise SpecPrefetchError(f"--quant {quant!r} is not offered by --target {cfg.target}: "
                                f"choose from {', '.join(tgt.QUANTS)}")
    if not 1 <= cfg.window <= 4:
        raise SpecPrefetchError(f"--window {cfg.window}: the prefetch window is 1..4 MoE layers")
    if cfg.prompt_tokens < 2 or cfg.decode_tokens < 1 or cfg.parity_prompts < 1:
        raise SpecPrefetchError("--prompt-tokens must be >= 2, --decode-tokens and --parity-prompts >= 1")
    if cfg.max_seq < cfg.prompt_tokens + cfg.decode_tokens:
        raise SpecPrefetchError(f"--max-seq {cfg.max_seq} is shorter than the parity sequences "
                                f"({cfg.prompt_tokens} + {cfg.decode_tokens} tokens)")
    if out.exists() and not out.is_dir():
        raise SpecPrefetchError(f"--out {out}: exists and is not a directory")
    tol = Tolerance.for_quant(quant).with_overrides(cfg.tolerance)
    tgt.preflight(cfg, quant)  # fail fast (missing SDK, token, network) before any heavy work
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(prefix="specprefetch-export-") as scratch:
            manifest = _assemble(model, work, Path(scratch), cfg, tgt, quant, tol, adapter, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    # replace an existing bundle only now, and so that some complete bundle is always on disk
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    work.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(out.with_name(out.name + ".rejected"), ignore_errors=True)
    return manifest


def _assemble(model, work: Path, scratch: Path, cfg: ExportConfig, tgt, quant: str, tol, adapter, out: Path) -> dict[str, Any]:
    from export.graphs import MASK_VALUE, StepModel, adapter_heads, describe
    from toolkit.runtime.backend import IO_MASK_VALUE
    from export.pipeline import ExpertWeights, check, compare, free_running, run_sequence
    from toolkit.models.loader import inspect_model_dir, load_dense_model
    from toolkit.models.routers import load_router_bank
    from toolkit.runtime.expert_store import ExpertStore, build_store

    spec = inspect_model_dir(model)
    if spec.family.is_vision_language:
        _log(cfg, "vision-language model: exporting its language model (text decode graphs)")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
    g = spec.geometry
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    (work / "model").mkdir(parents=True)
    (work / "graphs").mkdir()
    for name in MODEL_FILES:
        if (spec.path / name).exists():
            shutil.copy2(spec.path / name, work / "model" / name)

    # predictor heads: the adapter's, or next-gate (the adapter with B = 0) without one
    bank = load_router_bank(spec)
    if adapter is not None:
        from adapters.checkpoint import load_adapter
        ad, ad_meta = load_adapter(adapter, spec)
        shutil.copytree(adapter, work / "adapter")
        predictor = "adapter"
    else:
        from adapters.lowrank import PrefetchAdapter
        ad = PrefetchAdapter(num_layers=len(g.moe_layers), hidden_size=g.hidden_size,
                             num_experts=g.routing.num_experts, horizons=tuple(range(1, cfg.window + 1)), rank=1)
        ad_meta, predictor = None, "next-gate"
    horizons = tuple(h for h in ad.horizons if h <= cfg.window)
    if not horizons:
        raise SpecPrefetchError(f"--window {cfg.window}: the adapter predicts horizons {list(ad.horizons)} only")
    heads = adapter_heads(ad, bank, horizons)
    if bank.score_bias is not None:
        from safetensors.torch import save_file
        save_file({"score_bias": bank.score_bias.contiguous()}, str(work / "host.safetensors"))

    t0 = time.perf_counter()
    _log(cfg, f"expert store ({cfg.experts})")
    build_store(spec, work / "experts.spx", cfg.experts, progress=cfg.progress)
    store = ExpertStore(work / "experts.spx", spec)
    timings["expert_store_s"] = time.perf_counter() - t0

    steps = StepModel(spec, load_dense_model(spec), max_seq=cfg.max_seq, adapter_heads=heads)
    experts = ExpertWeights(store, [m.role for m in spec.family.expert_matrices(g)], g.moe_layers)
    run_kw = dict(moe_layers=g.moe_layers, num_layers=g.num_layers, routing=g.routing,
                  score_bias=bank.score_bias, experts=experts)
    # one read of the prompt file: parity prompts first, QDQ calibration prompts after them (disjoint)
    n_calib = cfg.calibration_prompts if tgt.NEEDS_CALIBRATION.get(quant) else 0
    prompts = calibration_prompts(tok, cfg.calibration, cfg.parity_prompts + n_calib, cfg.prompt_tokens)
    parity_ids, calib_ids = prompts[:cfg.parity_prompts], prompts[cfg.parity_prompts:]

    t0 = time.perf_counter()
    _log(cfg, f"graphs: {cfg.target}, {quant}")
    built = tgt.build(steps, cfg, quant, work / "graphs", calib=calib_ids, run_kw=run_kw,
                      log=lambda m: _log(cfg, m), scratch=scratch)
    timings["graphs_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    _log(cfg, f"parity: {len(parity_ids)} prompts x ({cfg.prompt_tokens} + {cfg.decode_tokens}) tokens")
    eos = tok.eos_token_id
    ref_backend = built.reference
    refs = [run_sequence(ref_backend, p, extend=cfg.decode_tokens, eos=eos, **run_kw) for p in parity_ids]
    bundle_backend = built.backend()
    gots = [run_sequence(bundle_backend, r.tokens, force_ids=r.ids, **run_kw) for r in refs]
    figures = compare(refs, gots)
    figures["free_running"] = free_running(
        refs, [run_sequence(bundle_backend, p, extend=cfg.decode_tokens, eos=eos, **run_kw) for p in parity_ids],
        [len(p) for p in parity_ids])
    failures = check(figures, tol)
    extra = built.extra_parity(refs, gots, run_kw)
    timings["parity_s"] = time.perf_counter() - t0
    parity = {"reference": built.reference_label, "bundle": built.backend_label, "quant": quant,
              "tolerance": dataclasses.asdict(tol), **figures, **extra,
              "passed": not failures, "failures": failures,
              "prompts": len(parity_ids), "prompt_tokens": cfg.prompt_tokens, "decode_tokens": cfg.decode_tokens}
    write_json_atomic(work / "parity.json", parity)
    (work / "parity.md").write_text(parity_markdown(parity))
    if failures:
        rejected = out.with_name(out.name + ".rejected")
        shutil.rmtree(rejected, ignore_errors=True)
        work.rename(rejected)
        raise ParityRefused(
            f"parity failed, bundle refused ({built.backend_label} vs {built.reference_label}, {quant}): "
            + "; ".join(failures) + f". Report and partial bundle kept in {rejected}")

    expert_bytes = store.slot_bytes * store.num_layers * store.num_experts
    pool_mib = cfg.pool_mib if cfg.pool_mib is not None else round(expert_bytes / 4 / 2**20, 3)
    from toolkit.runtime.scheduler import SchedulerConfig
    sched = dataclasses.asdict(SchedulerConfig(window=cfg.window))
    timings["total_s"] = time.perf_counter() - t_start
    manifest = {
        "format": FORMAT, "version": VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": cfg.target, "soc": built.soc, "quantization": {"dense": quant, "experts": cfg.experts,
                                                                "expert_graph": built.expert_precision},
        "model": {"family": g.family, "model_type": g.model_type, "config_hash": spec.config_hash,
                  "config": "model/config.json", "source": str(spec.path),
                  "num_layers": g.num_layers, "moe_layers": list(g.moe_layers), "hidden_size": g.hidden_size,
                  "vocab_size": g.vocab_size, "num_experts": g.routing.num_experts, "top_k": g.routing.top_k},
        "tokenizer": sorted(f"model/{p.name}" for p in (work / "model").iterdir() if p.name.startswith("tokenizer")),
        "eos_token_id": eos,
        "routing": {**dataclasses.asdict(g.routing),
                    "score_bias_file": "host.safetensors" if bank.score_bias is not None else None},
        "kv": {"mode": built.kv_mode, "max_seq": cfg.max_seq,
               "mask_value": MASK_VALUE if built.kv_mode == "buffer" else IO_MASK_VALUE,
               "layers": [{"k": list(c.k_shape), "v": list(c.v_shape), "window": w}
                          for c, w in zip(steps.cache_specs, steps.windows)]},
        "predictor": {"kind": predictor, "horizons": list(horizons), "adapter": "adapter" if ad_meta else None,
                      "preds_rows": {str(g.moe_layers[i]): [h for h in horizons if (i, h) in ad.pair_index]
                                     for i in range(len(g.moe_layers))}},
        "runtime": {"pool_mib": pool_mib, "scheduler": sched, "expert_store": "experts.spx",
                    "expert_bytes_total": expert_bytes},
        "graphs": {**built.graphs, "signatures": describe(steps, built.kv_mode)},
        "parity": {**{k: parity[k] for k in ("passed", "max_abs_logit_diff", "median_logit_diff", "topk_agreement",
                                              "next_token_agreement")},
                   "free_running_token_match": parity["free_running"]["token_match"]},
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "versions": _versions(),
    }
    manifest["files"] = {str(p.relative_to(work)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
                         for p in sorted(work.rglob("*")) if p.is_file()}
    write_json_atomic(work / "manifest.json", manifest)
    return manifest


def parity_markdown(p: dict[str, Any]) -> str:
    t = p["tolerance"]

    def bound(key, op):
        v = t[key]
        return "" if v == float("inf") else f"{op} {v:g}"
    rows = [("max |logit diff| (worst position)", f"{p['max_abs_logit_diff']:.3g}", bound("max_abs_logit_diff", "<=")),
            ("max |logit diff| / max |logit|", f"{p['max_rel_logit_diff']:.3g}", bound("max_rel_logit_diff", "<=")),
            ("median |logit diff| (per position)", f"{p['median_logit_diff']:.3g}", bound("max_median_logit_diff", "<=")),
            ("p95 |logit diff| (per position)", f"{p['p95_logit_diff']:.3g}", ""),
            ("router top-k agreement (same set)", f"{p['topk_agreement']:.4f}", bound("min_topk_agreement", ">=")),
            ("router top-k overlap", f"{p['topk_overlap']:.4f}", ""),
            ("greedy next-token agreement", f"{p['next_token_agreement']:.4f}", bound("min_next_token_agreement", ">=")),
            ("free-running greedy decode: share of tokens before the first difference",
             f"{p['free_running']['token_match']:.4f}", bound("min_free_token_match", ">=")),
            ("free-running greedy decode: identical continuations",
             f"{p['free_running']['identical']} of {p['prompts']}", "")]
    for k, v in p.items():
        if k.startswith("vs_") and v:
            rows.append((k, json.dumps(v), ""))
    lines = [f"# Parity: {p['bundle']} vs {p['reference']} ({p['quant']})", "",
             f"{p['prompts']} prompts x ({p['prompt_tokens']} prompt + {p['decode_tokens']} greedy) tokens, "
             f"{p['positions']} positions. The logit, top-k and next-token figures are teacher-forced on the "
             "reference's tokens and expert choice (a router flip is counted by the top-k agreement, not left to "
             "cascade); the free-running rows let the bundle decode greedily from each prompt on its own.", "",
             "| figure | value | bound |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "**passed**" if p["passed"] else "**FAILED**: " + "; ".join(p["failures"]), ""]
    return "\n".join(lines)


# -- inspect --------------------------------------------------------------------------------

def inspect_bundle(path: Path | str, *, load_graphs: bool = True) -> dict[str, Any]:
    """Validate a bundle (manifest, every file's size and sha256, versions, the expert store and
    the graph signatures); returns a summary. Any problem is a SpecPrefetchError naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise SpecPrefetchError(f"{path}: not a bundle directory")
    mf = path / "manifest.json"
    if not mf.exists():
        raise SpecPrefetchError(f"{mf}: missing (not a specprefetch bundle)")
    m = read_json(mf, "bundle manifest")
    try:
        return _inspect(path, mf, m, load_graphs)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        raise SpecPrefetchError(f"{mf}: malformed manifest ({type(e).__name__}: {e})") from None


def bundle_file(path: Path, files: dict[str, Any], rel: Any, what: str) -> Path:
    """A path the manifest names: relative, inside the bundle, and one of its hashed files."""
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise SpecPrefetchError(f"{path / 'manifest.json'}: {what} {rel!r} is not a path inside the bundle")
    if rel not in files:
        raise SpecPrefetchError(f"{path / 'manifest.json'}: {what} {rel!r} is not among the hashed files")
    return path / rel


def _inspect(path: Path, mf: Path, m: dict[str, Any], load_graphs: bool) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise SpecPrefetchError(f"{mf}: not a JSON object")
    if m.get("format") != FORMAT:
        raise SpecPrefetchError(f"{mf}: format {m.get('format')!r}, expected {FORMAT!r}")
    if m.get("version") != VERSION:
        raise SpecPrefetchError(f"{mf}: bundle version {m.get('version')!r}; this toolkit reads version {VERSION}")
    for key in ("target", "model", "graphs", "files", "kv", "routing", "runtime", "quantization", "predictor"):
        if key not in m:
            raise SpecPrefetchError(f"{mf}: missing field {key!r}")
    files = m["files"]
    if not isinstance(files, dict) or not files:
        raise SpecPrefetchError(f"{mf}: 'files' must map paths to sizes and hashes")
    root = path.resolve()
    for rel, meta in files.items():
        p = bundle_file(path, files, rel, "file")
        if not p.resolve().is_relative_to(root):
            raise SpecPrefetchError(f"{mf}: file {rel!r} resolves outside the bundle")
        if not p.is_file():
            raise SpecPrefetchError(f"{p}: listed in the manifest but missing")
        size = p.stat().st_size
        if size != meta["size"]:
            raise SpecPrefetchError(f"{p}: {size} bytes, the manifest says {meta['size']} (truncated or modified)")
        if sha256_file(p) != meta["sha256"]:
            raise SpecPrefetchError(f"{p}: sha256 mismatch (tampered or corrupt)")
    extra = [str(p.relative_to(path)) for p in path.rglob("*")
             if p.is_file() and str(p.relative_to(path)) != "manifest.json" and str(p.relative_to(path)) not in files]
    if extra:
        raise SpecPrefetchError(f"{path}: files not in the manifest: {', '.join(sorted(extra)[:5])}")
    # the manifest's own claims, checked against hashed content
    from dataclasses import asdict

    from toolkit.models.loader import inspect_model_dir
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
    for k, v in asdict(g.routing).items():
        if m["routing"][k] != v:
            raise SpecPrefetchError(f"{mf}: routing.{k} is {m['routing'][k]!r}, {cfg_file} says {v!r}")
    for rel in m["tokenizer"]:
        bundle_file(path, files, rel, "tokenizer file")
    parity_file = bundle_file(path, files, "parity.json", "parity report")
    parity = read_json(parity_file, "parity report")
    if not parity.get("passed") or any(m["parity"][k] != parity[k] for k in m["parity"] if k in parity):
        raise SpecPrefetchError(f"{mf}: parity summary does not match {parity_file} (or parity did not pass)")
    if len(m["kv"]["layers"]) != g.num_layers:
        raise SpecPrefetchError(f"{mf}: kv.layers lists {len(m['kv']['layers'])} layers, the model has {g.num_layers}")
    notes = []
    installed = _versions()
    for pkg, want in m.get("versions", {}).items():
        have = installed.get(pkg)
        if have is not None and have != want and pkg in ("executorch", "onnxruntime-qnn", "onnxruntime"):
            notes.append(f"built with {pkg} {want}, {have} installed here")
    from toolkit.runtime.expert_store import ExpertStore
    store_path = bundle_file(path, files, m["runtime"]["expert_store"], "expert store")
    store = ExpertStore(store_path, spec)
    if (store.num_layers, store.num_experts) != (len(g.moe_layers), g.routing.num_experts):
        raise SpecPrefetchError(f"{store_path}: {store.num_layers} layers x {store.num_experts} experts, the model "
                                f"has {len(g.moe_layers)} x {g.routing.num_experts}")
    if m["predictor"].get("adapter"):
        ad = bundle_file(path, files, "adapter/adapter.json", "adapter config")
        meta = read_json(ad, "adapter config")
        if meta["model"]["config_hash"] != m["model"]["config_hash"]:
            raise SpecPrefetchError(f"{ad}: adapter for another model config")
        bundle_file(path, files, "adapter/adapter.safetensors", "adapter weights")
    graphs = {}
    if load_graphs:
        graphs = _target(m["target"]).check_graphs(path, m)
    return {"path": str(path), "target": m["target"], "soc": m.get("soc"), "family": m["model"]["family"],
            "config_hash": m["model"]["config_hash"], "quantization": m["quantization"],
            "max_seq": m["kv"]["max_seq"], "predictor": m["predictor"]["kind"],
            "pool_mib": m["runtime"]["pool_mib"], "parity": m.get("parity"),
            "files": len(files), "bytes": sum(f["size"] for f in files.values()),
            "sizes": _sizes(files), "graphs": graphs, "notes": notes, "versions": m.get("versions", {})}


def _sizes(files: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rel, meta in files.items():
        part = rel.split("/")[0]
        out[part] = out.get(part, 0) + meta["size"]
    return out


def load_manifest_backend(path: Path | str):
    """(manifest, backend running the bundle's graphs, host pieces) for running a bundle."""
    path = Path(path)
    m = read_json(path / "manifest.json", "bundle manifest")
    return m, _target(m["target"]).open_backend(path, m)
