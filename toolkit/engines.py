"""One engine interface for `specprefetch run`: the Python reference runner, the native C++ runner and
the GPU tier behind the same four steps (encode, generate, reference, summary), and one `run` that
drives any of them.

    engine = python_engine(...) | native_engine(...) | gpu_engine(...)
    run(engine, prompts, max_new_tokens, check=..., json_out=..., events_out=...)

`run` is the only place that encodes the prompts, checks the tokens against the unmodified model,
writes the JSON and the decision log, and prints the summary, so a mismatch has one rule in every
engine: the JSON is written first (with `matches_unmodified_model: false`, the evidence), then an
engine whose output must equal the unmodified model's (`exact`: the Python engine with fp16 experts
of a model directory, the GPU tier) fails with a one-line error, and one whose output may differ by
its precision (quantised experts or graphs, the native runner's own float32 attention whose sums run
in another order) prints a note per prompt.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import click

from toolkit.errors import SpecPrefetchError


def fmt(v, spec: str = ".2f") -> str:
    """A figure for a summary line; undefined (None or NaN, e.g. TPOT of a single token) prints as n/a."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return format(v, spec)


def decode_text(tokenizer, tokens: list[int]) -> str:
    """The generated tokens as text (special tokens included, as the native runner decodes)."""
    try:
        return tokenizer.decode(tokens, skip_special_tokens=False)
    except Exception as e:  # noqa: BLE001 - a tokenizer that cannot decode leaves the tokens in the JSON
        raise SpecPrefetchError(f"the tokenizer cannot decode the generated tokens ({type(e).__name__}: {e})") from None


def echo_text(r: dict) -> None:
    """A run's prompt and generated text on one line, each as a JSON string (newlines escaped)."""
    import json

    show = lambda t: json.dumps(t, ensure_ascii=False)  # noqa: E731
    click.echo(f"{show(r['prompt'])} -> {show(r.get('text', ''))}")


@dataclasses.dataclass
class Engine:
    """What `run` needs of an engine. `generate(prompts, encoded, max_new_tokens, events)` returns
    (one JSON run per prompt, the report's engine-level fields, the decision log's text or None);
    it is called once, and `reference` (the GPU tier's frees the engine first) after it."""
    name: str                                   # "python", "native-host", "cuda:0", ...
    policy: str                                 # PREDICTOR+EVICTION (a generate's extra "policy" wins)
    label: str                                  # what runs, for messages
    exact: bool                                 # tokens must equal the unmodified model's
    mismatch: str                               # why tokens may differ (a note), or where to look (an error)
    tokenizer: Any
    generate: Callable[[list[str], list[list[int]], int, bool], tuple[list[dict], dict, str | None]]
    summary: Callable[[dict], str]              # one run's summary line
    source: Any                                 # export.session.ModelSource: resolved only if --check needs it
    check_shipped: bool = True                  # --check when not given: on for the shipped models
    tail: str = ""                              # after the summary's match suffix (e.g. flash emulated)
    reference: Callable[[list[list[int]], int], list[list[int]]] | None = None  # default: transformers' generate
    trailer: Callable[[dict], str] | None = None  # the last line before `wrote` (peak RSS, reads)

    def encode(self, prompt: str) -> list[int]:
        from export.session import encode_prompt

        return encode_prompt(self.tokenizer, prompt)


