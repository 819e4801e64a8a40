"""`specprefetch bench cpu`: the reference runner's policies measured side by side, and the simulator
checked against them, in one run (docs/benchmarks.md).

For each pool size, every policy runs every prompt, in an order shuffled per round (A B C, C A B,
...), after a warm-up; per policy the median over rounds and prompts of TPOT, stall, hit rate and
MiB read is reported, with the ratios on-demand / policy and policy / oracle. Before any time is
quoted, every run's tokens are checked against the unmodified model. The same prompts are traced
and replayed through the simulator with the calibrated `this-machine` profile, so measured and
simulated TPOT can be compared per policy.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.bench.common import bench_prompts, medians, simulate_same_prompts, torch_threads
from toolkit.errors import SpecPrefetchError
from toolkit.reporting import figure, save_figure, write_report
from toolkit.runtime.policy import Policy


def run_bench(*, model: str = "embedded", adapter: Path | None, policies: list[Policy], pools: list[float],
              frequency_trace: Path | None = None,
              prompts: int = 4, prompt_tokens: int = 64, new_tokens: int = 48, rounds: int = 3,
              flash_profile: str | None = None, window: int | None = None, store: Path | None = None,
              simulate: bool = True, threads: int = 1, progress: bool = True,
              images: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Every policy x pool over the same prompts through the reference runner, interleaved; `images`: the
    same images before every prompt's text (image prompts; the simulator, which replays text, is left out)."""
    from export.session import open_session, reference_tokens
    from toolkit.runtime.profiles import load_profile
    from toolkit.runtime.runner import RunConfig

    torch_threads(threads)
    cfg = RunConfig(policy=policies[0], pool_mib=max(pools), window=window or 2,
                    flash_profile=load_profile(flash_profile) if flash_profile else None)
    # a bundle: its exported scheduler settings, as `run` (the window only when not given: None)
    s = open_session(model, cfg, predictors=[p.predictor for p in policies], adapter=adapter, store=store,
                     frequency_trace=frequency_trace, progress=progress,
                     scheduler_default=(*(("window",) if window is None else ()),
                                        "queue_depth", "min_confidence", "candidate_threshold", "step_budget_kib"))
    window = s.runner.cfg.window
    texts = bench_prompts(prompts, prompt_tokens, s.tokenizer)
    ids = text_ids = [s.encode(t) for t in texts]
    ips = [None] * len(ids)
    if images:  # image prompts: the images through the tower once, before every prompt's text
        enc = s.encode_images(list(images))
        ips = [s.image_prompt(list(images), p, encoded=enc) for p in ids]
        ids = [ip.ids for ip in ips]
    # the future oracle and Belady read
    recorded = [s.runner.record(p, new_tokens, images=ip) for p, ip in zip(ids, ips)]
    checked = False
    if s.kind == "model" and s.runner.store.dtype == "fp16" and s.source_model is not None:  # no hashing for a bundle
        for p, rec in zip(ids, recorded):
            want = reference_tokens(s.source_model, p, new_tokens, images=list(images), vision=s.vision)
            if rec.tokens != want:
                raise SpecPrefetchError("bench: the runner's tokens differ from the unmodified model's: a bug")
        checked = True
    results: dict[str, Any] = {"model": s.label, "flash_profile": flash_profile, "direct_io": None,
                               "rounds": rounds, "prompts": texts, "new_tokens": new_tokens, "window": window,
                               "threads": threads, "checked_against_unmodified_model": checked,
                               "store_dtype": s.runner.store.dtype, "points": [],
                               **({"images": [str(x) for x in images], "image_tokens_per_prompt":
                                   len(ids[0]) - len(text_ids[0])} if images else {})}
    for pool in pools:
        samples: dict[str, list[dict]] = {p.name: [] for p in policies}
        for rnd in range(rounds + 1):  # round 0 is the warm-up
            order = policies[:]
            random.Random(rnd).shuffle(order)
            for pol in order:
                s.runner.configure(policy=pol, pool_mib=pool)
                for p, rec, ip in zip(ids, recorded, ips):
                    g = s.runner.run(p, new_tokens, recorded=rec, images=ip)
                    if g.tokens != rec.tokens:
                        raise SpecPrefetchError(f"bench: {pol.name} changed the output for a prompt: a bug")
                    if g.stats.peak_pool_bytes > g.stats.budget_bytes:
                        raise SpecPrefetchError(f"bench: {pol.name} exceeded the pool budget: a bug")
                    results["direct_io"] = g.direct_io
                    if rnd > 0:
                        samples[pol.name].append(g.stats.to_json())
        point: dict[str, Any] = {"pool_mib": pool, "policies": {}}
        for pol, rs in samples.items():
            point["policies"][pol] = medians(rs, MEDIAN_KEYS)
            point["policies"][pol]["runs"] = len(rs)
        results["points"].append(point)
    if simulate and images:
        results["simulated_skipped"] = "the simulator replays text prompts; these are image prompts"
    elif simulate and s.source_model is not None and s.kind == "model":
        results["simulated"] = simulate_same_prompts(s.source_model, texts, adapter, policies, pools, new_tokens,
                                                     window, store)
    elif simulate:
        results["simulated_skipped"] = "the simulator replays traces of a model directory; a bundle has none"
    return results


