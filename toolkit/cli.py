"""The `specprefetch` command line: one verb per pipeline stage, nothing else lives here.

    specprefetch info MODEL_DIR            geometry and expert bytes of a MoE checkpoint
    specprefetch trace MODEL_DIR --data F  routing traces for adapter training and evaluation
    specprefetch export MODEL_DIR --out B  a phone-ready bundle (ExecuTorch / QNN / AI Hub), parity-checked
    specprefetch inspect BUNDLE            validate a bundle and summarise it
    specprefetch tiny FAMILY --out DIR     a tiny random checkpoint of a family, for trying things

MODEL_DIR may be `embedded` for the embedded default model.
"""
from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import click

from toolkit import __version__
from toolkit.errors import SpecPrefetchError


def friendly_errors(fn):
    """Turn toolkit errors and Ctrl-C into one clear line and a non-zero exit, no traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecPrefetchError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted: nothing was written under the output name; partial work is "
                       "kept beside it and the same command resumes it", err=True)
            sys.exit(130)
    return wrapper


class FiniteFloat(click.ParamType):
    """A finite number above `low` (a one-line error for nan, inf, words or empty text)."""
    name = "number"

    def __init__(self, low: float = 0.0):
        self.low = low

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            v = float(value)
        else:
            try:
                v = float(str(value).strip())
            except ValueError:
                self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(v) or v <= self.low:
            self.fail(f"{value!r}: must be a finite number above {self.low:g}", param, ctx)
        return v


class FloatList(click.ParamType):
    """Comma-separated finite positive numbers, e.g. 4,8,16."""
    name = "list"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        items = [x for x in str(value).split(",") if x.strip()]
        if not items:
            self.fail(f"{value!r}: expected comma-separated numbers", param, ctx)
        return [FiniteFloat().convert(x, param, ctx) for x in items]


POOL_MIB = FiniteFloat()
OUT_FILE = click.Path(dir_okay=False, path_type=Path)  # an output file: a directory there is a one-line error


def fmt(v, spec: str = ".2f") -> str:
    """A figure for a summary line; undefined (None, e.g. TPOT of a single token) prints as '-'."""
    return "-" if v is None else format(v, spec)


def scheduler_limits(fn):
    """The scheduler's flash-saturation limits, shared by `simulate` and `run`."""
    fn = click.option("--step-budget-kib", type=click.IntRange(min=1), default=None,
                      help="prefetch bytes issued per step at most")(fn)
    return click.option("--min-confidence", type=click.FloatRange(0, 1), default=0.02, show_default=True,
                        help="when flash is saturated, drop queued prefetches below this predicted probability")(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specprefetch")
def main() -> None:
    """Predict and prefetch Mixture-of-Experts experts from flash into a bounded DRAM pool."""


@main.command()
@click.argument("model", default="embedded")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a summary")
@friendly_errors
def info(model: str, as_json: bool) -> None:
    """Family, layers, experts, top-k and expert bytes (fp16/int8/int4) of MODEL.

    MODEL is a Hugging Face checkpoint directory (config.json + safetensors) or `embedded`.
    A directory with config.json alone is accepted: sizes then come from the config.
    """
    from toolkit.models.info import info as model_info, render

    d = model_info(model)
    click.echo(json.dumps(d, indent=1) if as_json else render(d))


@main.command()
@click.argument("model", default="embedded")
@click.option("--data", "data", multiple=True, required=True, type=click.Path(path_type=Path),
              help=".txt or .jsonl file ({\"text\": ..., \"image\": ...} per line); repeatable")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="trace directory to write")
@click.option("--prompt-tokens", default=256, show_default=True, help="tokens per prompt")
@click.option("--decode-tokens", default=32, show_default=True, help="greedy decode steps per prompt")
@click.option("--max-sequences", type=int, default=None, help="stop after this many prompts")
@click.option("--probs-top-m", type=int, default=None,
              help="keep only the top-m router probabilities (default: all up to 256 experts, else 64)")
@click.option("--hidden-sample", default=1.0, show_default=True,
              help="share of prefill tokens whose router input is stored (decode tokens: always)")
@click.option("--heldout-frac", default=0.1, show_default=True, help="share of prompts held out")
@click.option("--seed", default=0, show_default=True)
@click.option("--shard-tokens", default=16384, show_default=True, help="tokens per shard")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda, cuda:N, or auto (spread over all GPUs with accelerate)")
@click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16")
@click.option("--overwrite", is_flag=True, help="replace an existing --out (only once the new trace is complete)")
@friendly_errors
def trace(model, data, out, prompt_tokens, decode_tokens, max_sequences, probs_top_m,
          hidden_sample, heldout_frac, seed, shard_tokens, device, dtype, overwrite) -> None:
    """Record routing traces of MODEL over text (and images) in prefill and greedy decode.

    Per token and MoE layer: selected experts and weights, the router's probability vector and
    its input hidden state. Interrupted runs resume when the same command is run again.
    """
    from toolkit.traces.capture import TraceSettings, run_trace
    from toolkit.traces.format import TraceReader

    s = TraceSettings(prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                      max_sequences=max_sequences, probs_top_m=probs_top_m,
                      hidden_sample=hidden_sample, heldout_frac=heldout_frac, seed=seed,
                      shard_tokens=shard_tokens, device=device, dtype=dtype)
    path = run_trace(model, list(data), out, s, overwrite=overwrite)
    m = TraceReader(path).manifest
    t = m["tokens"]
    click.echo(f"wrote {path}: {len(m['shards'])} shards; train {t['train']['total']} tokens "
               f"({t['train']['decode']} decode), held-out {t['heldout']['total']} tokens "
               f"({t['heldout']['decode']} decode)")


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecPrefetchError(f"{option} {text!r}: expected comma-separated integers") from None


