"""Open something runnable (a model directory, `embedded`, or a bundle) as a reference `Runner`.

    model directory  eager PyTorch step graphs (export/graphs.py) built from the dense model only
                     (experts are never loaded), the prefetch adapter folded into the layer graphs'
                     preds rows, an expert store (built once into the cache, keyed by the config
                     hash, the sha256 of the weights and the dtype; or --store, which must exist
                     and must have been built from these very weights)
    bundle           its own graphs (ExecuTorch program, or QNN context binaries on the HTP
                     simulator here), its expert store, its preds heads, its host routing tensors

Either way the experts stream from the store through the bounded pool (toolkit/runtime/runner.py).
This module composes the runtime with the export's graphs and backends; the runtime itself imports
neither.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch

from adapters.reuse import ReuseTable
from toolkit.errors import SpecPrefetchError
from toolkit.models.loader import ModelSpec, eos_token_ids, inspect_model_dir, load_dense_model, shipped_model_name
from toolkit.predictors.registry import PREDICTORS, build_predictor
from toolkit.runtime.expert_store import ExpertStore
from toolkit.runtime.planner import GRAPH
from toolkit.runtime.runner import ModelInfo, RunConfig, Runner
from toolkit.runtime.store_cache import cached_store, default_store_path  # noqa: F401  (re-exported)


class StreamedExperts(torch.nn.Module):
    """Stands where a MoE block's routed experts were: they stream from the store through the
    pool, so the step graphs never call this."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("routed experts are computed by the runner from the expert store, not in the graph")


@dataclasses.dataclass
class ModelSource:
    """The unmodified checkpoint a run's tokens are checked against (`run --check`), if it is on this
    machine: for a bundle, only when its weights are the very ones the bundle's expert store was built
    from (same config is not enough: a fine-tune has the same config)."""
    label: str                      # what was opened, for messages
    candidate: Path | None          # the checkpoint the check would load
    weights: dict | None = None     # a bundle: the weights its store was built from
    recorded: str | None = None     # a bundle: its manifest's model.source

    @functools.cached_property
    def _resolved(self) -> tuple[Path | None, str | None]:
        src = self.candidate
        if src is None:
            rec = self.recorded
            return None, (f"the unmodified model of {self.label} is not on this machine" if not rec else
                          f"{self.label} was exported from {rec}, which is not on this machine (or holds "
                          "another model config now)")
        if self.weights is None:
            return src, None
        from toolkit.runtime.fingerprint import weights_mismatch

        try:
            why = weights_mismatch(self.weights, inspect_model_dir(src))
        except SpecPrefetchError as e:
            return None, f"the unmodified model {src} cannot be read ({e})"
        if why is not None:
            return None, f"the model at {src} is not the one {self.label}'s expert store was built from ({why})"
        return src, None

    @property
    def model(self) -> Path | None:
        return self._resolved[0]

    @property
    def problem(self) -> str | None:
        """Why `model` is None, else None."""
        return self._resolved[1]

    @property
    def is_shipped(self) -> bool:
        """One of the shipped models (embedded, phone): --check is on by default."""
        return self.model is not None and shipped_model_name(self.model) is not None


def bundle_source(path: Path, m: dict, weights: dict | None = None) -> ModelSource:
    """A bundle's recorded source checkpoint (manifest model.source), if it is on this machine with the
    config the bundle was exported from; `weights`: its store's record of the weights (default: read
    from the bundle's expert store)."""
    rec = m["model"].get("source")
    src = Path(rec) if isinstance(rec, str) and rec else None  # recorded resolved (older bundles: maybe not)
    candidate = src if src is not None and src.is_dir() and (src / "config.json").is_file() else None
    if candidate is not None:
        try:
            if inspect_model_dir(candidate).config_hash != m["model"]["config_hash"]:
                candidate = None
        except SpecPrefetchError:
            candidate = None
    if weights is None and candidate is not None:
        try:
            weights = ExpertStore(path / m["runtime"]["expert_store"]).meta.get("source")
        except (SpecPrefetchError, KeyError, TypeError):
            candidate = None
    return ModelSource(str(path), candidate, weights, rec if isinstance(rec, str) else None)


