"""The `specprefetch` command line: one verb per pipeline stage, nothing else lives here (the parameter
types, shared options and help texts are in toolkit/cli_params.py, the one-line errors and the command
group in toolkit/cli_errors.py).

    specprefetch info MODEL                 geometry and expert bytes of a MoE checkpoint
    specprefetch trace MODEL --data F       routing traces for adapter training and evaluation
    specprefetch train TRACES --out A       the prefetch adapter (and its reuse table) on the frozen model
    specprefetch eval TRACES --json R       recall@k / budget recall of every predictor, per horizon
    specprefetch store MODEL --out S        the expert store (fp16 / int8 / int4), 4 KiB-aligned
    specprefetch simulate TRACES            policies replayed on virtual-time flash (TPOT, TTFT) per pool
    specprefetch eviction-bounds TRACES     bytes read per token for every eviction rule, Belady included
    specprefetch calibrate MODEL            a device profile measured from this machine's reads
    specprefetch run MODEL|BUNDLE           one generation through the pool (--engine python|native, --device cuda)
    specprefetch bench cpu MODEL            the Python runner's policies side by side, interleaved, the simulator beside
    specprefetch bench gpu MODEL            the GPU tier's policies side by side (--device cuda|cuda:N)
    specprefetch bench llama.cpp BUNDLE...  llama.cpp and the native runner under the same memory limits
    specprefetch bench reads TRACES         O_DIRECT reads in the store's order and in co-activation order, merged
    specprefetch export MODEL --out B       a phone-ready bundle (ExecuTorch / QNN / AI Hub), parity-checked
    specprefetch inspect BUNDLE             validate a bundle and summarise it
    specprefetch runner build|bench BUNDLE  the native C++ runner: build (host, arm64, android), bench
    specprefetch device list|push|standin|bench   a phone over adb, or the loopback stand-in phone
    specprefetch tiny FAMILY --out DIR      a tiny random checkpoint of a family, for trying things
    specprefetch widen MODEL --moe-intermediate-size N --out DIR   wider experts, same function

MODEL may be `embedded` for the embedded default model, `phone` for the phone-class model or
`embedded-vl` for the vision-language demo model.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from adapters.reuse import CLASSES as REUSE_CLASSES
from adapters.reuse import MAX_CLASSES as MAX_REUSE_CLASSES
from adapters.reuse import MAX_NEXT_VISITS
from toolkit import __version__
from toolkit.cli_errors import Cli, friendly_errors, quiet_libraries, quiet_native_stderr
from toolkit.cli_params import (MIN_TIMED_TOKENS, NOT_WRITTEN, NOTHING_TO_OUT, OUT_DIR, OUT_FILE, POOL_AUTO_MIB,
                                POOL_MIB, POOL_MIB_LIST, POOL_MIB_OR_AUTO, WINDOW_HELP, FiniteFloat, FloatList, IntList,
                                Text, TextFile, bench_runs, ctx_default, cuda_device, device_name, int_tuple,
                                ImageSize, IntOrAuto, budget_or_none, json_report, scheduler_limits)
from toolkit.engines import fmt
from toolkit.errors import SpecPrefetchError


def _inputs(*paths) -> list[Path]:
    """A command's inputs that exist, as paths (`embedded` / `phone` / `embedded-vl`: the shipped model's directory):
    what its outputs must never be, nor lie inside."""
    from toolkit.models.loader import resolve_model_dir

    out: list[Path] = []
    for p in paths:
        if p is None:
            continue
        if isinstance(p, (list, tuple)):
            out += _inputs(*p)
            continue
        q = resolve_model_dir(p) if isinstance(p, str) else Path(p)
        if q.exists():
            out.append(q)
    return out


def claim(out, kind: str, overwrite: bool, inputs=(), option: str = "--json", siblings=None, beside=()):
    """Claim a report file before any work (toolkit.artifacts.claim_report): the rule for every
    --json, --events and profile --out; `kind` is the command that writes it."""
    from toolkit.artifacts import REPORT_SIBLINGS, claim_report

    return claim_report(out, kind=kind, overwrite=overwrite, inputs=_inputs(*inputs), option=option,
                        siblings=REPORT_SIBLINGS if siblings is None else siblings, beside=beside)


def wrote(*claims) -> str:
    """`wrote A, B, C`: the files the claims wrote (a FIFO or /dev/null: the JSON alone)."""
    return "wrote " + ", ".join(str(f) for c in claims if c is not None for f in c.files())


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specprefetch")
def main() -> None:
    """Predict and prefetch Mixture-of-Experts experts from flash into a bounded DRAM pool."""
    from toolkit.errors import install_signal_handlers

    quiet_libraries()
    install_signal_handlers()  # SIGTERM and SIGHUP end a command as Ctrl-C does (same cleanup, same message)


@main.command()
@click.argument("model", default="embedded")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a summary")
@friendly_errors(interrupt="nothing was written")
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
@click.option("--data", "data", multiple=True, required=True, type=TextFile(),
              help=".txt or .jsonl file ({\"text\": ..., \"image\": ...} per line); repeatable")
@click.option("--out", required=True, type=OUT_DIR, help="trace directory to write")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="tokens per prompt")
@click.option("--decode-tokens", type=click.IntRange(min=0), default=32, show_default=True,
              help="greedy decode steps per prompt")
@click.option("--max-sequences", type=click.IntRange(min=1), default=None,
              help="stop after this many prompts [default: every prompt in --data]")
@click.option("--probs-top-m", type=click.IntRange(min=1), default=None,
              help="keep only the top-m router probabilities (default: all up to 256 experts, else 64)")
@click.option("--hidden-sample", type=click.FloatRange(0, 1), default=1.0, show_default=True,
              help="share of prefill tokens whose router input is stored (decode tokens: always)")
@click.option("--heldout-frac", type=click.FloatRange(0, 1, max_open=True), default=0.1, show_default=True,
              help="share of prompts held out")
@click.option("--seed", default=0, show_default=True)
@click.option("--shard-tokens", type=click.IntRange(min=1), default=16384, show_default=True, help="tokens per shard")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda, cuda:N, or auto (spread over all GPUs with accelerate)")
@click.option("--max-memory", default=None,
              help="budgets for --device auto, e.g. '0=40GiB,cpu=200GiB': the layers fill the GPUs by index, then "
                   "host memory, then a disk scratch folder beside --out (removed afterwards); host and disk "
                   "layers compute on the first GPU (or the CPU where there is none)")
@click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="prompts per forward pass [default: 1 on cpu, 16 on a GPU]")
@click.option("--overwrite", is_flag=True, help="replace an existing --out (only once the new trace is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def trace(model, data, out, prompt_tokens, decode_tokens, max_sequences, probs_top_m,
          hidden_sample, heldout_frac, seed, shard_tokens, device, max_memory, dtype, batch, overwrite) -> None:
    """Record routing traces of MODEL over text (and images) in prefill and greedy decode.

    Per token and MoE layer: selected experts and weights, the router's probability vector and
    its input hidden state. Interrupted runs resume when the same command is run again.
    """
    from toolkit.traces.capture import TraceSettings, run_trace
    from toolkit.traces.format import TraceReader

    s = TraceSettings(prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                      max_sequences=max_sequences, probs_top_m=probs_top_m,
                      hidden_sample=hidden_sample, heldout_frac=heldout_frac, seed=seed,
                      shard_tokens=shard_tokens, device=device, dtype=dtype, batch=batch,
                      max_memory=max_memory)
    path = run_trace(model, list(data), out, s, overwrite=overwrite)
    m = TraceReader(path).manifest
    t = m["tokens"]
    click.echo(f"wrote {path}: {len(m['shards'])} shards; train {t['train']['total']} tokens "
               f"({t['train']['decode']} decode), held-out {t['heldout']['total']} tokens "
               f"({t['heldout']['decode']} decode)")


@main.command()
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=OUT_DIR, help="adapter directory to write")
@click.option("--model", default=None, help="model directory (default: the one the trace records)")
@click.option("--rank", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--horizons", default="1,2", show_default=True, help="MoE layers ahead, 1..4")
@click.option("--cross-token/--no-cross-token", default=True, show_default=True,
              help="let the last layers predict the next token's first layers")
@click.option("--next-visits", type=click.IntRange(0, MAX_NEXT_VISITS), default=None,
              help="also train heads for each MoE layer's next N visits (the same layer of the next N tokens), which "
                   "the reuse eviction reads (docs/runtime.md; 0: none) [default: 3 with --cross-token, 0 without]")
@click.option("--horizon-weights", default=None,
              help="loss weight per horizon, e.g. '1:2,2:1' (default 2 for h=1, 1 otherwise)")
@click.option("--topk-weight", type=FiniteFloat(0.0, inclusive=True), default=0.0, show_default=True,
              help="weight of the top-k ranking term")
@click.option("--next-visit-weight", type=FiniteFloat(0.0, inclusive=True), default=1.0, show_default=True,
              help="loss weight of the next-visit heads (horizons L, 2L, ...; in the validation loss too)")
@click.option("--reuse-classes", type=click.IntRange(1, MAX_REUSE_CLASSES), default=REUSE_CLASSES, show_default=True,
              help="the reuse table's frequency classes: each layer's experts in this many shares by how often "
                   "the train split routes to them, a table per share (docs/runtime.md; 1: one table)")
@click.option("--steps", type=click.IntRange(min=1), default=3000, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--lr", type=FiniteFloat(), default=3e-3, show_default=True)
@click.option("--val-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="validate every this many steps")
@click.option("--patience", type=click.IntRange(min=1), default=6, show_default=True,
              help="validations without improvement before stopping")
@click.option("--seed", default=0, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--max-memory-mb", type=click.IntRange(min=1), default=512, show_default=True,
              help="trace shards held in memory at once (the training stream's; the validation set's, each)")
@click.option("--overwrite", is_flag=True,
              help="replace an existing adapter at --out (only once the new one is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def train(traces, out, model, rank, horizons, cross_token, next_visits, horizon_weights, topk_weight,
          next_visit_weight, reuse_classes, steps, batch_size, lr, val_every, patience, seed, device, max_memory_mb,
          overwrite) -> None:
    """Train the prefetch adapter on TRACES (a `trace` directory): a rank-r correction of each
    future layer's router, KL to the real routing, backbone frozen."""
    from adapters.train import TrainConfig, train_adapter

    hw = None
    if horizon_weights:
        try:
            hw = {int(a): float(b) for a, b in (x.split(":") for x in horizon_weights.split(","))}
        except ValueError:
            raise SpecPrefetchError(f"--horizon-weights {horizon_weights!r}: expected H:W,H:W") from None
    cfg = TrainConfig(rank=rank, horizons=int_tuple(horizons, "--horizons"), cross_token=cross_token,
                      next_visits=next_visits, horizon_weights=hw, topk_weight=topk_weight,
                      next_visit_weight=next_visit_weight, reuse_classes=reuse_classes, steps=steps,
                      batch_size=batch_size, lr=lr, val_every=val_every, patience=patience, seed=seed, device=device,
                      max_memory_mb=max_memory_mb)
    if not cfg.next_visits and not ctx_default(click.get_current_context(), "next_visit_weight"):
        raise SpecPrefetchError("--next-visit-weight: this adapter has no next-visit heads (--next-visits 0, or "
                                "--no-cross-token without --next-visits)")
    try:
        r = train_adapter(traces, out, cfg, model=model, overwrite=overwrite)
    except ValueError as e:
        raise SpecPrefetchError(f"train: {e}") from None
    v = r["validation"]
    click.echo(f"wrote {out}: {r['params']:,} parameters ({100 * r['share_of_model']:.2f}% of the model), "
               f"best step {r['training']['best_step']}")
    for h in v["adapter"]["recall_at_k"]:
        click.echo(f"  validation recall@k h={h}: next-gate {fmt(v['next_gate']['recall_at_k'].get(h), '.3f')} -> "
                   f"adapter {fmt(v['adapter']['recall_at_k'][h], '.3f')}")