@main.command()
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="adapter directory to write")
@click.option("--model", default=None, help="model directory (default: the one the trace records)")
@click.option("--rank", default=64, show_default=True)
@click.option("--horizons", default="1,2", show_default=True, help="MoE layers ahead, 1..4")
@click.option("--cross-token/--no-cross-token", default=True, show_default=True,
              help="let the last layers predict the next token's first layers")
@click.option("--horizon-weights", default=None,
              help="loss weight per horizon, e.g. '1:2,2:1' (default 2 for h=1, 1 otherwise)")
@click.option("--topk-weight", default=0.0, show_default=True, help="weight of the top-k ranking term")
@click.option("--steps", default=3000, show_default=True)
@click.option("--batch-size", default=512, show_default=True)
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--val-every", default=100, show_default=True)
@click.option("--patience", default=6, show_default=True, help="validations without improvement before stopping")
@click.option("--seed", default=0, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--max-memory-mb", default=512, show_default=True, help="trace shards held in memory at once")
@friendly_errors
def train(traces, out, model, rank, horizons, cross_token, horizon_weights, topk_weight, steps,
          batch_size, lr, val_every, patience, seed, device, max_memory_mb) -> None:
    """Train the prefetch adapter on TRACES (a `trace` directory): a rank-r correction of each
    future layer's router, KL to the real routing, backbone frozen."""
    from adapters.train import TrainConfig, train_adapter

    hw = None
    if horizon_weights:
        try:
            hw = {int(a): float(b) for a, b in (x.split(":") for x in horizon_weights.split(","))}
        except ValueError:
            raise SpecPrefetchError(f"--horizon-weights {horizon_weights!r}: expected H:W,H:W") from None
    cfg = TrainConfig(rank=rank, horizons=_ints(horizons, "--horizons"), cross_token=cross_token,
                      horizon_weights=hw, topk_weight=topk_weight, steps=steps, batch_size=batch_size,
                      lr=lr, val_every=val_every, patience=patience, seed=seed, device=device,
                      max_memory_mb=max_memory_mb)
    try:
        r = train_adapter(traces, out, cfg, model=model)
    except ValueError as e:
        raise SpecPrefetchError(f"train: {e}") from None
    v = r["validation"]
    click.echo(f"wrote {out}: {r['params']:,} parameters ({100 * r['share_of_model']:.2f}% of the model), "
               f"best step {r['training']['best_step']}")
    for h in v["adapter"]["recall_at_k"]:
        click.echo(f"  validation recall@k h={h}: next-gate {v['next_gate']['recall_at_k'][h]:.3f} -> "
                   f"adapter {v['adapter']['recall_at_k'][h]:.3f}")


@main.command(name="eval")
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--adapter", type=click.Path(path_type=Path), default=None, help="adapter directory")
@click.option("--predictors", default=None,
              help="comma-separated: next-gate,fate,frequency,previous-token,adapter,draft,oracle "
                   "(default: all; adapter only with --adapter)")
@click.option("--model", default=None, help="model directory (default: the one the trace records)")
@click.option("--horizons", default=None, help="default: the adapter's, else 1,2")
@click.option("--budget", type=int, default=None, help="candidate budget M (default 2k)")
@click.option("--draft-bits", default=4, show_default=True, help="bits of the draft's routed experts")
@click.option("--json", "json_out", required=True, type=OUT_FILE,
              help="JSON report; the Markdown table and PNG plot go beside it")
@friendly_errors
def eval_cmd(traces, adapter, predictors, model, horizons, budget, draft_bits, json_out) -> None:
    """Recall@k, recall/precision within a budget, per-layer curves for each predictor on the
    held-out decode tokens of TRACES."""
    from toolkit.predictors.evaluate import ALL, evaluate, markdown, write_reports

    names = [p.strip() for p in predictors.split(",")] if predictors else [
        p for p in ALL if p != "adapter" or adapter is not None]
    r = evaluate(traces, predictors=names, adapter=adapter, model=model,
                 horizons=_ints(horizons, "--horizons") if horizons else None, budget=budget,
                 draft_bits=draft_bits)
    md, png = write_reports(r, json_out)
    click.echo(markdown(r))
    click.echo(f"wrote {json_out}, {md}, {png}")


@main.command()
@click.argument("model", default="embedded")
@click.option("--out", required=True, type=OUT_FILE, help="expert store file to write")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "int8", "int4"]))
@friendly_errors
def store(model, out, dtype) -> None:
    """Write MODEL's routed experts into one 4 KiB-aligned expert store file (docs/expert-store.md)."""
    from toolkit.models.loader import inspect_model_dir
    from toolkit.runtime.expert_store import ExpertStore, build_store

    path = build_store(inspect_model_dir(model), out, dtype)
    st = ExpertStore(path)
    click.echo(f"wrote {path}: {len(st.entries)} experts of {st.blob_size:,} B ({dtype}), "
               f"{path.stat().st_size / 2**20:.1f} MiB")


@main.command()
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--policies", "--predictor", "policies",
              default="on-demand+lru,next-gate+prediction,adapter+prediction,oracle+belady", show_default=True,
              help="comma-separated PREDICTOR+EVICTION (eviction: lru, lfu, prediction, belady)")