@dataclasses.dataclass
class Session:
    """A runner over one model or bundle, with what a caller needs around it."""
    runner: Runner
    tokenizer: Any
    spec: ModelSpec                 # the model's config (weights only for model directories)
    kind: str                       # "model" or "bundle"
    label: str                      # what was opened, for reports
    source_candidate: Path | None   # the checkpoint the unmodified-model check would load
    notes: list[str] = dataclasses.field(default_factory=list)
    default_pool_mib: float | None = None   # a bundle's own default budget
    source_weights: dict | None = None      # a bundle: the weights its store was built from
    source_recorded: str | None = None      # a bundle: its manifest's model.source
    vision: Any = None                      # what encodes images (export/images.py), if it takes them

    def encode_images(self, images: list[Path]) -> list:
        """Each image through the vision tower: (grid_thw, image_embeds, deepstack) per image."""
        from export.images import encode_images

        if self.vision is None:
            what = ("a text-only model" if not self.spec.family.is_vision_language else
                    "a text-only bundle (a vision-language model exported with --target executorch or qnn takes "
                    "images)")
            raise SpecPrefetchError(f"--image: {self.label} takes no images: {what}")
        return encode_images(self.vision, images)

    def image_prompt(self, images: list[Path], text_ids: list[int], *, encoded: list | None = None):
        """The image prompt (toolkit/runtime/images.py: ImagePrompt) of `images` then `text_ids`
        (`encoded`: encode_images' result for these images, else they are encoded here)."""
        from export.images import image_prompt

        return image_prompt(self.vision, encoded if encoded is not None else self.encode_images(images),
                            text_ids)

    @functools.cached_property
    def source(self) -> ModelSource:
        return ModelSource(self.label, self.source_candidate, self.source_weights, self.source_recorded)

    @property
    def source_model(self) -> Path | None:
        """The checkpoint the unmodified-model check can load, if on disk (ModelSource)."""
        return self.source.model

    @property
    def source_problem(self) -> str | None:
        """Why `source_model` is None (for `--check`'s error), else None."""
        return self.source.problem

    @property
    def is_embedded(self) -> bool:
        """The source model is one of the shipped models (embedded, phone): --check is on by default."""
        return self.source.is_shipped

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A prompt's token ids as every engine feeds them (no special tokens); an empty one is refused."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise SpecPrefetchError(f"--prompt {text!r} is empty after tokenisation")
    return ids


def is_bundle(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "manifest.json").is_file()


def _frequency(trace: Path | None, spec: ModelSpec):
    """The frequency predictor's counts, from a trace of this very model (by config hash)."""
    if trace is None:
        return None

    def counts():
        from toolkit.predictors.evaluate import frequency_counts
        from toolkit.traces.format import TraceReader

        r = TraceReader(trace)
        r.check_model(spec, option="--frequency-trace")
        return frequency_counts(r)
    return counts


def _predictors(names: list[str], *, E: int, graph: str | None, bank, adapter, counts, draft) -> dict[str, Any]:
    """name -> predictor for each requested name that this model can serve (GRAPH: the preds rows)."""
    out: dict[str, Any] = {}
    for n in names:
        if n == "on-demand":
            continue
        if n == graph:
            out[n] = GRAPH
            continue
        if n == "adapter" and graph != "adapter":
            raise SpecPrefetchError("the adapter policy needs the adapter's heads: --adapter DIR for a model "
                                    "directory, or a bundle exported with --adapter")
        out[n] = build_predictor(n, num_experts=E, bank=bank, adapter=adapter, counts=counts, draft=draft)
    return out


def open_session(source: str | Path, cfg: RunConfig, *, predictors: list[str] | None = None,
                 adapter: Path | None = None, store: Path | None = None, dtype: str | None = None,
                 frequency_trace: Path | None = None, max_seq: int = 512, progress: bool = True,
                 pool_default: bool = False, scheduler_default: tuple[str, ...] = ()) -> Session:
    """A Runner over `source` (model directory, `embedded`, or bundle directory).

    Args:
        cfg: the run's policy, budget and scheduler settings.
        predictors: predictor names to make available (default: the policy's).
        adapter: the prefetch adapter (model directories; a bundle carries its own).
        store: an existing expert store (model directories; default: built once into the cache). It
            must exist (a missing one is an error, never built here) and must have been built
            from this model's weights.
        dtype: the store's precision when it is built (default fp16); with `store`, or for a bundle,
            the store's own dtype, checked (a different one is an error, never ignored).
        frequency_trace: the trace whose expert counts drive the frequency predictor.
        max_seq: KV cache length of the eager graphs (model directories).
        pool_default: a bundle's own default pool budget replaces cfg.pool_mib.
        scheduler_default: RunConfig fields (of export.manifest.SCHEDULER_DEFAULTS) a bundle's own
            exported settings replace (the options the caller was not given), as the native runner
            takes them; model directories keep cfg's.
    """
    names = list(dict.fromkeys(predictors or [cfg.policy.predictor]))
    for n in names:
        if n not in PREDICTORS:
            raise SpecPrefetchError(f"--policy: unknown predictor {n!r}; choose from {', '.join(PREDICTORS)}")
    if is_bundle(source):
        if adapter is not None or store is not None:
            raise SpecPrefetchError(f"{source}: a bundle carries its own adapter heads and expert store; "
                                    "drop --adapter / --store")
        s = _open_bundle(Path(source), cfg, names, frequency_trace, pool_default, scheduler_default)
        _check_dtype(dtype, s.runner.store, f"{source}: the bundle's own expert store")
        return s
    return _open_model(source, cfg, names, adapter, store, dtype, frequency_trace, max_seq, progress)