def run(engine: Engine, prompts: list[str], max_new_tokens: int, *, check: bool | None, json_out: Path,
        events_out: Path | None) -> dict:
    """Encode, generate, check, write the JSON (and the decision log), print the summary; the one
    mismatch rule (module docstring). Returns the report."""
    from toolkit.reporting import write_json_report, write_text_report
    from toolkit.runtime.stats import peak_rss_bytes

    if check is None:  # the source is resolved (its weights hashed, for a bundle) only here
        check = engine.check_shipped and engine.source.is_shipped
    if check and engine.source.model is None:
        why = engine.source.problem or f"the unmodified model of {engine.label} is not on this machine"
        raise SpecPrefetchError(f"--check: {why}")
    encoded = [engine.encode(p) for p in prompts]
    runs, extra, events_text = engine.generate(list(prompts), encoded, max_new_tokens, events_out is not None)
    extra.setdefault("peak_rss_bytes", peak_rss_bytes())  # before --check loads the unmodified model
    if check:
        refs = (engine.reference(encoded, max_new_tokens) if engine.reference is not None else
                [_reference_tokens(engine.source.model, ids, max_new_tokens) for ids in encoded])
        for r, ref in zip(runs, refs):
            r["matches_unmodified_model"] = r["tokens"] == ref
    # one shape for one prompt or several, every engine: policy and the engine's own header, then the runs
    head = {k: extra.pop(k) for k in ("policy", "engine", "device") if k in extra}
    out = {"policy": head.pop("policy", engine.policy), **head, "runs": runs, **extra}
    write_json_report(json_out, out)
    if events_out is not None:
        write_text_report(events_out, events_text)
    for r in runs:
        echo_text(r)
        click.echo(engine.summary(r) + (", tokens match the unmodified model" if r["matches_unmodified_model"] else "")
                   + engine.tail)
    if engine.trailer is not None:
        click.echo(engine.trailer(out))
    click.echo(f"wrote {json_out}" + (f", {events_out}" if events_out else ""))
    bad = [r["prompt"] for r in runs if r["matches_unmodified_model"] is False]
    if bad and engine.exact:
        raise SpecPrefetchError(f"{engine.name}: tokens differ from the unmodified model's greedy decode for "
                                f"{len(bad)} of {len(runs)} prompt(s), first {bad[0]!r} (the report, written, says "
                                f"so): {engine.mismatch}")
    for p in bad:
        click.echo(f"note: {engine.label} ({engine.name}) decodes other tokens than the unmodified model for prompt "
                   f"{p!r} ({engine.mismatch})", err=True)
    return out