@click.option("--adapter", type=click.Path(path_type=Path), default=None)
@click.option("--profile", default="snapdragon-8-elite", show_default=True,
              help="snapdragon-8-elite, this-machine (after calibrate), or a profile JSON file")
@click.option("--pool-mib", type=FloatList(), default="8", show_default=True, help="pool budget; comma list to sweep")
@click.option("--window", default="2", show_default=True, help="steps ahead; comma list to sweep")
@click.option("--queue-depth", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "int8", "int4"]))
@click.option("--geometry", default=None, help="config.json directory whose sizes to use (routing stays the trace's)")
@click.option("--split", default="heldout", show_default=True, type=click.Choice(["heldout", "train"]))
@click.option("--max-sequences", type=click.IntRange(min=1), default=None)
@scheduler_limits
@click.option("--json", "json_out", required=True, type=OUT_FILE)
@friendly_errors
def simulate(traces, policies, adapter, profile, pool_mib, window, queue_depth, dtype, geometry, split,
             max_sequences, min_confidence, step_budget_kib, json_out) -> None:
    """Replay TRACES through the pool and scheduler against a device profile: TPOT, stall, hit
    rate, MiB read and wasted prefetch per policy; sweeps give a table and plots."""
    from toolkit.runtime.policy import parse_policies
    from toolkit.runtime.profiles import load_profile
    from toolkit.simulate.report import sweep, write_sweep

    windows = list(_ints(window, "--window"))
    if not windows or min(windows) < 1:
        raise SpecPrefetchError(f"--window {window!r}: steps ahead must be >= 1")
    r = sweep(traces, policies=parse_policies(policies), profile=load_profile(profile), pools=pool_mib,
              windows=windows, queue_depth=queue_depth, dtype=dtype, geometry=geometry, adapter=adapter,
              split=split, max_sequences=max_sequences, min_confidence=min_confidence,
              step_budget_kib=step_budget_kib)
    md, png = write_sweep(r, json_out)
    click.echo(md.read_text())
    click.echo(f"wrote {json_out}, {md}, {png}")


@main.command()
@click.argument("model", default="embedded")
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
              help="expert store (default: built once into ~/.cache/specprefetch/stores)")
@click.option("--reads", default=200, show_default=True, help="reads per measured point")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="profile JSON (default: the cache)")
@friendly_errors
def calibrate(model, store_path, reads, out) -> None:
    """Measure this machine (O_DIRECT expert reads by queue depth, runtime compute per layer and
    expert) into the `this-machine` device profile."""
    from toolkit.simulate.calibrate import calibrate as run_calibrate

    prof, path = run_calibrate(model, store=store_path, reads=reads, out=out)
    click.echo(json.dumps(prof.to_json(), indent=1))
    click.echo(f"wrote {path}")


@main.command()
@click.argument("model", default="embedded")
@click.option("--policy", default="adapter+prediction", show_default=True,
              help="PREDICTOR+EVICTION: on-demand, next-gate, fate, previous-token, frequency, adapter, draft "
                   "or oracle; lru, lfu, prediction or belady")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="prefetch adapter (model directories; a bundle carries its own heads)")
@click.option("--frequency-trace", type=click.Path(path_type=Path), default=None,
              help="trace whose expert counts drive the frequency policy")
@click.option("--pool-mib", type=POOL_MIB, default=None,
              help="pool budget in MiB [default: a bundle's own default, else 8]")
@click.option("--window", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--queue-depth", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
              help="an existing expert store (model directories; default: built once into the cache)")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "int8", "int4"]),
              help="precision of the store built for a model directory")
@click.option("--flash-profile", default=None, help="pace real reads to this device profile (emulated)")
@click.option("--prompt", "prompts", multiple=True, required=True, help="repeatable")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max-seq", type=click.IntRange(min=2), default=512, show_default=True,
              help="KV cache length of a model directory's graphs")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="compute threads: torch's, and ExecuTorch's thread pool for a bundle's graphs (the rest "
                   "serve I/O)")
@click.option("--io", "io_mode", default="process", show_default=True, type=click.Choice(["process", "threads"]),
              help="reads in a forked reader process, or in threads of this process")
@click.option("--check/--no-check", default=None,
              help="compare the tokens with the unmodified model's own generate (loads all its weights) "
                   "[default: on for the embedded model only]")
@click.option("--events", "events_out", type=OUT_FILE, default=None,
              help="write every scheduler and pool decision here (docs/runtime.md)")
@scheduler_limits
@click.option("--engine", default="python", show_default=True, type=click.Choice(["python", "native"]),
              help="the Python reference runner, or the native C++ runner (ExecuTorch bundles; docs/runner.md)")
@click.option("--abi", default="host", show_default=True, type=click.Choice(["host", "arm64"]),
              help="--engine native: this machine's build, or the arm64 build (under qemu-aarch64 on x86-64)")