@main.command(name="eval")
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--adapter", type=click.Path(path_type=Path), default=None, help="adapter directory")
@click.option("--predictors", default=None,
              help="comma-separated: next-gate,fate,frequency,previous-token,adapter,draft,oracle "
                   "(default: all; adapter only with --adapter)")
@click.option("--model", default=None, help="model directory (default: the one the trace records)")
@click.option("--horizons", default=None, help="default: the adapter's, else 1,2")
@click.option("--budget", type=click.IntRange(min=1), default=None, help="candidate budget M (default 2k)")
@click.option("--draft-bits", type=click.IntRange(2, 8), default=4, show_default=True,
              help="bits of the draft's routed experts")
@json_report
@friendly_errors(interrupt=NOT_WRITTEN)
def eval_cmd(traces, adapter, predictors, model, horizons, budget, draft_bits, json_out, overwrite) -> None:
    """Recall@k, recall/precision within a budget, per-layer curves for each predictor on the
    held-out decode tokens of TRACES."""
    c = claim(json_out, "eval", overwrite, inputs=(traces, adapter, model))
    from toolkit.predictors.evaluate import ALL, evaluate, markdown, write_reports

    names = [p.strip() for p in predictors.split(",")] if predictors else [
        p for p in ALL if p != "adapter" or adapter is not None]
    r = evaluate(traces, predictors=names, adapter=adapter, model=model,
                 horizons=int_tuple(horizons, "--horizons") if horizons else None, budget=budget,
                 draft_bits=draft_bits)
    write_reports(r, json_out)
    click.echo(markdown(r))
    click.echo(wrote(c))


@main.command()
@click.argument("model", default="embedded")
@click.option("--out", required=True, type=OUT_FILE, help="expert store file to write")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "int8", "int4"]))
@click.option("--overwrite", is_flag=True,
              help="replace an existing expert store at --out (only once the new one is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def store(model, out, dtype, overwrite) -> None:
    """Write MODEL's routed experts into one 4 KiB-aligned expert store file (docs/expert-store.md)."""
    from toolkit.models.loader import inspect_model_dir
    from toolkit.runtime.expert_store import ExpertStore, build_store

    path = build_store(inspect_model_dir(model), out, dtype, overwrite=overwrite)
    st = ExpertStore(path)
    click.echo(f"wrote {path}: {len(st.entries)} experts of {st.blob_size:,} B ({dtype}), "
               f"{path.stat().st_size / 2**20:.1f} MiB")


@main.command()
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--policies", "--predictor", "policies",
              default="on-demand+lru,previous-token+lru,next-gate+prediction,adapter+prediction,oracle+belady",
              show_default=True,
              help="comma-separated PREDICTOR+EVICTION (eviction: lru, lfu, prediction, belady, reuse)")
@click.option("--adapter", type=click.Path(path_type=Path), default=None)
@click.option("--profile", default="snapdragon-8-elite", show_default=True,
              help="snapdragon-8-elite, snapdragon-8-elite-npu (prefill on the NPU), this-machine (after "
                   "calibrate), or a profile JSON file")
@click.option("--pool-mib", type=POOL_MIB_LIST, default="8", show_default=True, help="pool budget; comma list to sweep")
@click.option("--window", "windows", type=IntList(1), default="2", show_default=True,
              help=WINDOW_HELP + "; a comma list sweeps")
