"""`specprefetch runner bench BUNDLE`: the native runner measured side by side (docs/benchmarks.md).

Two parts, each in one run with interleaved rounds so that drift hits every configuration alike:

1. A pool of every expert: the native runner and the Python reference runner on the same bundle,
   each reading an expert on its first use (the same work), then the native runner with every
   expert read before the run (--preload: all resident), and the floor: the bytes one decode token
   touches (the program's dense weights and the top-k experts of every MoE layer) over this machine's
   memory read bandwidth, measured here.
2. Streaming: real O_DIRECT reads from a cold page cache (the runner evicts its store's pages),
   pools of a fraction of the experts, on-demand LRU / the bundle's predictor / the oracle.
3. The simulator recalibrated against the native runner (`calibrate_native`) replaying the same
   prompts at the same pools: simulated / measured TPOT per policy.

Tokens, checked on every run: each policy at each pool must give, prompt for prompt, the tokens of
the same bundle with every expert resident (the --preload run of part 1): `tokens_match_resident`.
That is the whole promise for a quantised bundle (dense 8da4w/8da8w/w8/w4, or int8/int4 experts),
whose tokens need not be the fp32 checkpoint's; an fp32 bundle (fp32 dense, fp16 experts) also keeps
the Python engine's tokens (`tokens_match_python`, native against the Python reference runner).
`tokens_match` is the bundle's guarantee: resident for a quantised bundle, both for an fp32 one.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from android_runner.build import build
from android_runner.build import run_native as _run_native
from toolkit.artifacts import read_json
from toolkit.errors import SpecPrefetchError
from toolkit.bench.common import medians
from toolkit.runtime.policy import VARIANT_TAG, parse_variants
from toolkit.runtime.profiles import check_budget_kib
from toolkit.metrics import median, median_low
from toolkit.reporting import figure, save_figure, write_report

MiB = 2**20


def memory_read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second this machine reads from DRAM (numpy sum over an array larger than caches; best of n)."""
    a = np.ones(mib * MiB // 8, dtype=np.float64)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def _pooled(runs: list[dict]) -> dict:
    """One RunStats-like dict over several runs: per-token figures weighted by decode tokens,
    counts summed, per-call timings as medians (what runtime_profile reads)."""
    dec = [max(1, r.get("decode_tokens") or len(r["tokens"]) - 1) for r in runs]
    n = sum(dec)

    def per_token(key: str) -> float:
        return sum(r[key] * d for r, d in zip(runs, dec)) / n

    return {"tpot_ms": per_token("tpot_ms"), "stall_ms_per_token": per_token("stall_ms_per_token"),
            "mib_read_per_token": per_token("mib_read_per_token"), "decode_tokens": n,
            "counts": {"misses": sum(r["counts"]["misses"] for r in runs)},
            "expert_ms_per_call": median([r["expert_ms_per_call"] for r in runs], ndigits=None),
            "plan_ms_per_layer": median([r["plan_ms_per_layer"] for r in runs], ndigits=None),
            "direct_io": all(r["direct_io"] for r in runs),
            # the pool the runs had, where they all had one (runtime_profile records the oracle run's)
            **({"budget_bytes": b.pop()} if len(b := {r.get("budget_bytes") for r in runs}) == 1 and None not in b
               else {})}


def calibrate_native(bundle: Path, prompts: list[list[int]], *, all_mib: float, tokens: int = 32,
                     reads: int = 200, repeats: int = 2, threads: int = 1, oracle_runs: list[dict] | None = None):
    """A device profile of this machine as the native runner sees it (the simulator's inputs): the
    store's O_DIRECT read table, and the runner's own compute: dense time per layer, expert kernel
    time, planning time, what a demand miss, a read and a streaming token cost it. Each figure is pooled
    over every prompt, `repeats` times (the configurations interleaved). `oracle_runs`: perfect-prefetch
    runs (oracle + Belady, these prompts and tokens; runner bench's own at its smallest pool) already
    made, interleaved with the runs the profile is compared with, so the flash rate is the one those runs
    saw: used instead of running them here at flash_pool_mib (their number is `measured.oracle_runs`)."""
    from toolkit.runtime.expert_store import ExpertStore
    from toolkit.simulate.calibrate import flash_pool_mib, measure_flash, runtime_profile, tiny_pool_mib

    m = read_json(Path(bundle) / "manifest.json", "bundle manifest")
    st = ExpertStore(Path(bundle) / m["runtime"]["expert_store"])
    L, k = st.num_layers, m["routing"]["top_k"]
    flash = measure_flash(st, reads)
    tiny = tiny_pool_mib(k, st.slot_bytes)
    runner = build(bundle, "host")
    configs = {"resident": ("on-demand+lru", all_mib, ["--preload"], False),
               "plan": ("oracle+lru", all_mib, ["--preload"], False),
               "on_demand": ("on-demand+lru", tiny, [], True),
               "oracle": ("oracle+belady", flash_pool_mib(L, k, st.slot_bytes), [], True)}
    if oracle_runs:
        del configs["oracle"]
    got: dict[str, list[dict]] = {c: [] for c in configs}
    if oracle_runs:
        got["oracle"] = list(oracle_runs)
    _run_native(bundle, prompts[:1], max_new_tokens=tokens, policy="on-demand+lru", pool_mib=all_mib,
                threads=threads, extra=["--preload"], runner=runner)  # warm-up
    for _ in range(repeats):
        for c, (policy, pool, extra, cold) in configs.items():
            got[c] += _run_native(bundle, prompts, max_new_tokens=tokens, policy=policy, pool_mib=pool, cold=cold,
                                  threads=threads, extra=extra, runner=runner)["runs"]
    res = {c: _pooled(runs) for c, runs in got.items()}
    return runtime_profile(
        "this-machine-native", f"the native runner on {os.uname().nodename} with {st.path.name}", flash=flash,
        L=L, k=k, slot_bytes=st.slot_bytes, all_resident=res["resident"],
        expert_ms=res["resident"]["expert_ms_per_call"], plan_ms=res["plan"]["plan_ms_per_layer"],
        on_demand=res["on_demand"], oracle=res["oracle"],
        measured={"direct_io": res["resident"]["direct_io"], "reads_per_point": reads, "prompts": len(prompts),
                  "repeats": repeats, "oracle_runs": len(got["oracle"])},
        source="specprefetch runner bench (android_runner/bench.py: calibrate_native)")


# the row of the predictor's policy without the streaming rows' read budget: "<policy> read-budget=off"
NO_READ_BUDGET_TAG = " read-budget=off"
# a row of the predictor's reuse policy without the adapter's next-visit heads (run --no-next-visit),
# where the bundle has them
NO_NEXT_VISIT_TAG = " next-visit=off"

# runner bench --ablation: every predictor of the report with the other evictions, so that the gap to the
# oracle splits into prediction (oracle+lru, oracle+prediction against oracle+belady) and eviction (the
# predictor with Belady's eviction, which knows the real future; on-demand+belady: eviction alone)
ABLATION_POLICIES = ("oracle+lru", "oracle+prediction", "{graph}+belady", "on-demand+belady")


def is_quantised(manifest: dict) -> bool:
    """Dense graphs quantised (8da4w, 8da8w, w8, w4) or experts stored in int8 / int4."""
    q = manifest.get("quantization") or {}
    return q.get("dense", "fp32") != "fp32" or q.get("experts") in ("int8", "int4")


def token_check(results: list[dict], reference: list[list[int]]) -> dict[str, Any]:
    """Whether every run of `results` (run_native outputs over the same prompts as `reference`) gave the
    reference's tokens, prompt for prompt: {"match": bool, "runs": n, "mismatches": [{"prompt", "at"}...]}."""
    bad, n = [], 0
    for res in results:
        for i, (run, ref) in enumerate(zip(res["runs"], reference)):
            n += 1
            got = list(run["tokens"])
            if got != list(ref):
                at = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                bad.append({"prompt": i, "at": at, "got": len(got), "want": len(ref)})
        if len(res["runs"]) != len(reference):
            bad.append({"prompt": None, "at": None, "got": len(res["runs"]), "want": len(reference)})
    return {"match": not bad, "runs": n, "mismatches": bad[:8]}


def run(bundle: Path, *, prompts: int = 4, prompt_tokens: int = 32, new_tokens: int = 32, rounds: int = 3,
        pool_fracs: tuple[float, ...] = (0.13, 0.27), threads: int = 1, ablation: bool = False,
        read_budget_kib: int | str | None = "auto", images: tuple[Path, ...] = (), prompt_texts: tuple[str, ...] = (),
        variants: tuple[str, ...] = (), log: Callable[[str], None] = print) -> dict[str, Any]:
    """The native runner against the Python reference runner and the memory floor, then its policies
    streaming from flash, then the simulator recalibrated against it. Both engines run the layer
    graphs on an ExecuTorch thread pool of `threads` (one: a decode step's matrices are too small
    to gain from more on this machine; docs/benchmarks.md). ablation: also the eviction ablation
    (ABLATION_POLICIES: each predictor with the other eviction, in the same interleaved rounds), which
    separates what prediction and what eviction cost against the oracle. read_budget_kib: the streaming
    runs' read budget (`run --read-budget-kib`): "auto" (the runner's default: each run measures the
    flash's rate at start-up and each step's compute time as it goes), KiB a step, or None (off); unless
    off, the predictor's policy also runs without it (a row of its own, `<policy> read-budget=off`), and
    each row is simulated with the budget its runs had (their decode steps' median). images: every
    prompt gets these images before its text (a bundle that takes images; both engines run the image
    prompt; the simulator, which replays text, is left out). prompt_texts: the prompts' texts (then
    `prompts` and `prompt_tokens` do not apply); default: held-out texts. variants: also the predictor's
    policy with these scheduler settings (`parse_variants`: window, queue_depth, candidate_threshold,
    min_confidence instead of the bundle's; reuse_classes=off: the whole reuse table, not its frequency
    classes), each a row of its own in the same rounds, simulated too."""
    from transformers import AutoTokenizer

    from export.executorch_target import set_threads
    from export.manifest import manifest_next_visits, validate_bundle
    from export.session import open_session
    from toolkit.bench.common import bench_prompts, torch_threads
    from toolkit.runtime.expert_store import ExpertStore
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.runner import RunConfig

    knobs = parse_variants(variants)   # checked before anything runs
    m, _ = validate_bundle(bundle, hash_store=False)
    if m.get("target") != "executorch":
        raise SpecPrefetchError(f"{bundle}: runner bench measures executorch bundles; a {m.get('target')} bundle's "
                                "graphs run on the HTP simulator here, whose times are not a phone's (run it with "
                                "`specprefetch run BUNDLE --engine native`)")
    tok = AutoTokenizer.from_pretrained(str(Path(bundle) / Path(m["model"]["config"]).parent), local_files_only=True)
    texts = list(prompt_texts) or bench_prompts(prompts, prompt_tokens, tok)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    for t, x in zip(texts, ids):
        if not x:
            raise SpecPrefetchError(f"--prompt {json.dumps(t)[:60]}: no tokens")
    store = ExpertStore(Path(bundle) / m["runtime"]["expert_store"])
    check_budget_kib(read_budget_kib, store.slot_bytes, "--read-budget-kib")
    L, E, k = store.num_layers, store.num_experts, m["routing"]["top_k"]
    heads = manifest_next_visits(m, Path(bundle) / "manifest.json")   # the bundle's next-visit heads
    for label, v in knobs.items():   # the runners' window looks one token ahead at most
        if v.get("window", 1) > L:
            raise SpecPrefetchError(f"--variant {label}: window must be 1..{L} (the bundle's MoE layers)")
        if "reuse_classes" in v:
            if m["predictor"].get("reuse") is None:
                raise SpecPrefetchError(f"--variant {label}: the bundle has no reuse table (exported without an "
                                        "adapter, or with one trained before it)")
            if m["predictor"]["reuse"].get("classes") is None:
                raise SpecPrefetchError(f"--variant {label}: the bundle's reuse table has no frequency classes "
                                        "(an adapter trained with --reuse-classes 1, or before them)")
        if "next_visits" in v and not (m["predictor"].get("reuse") is not None and v["next_visits"] < heads):
            raise SpecPrefetchError(f"--variant {label}: next_visits must be below the bundle's {heads} next-visit "
                                    "heads (read by its reuse eviction)")
    queue_depth = m["runtime"]["scheduler"].get("queue_depth", 4)  # the native runs' (the manifest's)
    all_mib = L * E * store.slot_bytes / MiB + 0.01
    graph = m["predictor"]["kind"] if m["predictor"].get("preds_rows") else "next-gate"
    quantised = is_quantised(m)
    out: dict[str, Any] = {"bundle": str(bundle), "prompts": texts, "new_tokens": new_tokens, "rounds": rounds,
                           "experts": L * E, "slot_bytes": store.slot_bytes, "threads": threads,
                           "quantization": m.get("quantization"), "quantised": quantised,
                           "token_reference": "resident" if quantised else "resident and python"}
    set_threads(threads)  # the Python engine's ExecuTorch, before its program loads
    torch_threads(threads)  # and its torch ops (the experts), as `run --threads` sets them
    runner = build(bundle, "host")
    image_args = [a for img in images for a in ("--image", str(img))]

    def run_native(*args, extra=(), **kw):  # every run with the images, if any
        return _run_native(*args, threads=threads, runner=runner, extra=[*extra, *image_args], **kw)

    # 1. all experts resident
    log("a pool of every expert: native vs the Python reference runner (each reads an expert on its first "
        "use), and native with every expert read before the run (--preload); interleaved")
    session = open_session(bundle, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=all_mib, io="threads"))
    if images:  # the image prompts, as the native runner lays them out (and their figures' image tokens)
        out["images"] = [str(x) for x in images]
        enc = session.encode_images(list(images))  # through the tower once
        image_prompts = [session.image_prompt(list(images), p, encoded=enc) for p in ids]
        out["image_tokens_per_prompt"] = len(image_prompts[0].ids) - len(ids[0])

    def python_run(i: int, n: int):
        return session.runner.run(image_prompts[i].ids, n, images=image_prompts[i]) if images else \
            session.runner.run(ids[i], n)
    native_t, preload_t, python_t, rss = [], [], [], []
    resident_tokens: list[list[int]] | None = None
    python_tokens: list[list[int]] | None = None
    first_use: list[dict] = []
    run_native(bundle, ids[:1], max_new_tokens=4, policy="on-demand+lru", pool_mib=all_mib)  # warm-up
    python_run(0, 4)
    for r in range(rounds):
        res = run_native(bundle, ids, max_new_tokens=new_tokens, policy="on-demand+lru", pool_mib=all_mib)
        native_t += [x["tpot_ms"] for x in res["runs"]]
        first_use.append(res)
        gens = [python_run(i, new_tokens) for i in range(len(ids))]
        python_t += [g.stats.tpot_ms for g in gens]
        if python_tokens is None:
            python_tokens = [list(g.tokens) for g in gens]
        res = run_native(bundle, ids, max_new_tokens=new_tokens, policy="on-demand+lru", pool_mib=all_mib,
                         extra=["--preload"])
        preload_t += [x["tpot_ms"] for x in res["runs"]]
        if resident_tokens is None:  # the reference: every expert resident
            resident_tokens = [list(x["tokens"]) for x in res["runs"]]
            resident_routing = [x["routing"] for x in res["runs"]]   # the bundle's own, for the simulator
        else:
            first_use.append(res)  # later preloaded rounds must repeat the first
        rss.append(res["peak_rss_bytes"])
        log(f"  round {r + 1}/{rounds}: native {median(native_t)} ms, python {median(python_t)} ms, "
            f"native preloaded {median(preload_t)} ms")
    # the bytes a decode token reads: the program's constants, less the embedding table when the
    # head does not read it whole (untied: one row is read), plus every layer's KV cache (the
    # graphs attend over the whole static cache) and the top-k experts of every MoE layer
    dense = (Path(bundle) / m["graphs"]["file"]).stat().st_size
    cfg = read_json(Path(bundle) / m["model"]["config"], "model config")
    tc = cfg.get("text_config", cfg)
    if not tc.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)):
        dense -= (int(tc["vocab_size"]) - 1) * int(tc["hidden_size"]) * 4
    kv = sum(4 * int(np.prod(x[key])) for x in m["kv"]["layers"] for key in ("k", "v"))
    touched = dense + kv + L * k * store.blob_size
    bw = memory_read_bandwidth()
    floor_ms = touched / bw * 1e3
    out["resident"] = {"native_tpot_ms": median(preload_t), "native_first_use_tpot_ms": median(native_t),
                       "python_tpot_ms": median(python_t),
                       "python_over_native": round(median(python_t) / median(native_t), 2),
                       "bytes_touched_per_token": touched, "dense_program_bytes": dense, "kv_cache_bytes": kv,
                       "memory_read_gbps": round(bw / 1e9, 2), "floor_ms": round(floor_ms, 4),
                       "native_over_floor": round(median(preload_t) / floor_ms, 2),
                       "native_peak_rss_mib": round(max(rss) / MiB, 1), "pool_mib": round(all_mib, 2),
                       "resident_tokens": resident_tokens,
                       "tokens_match_resident": token_check(first_use, resident_tokens)["match"]}
    py = token_check([{"runs": [{"tokens": t} for t in python_tokens]}], resident_tokens)
    out["resident"]["python_tokens_match_resident"] = py["match"]
    if not quantised and not py["match"]:
        log(f"fp32 bundle: the native runner's tokens differ from the Python engine's ({py['mismatches'][:2]})")

    # 2. streaming from flash, cold
    # previous-token+lru: the phone engines' temporal baseline (the previous token's routes for the next
    # --window layers into an LRU cache), beside every report's predictor
    # the predictor with the reuse eviction where the bundle has its table (toolkit/runtime/reuse.py),
    # and with the window-only `prediction` eviction beside it
    reuse = m["predictor"].get("reuse") is not None
    next_visit = reuse and heads > 0
    base = ["on-demand+lru", "previous-token+lru", f"{graph}+{'reuse' if reuse else 'prediction'}", "oracle+belady"]
    policies = base + ([f"{graph}+prediction"] if reuse else []) + \
        ([f"{base[2]}{NO_NEXT_VISIT_TAG}"] if next_visit else []) + \
        ([p.format(graph=graph) for p in ABLATION_POLICIES] if ablation else []) + \
        [f"{base[2]}{VARIANT_TAG}{v}" for v in knobs] + \
        ([f"{base[2]}{NO_READ_BUDGET_TAG}"] if read_budget_kib is not None else [])
    out["ablation"] = ablation
    out["read_budget_kib"] = read_budget_kib
    out["predictor_policy"] = base[2]  # what the ratios over "the predictor" are of
    out["points"] = []
    # the simulator's flash-bound calibration runs are the bench's own oracle + Belady runs at its smallest
    # pool (cold, interleaved with the policies): the flash as the runner draws it at the policies' own pool,
    # which a smaller calibration pool (half a token's working set until 2026-12-06, fourth) drew less from;
    # where those runs are not flash-bound the profile keeps the burst table (runtime_profile) and says so
    from export.session import bundle_source

    source = bundle_source(Path(bundle), m)   # the very weights the bundle's store was built from, if here
    simulate = source.model is not None and not images
    calib_runs: list[dict] = []
    def slots_of(frac: float) -> int:
        return max(k, int(round(frac * L * E)))

    calib_slots = min(slots_of(f) for f in pool_fracs)
    calib_point = None   # the index of the point whose oracle runs calibrate (the first at the smallest pool)
    for frac in pool_fracs:
        slots = slots_of(frac)
        pool = slots * store.slot_bytes / MiB
        log(f"pool {pool:.2f} MiB ({slots} of {L * E} experts): {', '.join(policies)}, cold, interleaved"
            + (f" ({base[3]}'s runs calibrate the simulator)" if simulate and slots == calib_slots
               and calib_point is None else ""))
        got: dict[str, list] = {p: [] for p in policies}
        order = policies
        for _ in range(rounds):
            for p in order:
                pol, no_budget, _ = p.partition(NO_READ_BUDGET_TAG)
                pol, off, _ = pol.partition(NO_NEXT_VISIT_TAG)
                pol, _, var = pol.partition(VARIANT_TAG)
                kv = knobs.get(var, {})
                extra = (("--no-next-visit",) if off else ()) + \
                    (("--no-reuse-classes",) if kv.get("reuse_classes") is False else ()) + \
                    (("--next-visits", str(kv["next_visits"])) if "next_visits" in kv else ()) + \
                    (("--candidate-threshold", repr(float(kv["candidate_threshold"])))
                     if "candidate_threshold" in kv else ())
                res = run_native(bundle, ids, max_new_tokens=new_tokens, policy=pol, pool_mib=pool, cold=True,
                                 read_budget_kib=None if no_budget else read_budget_kib, window=kv.get("window"),
                                 queue_depth=kv.get("queue_depth"), min_confidence=kv.get("min_confidence"),
                                 extra=extra)
                got[p].append(res)
            order = order[::-1]  # ABC, CBA, ...
        if simulate and slots == calib_slots and calib_point is None:
            calib_runs = [x for res in got[base[3]] for x in res["runs"]]
            calib_point = len(out["points"])
        point = {"pool_mib": round(pool, 3), "pool_frac": frac, "slots": slots, "policies": {}}
        for p, results in got.items():
            runs = [x for res in results for x in res["runs"]]
            point["policies"][p] = medians(runs, ("tpot_ms", "tpot_p95_ms", "ttft_ms", "stall_ms_per_token",
                                                  "hit_rate", "mib_read_per_token", "prefetch_precision",
                                                  "prefetch_recall"))
            point["policies"][p]["peak_rss_mib"] = round(max(res["peak_rss_bytes"] for res in results) / MiB, 1)
            point["policies"][p]["read_budget_kib"] = runs_budget_kib(runs)
            point["policies"][p]["direct_io"] = all(res["direct_io"] for res in results)
            chk = token_check(results, resident_tokens)
            point["policies"][p]["tokens_match_resident"] = chk["match"]
            if not quantised:  # fp32: the Python engine's tokens too
                point["policies"][p]["tokens_match_python"] = token_check(results, python_tokens)["match"]
            point["policies"][p]["tokens_match"] = chk["match"] and point["policies"][p].get("tokens_match_python",
                                                                                            True)
            if chk["mismatches"]:
                point["policies"][p]["token_mismatches"] = chk["mismatches"]
                log(f"  {p} at {pool:.2f} MiB: tokens differ from the all-resident run's {chk['mismatches'][:2]}")
        tp = {q: v["tpot_ms"] for q, v in point["policies"].items()}
        od, tmp, pr, orc = (tp[q] for q in base)
        point["on_demand_over_predictor"] = round(od / pr, 3)
        point["temporal_over_predictor"] = round(tmp / pr, 3)
        point["predictor_over_oracle"] = round(pr / orc, 3)
        if read_budget_kib is not None:  # the predictor's policy without the read budget over with it
            point["no_read_budget_over_predictor"] = round(tp[f"{base[2]}{NO_READ_BUDGET_TAG}"] / pr, 3)
        for v in knobs:   # each variant's settings over the bundle's: > 1 where the variant is faster
            point.setdefault("predictor_over_variant", {})[v] = round(pr / tp[f"{base[2]}{VARIANT_TAG}{v}"], 3)
        if next_visit:  # the reuse eviction without the next-visit heads over with them
            point["no_next_visit_over_predictor"] = round(tp[f"{base[2]}{NO_NEXT_VISIT_TAG}"] / pr, 3)
        if ablation:  # the same predictor, its eviction against Belady's (which knows the real future)
            point["predictor_eviction_over_belady"] = round(pr / tp[f"{graph}+belady"], 3)
            point["oracle_lru_over_belady"] = round(tp["oracle+lru"] / orc, 3)
            point["oracle_prediction_over_belady"] = round(tp["oracle+prediction"] / orc, 3)
            point["on_demand_belady_over_oracle"] = round(tp["on-demand+belady"] / orc, 3)
        out["points"].append(point)
        log(f"  on-demand / {base[2]}: {point['on_demand_over_predictor']}, previous-token / {base[2]}: "
            f"{point['temporal_over_predictor']}, {base[2]} / oracle: {point['predictor_over_oracle']}"
            + (f", without / with the read budget: {point['no_read_budget_over_predictor']}"
               if read_budget_kib is not None else "")
            + (f", without / with the next-visit heads: {point['no_next_visit_over_predictor']}" if next_visit
               else "")
            + "".join(f", {base[2]} / with {v}: {x}" for v, x in point.get("predictor_over_variant", {}).items()))
        if ablation:
            log(f"  {base[2]} / {graph}+belady: {point['predictor_eviction_over_belady']}, oracle+lru / "
                f"oracle+belady: {point['oracle_lru_over_belady']}, oracle+prediction / oracle+belady: "
                f"{point['oracle_prediction_over_belady']}")
    # 3. the simulator, recalibrated against the native runner, on the same prompts and pools
    src = source.model
    adapter = Path(bundle) / m["predictor"]["adapter"] if m["predictor"].get("adapter") else None
    if images:
        log("no simulator comparison: it replays text prompts, these are image prompts")
    elif src is not None:
        from export.manifest import scheduler_defaults
        from toolkit.bench.common import simulate_same_prompts
        from toolkit.runtime.policy import parse_policies

        log("the simulator, recalibrated against the native runner (calibrate_native), on the same prompts")
        prof = calibrate_native(bundle, ids, all_mib=all_mib, tokens=new_tokens, threads=threads,
                                oracle_runs=calib_runs)
        rows = [p for p in policies if not any(t in p for t in (NO_READ_BUDGET_TAG, NO_NEXT_VISIT_TAG, VARIANT_TAG))]
        rows_as = {f"{base[2]}{VARIANT_TAG}{v}": (parse_policies(base[2])[0], kv) for v, kv in knobs.items()}
        if read_budget_kib is not None:
            rows_as[f"{base[2]}{NO_READ_BUDGET_TAG}"] = (parse_policies(base[2])[0], {})
        # each row replayed with the read budget its runs had (none: the off row, and policies that prefetch nothing)
        budgets = [{name: {"read_budget_kib": v["read_budget_kib"]} for name, v in pt["policies"].items()}
                   for pt in out["points"]]
        sim = simulate_same_prompts(src, texts, adapter, parse_policies(",".join(rows)),
                                    [p["slots"] * store.slot_bytes / MiB for p in out["points"]], new_tokens,
                                    m["runtime"]["scheduler"]["window"], None, profile=prof, dtype=store.dtype,
                                    queue_depth=queue_depth,
                                    runs=[{"tokens": t, "routing": r}
                                          for t, r in zip(resident_tokens, resident_routing)],
                                    prefill_chunks=m["graphs"].get("prefill_chunks") or (),
                                    variants=rows_as, settings=scheduler_defaults(m), row_settings=budgets,
                                    calib_settings=budgets[calib_point][base[3]] if calib_point is not None else {})
        out["simulated"] = sim
        # the calibration's own runs: where their flash rate was used (flash-bound), their row is fitted to
        # them, not predicted; otherwise the burst table stands and the row is a prediction like the others
        rate_from = sim["profile"]["measured"]["flash_rate_from"]   # after fit_flash_rate
        fitted = rate_from.startswith("runner")
        out["simulated"]["calibrated_on"] = {"policy": base[3], "slots": calib_slots,
                                            "pool_mib": out["points"][calib_point]["pool_mib"],
                                            "flash_rate_from": rate_from, "row_fitted": fitted}
        if not fitted:
            log(f"  the {base[3]} runs at {calib_slots} experts did not set the flash rate (not flash-bound): "
                "the burst read table stands")
        for i, (p, sp) in enumerate(zip(out["points"], sim["points"])):
            for name, v in p["policies"].items():
                if name not in sp["policies"]:  # a next-visit=off row: not simulated
                    continue
                v["simulated_tpot_ms"] = sp["policies"][name]["tpot_ms"]
                v["sim_over_measured"] = round(v["simulated_tpot_ms"] / v["tpot_ms"], 3)
                if name == base[3] and i == calib_point and fitted:
                    v["simulator_calibration"] = True   # the simulator's flash rate was fitted to these runs
    else:
        log(f"no simulator comparison: {source.problem}")
    return out