@click.option("--json", "json_out", required=True, type=OUT_FILE)
@friendly_errors
def run(model, policy, adapter, frequency_trace, pool_mib, window, queue_depth, store_path, dtype, flash_profile,
        prompts, max_new_tokens, max_seq, threads, io_mode, check, events_out, min_confidence, step_budget_kib,
        engine, abi, json_out) -> None:
    """Run MODEL (a model directory, `embedded`, or a bundle) with its experts streamed from the
    expert store through a bounded pool (real O_DIRECT reads); with --check, compare the tokens
    with the unmodified model."""
    if engine == "native":
        if adapter or store_path or frequency_trace or flash_profile:
            raise SpecPrefetchError("--engine native runs a bundle as exported: drop --adapter, --store, "
                                    "--frequency-trace and --flash-profile")
        _run_native(model, abi=abi, policy=policy, pool_mib=pool_mib, window=window, queue_depth=queue_depth,
                    prompts=prompts, max_new_tokens=max_new_tokens, check=check, events_out=events_out,
                    min_confidence=min_confidence, step_budget_kib=step_budget_kib, json_out=json_out,
                    threads=threads)
        return
    if abi != "host":
        raise SpecPrefetchError("--abi: only with --engine native")
    from export.manifest import read_manifest
    from export.session import is_bundle, open_session, reference_tokens
    from toolkit.artifacts import write_json_atomic
    from toolkit.runtime.events import EventLog
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.profiles import load_profile
    from toolkit.runtime.runner import RunConfig, write_events
    from toolkit.runtime.stats import peak_rss_bytes

    from toolkit.bench import torch_threads

    torch_threads(threads)
    if is_bundle(model):
        head = read_manifest(model)[1]
        if isinstance(head, dict) and head.get("target") == "executorch":
            from export.executorch_target import set_threads

            if set_threads(threads, strict=False) != threads:  # only before the first program loads
                click.echo(f"note: ExecuTorch's thread pool stays at its size in this process (programs already "
                           f"loaded), not --threads {threads}", err=True)
    pol = Policy.parse(policy)
    cfg = RunConfig(policy=pol, pool_mib=pool_mib or 8.0, window=window, queue_depth=queue_depth,
                    flash_profile=load_profile(flash_profile, "--flash-profile") if flash_profile else None,
                    io=io_mode, min_confidence=min_confidence, step_budget_kib=step_budget_kib)
    s = open_session(model, cfg, adapter=adapter, store=store_path, dtype=dtype, frequency_trace=frequency_trace,
                     max_seq=max_seq, pool_default=pool_mib is None)
    if check is None:
        check = s.is_embedded
    if check and s.source_model is None:
        raise SpecPrefetchError(f"--check: the unmodified model of {s.label} is not on this machine")
    exact = s.kind == "model" and s.runner.store.dtype == "fp16"
    runs, encoded = [], []
    log = EventLog() if events_out else None  # one log: each prompt is its own `seq N`
    for p in prompts:
        ids = s.encode(p)
        g = s.runner.run(ids, max_new_tokens, events=log)
        encoded.append(ids)
        runs.append({"prompt": p, "source": s.label, **g.to_json(), "matches_unmodified_model": None,
                     **({"notes": s.notes} if s.notes else {})})
    rss = peak_rss_bytes()  # before --check loads the unmodified model: what the run itself needed
    if check:
        for r, ids in zip(runs, encoded):
            ref = reference_tokens(s.source_model, ids, max_new_tokens)
            r["matches_unmodified_model"] = r["tokens"] == ref
            if exact and r["tokens"] != ref:
                raise SpecPrefetchError(f"tokens differ from the unmodified model's generate for prompt {r['prompt']!r}: "
                                        "a bug, unless transformers departs from the model's config (docs/families.md)")
            if r["tokens"] != ref:
                click.echo(f"note: {s.label} ({s.runner.store.dtype} experts) decodes other tokens than the "
                           f"unmodified model for prompt {r['prompt']!r} (reduced precision)", err=True)
    out = runs[0] if len(runs) == 1 else {"policy": pol.name, "runs": runs}
    out["peak_rss_bytes"] = rss
    write_json_atomic(json_out, out)
    if events_out:
        write_events(events_out, log)
    for r in runs:
        click.echo(f"{pol.name}: TTFT {fmt(r['ttft_ms'], '.1f')} ms, TPOT {fmt(r['tpot_ms'])} ms "
                   f"(p95 {fmt(r['tpot_p95_ms'])}), stall {fmt(r['stall_ms_per_token'])} ms/token, "
                   f"hit rate {fmt(r['hit_rate'], '.3f')}, {r['mib_read']:.1f} MiB read, peak pool "
                   f"{r['peak_pool_bytes'] / 2**20:.2f} of {r['budget_bytes'] / 2**20:.2f} MiB"
                   + (", tokens match the unmodified model" if r["matches_unmodified_model"] else "")
                   + (f" [flash emulated: {flash_profile}]" if flash_profile else ""))
    rss = out["peak_rss_bytes"]
    click.echo(f"peak RSS {rss / 2**20:.0f} MiB (before --check)" if rss else "peak RSS unknown")
    click.echo(f"wrote {json_out}" + (f", {events_out}" if events_out else ""))