@click.option("--queue-depth", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "int8", "int4"]))
@click.option("--geometry", default=None, help="config.json directory whose sizes to use (routing stays the trace's)")
@click.option("--split", default="heldout", show_default=True, type=click.Choice(["heldout", "train"]))
@click.option("--max-sequences", type=click.IntRange(min=1), default=None)
@click.option("--prompt-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="also project TTFT for a prompt of this many positions (the split's prompts laid end to end; "
                   "needs a profile with a prefill rate); 0: decode only")
@click.option("--no-next-visit", "no_next_visit", is_flag=True,
              help="the reuse eviction without the adapter's next-visit heads (as run --no-next-visit)")
@click.option("--next-visits", "next_visits", type=click.IntRange(min=0), default=None,
              help="the reuse eviction reads at most N of the adapter's next-visit heads (as run --next-visits)")
@click.option("--no-reuse-classes", "no_reuse_classes", is_flag=True,
              help="the reuse eviction with the whole reuse table, not its frequency classes (as run "
                   "--no-reuse-classes)")
@scheduler_limits
@json_report
@friendly_errors(interrupt=NOT_WRITTEN)
def simulate(traces, policies, adapter, profile, pool_mib, windows, queue_depth, dtype, geometry, split,
             max_sequences, prompt_tokens, no_next_visit, next_visits, no_reuse_classes, min_confidence,
             step_budget_kib, read_budget_kib, json_out, overwrite) -> None:
    """Replay TRACES through the pool and scheduler against a device profile: TPOT, stall, hit
    rate, MiB read and wasted prefetch per policy; sweeps give a table and plots."""
    from toolkit.runtime.profiles import profile_dir

    c = claim(json_out, "simulate", overwrite,
              inputs=(traces, adapter, geometry, Path(profile), profile_dir() / f"{profile}.json"))
    from toolkit.runtime.policy import parse_policies
    from toolkit.runtime.profiles import load_profile
    from toolkit.simulate.report import markdown, sweep, write_sweep

    r = sweep(traces, policies=parse_policies(policies), profile=load_profile(profile), pools=pool_mib,
              windows=windows, queue_depth=queue_depth, dtype=dtype, geometry=geometry, adapter=adapter,
              split=split, max_sequences=max_sequences, min_confidence=min_confidence,
              step_budget_kib=step_budget_kib, read_budget_kib=budget_or_none(read_budget_kib),
              prompt_tokens=prompt_tokens, next_visit=not no_next_visit, next_visits=next_visits,
              reuse_classes=not no_reuse_classes)
    write_sweep(r, json_out)
    click.echo(markdown(r))
    click.echo(wrote(c))


@main.command("eviction-bounds")
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--pool-frac", "pool_fracs", type=FloatList(FiniteFloat(high=1.0)), default="0.13,0.27",
              show_default=True,
              help="pools as shares of all experts (comma list)")
@click.option("--max-sequences", type=click.IntRange(min=1), default=None, help="held-out sequences to replay")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="an adapter with next-visit heads (train --next-visits): adds the adapter-next-visit rules (with "
                   "the whole reuse table, and with its frequency classes; with N > 1 heads, next-visits-N too)")
@click.option("--model", default=None, help="model directory (default: the one the trace records)")
@click.option("--draft-lookahead", "draft_lookahead", type=IntList(), default=None,
              help="comma list of D: adds draft-lookahead-D, Belady's rule on a self-draft's routing of the D "
                   "positions from each decode position on (the current one and D - 1 more), drafted on the "
                   "pool's experts only (runs the model, float32, on --device; text traces only)")
@click.option("--device", default="cpu", show_default=True, callback=lambda c, p, v: device_name(v, p),
              help="where --draft-lookahead's model runs: cpu, cuda or cuda:N")
@json_report
@friendly_errors(interrupt=NOT_WRITTEN)
def eviction_bounds_cmd(traces, pool_fracs, max_sequences, adapter, model, draft_lookahead, device, json_out,
                        overwrite) -> None:
    """Reads per decode token on TRACES' routing for LRU, the reuse eviction (and reuse-freq: its table by
    each expert's frequency class), Belady's rule knowing
    the future only so far (the current token, the next 1, 2 or 4 tokens, everything), and the reuse
    eviction knowing each layer's next visit (exactly; with --adapter, as its next-visit heads predict
    it); with --draft-lookahead, Belady's rule on a self-draft's routing: how much of the oracle's
    eviction a causal engine can reach (docs/runtime.md)."""
    c = claim(json_out, "eviction-bounds", overwrite, inputs=(traces, adapter, model))
    from toolkit.reporting import write_report
    from toolkit.simulate.bounds import eviction_bounds, markdown, plot

    r = eviction_bounds(traces, pool_fracs, max_sequences=max_sequences, adapter=adapter, model=model,
                        draft_lookahead=draft_lookahead or (), device=device,
                        progress=lambda m: click.echo(m, err=True))
    write_report(r, json_out, markdown, plot)
    click.echo(markdown(r))
    click.echo(wrote(c))


@main.command()
@click.argument("model", default="embedded")
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
              help="expert store (default: built once into ~/.cache/specprefetch/stores)")
@click.option("--reads", type=click.IntRange(min=1), default=200, show_default=True, help="reads per measured point")
@click.option("--out", type=OUT_FILE, default=None,
              help="profile JSON [default: the profile cache, where `this-machine` is found; replaced there]")
@click.option("--overwrite", is_flag=True, help="replace an existing device profile at --out (nothing else)")
@friendly_errors(interrupt="the profile was not written")
def calibrate(model, store_path, reads, out, overwrite) -> None:
    """Measure this machine (O_DIRECT expert reads by queue depth, runtime compute per layer and
    expert) into the `this-machine` device profile."""
    import tempfile

    from toolkit.reporting import write_json_report
    from toolkit.simulate.calibrate import calibrate as run_calibrate

    if out is None:  # the cache: each calibration replaces the last
        prof, path = run_calibrate(model, store=store_path, reads=reads)
    else:
        claim(out, "profile", overwrite, inputs=(model, store_path), option="--out", siblings=())
        with tempfile.TemporaryDirectory() as tmp:  # measured first; --out written by the claim's rule
            prof, _ = run_calibrate(model, store=store_path, reads=reads, out=Path(tmp) / "profile.json")
        path = write_json_report(out, prof.to_json())
    click.echo(json.dumps(prof.to_json(), indent=1))
    click.echo(f"wrote {path}")


@main.command()
@click.argument("model", default="embedded")
@click.option("--policy", default="adapter+prediction", show_default=True,
              help="PREDICTOR+EVICTION: on-demand, next-gate, fate, previous-token, frequency, adapter, draft "
                   "or oracle; lru, lfu, prediction, belady or reuse")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="prefetch adapter (model directories; a bundle carries its own heads)")
@click.option("--frequency-trace", type=click.Path(path_type=Path), default=None,
              help="trace whose expert counts drive the frequency policy")
@click.option("--pool-mib", type=POOL_MIB_OR_AUTO, default=None,
              help="pool budget in MiB [default: a bundle's own default, else 8]; auto (--engine native): sized "
                   "from the available memory, shrunk when it runs low")
@click.option("--pool-reserve-mib", type=POOL_AUTO_MIB, default=None,
              help="--pool-mib auto: memory left free [default: 512, or a quarter of the available memory when "
                   "that is under 2 GiB]")
@click.option("--pool-low-watermark-mib", type=POOL_AUTO_MIB, default=None,
              help="--pool-mib auto: the pool shrinks when the available memory falls under this [default: half "
                   "the reserve]")
@click.option("--window", type=click.IntRange(min=1), default=2, show_default=True,
              help=WINDOW_HELP + " (a bundle: the one it was exported with, unless given)")
@click.option("--queue-depth", type=click.IntRange(min=1), default=4,
              help="prefetch reads in flight at most (a read counts until the next step) [default: 4; a bundle: "
                   "its exported setting; --device cuda: the same of prefetch copies, default the pool's free slots]")
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
              help="an existing expert store (model directories; default: built once into the cache)")
@click.option("--dtype", default=None, type=click.Choice(["fp16", "int8", "int4"]),
              help="precision of the store built for a model directory [default: fp16]; with --store or a bundle "
                   "it must be that store's")
@click.option("--device", default="cpu", show_default=True, callback=lambda c, p, v: device_name(v, p),
              help="cpu, or cuda / cuda:N: the GPU tier (experts in pinned host memory, the pool in GPU memory; "
                   "docs/gpu-tier.md)")
@click.option("--flash-profile", default=None, help="pace real reads to this device profile (emulated)")
@click.option("--draft-k", type=click.IntRange(min=1), default=8, show_default=True,
              help="--device cuda with the draft policy: tokens the draft proposes per round (`bench gpu` "
                   "picks it by profiling)")
