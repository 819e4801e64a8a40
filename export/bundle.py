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
      host.safetensors     host-side routing tensors: every MoE layer's router (`router_weight`
                           [L, E, H], `router_bias` [L, E] where the family has one) for host
                           predictors (next-gate, FATE), and the DeepSeek-V3 selection bias
      parity.json / .md    the parity report the bundle was accepted with

The bundle is assembled in a work directory beside BUNDLE unique to the process
(BUNDLE.partial-PID-XXXXXXXX) and renamed into place only after parity holds; a bundle past tolerance
is refused and its work directory kept (renamed BUNDLE.rejected) for inspection; any other failure,
a full disk, Ctrl-C or SIGTERM removes it and the scratch directory (toolkit.artifacts.atomic_directory).
An existing BUNDLE is replaced only with overwrite=True and only if it is a bundle; the model, the
adapter and the calibration file are never written over, and a second export to the same BUNDLE
while one runs is refused (the destination is locked). The manifest's format, the registry of targets and the
validation of a bundle live in export/manifest.py; each target implements export.target.Target.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
import time
from pathlib import Path
from typing import Any


from export.manifest import (FORMAT, TARGETS, VERSION, get_target, malformed, sizes, validate_bundle,
                             versions)
from toolkit.artifacts import (atomic_directory, claim_output, os_error, rejected_dir, sha256_file,
                               write_json_atomic)
from toolkit.errors import SpecPrefetchError, interrupt_on_signals

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
    image_size: tuple[int, int] | None = None  # vision-language models: the images' fixed (height, width)
    hub_client: Any = None            # the qai_hub module, or a double standing in for the service
    progress: bool = True


def image_targets() -> list[str]:
    """The targets whose bundles carry the vision tower (Target.VISION_PRECISION)."""
    return [n for n, t in TARGETS.items() if t.VISION_PRECISION is not None]


# the vision method against the eager tower: max |diff| over max |reference|, by the precision it runs at
# (ExecuTorch keeps the tower in float32; the HTP runs it in fp16: ~5e-3 measured on the tiny tower)
VISION_REL_TOL = {"fp32": 1e-3, "fp16": 2e-2}


def vision_parity(ref_backend, bundle_backend, block: dict[str, Any], processor, scratch: Path,
                  tol: float) -> dict[str, Any]:
    """The bundle's vision method against the eager tower on one generated picture (a colour gradient
    with a disc, through the same preprocessing as a user's image)."""
    import numpy as np
    from PIL import Image

    from export.images import fixed_size_pixels

    h, w = block["image_size"]
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), ((x - w / 2) ** 2 + (y - h / 2) ** 2
                                                                      < (min(h, w) / 3) ** 2) * 255], -1)
    path = scratch / "vision-parity.png"
    Image.fromarray(rgb.astype(np.uint8)).save(path)
    pix, _ = fixed_size_pixels(path, block, processor)
    ref = [t.float() for t in ref_backend.call("vision", [pix])]
    got = [t.float() for t in bundle_backend.call("vision", [pix])]
    diff = max(float((a - b).abs().max()) for a, b in zip(ref, got))
    scale = max(float(a.abs().max()) for a in ref)
    rel = diff / max(scale, 1e-12)
    return {"max_abs_diff": diff, "max_rel_diff": rel, "passed": rel <= tol, "tolerance": tol,
            "image_size": [h, w], "outputs": [list(t.shape) for t in ref]}


class ParityRefused(SpecPrefetchError):
    """The bundle's graphs are past tolerance; its directory was kept as OUT.rejected."""


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


def _log(cfg: ExportConfig, msg: str) -> None:
    if cfg.progress:
        from rich.console import Console
        Console(stderr=True).print(f"[bold]export[/bold] {msg}")