def _run_native(model, *, abi, policy, pool_mib, window, queue_depth, prompts, max_new_tokens, check, events_out,
                min_confidence, step_budget_kib, json_out, threads) -> None:
    """`run --engine native`: the C++ runner on an ExecuTorch bundle, the same JSON as the Python engine."""
    from transformers import AutoTokenizer

    from android_runner.build import build, has_tokenizer, run_native
    from export.manifest import validate_bundle
    from export.session import is_bundle, reference_tokens
    from toolkit.artifacts import write_json_atomic

    if not is_bundle(model):
        raise SpecPrefetchError(f"{model}: --engine native runs an exported bundle (specprefetch export "
                                "--target executorch); this is not a bundle directory")
    m, _ = validate_bundle(model, hash_store=False)
    tok = AutoTokenizer.from_pretrained(str(Path(model) / Path(m["model"]["config"]).parent), local_files_only=True)
    encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    # text in and out through the runner's own tokenizer where it has one (`runner build` builds it
    # in); a runner built with --no-tokenizer gets transformers' ids
    out = build(model, abi)
    text_in = has_tokenizer(out)
    res = run_native(model, list(prompts) if text_in else encoded, abi=abi, runner=out, max_new_tokens=max_new_tokens, policy=policy, pool_mib=pool_mib,
                     window=window, queue_depth=queue_depth, min_confidence=min_confidence,
                     step_budget_kib=step_budget_kib, events=events_out, threads=threads)
    src = Path(m["model"].get("source", ""))
    source_model = src if (src / "config.json").is_file() else None
    if check is None:  # as the Python engine: on for the embedded model
        from toolkit.models.loader import embedded_model_dir

        check = source_model is not None and source_model.resolve() == embedded_model_dir().resolve()
    if check and source_model is None:
        raise SpecPrefetchError(f"--check: the unmodified model of {model} is not on this machine")
    runs = []
    for p, ids, r in zip(prompts, encoded, res["runs"]):
        r = {"prompt": p, **{k: v for k, v in r.items() if k != "routing"}, "matches_unmodified_model": None,
             "engine": f"native-{abi}"}
        if text_in and r["prompt_ids"] != ids:
            click.echo(f"warning: the runner's tokenizer encodes {p!r} differently from transformers "
                       f"({len(r['prompt_ids'])} vs {len(ids)} tokens); --check compares with transformers' ids",
                       err=True)
        if check:
            r["matches_unmodified_model"] = r["tokens"] == reference_tokens(source_model, ids, max_new_tokens)
        runs.append(r)
    out = runs[0] if len(runs) == 1 else {"policy": res["policy"], "runs": runs}
    for k in ("peak_rss_bytes", "load_ms", "kernel_isa", "direct_io", "io_note", "tokenizer", "threads"):
        out[k] = res[k]
    write_json_atomic(json_out, out)
    for r in runs:
        click.echo(f"{res['policy']} (native {abi}, {res['kernel_isa']} kernels): TTFT {fmt(r['ttft_ms'], '.1f')} ms, "
                   f"TPOT {fmt(r['tpot_ms'])} ms (p95 {fmt(r['tpot_p95_ms'])}), stall {fmt(r['stall_ms_per_token'])} "
                   f"ms/token, hit rate {fmt(r['hit_rate'], '.3f')}, {r['mib_read']:.1f} MiB read, peak pool "
                   f"{r['peak_pool_bytes'] / 2**20:.2f} of {r['budget_bytes'] / 2**20:.2f} MiB"
                   + (", tokens match the unmodified model" if r["matches_unmodified_model"] else ""))
    click.echo(f"peak RSS {res['peak_rss_bytes'] / 2**20:.0f} MiB; reads: {res['io_note'] or 'O_DIRECT'}")
    click.echo(f"wrote {json_out}" + (f", {events_out}" if events_out else ""))


@main.group()
def runner() -> None:
    """The native C++ runner (docs/runner.md)."""


@runner.command(name="build")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--abi", default="host", show_default=True, type=click.Choice(["host", "arm64", "android"]),
              help="this machine; arm64 Linux (cross-built, starts from adb shell); Android with the NDK")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="output directory [default: the runner cache, ~/.cache/specprefetch/runners]")
@click.option("--force", is_flag=True, help="rebuild even if an up-to-date build is there")
@click.option("--tokenizer/--no-tokenizer", default=None,
              help="build the C++ tokenizer in (text in and out) or leave it out (token ids only) "
                   "[default: what the existing build has; a new build has it]")
@friendly_errors
def runner_build(bundle, abi, out, force, tokenizer) -> None:
    """Generate the native runner's CMake project for BUNDLE and build it (CMake + Ninja)."""
    from android_runner.build import build, command, has_tokenizer

    d = build(bundle, abi, out, force=force, tokenizer=tokenizer)
    click.echo(f"runner: {d / 'bin' / 'specprefetch-runner'} "
               f"({'text in and out' if has_tokenizer(d) else 'token ids only'})")
    if abi == "arm64":
        click.echo(f"on a phone: adb push {d} /data/local/tmp/specprefetch-runner, then run.sh BUNDLE ... there; "
                   f"here: {' '.join(command(d, abi))} BUNDLE ...")


@runner.command(name="bench")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--pool-frac", "pool_fracs", type=FloatList(), default="0.13,0.27", show_default=True,
              help="pools as fractions of all experts")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="ExecuTorch's thread pool for the layer graphs, in both engines")
@click.option("--json", "json_out", required=True, type=OUT_FILE)
@friendly_errors
def runner_bench(bundle, prompts, new_tokens, rounds, pool_fracs, threads, json_out) -> None:
    """Measure the native runner: all experts resident (vs the Python runner and the memory floor),
    and streaming from a cold cache at a few pool sizes (interleaved rounds)."""
    from android_runner.bench import run as run_native_bench, write

    r = run_native_bench(bundle, prompts=prompts, new_tokens=new_tokens, rounds=rounds, pool_fracs=tuple(pool_fracs),
                         threads=threads, log=lambda s: click.echo(s, err=True))
    md, png = write(r, json_out)
    click.echo(md.read_text())
    click.echo(f"wrote {json_out}, {md}, {png}")


@main.group()
def device() -> None:
    """A phone over adb: list devices, push a bundle and its runner, benchmark on it (docs/device.md)."""