@click.option("--attention", "attention", type=click.Choice(["fused", "sdpa"]), default=None,
              help="--device cuda: the one-position attention, fused (Triton kernels; the default where they "
                   "cover the model) or sdpa (the model's modules; docs/gpu-tier.md)")
@click.option("--router", "router", type=click.Choice(["fused", "model"]), default=None,
              help="--device cuda: the one-position router, fused (one Triton kernel; the default where it covers "
                   "the model) or model (the model's router; docs/gpu-tier.md)")
@click.option("--prompt", "prompts", type=Text(), multiple=True, required=True,
              help="repeatable; one JSON `runs` entry each")
@click.option("--image", "images", type=click.Path(path_type=Path), multiple=True,
              help="PNG, JPEG or PPM before every prompt's text (repeatable, in order): a bundle that takes images "
                   "(docs/export.md 'Images')")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max-seq", type=click.IntRange(min=2), default=512, show_default=True,
              help="KV cache length of a model directory's graphs")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="compute threads: torch's, and ExecuTorch's thread pool for a bundle's graphs (the rest "
                   "serve I/O)")
@click.option("--io", "io_mode", default="process", show_default=True, type=click.Choice(["process", "threads"]),
              help="reads in a forked reader process, or in threads of this process")
@click.option("--no-next-visit", "no_next_visit", is_flag=True,
              help="the reuse eviction without the adapter's next-visit heads, where the adapter or bundle has "
                   "them (docs/runtime.md)")
@click.option("--next-visits", "next_visits", type=click.IntRange(min=0), default=None,
              help="the reuse eviction reads at most N of the adapter's next-visit heads (the next N visits; "
                   "default: all it has; 0: as --no-next-visit)")
@click.option("--no-reuse-classes", "no_reuse_classes", is_flag=True,
              help="the reuse eviction with the whole reuse table, not its frequency classes, where the adapter "
                   "or bundle has them (docs/runtime.md)")
@click.option("--prefill-chunk", default=None, metavar="N|off",
              help="feed the prompt in chunks of up to N positions through a bundle's prefill methods, or off "
                   "(one position at a time) [default: the bundle's largest chunk]")
@click.option("--check/--no-check", default=None,
              help="compare the tokens with the unmodified model's own generate (loads all its weights) "
                   "[default: on for the shipped models, embedded, phone and embedded-vl, only]")
@click.option("--events", "events_out", type=OUT_FILE, default=None,
              help="write every scheduler and pool decision here (docs/runtime.md)")
@scheduler_limits
@click.option("--engine", default="python", show_default=True, type=click.Choice(["python", "native"]),
              help="the Python reference runner, or the native C++ runner (ExecuTorch bundles; docs/runner.md)")
@click.option("--abi", default="host", show_default=True, type=click.Choice(["host", "arm64"]),
              help="--engine native: this machine's build, or the arm64 build (under qemu-aarch64 on x86-64)")
@click.option("--json", "json_out", required=True, type=OUT_FILE,
              help='{"specprefetch_report": "run", "policy": ..., "runs": [one per --prompt], "peak_rss_bytes": ...} '
                   '(docs/runtime.md)')
@click.option("--overwrite", is_flag=True,
              help="replace an existing --json report and --events log if this command wrote them; nothing else "
                   "is ever replaced")
@friendly_errors(interrupt=NOT_WRITTEN)
def run(model, policy, adapter, frequency_trace, pool_mib, pool_reserve_mib, pool_low_watermark_mib, window,
        queue_depth, store_path, dtype, device, flash_profile, draft_k, attention, router, prompts, images,
        max_new_tokens, max_seq,
        threads, no_next_visit, next_visits, no_reuse_classes, io_mode, prefill_chunk, check, events_out,
        min_confidence, step_budget_kib, read_budget_kib, engine, abi, json_out, overwrite) -> None:
    """Run MODEL (a model directory, `embedded`, or a bundle) with its experts streamed from the
    expert store through a bounded pool (real O_DIRECT reads); prints each prompt's generated text
    and figures; with --check, compare the tokens with the unmodified model."""
    inputs = (model, adapter, frequency_trace, store_path, Path(flash_profile) if flash_profile else None, *images)
    if images and device != "cpu":
        raise SpecPrefetchError(f"--image: the CPU engines only so far (--device {device} runs text prompts)")
    chunk = None
    if prefill_chunk is not None:
        v = prefill_chunk.strip().lower()
        if v != "off" and not (v.isdigit() and int(v) >= 1):
            raise SpecPrefetchError(f"--prefill-chunk {prefill_chunk}: a chunk size (a positive integer) or off")
        chunk = 0 if v == "off" else int(v)
    if read_budget_kib is None:  # the CPU engines measure theirs in the run; the GPU tier has none unless given
        read_budget_kib = "auto" if device == "cpu" else None
    read_budget_kib = budget_or_none(read_budget_kib)
    if read_budget_kib == "auto" and device != "cpu":
        from toolkit.runtime.policy import GPU_AUTO_BUDGET

        raise SpecPrefetchError(GPU_AUTO_BUDGET)
    if pool_mib == "auto" and (engine != "native" or device != "cpu"):
        raise SpecPrefetchError("--pool-mib auto: only with --engine native (the Python reference runner's pool "
                                "has a fixed size; give --pool-mib F)")
    if pool_mib != "auto" and (pool_reserve_mib is not None or pool_low_watermark_mib is not None):
        raise SpecPrefetchError(f"--{'pool-reserve-mib' if pool_reserve_mib is not None else 'pool-low-watermark-mib'}"
                                ": only with --pool-mib auto")
    c = claim(json_out, "run", overwrite, inputs=inputs, siblings=())
    if events_out:
        claim(events_out, "events", overwrite, inputs=inputs, option="--events", siblings=(), beside=(c,))
    if device != "cpu":
        ctx = click.get_current_context()
        ignored = [o for o in ("step_budget_kib", "threads", "io_mode", "max_seq", "prefill_chunk")
                   if ctx.get_parameter_source(o) != click.core.ParameterSource.DEFAULT]
        if ignored:
            raise SpecPrefetchError(f"--device {device}: " + ", ".join(
                "--" + {"io_mode": "io"}.get(o, o).replace("_", "-") for o in ignored)
                + " do not apply to the GPU tier")
        if engine != "python" or abi != "host" or flash_profile or frequency_trace or events_out:
            raise SpecPrefetchError(f"--device {device}: the GPU tier takes a model directory with --store, --adapter, "
                                    "--policy and --pool-mib (drop --engine, --abi, --flash-profile, "
                                    "--frequency-trace, --events)")
        from toolkit.engines import gpu_engine, run as run_engine

        # --queue-depth: prefetch copies issued per layer step at most (default: the pool's free slots);
        # --read-budget-kib: the KiB its copies deliver per layer step (docs/gpu-tier.md, "Scheduler settings")
        eng = gpu_engine(model, device=device, policy=policy, adapter=adapter, store_path=store_path, dtype=dtype,
                         pool_mib=pool_mib, window=window, min_confidence=min_confidence, draft_k=draft_k,
                         next_visit=not no_next_visit, next_visits=next_visits, read_budget_kib=read_budget_kib,
                         reuse_classes=not no_reuse_classes, attention=attention, router=router,
                         copy_depth=None if ctx_default(ctx, "queue_depth") else queue_depth)
        run_engine(eng, list(prompts), max_new_tokens, check=check, json_out=json_out, events_out=None)
        return
    if ctx_default(click.get_current_context(), "draft_k") is False:
        raise SpecPrefetchError("--draft-k: only with --device cuda (the CPU engines' draft predicts, "
                                "it does not decode)")
    if attention is not None or router is not None:
        raise SpecPrefetchError(f"--{'attention' if attention is not None else 'router'}: only with --device cuda "
                                "(the GPU tier's kernels)")
    # a bundle runs with the scheduler settings it was exported with, in both engines, for the options
    # not given here (export.manifest.scheduler_defaults; the native runner reads them itself)
    ctx = click.get_current_context()
    not_given = tuple(k for k in ("window", "queue_depth", "min_confidence", "step_budget_kib") if ctx_default(ctx, k))
    if engine == "native":
        window, queue_depth, min_confidence = (None if k in not_given else v for k, v in (
            ("window", window), ("queue_depth", queue_depth), ("min_confidence", min_confidence)))
        if adapter or store_path or frequency_trace or flash_profile:
            raise SpecPrefetchError("--engine native runs a bundle as exported: drop --adapter, --store, "
                                    "--frequency-trace and --flash-profile")
        from toolkit.engines import native_engine, run as run_engine

        eng = native_engine(Path(model), abi=abi, policy=policy, pool_mib=pool_mib, window=window,
                            queue_depth=queue_depth, min_confidence=min_confidence, step_budget_kib=step_budget_kib,
                            threads=threads, prefill_chunk=chunk, read_budget_kib=read_budget_kib,
                            next_visit=not no_next_visit, next_visits=next_visits,
                            reuse_classes=not no_reuse_classes, pool_auto=(
                                ("--pool-reserve-mib", pool_reserve_mib),
                                ("--pool-low-watermark-mib", pool_low_watermark_mib)), images=list(images))
        run_engine(eng, list(prompts), max_new_tokens, check=check, json_out=json_out, events_out=events_out)
        return
    if abi != "host":
        raise SpecPrefetchError("--abi: only with --engine native")
    from export.manifest import read_manifest
    from export.session import is_bundle, open_session
    from toolkit.bench.common import torch_threads
    from toolkit.engines import python_engine, run as run_engine
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.profiles import load_profile
    from toolkit.runtime.runner import RunConfig

    torch_threads(threads)
    if is_bundle(model):
        head = read_manifest(model)[1]
        if isinstance(head, dict) and head.get("target") == "executorch":
            from export.executorch_target import set_threads

            with quiet_native_stderr():  # ExecuTorch's thread pool probes the CPU and logs it to fd 2
                have = set_threads(threads, strict=False)
            if have != threads:  # only before the first program loads
                click.echo(f"note: ExecuTorch's thread pool stays at its size in this process (programs already "
                           f"loaded), not --threads {threads}", err=True)
    pol = Policy.parse(policy)
    cfg = RunConfig(policy=pol, pool_mib=pool_mib or 8.0, window=window, queue_depth=queue_depth,
                    flash_profile=load_profile(flash_profile, "--flash-profile") if flash_profile else None,
                    io=io_mode, min_confidence=min_confidence, step_budget_kib=step_budget_kib,
                    read_budget_kib=read_budget_kib, prefill_chunk=chunk, next_visit=not no_next_visit,
                    next_visits=next_visits, reuse_classes=not no_reuse_classes)
    s = open_session(model, cfg, adapter=adapter, store=store_path, dtype=dtype, frequency_trace=frequency_trace,
                     max_seq=max_seq, pool_default=pool_mib is None,
                     scheduler_default=(*not_given, "candidate_threshold"))
    s.runner.progress = True  # a prefill progress bar on stderr for long prompts
    run_engine(python_engine(s, pol.name, flash_profile, images=list(images)), list(prompts), max_new_tokens,
               check=check, json_out=json_out, events_out=events_out)