def _open_model(model, cfg, names, adapter, store, dtype, frequency_trace, max_seq, progress) -> Session:
    from transformers import AutoTokenizer

    from export.graphs import StepModel, adapter_heads
    from export.eager import TorchBackend
    from toolkit.models.routers import load_router_bank
    from toolkit.predictors.draft import SequenceDraft

    spec = inspect_model_dir(model)
    g = spec.geometry
    if store is not None:
        if not Path(store).is_file():
            what = "is a directory, not an expert store" if Path(store).is_dir() else "no such expert store"
            raise SpecPrefetchError(f"--store {store}: {what} (build one with `specprefetch store`)")
        st = ExpertStore(store, spec)
        _check_dtype(dtype, st, f"--store {store}")
    else:
        st = cached_store(spec, dtype or "fp16", progress=progress)
    bank = functools.cache(lambda: load_router_bank(spec))
    heads, horizons, graph = None, {}, None
    ad, reuse = None, None
    if adapter is not None:
        from adapters.checkpoint import load_adapter, reuse_table

        ad, ad_meta = load_adapter(adapter, spec)
        reuse = reuse_table(ad_meta, Path(adapter) / "adapter.json")
        hs = tuple(ad.all_horizons)  # with next-visit heads, their rows too (horizons L, 2L, ...)
        heads = adapter_heads(ad, bank(), hs)
        horizons = {i: tuple(h for h in hs if (i, h) in ad.pair_index) for i in range(len(g.moe_layers))}
        graph = "adapter"
    tok = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
    dense = load_dense_model(spec)
    for layer in g.moe_layers:  # the routed experts stay in the store: nothing here may hold them
        spec.family.moe_block(dense, layer).experts = StreamedExperts()
    steps = StepModel(spec, dense, max_seq=max_seq, adapter_heads=heads)
    backend = TorchBackend(steps, "buffer")

    def draft():
        from toolkit.models.loader import load_model

        return SequenceDraft(load_model(spec.path))

    preds = _predictors(names, E=g.routing.num_experts, graph=graph, bank=bank,
                        adapter=(lambda: ad) if ad is not None else None, counts=_frequency(frequency_trace, spec),
                        draft=draft)
    info = ModelInfo(num_layers=g.num_layers, moe_layers=tuple(g.moe_layers), routing=g.routing,
                     hidden_size=g.hidden_size, expert_roles=tuple(m.role for m in spec.family.expert_matrices(g)),
                     eos_token_ids=eos_token_ids(spec, tok), score_bias=bank().score_bias, preds_horizons=horizons,
                     max_seq=max_seq, label=str(spec.path), text_config=spec.family.text_config(spec.config),
                     reuse=reuse, next_visits=ad.next_visits if ad is not None else 0)
    notes = [SequenceDraft.note, "the draft is built from the full model: its weights are in memory"] \
        if "draft" in names else []
    vision = None
    if spec.family.is_vision_language:
        from export.images import ModelVision
        from toolkit.models.loader import load_image_processor

        vision = ModelVision(dense, spec, load_image_processor(spec.path))
    return Session(Runner(backend, st, info, cfg, preds), tok, spec, "model", str(spec.path), spec.path, notes,
                   vision=vision)


def _bundle_vision(backend, m: dict, spec: ModelSpec):
    block = m["graphs"].get("vision")
    if block is None:
        return None
    from export.images import BundleVision
    from toolkit.models.loader import load_image_processor

    return BundleVision(backend, block, load_image_processor(spec.path), hidden=spec.geometry.hidden_size)


def _check_dtype(dtype: str | None, st: ExpertStore, what: str) -> None:
    """--dtype names the precision of a store to build; given with a store that exists (--store, a
    bundle's), it must be that store's: never silently ignored."""
    if dtype is not None and dtype != st.dtype:
        fix = ("the bundle's precision is chosen at export (--experts)" if what.endswith("own expert store")
               else f"build an {dtype} store with `specprefetch store --dtype {dtype}`")
        raise SpecPrefetchError(f"--dtype {dtype}: {what} holds {st.dtype} experts; drop --dtype ({fix})")