@device.command(name="list")
@click.option("--json", "json_out", type=OUT_FILE, default=None, help="also write the list as JSON")
@friendly_errors
def device_list(json_out) -> None:
    """Every attached device: state, SoC, ABI, RAM, free space, CPU clusters, inlinecrypt."""
    from toolkit.artifacts import write_json_atomic
    from toolkit.device.phone import list_devices, states_table

    rows = list_devices()
    click.echo(states_table(rows))
    if json_out:
        write_json_atomic(json_out, {"devices": rows})


@device.command(name="push")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--serial", default=None, help="the device (adb devices); needed when several are attached")
@friendly_errors
def device_push(bundle, serial) -> None:
    """Push BUNDLE and the runner built for the device to /data/local/tmp/specprefetch/<bundle hash>/
    (only files whose sha256 differs), then check every file there."""
    from toolkit.device.phone import push

    r = push(bundle, serial, log=lambda s: click.echo(s, err=True))
    click.echo(f"{r['serial']}: {r['remote']} ({r['sent']} of {r['files']} files sent, "
               f"{r['bytes_sent'] / 2**20:.1f} MiB; runner {r['runner_abi']})")


@device.command(name="standin")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=15555, show_default=True,
              help="TCP port on 127.0.0.1 (0: any free one; outside 5555-5585, where adb looks for emulators)")
@click.option("--root", "root_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="the phone's files (/data/local/tmp, /sys, /proc views) [default: a temporary directory]")
@click.option("--root-user", is_flag=True, help="the shell runs as root (drop_caches, governors writable)")
@click.option("--abi", default="arm64-v8a", show_default=True, type=click.Choice(["arm64-v8a", "x86_64"]),
              help="the ABI it reports: arm64-v8a gets the arm64 runner (run under qemu-aarch64 here), "
                   "x86_64 this machine's build (fast)")
@click.option("--fault", "faults", multiple=True,
              help="disconnect-after=SECONDS[:SUBSTRING], full-disk, unauthorized, offline (repeatable)")
@friendly_errors
def device_standin(port, root_dir, root_user, abi, faults) -> None:
    """A stand-in SM8750 phone on loopback that the real adb server reaches with `adb connect`:
    try the whole device flow without a phone (docs/device.md)."""
    from toolkit.device.standin import main as standin_main

    spec: dict[str, object] = {}
    for f in faults:
        name, _, value = f.partition("=")
        if name == "disconnect-after":
            secs, _, match = value.partition(":")
            try:
                spec["disconnect_after_s"] = float(secs)
            except ValueError:
                raise SpecPrefetchError(f"--fault {f}: expected disconnect-after=SECONDS[:SUBSTRING]") from None
            spec["disconnect_match"] = match
        elif name in ("full-disk", "unauthorized", "offline") and not value:
            spec[name.replace("-", "_")] = True
        else:
            raise SpecPrefetchError(f"--fault {f}: choose from disconnect-after=SECONDS[:SUBSTRING], full-disk, "
                                    "unauthorized, offline")
    standin_main(port, root_dir, spec, root_user, props={"ro.product.cpu.abi": abi})


@device.command(name="bench")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--serial", default=None, help="the device (adb devices); needed when several are attached")
@click.option("--policies", default="on-demand+lru,adapter+prediction", show_default=True,
              help="comma-separated PREDICTOR+EVICTION, run interleaved")
@click.option("--pool-mib", type=POOL_MIB, required=True)
@click.option("--prompt", "prompts", multiple=True, required=True, help="repeatable")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="ExecuTorch's thread pool on the phone")
@click.option("--fixed-performance", is_flag=True,
              help="also run every policy with the cpufreq governors at performance (root only)")
@click.option("--cooldown-timeout", type=FiniteFloat(), default=120.0, show_default=True,
              help="seconds to wait between runs for the thermal zones and MemAvailable to settle")
@click.option("--max-temp-c", type=FiniteFloat(), default=None,
              help="cool-down target for the hottest CPU zone [default: its temperature at start + 3]")
@click.option("--peer", type=click.Choice(["llama.cpp"]), default=None,
              help="also run llama.cpp's llama-bench on the same model (GGUF f16), interleaved")
@click.option("--run-timeout", type=FiniteFloat(), default=900.0, show_default=True,
              help="seconds one run may take on the device; past it the run is killed there and the bench stops")
@click.option("--json", "json_out", required=True, type=OUT_FILE)
@friendly_errors
def device_bench(bundle, serial, policies, pool_mib, prompts, max_new_tokens, repeats, threads, fixed_performance,
                 cooldown_timeout, max_temp_c, peer, run_timeout, json_out) -> None:
    """Benchmark policies on the phone: cold cache, pinned to the big cores, interleaved, with a
    cool-down between runs; pulls every run's JSON and writes a table, a PNG and the JSON."""
    from toolkit.device.phone import bench
    from toolkit.runtime.policy import parse_policies

    names = [p.name for p in parse_policies(policies, "--policies")]
    bench(bundle, serial=serial, policies=names, pool_mib=pool_mib, prompts=list(prompts),
          max_new_tokens=max_new_tokens, repeats=repeats, json_out=json_out, fixed_performance=fixed_performance,
          threads=threads, cooldown_timeout_s=cooldown_timeout, max_temp_c=max_temp_c, peer=peer,
          run_timeout_s=run_timeout,
          log=lambda s: click.echo(s, err=True))
    click.echo(json_out.with_suffix(".md").read_text())
    click.echo(f"wrote {json_out}, {json_out.with_suffix('.md')}, {json_out.with_suffix('.png')}")