@main.group()
def runner() -> None:
    """The native C++ runner (docs/runner.md)."""


@runner.command(name="build")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--abi", default="host", show_default=True, type=click.Choice(["host", "arm64", "android"]),
              help="this machine; arm64 Linux (cross-built, starts from adb shell); Android with the NDK")
@click.option("--out", type=OUT_DIR, default=None,
              help="output directory [default: the runner cache, ~/.cache/specprefetch/runners]")
@click.option("--force", is_flag=True, help="rebuild even if an up-to-date build is there")
@click.option("--tokenizer/--no-tokenizer", default=None,
              help="build the C++ tokenizer in (text in and out) or leave it out (token ids only) "
                   "[default: what the existing build has; a new build has it]")
@click.option("--overwrite", is_flag=True,
              help="replace a runner build of another configuration at --out (only a runner build)")
@friendly_errors(interrupt="a build in progress is kept in the build directory and the same command continues it")
def runner_build(bundle, abi, out, force, tokenizer, overwrite) -> None:
    """Generate the native runner's CMake project for BUNDLE and build it (CMake + Ninja)."""
    from android_runner.build import build, command, has_tokenizer

    d = build(bundle, abi, out, force=force, tokenizer=tokenizer, **({"overwrite": True} if overwrite else {}))
    click.echo(f"runner: {d / 'bin' / 'specprefetch-runner'} "
               f"({'text in and out' if has_tokenizer(d) else 'token ids only'})")
    if abi == "arm64":
        click.echo(f"on a phone: adb push {d} /data/local/tmp/specprefetch-runner, then run.sh BUNDLE ... there; "
                   f"here: {' '.join(command(d, abi))} BUNDLE ...")


@runner.command(name="bench")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=MIN_TIMED_TOKENS), default=32, show_default=True,
              help=f"tokens per prompt, at least {MIN_TIMED_TOKENS}: the simulator needs two decode tokens to time")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--pool-frac", "pool_fracs", type=FloatList(), default="0.13,0.27", show_default=True,
              help="pools as fractions of all experts")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="ExecuTorch's thread pool for the layer graphs, in both engines")
@click.option("--ablation", is_flag=True,
              help="also the eviction ablation: oracle+lru, oracle+prediction, the predictor+belady and "
                   "on-demand+belady in the same rounds (what prediction and what eviction cost)")
@click.option("--read-budget-kib", type=IntOrAuto(off=True), default="auto", show_default=True,
              help="the streaming runs' read budget (run --read-budget-kib): auto, the runner's default (each run "
                   "measures the flash's rate at its start and each step's compute time as it goes), KiB a step, or "
                   "off; unless off, the predictor's policy also runs without it, in the same rounds")
@click.option("--image", "images", type=click.Path(path_type=Path), multiple=True,
              help="PNG, JPEG or PPM before every bench prompt's text (repeatable): image prompts, a bundle that takes "
                   "images (no simulator comparison then)")
@click.option("--prompt", "prompt_texts", type=Text(), multiple=True,
              help="a bench prompt's text (repeatable; default: --prompts held-out texts of 32 tokens; not with "
                   "--prompts)")
@click.option("--variant", "variants", multiple=True, metavar="KEY=V[,KEY=V]",
              help="also the predictor's policy with these scheduler settings (window, queue_depth, "
                   "candidate_threshold, min_confidence; reuse_classes=off: the whole reuse table, not its frequency "
                   "classes; next_visits=N: at most N of its next-visit heads) instead of the bundle's, in the same "
                   "rounds and simulated (repeatable)")
@json_report
@friendly_errors(interrupt=NOT_WRITTEN)
def runner_bench(bundle, prompts, new_tokens, rounds, pool_fracs, threads, ablation, read_budget_kib, images,
                 prompt_texts, variants, json_out, overwrite) -> None:
    """Measure the native runner: all experts resident (vs the Python runner and the memory floor),
    and streaming from a cold cache at a few pool sizes (interleaved rounds)."""
    if prompt_texts and click.get_current_context().get_parameter_source("prompts") != \
            click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--prompts N picks held-out texts; --prompt gives them: use one of the two")
    c = claim(json_out, "runner bench", overwrite, inputs=(bundle, *images))
    from android_runner.bench import markdown, run as run_native_bench, write

    r = run_native_bench(bundle, prompts=prompts, new_tokens=new_tokens, rounds=rounds, pool_fracs=tuple(pool_fracs),
                         threads=threads, ablation=ablation,
                         read_budget_kib=budget_or_none(read_budget_kib), images=tuple(images),
                         prompt_texts=tuple(prompt_texts), variants=tuple(variants),
                         log=lambda s: click.echo(s, err=True))
    write(r, json_out)
    click.echo(markdown(r))
    click.echo(wrote(c))


@main.group()
def device() -> None:
    """A phone over adb: list devices, push a bundle and its runner, benchmark on it (docs/device.md)."""