MEDIAN_KEYS = ("tpot_ms", "tpot_p95_ms", "ttft_ms", "stall_ms_per_token", "hit_rate", "mib_read_per_token",
               "prefetch_precision", "prefetch_recall", "wasted_prefetch_mib")


def markdown(r: dict[str, Any]) -> str:
    flash = f"emulated `{r['flash_profile']}` flash (paced real reads)" if r["flash_profile"] else \
        "real O_DIRECT reads" if r["direct_io"] else "buffered reads (O_DIRECT unsupported here)"
    imgs = (f" (each after {len(r['images'])} image(s), {r['image_tokens_per_prompt']} image tokens)"
            if r.get("images") else "")
    lines = [f"{len(r['prompts'])} prompts{imgs} x {r['new_tokens']} tokens, {r['rounds']} interleaved rounds after a "
             f"warm-up, {flash}, window {r['window']}, {r['threads']} compute thread(s); medians.", "",
             "| pool MiB | policy | TPOT ms | p95 ms | stall ms/token | hit rate | MiB read/token | "
             "on-demand / policy | policy / oracle | simulated TPOT ms | sim / measured |",
             "|" + "---|" * 11]
    sims = {p["pool_mib"]: p["policies"] for p in r.get("simulated", {}).get("points", [])}
    for p in r["points"]:
        pol = p["policies"]
        base = next((v["tpot_ms"] for k, v in pol.items() if k.startswith("on-demand")), None)
        orc = next((v["tpot_ms"] for k, v in pol.items() if k.startswith("oracle")), None)
        for name, v in pol.items():
            s = sims.get(p["pool_mib"], {}).get(name)
            lines.append(f"| {p['pool_mib']:g} | {name} | {v['tpot_ms']:.2f} | {v['tpot_p95_ms']:.2f} | "
                         f"{v['stall_ms_per_token']:.2f} | {v['hit_rate']:.3f} | {v['mib_read_per_token']:.3f} | "
                         + (f"{base / v['tpot_ms']:.3f}" if base else "-") + " | "
                         + (f"{v['tpot_ms'] / orc:.3f}" if orc else "-") + " | "
                         + (f"{s['tpot_ms']:.2f} | {s['tpot_ms'] / v['tpot_ms']:.2f}" if s else "- | -") + " |")
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    pols = list(r["points"][0]["policies"])
    fig, ax = figure((8, 4))
    width = 0.8 / (2 * len(r["points"]))
    sims = {p["pool_mib"]: p["policies"] for p in r.get("simulated", {}).get("points", [])}
    for n, p in enumerate(r["points"]):
        xs = np.arange(len(pols)) + n * 2 * width
        ax.bar(xs, [p["policies"][q]["tpot_ms"] for q in pols], width, label=f"measured, {p['pool_mib']:g} MiB")
        if p["pool_mib"] in sims:
            ax.bar(xs + width, [sims[p["pool_mib"]][q]["tpot_ms"] for q in pols], width, alpha=0.6,
                   label=f"simulated, {p['pool_mib']:g} MiB")
    ax.set_xticks(np.arange(len(pols)) + width * (len(r["points"]) - 0.5), pols, rotation=20, fontsize=8)
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("reference runner: measured vs simulated TPOT")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


def write(r: dict[str, Any], json_path: Path) -> tuple[Path, Path]:
    """json_path, and its .md (the table) and .png (the plot) beside it (toolkit.reporting.write_report)."""
    return write_report(r, json_path, markdown, plot)