@main.command()
@click.argument("model", default="embedded")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="prefetch adapter (model directories; needed by the adapter policies)")
@click.option("--policies", default="on-demand+lru,next-gate+prediction,adapter+prediction,adapter+lru,oracle+belady",
              show_default=True, help="comma-separated PREDICTOR+EVICTION")
@click.option("--pool-mib", type=FloatList(), default="4,8", show_default=True)
@click.option("--prompts", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=2), default=48, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--window", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--flash-profile", default=None, help="pace reads to a device profile (emulated flash)")
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None)
@click.option("--no-simulate", is_flag=True, help="skip the simulator comparison")
@click.option("--frequency-trace", type=click.Path(path_type=Path), default=None,
              help="trace whose counts drive the frequency policy, if benchmarked")
@click.option("--peer", type=click.Choice(["llama.cpp"]), default=None,
              help="instead: llama.cpp and the native runner side by side under memory limits (docs/benchmarks.md "
                   "section 8), on each --bundle")
@click.option("--bundle", "bundles", multiple=True, type=click.Path(path_type=Path),
              help="--peer: an ExecuTorch bundle whose source checkpoint is on this machine (repeatable)")
@click.option("--limits", default="1,0.75,0.5,0.25,none", show_default=True,
              help="--peer: memory limits as fractions of the model's f16 GGUF bytes; none: no limit")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=64, show_default=True, help="--peer")
@click.option("--timeout", type=FiniteFloat(), default=600.0, show_default=True,
              help="--peer: seconds one run may take (a run past it is recorded as a timeout)")
@click.option("--json", "json_out", required=True, type=OUT_FILE)
@friendly_errors
def bench(model, adapter, policies, pool_mib, prompts, new_tokens, rounds, window, flash_profile, store_path,
          no_simulate, frequency_trace, peer, bundles, limits, prompt_tokens, timeout, json_out) -> None:
    """Measure the runner's policies side by side on MODEL (model directory, `embedded` or bundle):
    interleaved rounds, medians, token equality checked; the simulator beside them. With --peer
    llama.cpp: llama.cpp and the native runner on each --bundle under the same memory limits."""
    from toolkit.bench import run_bench, write
    from toolkit.runtime.policy import parse_policies

    if peer:
        _bench_peer(bundles, limits, prompts, prompt_tokens, new_tokens, rounds, timeout, json_out)
        return
    if bundles:
        raise SpecPrefetchError("--bundle: only with --peer llama.cpp (the bench of MODEL takes MODEL)")

    r = run_bench(model=model, adapter=adapter, policies=parse_policies(policies), pools=pool_mib, prompts=prompts,
                  new_tokens=new_tokens, rounds=rounds, flash_profile=flash_profile, window=window,
                  store=store_path, simulate=not no_simulate, frequency_trace=frequency_trace)
    md, png = write(r, json_out)
    click.echo(md.read_text())
    click.echo(f"wrote {json_out}, {md}, {png}")


def _bench_peer(bundles, limits, prompts, prompt_tokens, new_tokens, rounds, timeout, json_out) -> None:
    from toolkit.peers import sidebyside

    if not bundles:
        raise SpecPrefetchError("--peer llama.cpp: give at least one --bundle (an ExecuTorch bundle)")
    fracs: list[float | None] = []
    for item in limits.split(","):
        item = item.strip().lower()
        if item in ("none", "no", "inf"):
            fracs.append(None)
            continue
        try:
            v = float(item)
        except ValueError:
            raise SpecPrefetchError(f"--limits {limits!r}: fractions like 0.5, or none") from None
        if not (0 < v <= 4):
            raise SpecPrefetchError(f"--limits {limits!r}: {item} is not a fraction in (0, 4]")
        fracs.append(v)
    r = sidebyside.run([Path(b) for b in bundles], limits=tuple(fracs), prompts=prompts, prompt_tokens=prompt_tokens,
                       new_tokens=new_tokens, rounds=rounds, timeout_s=timeout, log=lambda s: click.echo(s, err=True))
    md, png = sidebyside.write(r, json_out)
    click.echo(md.read_text())
    click.echo(f"wrote {json_out}, {md}, {png}")
    if r.get("status") == "partial":
        raise SpecPrefetchError(f"{r['reason']}: partial results ({len(r['rows'])} rows) in {json_out}")


def _tolerances(items: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for it in items:
        key, sep, val = it.partition("=")
        try:
            out[key.strip()] = float(val)
        except ValueError:
            sep = ""
        if not sep:
            raise SpecPrefetchError(f"--tolerance {it!r}: expected KEY=NUMBER, e.g. max_abs_logit_diff=0.5")
    return out


@main.command(name="export")
@click.argument("model", default="embedded")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="prefetch adapter directory (default: next-gate prediction heads)")
@click.option("--target", type=click.Choice(["executorch", "qnn", "qai-hub"]), default="executorch", show_default=True)
@click.option("--soc", default="SM8750", show_default=True, help="Snapdragon SoC for qnn / qai-hub (SM8750 = 8 Elite)")
@click.option("--quant", default=None,
              help="dense graphs: executorch fp32|8da8w|8da4w|w8|w4 (default fp32); qnn / qai-hub fp16|a16w8|a8w8 (default fp16)")
@click.option("--experts", "experts_dtype", type=click.Choice(["fp16", "int8", "int4"]), default="fp16",
              show_default=True, help="expert store precision")