@device.command(name="list")
@click.option("--json", "json_out", type=OUT_FILE, default=None, help="also write the list as JSON")
@click.option("--overwrite", is_flag=True, help="replace an existing --json list if this command wrote it")
@friendly_errors(interrupt="nothing was written")
def device_list(json_out, overwrite) -> None:
    """Every attached device: state, SoC, ABI, RAM, free space, CPU clusters, inlinecrypt."""
    if json_out:
        claim(json_out, "device list", overwrite, siblings=())
    from toolkit.device.phone import list_devices, states_table
    from toolkit.reporting import write_json_report

    rows = list_devices()
    click.echo(states_table(rows))
    if json_out:
        write_json_report(json_out, {"devices": rows})


@device.command(name="push")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--serial", default=None, help="the device (adb devices); needed when several are attached")
@friendly_errors(interrupt="the files already on the device stay there; the same command sends only what is "
                           "missing or different")
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
@friendly_errors(interrupt="the stand-in phone stopped")
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
@click.option("--policies", default="on-demand+lru,previous-token+lru,adapter+prediction", show_default=True,
              help="comma-separated PREDICTOR+EVICTION, run interleaved")
@click.option("--pool-mib", type=POOL_MIB, required=True)
@click.option("--prompt", "prompts", type=Text(), multiple=True, required=True, help="repeatable")
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
@click.option("--image", "images", type=click.Path(path_type=Path), multiple=True,
              help="PNG, JPEG or PPM before every prompt's text (repeatable): image prompts, a bundle that takes "
                   "images")
@json_report
@friendly_errors(interrupt=NOT_WRITTEN)
def device_bench(bundle, serial, policies, pool_mib, prompts, max_new_tokens, repeats, threads, fixed_performance,
                 cooldown_timeout, max_temp_c, peer, run_timeout, images, json_out, overwrite) -> None:
    """Benchmark policies on the phone: cold cache, pinned to the big cores, interleaved, with a
    cool-down between runs; pulls every run's JSON and writes a table, a PNG and the JSON."""
    c = claim(json_out, "device bench", overwrite, inputs=(bundle, *images))
    from toolkit.device.phone import bench, markdown
    from toolkit.runtime.policy import parse_policies

    names = [p.name for p in parse_policies(policies, "--policies")]
    r = bench(bundle, serial=serial, policies=names, pool_mib=pool_mib, prompts=list(prompts),
          max_new_tokens=max_new_tokens, repeats=repeats, json_out=json_out, fixed_performance=fixed_performance,
          threads=threads, cooldown_timeout_s=cooldown_timeout, max_temp_c=max_temp_c, peer=peer,
          run_timeout_s=run_timeout, images=list(images),
          log=lambda s: click.echo(s, err=True))
    click.echo(markdown(r))
    click.echo(wrote(c))


@main.group()
def bench() -> None:
    """Measure configurations side by side in one run: interleaved rounds, medians, tokens checked
    before any time is quoted (docs/benchmarks.md). The native runner's own bench is `runner bench`,
    a phone's `device bench`."""


# The report kinds the bench sub-commands claim (toolkit.artifacts.claim_report, the JSON's
# "specprefetch_report" marker): the names they had as modes of one `bench` verb, kept so that a report
# written before the sub-commands (docs/img/*.json among them) is still recognised as this command's
BENCH_KINDS = {"cpu": "bench", "gpu": "bench --device cuda", "llama.cpp": "bench --peer llama.cpp"}


def _show_report(r, json_out, c, write, markdown) -> None:
    """A bench's report written (JSON, table, plot: toolkit.reporting.write_report), its table printed."""
    write(r, json_out)
    click.echo(markdown(r))
    click.echo(wrote(c))


@bench.command(name="cpu", short_help="the Python runner's policies side by side, the simulator beside them")
@click.argument("model", default="embedded")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="prefetch adapter (model directories; needed by the adapter policies)")
@click.option("--policies", default="on-demand+lru,previous-token+lru,next-gate+prediction,adapter+prediction,"
                                    "adapter+lru,oracle+belady",
              show_default=True, help="comma-separated PREDICTOR+EVICTION")
@click.option("--pool-mib", type=POOL_MIB_LIST, default="4,8", show_default=True)
@bench_runs(new_tokens_help=f"tokens per prompt; at least {MIN_TIMED_TOKENS} unless --no-simulate (the simulator "
                            "needs two decode tokens to time)")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="tokens per bench prompt")
@click.option("--window", type=click.IntRange(min=1), default=2, show_default=True, help=WINDOW_HELP)
@click.option("--flash-profile", default=None, help="pace reads to a device profile (emulated flash)")
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None)
@click.option("--no-simulate", is_flag=True, help="skip the simulator comparison")
@click.option("--frequency-trace", type=click.Path(path_type=Path), default=None,
              help="trace whose counts drive the frequency policy, if benchmarked")
@click.option("--image", "images", type=click.Path(path_type=Path), multiple=True,
              help="PNG, JPEG or PPM before every bench prompt's text (repeatable): image prompts, a model or bundle "
                   "that takes images (no simulator comparison then)")
@json_report
@friendly_errors(interrupt=NOT_WRITTEN)
@click.pass_context
def bench_cpu(ctx, model, adapter, policies, pool_mib, prompts, new_tokens, rounds, prompt_tokens, window,
              flash_profile, store_path, no_simulate, frequency_trace, images, json_out, overwrite) -> None:
    """Measure the Python reference runner's policies side by side on MODEL (model directory, `embedded`
    or bundle): interleaved rounds, medians, token equality checked; the simulator beside them."""
    if not no_simulate and new_tokens < MIN_TIMED_TOKENS:
        raise SpecPrefetchError(f"--new-tokens {new_tokens}: the simulator comparison needs at least "
                                f"{MIN_TIMED_TOKENS} (two decode tokens to time); pass more, or --no-simulate")
    c = claim(json_out, BENCH_KINDS["cpu"], overwrite, inputs=(model, adapter, store_path, frequency_trace,
                                                     Path(flash_profile) if flash_profile else None, *images))
    from toolkit.bench import policies as policies_bench
    from toolkit.runtime.policy import parse_policies

    r = policies_bench.run_bench(model=model, adapter=adapter, policies=parse_policies(policies), pools=pool_mib,
                                 prompts=prompts, prompt_tokens=prompt_tokens, new_tokens=new_tokens, rounds=rounds,
                                 flash_profile=flash_profile, window=None if ctx_default(ctx, "window") else window,
                                 store=store_path, simulate=not no_simulate, frequency_trace=frequency_trace,
                                 images=tuple(images))
    _show_report(r, json_out, c, policies_bench.write, policies_bench.markdown)


@bench.command(name="reads", short_help="O_DIRECT reads of a store in its order and in co-activation order, merged")
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--store", "store_path", type=click.Path(path_type=Path), required=True,
              help="expert store of the traced model (`store`, or a bundle's experts.spx): the file read")
@click.option("--pool-frac", "pool_fracs", type=FloatList(FiniteFloat(low=0.0, inclusive=True, high=1.0)),
              default="0,0.13,0.27", show_default=True,
              help="on-demand LRU pools as shares of all experts (comma list; 0: no pool)")
@click.option("--max-sequences", type=click.IntRange(min=1), default=10, show_default=True,
              help="held-out sequences whose decode reads are timed")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="interleaved rounds")
@click.option("--lanes", type=click.IntRange(min=1, max=64), default=5, show_default=True,
              help="read threads (the native runner's at its default queue depth)")
@click.option("--profile", default="snapdragon-8-elite", show_default=True,
              help="device profile whose flash model estimates the same reads")