def runs_budget_kib(runs: list[dict]) -> int | None:
    """The read budget a row's runs had (the runner's report's read_budget): a fixed one's KiB, auto's
    decode-step medians' lower median over the runs, None without one (or auto with nothing prefetched)."""
    return median_low([(x.get("read_budget") or {}).get("kib") for x in runs])


def _yes(v: bool | None) -> str:
    return "-" if v is None else "yes" if v else "**no**"


def markdown(r: dict[str, Any]) -> str:
    res = r["resident"]
    py_match = _yes(res.get("python_tokens_match_resident"))
    if r.get("quantised") and res.get("python_tokens_match_resident") is False:
        py_match = "no (not required of a quantised bundle)"
    promise = "quantised: that is the promise" if r.get("quantised") else "fp32: the Python engine must match too"
    imgs = (f", each after {len(r['images'])} image(s) ({r['image_tokens_per_prompt']} image tokens)"
            if r.get("images") else "")
    lines = [f"{len(r['prompts'])} prompts{imgs} x {r['new_tokens']} tokens, {r['rounds']} interleaved rounds; "
             "medians.", "",
             "A pool of every expert:", "",
             "| native TPOT ms | Python TPOT ms | Python / native | native preloaded TPOT ms | floor ms | "
             "preloaded / floor | native peak RSS MiB |",
             "|---|---|---|---|---|---|---|",
             f"| {res['native_first_use_tpot_ms']:.3f} | {res['python_tpot_ms']:.3f} | "
             f"{res['python_over_native']:.1f} | "
             f"{res['native_tpot_ms']:.3f} | {res['floor_ms']:.3f} | {res['native_over_floor']:.1f} | "
             f"{res['native_peak_rss_mib']} |", "",
             "(native and Python with a pool of every expert, each read on its first use; preloaded: every "
             "expert read before the run)", "",
             f"Tokens: the reference is the all-resident (preloaded) run's; {r.get('quantization') or {}} "
             f"({promise}). "
             f"First-use runs match it: {_yes(res.get('tokens_match_resident'))}; the Python engine's tokens match "
             f"it: {py_match}.", "",
             f"Floor: {res['bytes_touched_per_token'] / MiB:.2f} MiB touched per token (program "
             f"{res['dense_program_bytes'] / MiB:.2f} MiB read of the program + "
             f"{res.get('kv_cache_bytes', 0) / MiB:.2f} MiB of KV cache + top-k experts) at "
             f"{res['memory_read_gbps']} GB/s measured.",
             "", "Streaming (O_DIRECT, cold page cache)" + {
                 "auto": "; read budget: auto, each run's own (the flash's rate measured at its start x each step's "
                         "compute time, measured as it goes; the column: its decode steps' median)",
                 None: "; no read budget"}.get(r.get("read_budget_kib"), f"; read budget {r.get('read_budget_kib')} "
                                                                       "KiB a step") + ":", "",
             "| pool MiB (experts) | policy | TTFT ms | TPOT ms | p95 ms | stall ms/token | hit rate | "
             "MiB read/token | read budget KiB | peak RSS MiB | simulated TPOT ms | sim / measured | "
             "tokens = resident |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["points"]:
        for name, v in p["policies"].items():
            # the ratio from the TPOTs themselves (its JSON field is rounded to 3 places already)
            sim = (f"{v['simulated_tpot_ms']:.3f} | {v['simulated_tpot_ms'] / v['tpot_ms']:.2f}"
                   if "simulated_tpot_ms" in v else "- | -")
            sim += " (calibration)" if v.get("simulator_calibration") else ""
            ttft = "-" if v.get("ttft_ms") is None else f"{v['ttft_ms']:.2f}"
            lines.append(f"| {p['pool_mib']:.2f} ({p['slots']}) | {name} | {ttft} | {v['tpot_ms']:.3f} | "
                         f"{v['tpot_p95_ms']:.3f} | "
                         f"{v['stall_ms_per_token']:.3f} | {v['hit_rate']:.3f} | {v['mib_read_per_token']:.3f} | "
                         f"{'-' if v.get('read_budget_kib') is None else v['read_budget_kib']} | "
                         f"{v['peak_rss_mib']} | {sim} | {_yes(v.get('tokens_match_resident'))}"
                         + (f" (Python: {_yes(v['tokens_match_python'])})" if "tokens_match_python" in v else "")
                         + " |")
        lines.append(f"| | on-demand / predictor {p['on_demand_over_predictor']:.3f}, previous-token / predictor "
                     f"{p['temporal_over_predictor']:.3f}, predictor / oracle "
                     f"{p['predictor_over_oracle']:.3f}"
                     + (f", predictor without / with the read budget {p['no_read_budget_over_predictor']:.3f}"
                        if "no_read_budget_over_predictor" in p else "")
                     + (f", predictor without / with the next-visit heads {p['no_next_visit_over_predictor']:.3f}"
                        if "no_next_visit_over_predictor" in p else "")
                     + "".join(f", predictor / with {v} {x:.3f}"
                               for v, x in p.get("predictor_over_variant", {}).items())
                     + " | | | | | | | | | | | |")
        if "predictor_eviction_over_belady" in p:
            lines.append(f"| | eviction ablation: predictor / predictor+belady "
                         f"{p['predictor_eviction_over_belady']:.3f}, "
                         f"oracle+lru / oracle {p['oracle_lru_over_belady']:.3f}, oracle+prediction / oracle "
                         f"{p['oracle_prediction_over_belady']:.3f}, on-demand+belady / oracle "
                         f"{p['on_demand_belady_over_oracle']:.3f} | | | | | | | | | | | |")
    if "simulated" in r:
        pr = r["simulated"]["profile"]
        cal = r["simulated"].get("calibrated_on")
        how = pr.get("measured", {}).get("read_cost_from")
        lines += ["", f"Simulator profile (calibrate_native): dense {pr['dense_ms_per_layer']} ms/layer, expert "
                      f"{pr['expert_ms']} ms, planning {pr['plan_ms_per_layer']} ms/layer, read CPU "
                      f"{pr['read_cpu_us']} us, a streaming token {pr.get('streaming_token_ms', 0.0)} ms"
                      + (f" ({how})" if how else "") + f", flash latency {pr['flash_latency_us']} us"
                      + ((f"; its flash rate from the {cal['policy']} runs at {cal['pool_mib']} MiB "
                          f"({cal['slots']} experts; {cal.get('flash_rate_from', 'runner')}): that row's simulated "
                          "/ measured is the calibration's (the replay aims at their mean TPOT, the row shows their "
                          "median)" if cal.get("row_fitted", True)
                          else f"; the {cal['policy']} runs at {cal['pool_mib']} MiB did not set the flash rate: "
                          "the burst read table stands") if cal else "") + "."]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    fig, ax = figure((8, 4))
    pols = list(r["points"][0]["policies"])
    width = 0.8 / len(r["points"])
    for n, p in enumerate(r["points"]):
        ax.bar(np.arange(len(pols)) + n * width, [p["policies"][q]["tpot_ms"] for q in pols], width,
               label=f"{p['pool_mib']:.1f} MiB ({p['slots']} experts)")
    ax.axhline(r["resident"]["native_tpot_ms"], color="k", ls="--", lw=1, label="all resident")
    ax.axhline(r["resident"]["floor_ms"], color="gray", ls=":", lw=1, label="memory floor")
    ax.set_xticks(np.arange(len(pols)) + width * (len(r["points"]) - 1) / 2, pols, fontsize=8)
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("native runner: TPOT by policy and pool (O_DIRECT, cold)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


def write(r: dict[str, Any], json_path: Path) -> tuple[Path, Path]:
    """json_path, and its .md (the table) and .png (the plot) beside it (toolkit.reporting.write_report)."""
    return write_report(r, json_path, markdown, plot)