def export_bundle(model: str | Path, out: Path, cfg: ExportConfig, adapter: Path | None = None, *,
                  overwrite: bool = False) -> dict[str, Any]:
    """Build, check and write a bundle; returns its manifest.

    An existing OUT is refused unless `overwrite`, and even then replaced only if it is a bundle;
    OUT may not be, hold or lie inside the model, the adapter or the calibration file
    (toolkit.artifacts.claim_output). Everything is assembled in a work directory unique to this
    process (and a scratch directory, always removed) while OUT is locked; an existing OUT is only
    replaced once the new bundle is complete. On any failure, a full disk, Ctrl-C or SIGTERM
    included, the work directory is removed, except after a parity refusal, which keeps it as
    OUT.rejected."""
    import tempfile

    from export.parity import Tolerance
    from toolkit.models.loader import resolve_model_dir

    out = Path(out)
    inputs = (resolve_model_dir(model), adapter, cfg.calibration)
    claim_output(out, kind="bundle", overwrite=overwrite, inputs=inputs)  # before any heavy work
    tgt = get_target(cfg.target)
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
    if cfg.image_size is not None and tgt.VISION_PRECISION is None:
        raise SpecPrefetchError(f"--image-size: images are exported for --target {' and '.join(image_targets())}, "
                                f"not {cfg.target}")
    tol = Tolerance.for_quant(quant, cfg.experts).with_overrides(cfg.tolerance)
    tgt.preflight(cfg, quant)  # fail fast (missing SDK, token, network) before any heavy work
    # the work directory becomes OUT only when complete (an existing OUT is replaced only then); a
    # parity refusal keeps it as OUT.rejected, any other failure removes it; SIGTERM is an interrupt
    try:
        with interrupt_on_signals(), \
                atomic_directory(out, overwrite=overwrite, kind="bundle", inputs=inputs,
                                 keep_on=(ParityRefused,)) as work, \
                tempfile.TemporaryDirectory(prefix="specprefetch-export-") as scratch:
            manifest = _assemble(model, work, Path(scratch), cfg, tgt, quant, tol, adapter, out)
    except OSError as e:  # a full disk is mapped by atomic_directory; the rest in one line too
        raise os_error(e, out) from None
    return manifest