@json_report
@friendly_errors(interrupt=NOT_WRITTEN)
def bench_reads_cmd(traces, store_path, pool_fracs, max_sequences, rounds, lanes, profile, json_out,
                    overwrite) -> None:
    """Whether a store ordered by co-activation pays: TRACES' held-out decode reads (misses of an
    on-demand LRU pool) timed with O_DIRECT on STORE as one request per expert, merged where adjacent,
    and merged in the co-activation order learnt from the train split (docs/expert-store.md)."""
    c = claim(json_out, "bench reads", overwrite, inputs=(traces, store_path))
    from toolkit.bench.reads import bench_reads, markdown, plot
    from toolkit.reporting import write_report
    from toolkit.runtime.profiles import load_profile

    r = bench_reads(traces, store_path, pool_fracs, max_sequences=max_sequences, rounds=rounds, lanes=lanes,
                    profile=load_profile(profile), progress=lambda m: click.echo(m, err=True))
    _show_report(r, json_out, c, lambda r, p: write_report(r, p, markdown, plot), markdown)


@bench.command(name="gpu", short_help="the GPU tier's policies side by side, pools as fractions of the experts")
@click.argument("model", default="embedded")
@click.option("--device", default="cuda", show_default=True, callback=lambda c, p, v: cuda_device(v, p),
              help="cuda or cuda:N: the GPU the tier runs on (experts in pinned host memory, the pool in its memory)")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="prefetch adapter (needed by the adapter policies)")
@click.option("--policies", default=None,
              help="comma-separated PREDICTOR+EVICTION [default: on-demand+lru,next-gate+prediction, "
                   "adapter+prediction with --adapter, draft+prediction,oracle+belady]")
@click.option("--pool-fractions", type=FloatList(), default="0.1,0.25,0.5", show_default=True,
              help="pool sizes as fractions of all experts")
@bench_runs()
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="tokens per bench prompt")
@click.option("--window", type=click.IntRange(min=1), default=2, show_default=True, help=WINDOW_HELP)
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None)
@click.option("--draft-k", default="2,4,6,8,12", show_default=True,
              help="the draft's K values the profiling pass tries")
@click.option("--decode", "decode", type=click.Choice(["graph", "static", "modules"]), default=None,
              help="the decode path (default graph where the family allows; docs/gpu-tier.md)")
@click.option("--experts", "experts", type=click.Choice(["fused", "eager"]), default=None,
              help="the static decoder's expert math: fused (slots read in place by one grouped GEMV; the "
                   "default with graph on fp16) or eager (gathered, transformers' loop)")
@click.option("--attention", "attention", type=click.Choice(["fused", "sdpa"]), default=None,
              help="the static decoder's one-position attention: fused (the input norm and q/k/v GEMV, then norms, "
                   "rotary, cache write and attention, as Triton kernels; fp16; the default with graph where they "
                   "cover the model) or sdpa (the model's norms and rotary, torch's scaled_dot_product_attention)")
@click.option("--router", "router", type=click.Choice(["fused", "model"]), default=None,
              help="the static decoder's one-position routing: fused (residual add, norm, router, softmax and top-k "
                   "in one kernel a MoE layer; fp16; the default with graph, as --attention) or model (the model's "
                   "norm and router)")
@click.option("--verify", type=click.Choice(["exact", "batched"]), default="exact", show_default=True,
              help="the draft's verification: exact (the target's one-token step per position: the model's own "
                   "tokens) or batched (one pass over all K + 1 rows: tokens equal up to near-ties)")
@click.option("--report-mismatches", is_flag=True,
              help="write the figures even when some run's tokens differ from transformers' (marked so; for "
                   "diagnosis only)")
@click.option("--profile-resident", is_flag=True,
              help="also profile an all-resident decode token: its kernels, how many and their device time "
                   "(the report's resident_profile)")
@click.option("--compile", "compile_backend", type=click.Choice(["inductor", "aot_eager"]), default=None,
              help="the static decoder's one-token step (each segment, the resident token, the draft's step) "
                   "through torch.compile with this backend (inductor: fused Triton kernels inside the graphs; "
                   "docs/gpu-tier.md)")
@click.option("--variant", "variants", multiple=True, metavar="KEY=V[,KEY=V]",
              help="also each predicting policy with these scheduler settings (window, queue_depth: prefetch copies "
                   "issued per layer step, candidate_threshold, min_confidence, read_budget_kib: KiB copied per layer "
                   "step, at least one expert, or auto: the measured copy rate times a layer's resident step; "
                   "reuse_classes=off: +reuse policies with the whole reuse table; host=native: every policy with "
                   "the native runner's scheduler and pool, the same decisions off Python; plan=host: the "
                   "planner's rows folded on the host from the router's input, not on the device: the same "
                   "decisions up to rounding at near-ties; plan=inline: on the device but on the compute stream, "
                   "before each layer's sync; launch=torch: every policy with torch's CUDA calls on the per-layer "
                   "path, not the driver's), in the same rounds (repeatable)")
@json_report
@friendly_errors(interrupt=NOT_WRITTEN)
def bench_gpu(model, device, adapter, policies, pool_fractions, prompts, new_tokens, rounds, prompt_tokens, window,
              store_path, draft_k, decode, experts, attention, router, verify, report_mismatches, profile_resident,
              compile_backend, variants, json_out, overwrite) -> None:
    """Measure the GPU tier's policies side by side on MODEL (a model directory or `embedded`): pools as
    fractions of the experts, the all-resident bound and transformers' generate beside them, the
    draft's K profiled per pool; tokens checked against transformers' (docs/gpu-tier.md)."""
    if any(not 0 < f <= 1 for f in pool_fractions):
        raise SpecPrefetchError(f"--pool-fractions: fractions in (0, 1], not {pool_fractions}")
    ks = int_tuple(draft_k, "--draft-k")
    if not ks or min(ks) < 1:
        raise SpecPrefetchError(f"--draft-k {draft_k!r}: comma-separated draft lengths >= 1")
    from toolkit.runtime.policy import GPU_VARIANT_KEYS, parse_variants

    parse_variants(variants, GPU_VARIANT_KEYS)   # a bad --variant refused before anything is claimed
    c = claim(json_out, BENCH_KINDS["gpu"], overwrite, inputs=(model, adapter, store_path))
    from toolkit.runtime import gpu_bench
    from toolkit.runtime.policy import parse_policies

    if policies is None:
        policies = "on-demand+lru,next-gate+prediction," + ("adapter+prediction," if adapter else "") \
            + "draft+prediction,oracle+belady"
    r = gpu_bench.run_gpu_bench(model, store=store_path, adapter=adapter, policies=parse_policies(policies),
                                fractions=pool_fractions, prompts=prompts, new_tokens=new_tokens, repeats=rounds,
                                ks=ks, device=device, window=window, prompt_tokens=prompt_tokens, decode=decode,
                                experts=experts, attention=attention, router=router, verify=verify,
                                strict=not report_mismatches,
                                profile=profile_resident, compile=compile_backend, variants=tuple(variants),
                                log=lambda m: click.echo(m, err=True))
    _show_report(r, json_out, c, gpu_bench.write, gpu_bench.markdown)


@bench.command(name="llama.cpp", short_help="llama.cpp and the native runner under the same memory limits")
@click.argument("bundles", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="BUNDLE...")
@click.option("--limits", default="1,0.75,0.5,0.25,none", show_default=True,
              help="memory limits as fractions of the model's f16 GGUF bytes; none: no limit")
@bench_runs()
@click.option("--prompt-tokens", default="64", show_default=True,
              help="comma-separated prompt lengths, e.g. 128,512")
@click.option("--threads", "threads", default="1,2", show_default=True,
              help="compute threads of both engines, each a set of rows, e.g. 1,2")
@click.option("--no-readaround-off", is_flag=True, help="skip the llama.cpp read-around-off rows")
@click.option("--no-llama-bench", is_flag=True, help="skip llama-bench at no limit")
@click.option("--llama-repack", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="llama.cpp's CPU weight repacking (auto: with no limit only; it doubles its memory)")
@click.option("--timeout", type=FiniteFloat(), default=600.0, show_default=True,
              help="seconds one run may take (a run past it is recorded as a timeout)")