@click.option("--max-seq", default=256, show_default=True, help="KV cache length (prompt + generated tokens)")
@click.option("--pool-mib", type=float, default=None, help="default DRAM pool budget (default: 1/4 of the experts)")
@click.option("--window", default=2, show_default=True, help="prefetch window: MoE layers predicted ahead")
@click.option("--calibration", type=click.Path(path_type=Path), default=None,
              help="calibration / parity prompts (.jsonl or .txt; default: the embedded held-out text)")
@click.option("--parity-prompts", default=3, show_default=True)
@click.option("--prompt-tokens", default=12, show_default=True, help="parity prompt length")
@click.option("--decode-tokens", default=8, show_default=True, help="greedy tokens per parity prompt")
@click.option("--tolerance", multiple=True, help="override a parity bound, KEY=VALUE (repeatable)")
@click.option("--qnn-path", type=click.Choice(["ort", "executorch"]), default="ort", show_default=True,
              help="qnn: onnxruntime-qnn, or ExecuTorch's Qualcomm backend (needs QAIRT at QNN_SDK_ROOT)")
@click.option("--hub-device", default="Snapdragon 8 Elite QRD", show_default=True, help="qai-hub device")
@click.option("--hub-timeout", default=15.0, show_default=True, help="qai-hub: seconds before giving up on the service")
@click.option("--hub-profile/--no-hub-profile", default=True, show_default=True,
              help="qai-hub: also profile every graph on the device")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="bundle directory to write")
@friendly_errors
def export_cmd(model, adapter, target, soc, quant, experts_dtype, max_seq, pool_mib, window, calibration,
               parity_prompts, prompt_tokens, decode_tokens, tolerance, qnn_path, hub_device, hub_timeout, hub_profile,
               out) -> None:
    """Export MODEL as a phone-ready bundle: dense step graphs for the target, the expert store,
    the adapter, and a parity report. The bundle is refused if parity is past tolerance."""
    from export.bundle import ExportConfig, export_bundle

    cfg = ExportConfig(target=target, quant=quant, experts=experts_dtype, soc=soc, max_seq=max_seq,
                       pool_mib=pool_mib, window=window, calibration=calibration, parity_prompts=parity_prompts,
                       prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                       tolerance=_tolerances(tolerance), qnn_path=qnn_path, hub_device=hub_device,
                       hub_timeout_s=hub_timeout, hub_profile=hub_profile)
    try:
        m = export_bundle(model, out, cfg, adapter=adapter)
    except KeyboardInterrupt:
        click.echo(f"interrupted: the partial bundle was removed; {out} is as it was", err=True)
        sys.exit(130)
    click.echo((out / "parity.md").read_text())
    total = sum(f["size"] for f in m["files"].values())
    click.echo(f"wrote {out}: {m['target']} ({m['quantization']['dense']}), {len(m['files'])} files, "
               f"{total / 2**20:.1f} MiB, in {m['timings_s']['total_s']:.0f} s")


@main.command(name="inspect")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a summary")
@friendly_errors
def inspect_cmd(bundle: Path, as_json: bool) -> None:
    """Validate a bundle (manifest, hashes, versions, graph signatures) and summarise it."""
    from export.bundle import inspect_bundle

    s = inspect_bundle(bundle)
    if as_json:
        click.echo(json.dumps(s, indent=1))
        return
    p = s["parity"] or {}
    click.echo(f"{s['path']}: valid {s['target']} bundle" + (f" for {s['soc']}" if s["soc"] else ""))
    click.echo(f"  model      {s['family']} (config {s['config_hash']}), KV cache {s['max_seq']} tokens")
    q = s["quantization"]
    click.echo(f"  precision  dense {q['dense']}, experts {q['experts']}, expert graph {q['expert_graph']}")
    click.echo(f"  prefetch   {s['predictor']} heads, default pool {s['pool_mib']} MiB")
    click.echo(f"  parity     {'passed' if p.get('passed') else 'NOT passed'}: max |logit diff| "
               f"{p.get('max_abs_logit_diff', float('nan')):.3g}, top-k agreement {p.get('topk_agreement', 0):.4f}, "
               f"next-token agreement {p.get('next_token_agreement', 0):.4f}")
    click.echo(f"  files      {s['files']} files, {s['bytes'] / 2**20:.2f} MiB: "
               + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(s["sizes"].items())))
    click.echo(f"  graphs     {len(s['graphs'])} checked: " + ", ".join(sorted(s["graphs"])))
    for n in s["notes"]:
        click.echo(f"  note       {n}")


@main.command()
@click.argument("family")
@click.option("--out", required=True, type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True)
@click.option("--set", "sets", multiple=True,
              help="KEY=VALUE: a config attribute (VALUE as JSON, e.g. hidden_size=768, mlp_only_layers=[]); "
                   "repeatable, for a larger random model")
@friendly_errors
def tiny(family: str, out: Path, seed: int, sets: tuple[str, ...]) -> None:
    """Write a tiny random checkpoint of FAMILY (qwen3_moe, qwen3_vl_moe, deepseek_v2,
    deepseek_v3, mixtral, olmoe, gpt_oss) to --out."""
    from toolkit.models.tiny import build_tiny

    overrides = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SpecPrefetchError(f"--set {item!r}: expected KEY=VALUE")
        try:
            overrides[key] = json.loads(value)
        except ValueError:
            raise SpecPrefetchError(f"--set {item!r}: VALUE must be JSON (a number, true/false, a list)") from None
    click.echo(f"wrote {build_tiny(family, out, seed=seed, overrides=overrides)}")


if __name__ == "__main__":
    main()