def _assemble(model, work: Path, scratch: Path, cfg: ExportConfig, tgt, quant: str, tol, adapter,
              out: Path) -> dict[str, Any]:
    from export.graphs import MASK_VALUE, StepModel, adapter_heads, describe
    from toolkit.runtime.backend import IO_MASK_VALUE
    from export.eager import run_model, run_sequence
    from export.parity import check, compare, free_running
    from toolkit.models.loader import eos_token_ids, inspect_model_dir, load_dense_model
    from toolkit.models.routers import load_router_bank
    from toolkit.runtime.expert_store import ExpertStore, build_store

    spec = inspect_model_dir(model)
    processor = vision = None
    if spec.family.is_vision_language and tgt.VISION_PRECISION is not None:
        from export.images import default_image_size, vision_block
        from toolkit.models.loader import load_image_processor

        processor = load_image_processor(spec.path)
        vision = vision_block(spec, processor, cfg.image_size or default_image_size(processor),
                              given=cfg.image_size is not None)
        vision["precision"] = tgt.VISION_PRECISION  # the tower's, whatever --quant says
        _log(cfg, f"vision-language model: its language model and its vision tower for "
                  f"{vision['image_size'][0]}x{vision['image_size'][1]} images ({vision['tokens']} image tokens)")
    elif cfg.image_size is not None:
        raise SpecPrefetchError("--image-size: a text-only model takes no images")
    elif spec.family.is_vision_language:
        _log(cfg, f"vision-language model: exporting its language model (text decode graphs; images: --target "
                  f"{' or '.join(image_targets())}, not {cfg.target})")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
    g = spec.geometry
    if cfg.window > len(g.moe_layers):  # the runners plan at most one token's MoE layers ahead
        raise SpecPrefetchError(f"--window {cfg.window}: this model has {len(g.moe_layers)} MoE layers; "
                                f"the window is at most that")
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
        from adapters.checkpoint import reuse_table
        ad, ad_meta = load_adapter(adapter, spec)
        reuse = reuse_table(ad_meta, Path(adapter) / "adapter.json")
        shutil.copytree(adapter, work / "adapter")
        predictor = "adapter"
    else:
        from adapters.lowrank import PrefetchAdapter
        ad = PrefetchAdapter(num_layers=len(g.moe_layers), hidden_size=g.hidden_size,
                             num_experts=g.routing.num_experts, horizons=tuple(range(1, cfg.window + 1)), rank=1)
        ad_meta, predictor, reuse = None, "next-gate", None
    horizons = tuple(h for h in ad.horizons if h <= cfg.window)
    if not horizons:
        raise SpecPrefetchError(f"--window {cfg.window}: the adapter predicts horizons {list(ad.horizons)} only")
    # the adapter's next-visit heads (horizons L, 2L, ...) ride in the same preds rows, after the window's:
    # the reuse eviction reads them (toolkit/runtime/reuse.py), the window planner does not
    rows = tuple(sorted(set(horizons) | set(ad.visit_horizons)))
    heads = adapter_heads(ad, bank, rows)
    from safetensors.torch import save_file
    host = {"router_weight": bank.weight.contiguous()}
    if bank.bias is not None:
        host["router_bias"] = bank.bias.contiguous()
    if bank.score_bias is not None:
        host["score_bias"] = bank.score_bias.contiguous()
    save_file(host, str(work / "host.safetensors"))

    t0 = time.perf_counter()
    _log(cfg, f"expert store ({cfg.experts})")
    build_store(spec, work / "experts.spx", cfg.experts, progress=cfg.progress)
    store = ExpertStore(work / "experts.spx", spec)
    timings["expert_store_s"] = time.perf_counter() - t0

    steps = StepModel(spec, load_dense_model(spec), max_seq=cfg.max_seq, adapter_heads=heads)
    if vision is not None:
        from export.vision import VisionGraph

        steps.vision = VisionGraph(steps.model, tuple(vision["grid_thw"])).eval()
    run_kw = dict(model=run_model(spec, store, bank.score_bias), store=store)  # the reference runner's view
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
    n = len(parity_ids)
    _log(cfg, f"parity: {n} prompts x ({cfg.prompt_tokens} + {cfg.decode_tokens}) tokens")
    eos = eos_token_ids(spec, tok)  # every id generation stops at (generation config, else tokenizer)
    ref_backend = built.reference

    def step(what: str, i: int, fn):
        _log(cfg, f"parity {i + 1}/{n}: {what}")
        return fn()
    refs = [step(f"reference, {built.reference_label}", i,
                 lambda p=p: run_sequence(ref_backend, p, extend=cfg.decode_tokens, eos=eos, **run_kw))
            for i, p in enumerate(parity_ids)]
    bundle_backend = built.backend()
    gots = [step(f"bundle, {built.backend_label}, teacher-forced", i,
                 lambda r=r: run_sequence(bundle_backend, r.tokens, force_ids=r.ids, **run_kw))
            for i, r in enumerate(refs)]
    figures = compare(refs, gots)
    figures["free_running"] = free_running(
        refs, [step(f"bundle, {built.backend_label}, free-running", i,
                    lambda p=p: run_sequence(bundle_backend, p, extend=cfg.decode_tokens, eos=eos, **run_kw))
               for i, p in enumerate(parity_ids)],
        [len(p) for p in parity_ids])
    failures = check(figures, tol)
    if vision is not None:
        vtol = VISION_REL_TOL[vision["precision"]]
        figures["vision"] = vision_parity(ref_backend, bundle_backend, vision, processor, scratch, vtol)
        if not figures["vision"]["passed"]:
            failures.append(f"vision method: max |diff| {figures['vision']['max_abs_diff']:.3g} "
                            f"(relative {figures['vision']['max_rel_diff']:.3g}, tolerance {vtol})")
    extra = built.extra_parity(refs, gots, run_kw)
    timings["parity_s"] = time.perf_counter() - t0
    parity = {"reference": built.reference_label, "bundle": built.backend_label, "quant": quant,
              "tolerance": dataclasses.asdict(tol), **figures, **extra,
              "passed": not failures, "failures": failures,
              "prompts": len(parity_ids), "prompt_tokens": cfg.prompt_tokens, "decode_tokens": cfg.decode_tokens}
    write_json_atomic(work / "parity.json", parity)
    (work / "parity.md").write_text(parity_markdown(parity))
    if failures:  # atomic_directory keeps the partial bundle as OUT.rejected
        rejected = rejected_dir(out)
        raise ParityRefused(
            f"parity failed, bundle refused ({built.backend_label} vs {built.reference_label}, {quant}): "
            + "; ".join(failures) + f". Report and partial bundle kept in {rejected}")

    expert_bytes = store.slot_bytes * store.num_layers * store.num_experts
    pool_mib = cfg.pool_mib if cfg.pool_mib is not None else round(expert_bytes / 4 / 2**20, 3)
    from toolkit.runtime.scheduler import SchedulerConfig
    # the read budget is a run's setting (run --read-budget-kib), not a bundle default: neither engine reads it there
    sched = {"window": cfg.window, **{k: v for k, v in dataclasses.asdict(SchedulerConfig()).items()
                                      if k != "read_budget_bytes"}}
    timings["total_s"] = time.perf_counter() - t_start
    manifest = {
        "format": FORMAT, "version": VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": cfg.target, "soc": built.soc, "quantization": {"dense": quant, "experts": cfg.experts,
                                                                "expert_graph": built.expert_precision},
        "model": {"family": g.family, "model_type": g.model_type, "config_hash": spec.config_hash,
                  "config": "model/config.json", "source": str(Path(spec.path).resolve()),
                  "num_layers": g.num_layers, "moe_layers": list(g.moe_layers), "hidden_size": g.hidden_size,
                  "vocab_size": g.vocab_size, "num_experts": g.routing.num_experts, "top_k": g.routing.top_k},
        "tokenizer": sorted(f"model/{p.name}" for p in (work / "model").iterdir() if p.name.startswith("tokenizer")),
        "eos_token_id": eos[0] if eos else None,
        "eos_token_ids": list(eos),
        "routing": {**dataclasses.asdict(g.routing),
                    "score_bias_file": "host.safetensors" if bank.score_bias is not None else None},
        "host_file": "host.safetensors",
        "kv": {"mode": built.kv_mode, "max_seq": cfg.max_seq,
               # mrope: every layer graph takes the (t, h, w) rotary positions last ([3, T]; io: one-hot [3, T, S])
               "rope": "mrope" if steps.mrope_axes is not None else "1d",
               "mask_value": MASK_VALUE if built.kv_mode == "buffer" else IO_MASK_VALUE,
               "layers": [{"k": list(c.k_shape), "v": list(c.v_shape), "window": w}
                          for c, w in zip(steps.cache_specs, steps.windows)]},
        "predictor": {"kind": predictor, "horizons": list(horizons), "adapter": "adapter" if ad_meta else None,
                      "preds_rows": {str(g.moe_layers[i]): [h for h in rows if (i, h) in ad.pair_index]
                                     for i in range(len(g.moe_layers))},
                      # preds rows of horizons L, 2L, ...: each layer's next visits (train --next-visits)
                      "next_visits": ad.next_visits,
                      # the `reuse` eviction's table (adapters/reuse.py), learned with the adapter
                      "reuse": reuse.to_json() if reuse is not None else None},
        # the store's own record, compared at every open (cheap: no hashing of the store's blobs), so a
        # store of other weights put in its place is refused even when its sha256 is not checked
        "runtime": {"pool_mib": pool_mib, "scheduler": sched, "expert_store": "experts.spx",
                    "expert_store_source": store.meta["source"]["digest"],
                    "expert_store_index_sha256": store.index_sha256,
                    "expert_bytes_total": expert_bytes},
        "graphs": {**built.graphs, "signatures": describe(steps, built.kv_mode),
                   **({"vision": vision} if vision is not None else {})},
        "parity": {**{k: parity[k] for k in ("passed", "max_abs_logit_diff", "median_logit_diff", "topk_agreement",
                                              "next_token_agreement")},
                   "free_running_token_match": parity["free_running"]["token_match"]},
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "versions": versions(),
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
            ("median |logit diff| (per position)", f"{p['median_logit_diff']:.3g}",
             bound("max_median_logit_diff", "<=")),
            ("p95 |logit diff| (per position)", f"{p['p95_logit_diff']:.3g}", ""),
            ("router top-k agreement (same set)", f"{p['topk_agreement']:.4f}", bound("min_topk_agreement", ">=")),
            ("router top-k overlap", f"{p['topk_overlap']:.4f}", ""),
            ("greedy next-token agreement", f"{p['next_token_agreement']:.4f}",
             bound("min_next_token_agreement", ">=")),
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
    """Validate a bundle (manifest, every file's size and sha256, versions, the expert store and,
    through its target, the graphs and their signatures); returns a summary. Any problem is a
    SpecPrefetchError naming the file."""
    path = Path(path)
    m, notes = validate_bundle(path)
    with malformed(path / "manifest.json"):
        graphs = get_target(m["target"]).check_graphs(path, m) if load_graphs else {}
        files = m["files"]
        return {"path": str(path), "target": m["target"], "soc": m.get("soc"), "family": m["model"]["family"],
                "config_hash": m["model"]["config_hash"], "quantization": m["quantization"],
                "max_seq": m["kv"]["max_seq"], "predictor": m["predictor"]["kind"],
                "pool_mib": m["runtime"]["pool_mib"], "parity": m.get("parity"),
                "files": len(files), "bytes": sum(f["size"] for f in files.values()),
                "sizes": sizes(files), "graphs": graphs, "notes": notes, "versions": m.get("versions", {})}