@json_report
@friendly_errors(interrupt=NOT_WRITTEN)
def bench_llama_cpp(bundles, limits, prompts, new_tokens, rounds, prompt_tokens, threads, no_readaround_off,
                    no_llama_bench, llama_repack, timeout, json_out, overwrite) -> None:
    """llama.cpp and the native runner side by side on each BUNDLE (an ExecuTorch bundle whose source
    checkpoint is on this machine) under the same cgroup memory limits, cold cache, same threads
    (docs/benchmarks.md section 8)."""
    from toolkit.peers import sidebyside

    # checked before the claim and any work
    lengths = sidebyside.parse_ints(prompt_tokens, "--prompt-tokens")
    fracs = sidebyside.parse_limits(limits)
    thread_counts = sidebyside.parse_ints(threads, "--threads")
    c = claim(json_out, BENCH_KINDS["llama.cpp"], overwrite, inputs=(list(bundles),))
    r = sidebyside.run(list(bundles), limits=fracs, prompts=prompts, prompt_tokens=lengths, new_tokens=new_tokens,
                       rounds=rounds, threads=thread_counts, timeout_s=timeout, readaround_off=not no_readaround_off,
                       llama_bench=not no_llama_bench, repack=llama_repack, log=lambda s: click.echo(s, err=True))
    _show_report(r, json_out, c, sidebyside.write, sidebyside.markdown)
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
              help="dense graphs: executorch fp32|8da8w|8da4w|w8|w4 (default fp32); "
                   "qnn / qai-hub fp16|a16w8|a8w8 (default fp16)")
@click.option("--experts", "experts_dtype", type=click.Choice(["fp16", "int8", "int4"]), default="fp16",
              show_default=True, help="expert store precision")
@click.option("--max-seq", type=click.IntRange(min=2), default=256, show_default=True,
              help="KV cache length (prompt + generated tokens)")
@click.option("--pool-mib", type=POOL_MIB, default=None, help="default DRAM pool budget (default: 1/4 of the experts)")
@click.option("--window", type=click.IntRange(1, 4), default=2, show_default=True,
              help="the bundle's default " + WINDOW_HELP.replace("1..the model's MoE layers", "1..4"))
@click.option("--calibration", type=TextFile(), default=None,
              help="calibration / parity prompts (.jsonl or .txt; default: the embedded held-out text)")
@click.option("--parity-prompts", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(min=2), default=12, show_default=True, help="parity prompt length")
@click.option("--decode-tokens", type=click.IntRange(min=1), default=8, show_default=True,
              help="greedy tokens per parity prompt")
@click.option("--tolerance", multiple=True, help="override a parity bound, KEY=VALUE (repeatable)")
@click.option("--qnn-path", type=click.Choice(["ort", "executorch"]), default="ort", show_default=True,
              help="qnn: onnxruntime-qnn, or ExecuTorch's Qualcomm backend (needs QAIRT at QNN_SDK_ROOT)")
@click.option("--hub-device", default="Snapdragon 8 Elite QRD", show_default=True, help="qai-hub device")
@click.option("--hub-timeout", type=FiniteFloat(), default=15.0, show_default=True,
              help="qai-hub: seconds before giving up on the service")
@click.option("--hub-profile/--no-hub-profile", default=True, show_default=True,
              help="qai-hub: also profile every graph on the device")
@click.option("--image-size", type=ImageSize(), default=None,
              help="vision-language models: every image is resized to HEIGHTxWIDTH (multiples of patch x merge) "
                   "for the bundle's vision method [default: the largest square up to 448 the processor keeps]")
@click.option("--out", required=True, type=OUT_DIR, help="bundle directory to write")
@click.option("--overwrite", is_flag=True,
              help="replace an existing bundle at --out (only once the new one is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def export_cmd(model, adapter, target, soc, quant, experts_dtype, max_seq, pool_mib, window, calibration,
               parity_prompts, prompt_tokens, decode_tokens, tolerance, qnn_path, hub_device, hub_timeout, hub_profile,
               image_size, out, overwrite) -> None:
    """Export MODEL as a phone-ready bundle: dense step graphs for the target, the expert store,
    the adapter, and a parity report. The bundle is refused if parity is past tolerance."""
    from export.bundle import ExportConfig, export_bundle

    cfg = ExportConfig(target=target, quant=quant, experts=experts_dtype, soc=soc, max_seq=max_seq,
                       pool_mib=pool_mib, window=window, calibration=calibration, parity_prompts=parity_prompts,
                       prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                       tolerance=_tolerances(tolerance), qnn_path=qnn_path, hub_device=hub_device,
                       hub_timeout_s=hub_timeout, hub_profile=hub_profile, image_size=image_size)
    m = export_bundle(model, out, cfg, adapter=adapter, overwrite=overwrite)
    click.echo((out / "parity.md").read_text())
    total = sum(f["size"] for f in m["files"].values())
    click.echo(f"wrote {out}: {m['target']} ({m['quantization']['dense']}), {len(m['files'])} files, "
               f"{total / 2**20:.1f} MiB, in {m['timings_s']['total_s']:.0f} s")


@main.command(name="inspect")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a summary")
@friendly_errors(interrupt="nothing was written")
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
    num = lambda key, spec: fmt(p[key], spec) if isinstance(p.get(key), (int, float)) else "n/a"  # noqa: E731
    click.echo(f"  parity     {'passed' if p.get('passed') else 'NOT passed'}: max |logit diff| "
               f"{num('max_abs_logit_diff', '.3g')}, top-k agreement {num('topk_agreement', '.4f')}, "
               f"next-token agreement {num('next_token_agreement', '.4f')}")
    click.echo(f"  files      {s['files']} files, {s['bytes'] / 2**20:.2f} MiB: "
               + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(s["sizes"].items())))
    click.echo(f"  graphs     {len(s['graphs'])} checked: " + ", ".join(sorted(s["graphs"])))
    for n in s["notes"]:
        click.echo(f"  note       {n}")


@main.command()
@click.argument("family")
@click.option("--out", required=True, type=OUT_DIR, help="model directory to write")
@click.option("--seed", default=0, show_default=True)
@click.option("--set", "sets", multiple=True,
              help="KEY=VALUE: a config attribute (VALUE as JSON, e.g. hidden_size=768, mlp_only_layers=[]; a "
                   "sub-config's as text_config.num_local_experts=32); repeatable, for a larger random model")
@click.option("--overwrite", is_flag=True, help="replace a model directory at --out (once the new one is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def tiny(family: str, out: Path, seed: int, sets: tuple[str, ...], overwrite: bool) -> None:
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
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" of a few MiB is not the user's business
    click.echo(f"wrote {build_tiny(family, out, seed=seed, overrides=overrides, overwrite=overwrite)}")


@main.command()
@click.argument("model", default="embedded")
@click.option("--moe-intermediate-size", "width", required=True, type=click.IntRange(min=1),
              help="the routed experts' new width (units of the intermediate axis); larger than today's")
@click.option("--out", required=True, type=OUT_DIR, help="model directory to write")
@click.option("--seed", default=0, show_default=True, help="seed of the added units' gate/up rows")
@click.option("--overwrite", is_flag=True,
              help="replace a checkpoint widen wrote at --out (only once the new one is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def widen(model, width, out, seed, overwrite) -> None:
    """Write MODEL with routed experts --moe-intermediate-size wide that compute exactly what
    MODEL's compute (added units: ordinary gate/up rows, zero down-projection columns), for
    studying larger experts on the same routing (docs/widen.md). Streams shard by shard.

    MODEL is a checkpoint directory, `embedded`, `phone` or `embedded-vl`; every supported family's
    experts are gated MLPs."""
    from toolkit.models.widen import widen_checkpoint

    s = widen_checkpoint(model, out, width, overwrite=overwrite, seed=seed, progress=True)
    fp16 = s["bytes_per_expert_fp16"]
    click.echo(f"wrote {s['out']}: {s['family']} experts {s['moe_intermediate_size']['from']} -> "
               f"{s['moe_intermediate_size']['to']} wide ({s['experts']} routed experts, {fp16['from']:,} -> "
               f"{fp16['to']:,} B each in fp16), {len(s['shards'])} shard(s), {s['bytes'] / 2**20:,.1f} MiB; "
               f"widened from {s['source']} (config hash {s['config_hash']['source']})")


if __name__ == "__main__":
    main()