def _reference_tokens(model: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    from export.session import reference_tokens

    return reference_tokens(model, ids, max_new_tokens)


def _figures(r: dict) -> str:
    return (f"TTFT {fmt(r['ttft_ms'], '.1f')} ms, TPOT {fmt(r['tpot_ms'])} ms (p95 {fmt(r['tpot_p95_ms'])}), "
            f"stall {fmt(r['stall_ms_per_token'])} ms/token, hit rate {fmt(r['hit_rate'], '.3f')}, "
            f"{r['mib_read']:.1f} MiB read, peak pool {r['peak_pool_bytes'] / 2**20:.2f} of "
            f"{r['budget_bytes'] / 2**20:.2f} MiB{_budget(r.get('read_budget'))}")


def _budget(rb: dict | None) -> str:
    """The read budget a run had, for its summary line (nothing when it had none)."""
    if not rb or rb["mode"] == "off":
        return ""
    if rb["mode"] == "fixed":
        return f", read budget {rb['kib']} KiB a step"
    if rb.get("rate_from") == "unused":
        return ", read budget auto (unused: nothing prefetched)"
    if rb.get("kib") is None:  # no decode step measured (a single token)
        return ""
    return (f", read budget auto {rb['kib']} KiB a step ({rb['read_mibs']:.0f} MiB/s x {rb['step_ms']:.3f} ms, "
            f"the decode steps' median)")


# -- the Python reference runner ---------------------------------------------------------------------

def python_engine(session, policy: str, flash_profile: str | None = None, images: list[Path] = ()) -> Engine:
    """An export.session.Session (a model directory or a bundle) as an engine; `images` go before every
    prompt's text (a bundle that takes images)."""
    from toolkit.runtime.events import EventLog

    s = session
    fed: list[list[int]] = []  # each prompt's ids as fed (an image prompt's image tokens included)

    def generate(prompts, encoded, max_new_tokens, events):
        log = EventLog() if events else None  # one log: each prompt is its own `seq N`
        runs = []
        enc = s.encode_images(list(images)) if images else None  # through the tower once, for every prompt
        for p, ids in zip(prompts, encoded):
            ip = s.image_prompt(list(images), ids, encoded=enc) if images else None
            g = s.runner.run(ip.ids, max_new_tokens, events=log, images=ip) if ip else \
                s.runner.run(ids, max_new_tokens, events=log)
            fed.append(ip.ids if ip else ids)
            runs.append({"prompt": p, "source": s.label, **g.to_json(), "text": decode_text(s.tokenizer, g.tokens),
                         "matches_unmodified_model": None, **({"notes": s.notes} if s.notes else {}),
                         **({"images": [str(x) for x in images], "image_tokens": len(ip.ids) - len(ids)}
                            if ip else {})})
        return runs, {}, ("\n".join(log.lines) + "\n") if log is not None else None

    def reference(encoded, max_new_tokens):
        from export.session import reference_tokens

        return [reference_tokens(s.source.model, ids, max_new_tokens, images=list(images), vision=s.vision)
                for ids in fed]

    exact = s.kind == "model" and s.runner.store.dtype == "fp16"
    return Engine(name="python", policy=policy, label=s.label, exact=exact,
                  mismatch=("a bug, unless transformers departs from the model's config (docs/families.md)" if exact
                            else "reduced precision: " + ", ".join(
                                ([f"{s.runner.store.dtype} experts"] if s.runner.store.dtype != "fp16" else [])
                                + (["the bundle's graphs"] if s.kind == "bundle" else []))),
                  tokenizer=s.tokenizer, generate=generate, summary=lambda r: f"{policy}: {_figures(r)}",
                  source=s.source, tail=f" [flash emulated: {flash_profile}]" if flash_profile else "",
                  reference=reference if images else None,
                  trailer=lambda out: (f"peak RSS {out['peak_rss_bytes'] / 2**20:.0f} MiB (before --check)"
                                       if out["peak_rss_bytes"] else "peak RSS unknown"))


# -- the native C++ runner ---------------------------------------------------------------------------

def native_engine(bundle: Path, *, abi: str, policy: str, pool_mib, window, queue_depth, min_confidence,
                  step_budget_kib, threads, prefill_chunk=None, pool_auto=(), read_budget_kib=None,
                  images: Sequence[Path] = (), next_visit: bool = True, next_visits: int | None = None,
                  reuse_classes: bool = True) -> Engine:
    """The C++ runner on an ExecuTorch, QNN or QAI Hub bundle (built for it on first use), the Python
    engine's JSON; `images` go before every prompt's text (the runner decodes and preprocesses them)."""
    from transformers import AutoTokenizer

    from export.manifest import validate_bundle
    from export.session import bundle_source, is_bundle

    if not is_bundle(bundle):
        raise SpecPrefetchError(f"{bundle}: --engine native runs an exported bundle (specprefetch export "
                                "--target executorch or qnn); this is not a bundle directory")
    m, _ = validate_bundle(bundle, hash_store=False)
    tok = AutoTokenizer.from_pretrained(str(Path(bundle) / Path(m["model"]["config"]).parent), local_files_only=True)
    source = bundle_source(Path(bundle), m)
    name = f"native-{abi}"
    res_box: dict = {}

    def generate(prompts, encoded, max_new_tokens, events):
        from android_runner.build import build, has_tokenizer, run_native

        # text in and out through the runner's own tokenizer where it has one (`runner build` builds it
        # in); a runner built with --no-tokenizer gets transformers' ids
        out = build(bundle, abi)
        text_in = has_tokenizer(out)
        with tempfile.TemporaryDirectory() as tmp:  # the runner's log, then --events by the claim's rule
            ev = Path(tmp) / "events.log" if events else None
            res = run_native(bundle, list(prompts) if text_in else encoded, abi=abi, runner=out,
                             max_new_tokens=max_new_tokens, policy=policy, pool_mib=pool_mib, window=window,
                             queue_depth=queue_depth, min_confidence=min_confidence, step_budget_kib=step_budget_kib,
                             read_budget_kib=read_budget_kib, events=ev, threads=threads,
                             extra=(() if prefill_chunk is None else ("--prefill-chunk", str(prefill_chunk or "off")))
                             + tuple(a for o, v in pool_auto if v is not None for a in (o, repr(v)))
                             + tuple(a for img in images for a in ("--image", str(img)))
                             + (() if next_visit else ("--no-next-visit",))
                             + (() if next_visits is None else ("--next-visits", str(next_visits)))
                             + (() if reuse_classes else ("--no-reuse-classes",)))
            events_text = ev.read_text(encoding="utf-8") if ev is not None else None
        res_box.update(res)
        runs = []
        for p, ids, r in zip(prompts, encoded, res["runs"]):
            r = {"prompt": p, **{k: v for k, v in r.items() if k != "routing"}, "matches_unmodified_model": None,
                 "engine": name}
            fed.append(r["prompt_ids"])
            text_ids = r["prompt_ids"][r.get("image_tokens", 0):]
            if text_in and text_ids != ids:
                click.echo(f"warning: the runner's tokenizer encodes {p!r} differently from transformers "
                           f"({len(text_ids)} vs {len(ids)} tokens); --check compares with transformers' ids",
                           err=True)
            if "text" not in r:  # a runner built without its tokenizer: transformers decodes
                r["text"] = decode_text(tok, r["tokens"])
            runs.append(r)
        extra = {"policy": res["policy"], "engine": name}
        for k in ("peak_rss_bytes", "load_ms", "kernel_isa", "direct_io", "io_note", "crc32_impl", "tokenizer",
                  "threads"):
            extra[k] = res[k]
        extra["backend"] = res.get("backend", "executorch")
        if "pool_auto" in res:  # --pool-mib auto: what was measured, the size chosen, each shrink
            extra["pool_mib"], extra["pool_auto"] = res["pool_mib"], res["pool_auto"]
        return runs, extra, events_text

    fed: list[list[int]] = []  # each prompt's ids as the runner fed them (an image prompt's image tokens included)

    def reference(encoded, max_new_tokens):  # transformers on the same image prompt, the same pixels
        from export.images import BundleVision
        from export.session import reference_tokens
        from toolkit.models.loader import load_image_processor

        vision = BundleVision(None, m["graphs"]["vision"],
                              load_image_processor(Path(bundle) / Path(m["model"]["config"]).parent))
        return [reference_tokens(source.model, ids, max_new_tokens, images=list(images), vision=vision) for ids in fed]

    return Engine(name=name, policy=policy, label=str(bundle), exact=False, reference=reference if images else None,
                  mismatch="its own float32 attention adds in another order than PyTorch's, and the bundle's "
                           "graphs and experts may be quantised",
                  tokenizer=tok, generate=generate,
                  summary=lambda r: (f"{res_box.get('policy', policy)} (native {abi}, {res_box.get('kernel_isa')} "
                                     f"kernels): {_figures(r)}"),
                  source=source,
                  trailer=lambda out: (f"peak RSS {out['peak_rss_bytes'] / 2**20:.0f} MiB; reads: "
                                       f"{out['io_note'] or 'O_DIRECT'}"))


# -- the GPU tier ------------------------------------------------------------------------------------

def gpu_engine(model, *, device: str, policy: str, adapter, store_path, dtype, pool_mib, window, min_confidence,
               draft_k, next_visit: bool = True, next_visits: int | None = None, read_budget_kib: int | None = None,
               copy_depth: int | None = None, reuse_classes: bool = True, attention: str | None = None,
               router: str | None = None) -> Engine:
    """`run --device cuda`: the GPU tier (toolkit/runtime/gpu.py) over a model directory. `read_budget_kib`:
    KiB the copies deliver per layer step (a prefetch that cannot land by its layer is dropped);
    `copy_depth`: prefetch copies issued per layer step at most (None: the pool's free slots); `attention` /
    `router`: GpuEngine's (None: its default)."""
    from export.session import is_bundle
    from toolkit.models.loader import inspect_model_dir, load_model
    from toolkit.runtime.expert_store import ExpertStore
    from toolkit.runtime.gpu import Device, GpuEngine
    from toolkit.runtime.profiles import check_budget_kib
    from toolkit.runtime.gpu_bench import gpu_predictors, gpu_reuse_table
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.runner import RunConfig

    if is_bundle(model):
        raise SpecPrefetchError(f"--device {device}: the GPU tier runs a model directory, not a bundle ({model})")
    if dtype not in (None, "fp16"):
        raise SpecPrefetchError(f"--device {device}: the GPU tier computes from fp16 experts; drop --dtype {dtype}")
    Device(device)  # CUDA present (a one-line error before any loading)
    cuda = device.startswith("cuda")
    if cuda:   # (a bad SPECPREFETCH_PDL too, rather than at the first kernel)
        from toolkit.runtime.gpu_kernels import check_pdl_setting

        check_pdl_setting()
    spec = inspect_model_dir(model)
    if store_path is None:
        from toolkit.runtime.store_cache import cached_store

        st = cached_store(spec, "fp16")
    else:
        st = ExpertStore(store_path, spec)
    check_budget_kib(read_budget_kib, st.blob_size, "--read-budget-kib")   # before the model loads
    pol = Policy.parse(policy)
    preds = gpu_predictors(spec, [pol.predictor], adapter)
    reuse = gpu_reuse_table(spec, [pol.eviction], adapter)
    held: dict[str, Any] = {"lm": load_model(spec.path, dtype="float16" if cuda else "float32")}
    held["eng"] = GpuEngine(held["lm"], st, RunConfig(policy=pol, pool_mib=pool_mib or 8.0, window=window,
                                                      min_confidence=min_confidence, next_visit=next_visit,
                                                      next_visits=next_visits,
                                                      read_budget_kib=read_budget_kib, reuse_classes=reuse_classes),
                            device=device, predictors=preds, reuse=reuse, attention=attention, router=router)
    held["eng"].configure(copy_depth=copy_depth)
    tok = held["lm"].tokenizer

    def generate(prompts, encoded, max_new_tokens, events):
        runs = []
        for p, ids in zip(prompts, encoded):
            g = held["eng"].run(ids, max_new_tokens, k=draft_k)
            runs.append({"prompt": p, "source": str(spec.path), **g.to_json(), "text": decode_text(tok, g.tokens),
                         "matches_unmodified_model": None})
        return runs, {"device": device}, None

    def reference(encoded, max_new_tokens):
        import torch

        from toolkit.runtime.gpu_bench import reference_generate

        held.clear()   # the engine's GPU memory goes before transformers loads the whole model there
        if cuda:
            torch.cuda.empty_cache()
        refs, _ = reference_generate(spec.path, encoded, max_new_tokens, device,
                                     torch.float16 if cuda else torch.float32, timed=False)
        return refs

    def summary(r):
        return (f"{pol.name} on {device}: TTFT {fmt(r['ttft_ms'], '.1f')} ms, TPOT {fmt(r['tpot_ms'])} ms, "
                f"stall {fmt(r['stall_ms_per_token'])} ms/token, hit rate {fmt(r['hit_rate'], '.3f')}, "
                f"{r['pcie_bytes_per_token'] / 2**20:.1f} MiB/token copied, pool {r['pool_slots']} slots "
                f"({r['budget_bytes'] / 2**20:.0f} MiB)")

    from export.session import ModelSource

    return Engine(name=device, policy=pol.name, label=str(spec.path), exact=True,
                  mismatch="a bug (docs/gpu-tier.md: what may differ on a GPU)", tokenizer=tok, generate=generate,
                  summary=summary, source=ModelSource(str(spec.path), spec.path), check_shipped=False,
                  reference=reference)