def _open_bundle(path: Path, cfg: RunConfig, names: list[str], frequency_trace, pool_default: bool,
                 scheduler_default: tuple[str, ...] = ()) -> Session:
    from export.manifest import malformed, open_bundle

    m, backend = open_bundle(path)
    with malformed(path / "manifest.json"):
        if scheduler_default:  # the settings it was exported with, for the options not given
            from export.manifest import SCHEDULER_DEFAULTS, scheduler_defaults

            unknown = set(scheduler_default) - set(SCHEDULER_DEFAULTS)
            if unknown:
                raise ValueError(f"scheduler_default: not a bundle scheduler setting: {sorted(unknown)}")
            cfg = dataclasses.replace(cfg, **{k: v for k, v in scheduler_defaults(m).items() if k in scheduler_default})
        return _bundle_session(path, m, backend, cfg, names, frequency_trace, pool_default)


def _bundle_session(path: Path, m: dict, backend, cfg: RunConfig, names: list[str], frequency_trace,
                    pool_default: bool) -> Session:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from export.manifest import check_store_record, manifest_next_visits
    from export.target import bundle_file
    from toolkit.models.families import RoutingSpec
    from toolkit.models.routers import RouterBank

    files = m["files"]
    spec = inspect_model_dir(bundle_file(path, files, m["model"]["config"], "model config").parent,
                             config_only_ok=True)
    g = spec.geometry
    st = ExpertStore(bundle_file(path, files, m["runtime"]["expert_store"], "expert store"), spec)
    check_store_record(st, m, path / "manifest.json")  # the store this run reads is the exported one
    routing = RoutingSpec(**{k: v for k, v in m["routing"].items() if k in
                             {f.name for f in dataclasses.fields(RoutingSpec)}})
    host = {}
    if m["routing"].get("score_bias_file") or m.get("host_file"):
        host = load_file(str(bundle_file(path, files, m.get("host_file") or m["routing"]["score_bias_file"],
                                         "host tensors")))
    score_bias = host.get("score_bias")
    moe = list(g.moe_layers)
    horizons = {moe.index(int(layer)): tuple(hs) for layer, hs in m["predictor"]["preds_rows"].items()}
    bank = None
    if "router_weight" in host:  # host routers: next-gate and FATE on a bundle
        bank = lambda: RouterBank(host["router_weight"], host.get("router_bias"), score_bias, routing,  # noqa: E731
                                  tuple(moe))
    preds = _predictors(names, E=routing.num_experts, graph=m["predictor"]["kind"], bank=bank,
                        adapter=None, counts=_frequency(frequency_trace, spec), draft=None)
    info = ModelInfo(num_layers=g.num_layers, moe_layers=tuple(moe), routing=routing, hidden_size=g.hidden_size,
                     expert_roles=tuple(x.role for x in spec.family.expert_matrices(g)),
                     eos_token_ids=tuple(int(i) for i in (m.get("eos_token_ids") or [m.get("eos_token_id")])
                                         if i is not None),
                     score_bias=score_bias, preds_horizons=horizons,
                     max_seq=m["kv"]["max_seq"], label=str(path),
                     text_config=spec.family.text_config(spec.config),
                     reuse=ReuseTable.from_json(m["predictor"]["reuse"], f"{path / 'manifest.json'}: predictor.reuse",
                                                shape=(len(moe), routing.num_experts))
                     if m["predictor"].get("reuse") is not None else None,
                     next_visits=manifest_next_visits(m, path / "manifest.json"))
    tok = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
    source = bundle_source(path, m, weights=st.meta["source"])
    if pool_default:  # no --pool-mib: the bundle's own budget
        cfg = dataclasses.replace(cfg, pool_mib=float(m["runtime"]["pool_mib"]))
    return Session(Runner(backend, st, info, cfg, preds), tok, spec, "bundle", str(path), source.candidate,
                   default_pool_mib=m["runtime"].get("pool_mib"), source_weights=source.weights,
                   source_recorded=source.recorded, vision=_bundle_vision(backend, m, spec))


@functools.lru_cache(maxsize=1)
def _unmodified(model: str):
    from toolkit.models.loader import load_model

    return load_model(model)


def reference_tokens(model: Path, prompt_ids: list[int], max_new_tokens: int, *,
                     images: list[Path] = (), vision=None) -> list[int]:
    """The unmodified model's greedy tokens (transformers' own `generate`): `run --check`. With `images`,
    `prompt_ids` is the image prompt (its image tokens included) and the images go through the session's
    preprocessing (`vision`: export/images.py) and then the model's own vision tower."""
    lm = _unmodified(str(Path(model).resolve()))
    eos = lm.tokenizer.eos_token_id
    ids = torch.tensor([prompt_ids])
    extra = {}
    if images:  # the session's own preprocessing (a bundle's fixed size, or the processor's), then the model's
        pix = [vision.pixels(p) for p in images]
        extra = {"pixel_values": torch.cat([x for x, _ in pix]),
                 "image_grid_thw": torch.tensor([g for _, g in pix]),
                 "mm_token_type_ids": (ids == vision.ids[1]).long(), "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        out = lm.model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=eos if eos is not None else 0, **extra)
    return out[0, len(prompt_ids):].tolist()
