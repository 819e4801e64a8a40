"""`specprefetch bench gpu MODEL`: the GPU tier's policies side by side in one run
(docs/benchmarks.md, "GPU tier").

For each pool (a fraction of all experts), every policy runs every prompt, interleaved over repeats
(A B C, C B A, ...), after a warm-up; TPOT comes from CUDA events. In the same run: the pinned
host -> GPU bandwidth (the floor of every copy), the all-resident upper bound (every expert preloaded
into the pool) twice: decoded on the device alone (one graph per token, the slots looked up on the
device) and as every policy decodes (one host sync per MoE layer), transformers' own generate with
the whole model on the GPU, and the draft's K picked by a short profiling pass per pool (Specter's
profiler). Where the adapter has next-visit heads, each `+reuse` policy that reads them also runs
without them (`POLICY next-visit=off`); with `--variant KEY=V[,KEY=V]`, each predicting policy (not
on-demand, the draft or the oracle) also runs with those scheduler settings (`POLICY scheduler=...`:
window, queue_depth (prefetch copies issued per layer step), candidate_threshold, min_confidence,
read_budget_kib: a number, or auto, the measured copy rate times a layer's resident step; reuse_classes=off,
the reuse eviction with the whole table, for `+reuse` policies only; host=native, for every policy: the native
runner's scheduler and pool decide, the same decisions off Python; plan=host: a folding planner's rows computed
on the host from the router's input read back, not on the device: the same decisions up to rounding at
near-ties; plan=inline: on the device but on the compute stream, waited for by the layer's sync, not on a
stream of their own: the same decisions; launch=torch, for every policy: the per-layer path's graph replays,
copies and events through torch's API, not the CUDA driver's: the same work), rows of their own in the same
rounds.
Every run's tokens are checked against transformers' greedy tokens before any time is quoted.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from toolkit.runtime.policy import GPU_VARIANT_KEYS, VARIANT_TAG, Policy, parse_variants, variant_label
from toolkit.errors import SpecPrefetchError
from toolkit.metrics import median

MiB = 2**20
NO_NEXT_VISIT = " next-visit=off"   # the row of a +reuse policy run without the adapter's next-visit heads
# the resident bound without a host sync per layer: one graph per token (graph), or the same segments
# run eagerly (static: no graph, so its launches are the host's)
ALONE = {"graph": "on the device alone (one graph per token)", "static": "without a host sync per layer (eager)"}


def _predicting(pol: Policy) -> bool:
    """Whether --variant's scheduler settings apply to `pol`: a predictor's prefetches (not on-demand's
    none, the draft's own verification rounds or the oracle's known future)."""
    return pol.predictor not in ("on-demand", "draft", "oracle")


def _takes(pol: Policy, v: dict, preds: dict | None = None) -> bool:
    """Whether the --variant settings `v` make a row of `pol`: a predicting policy (any policy where `v` sets
    only `host` or `launch`, whose scheduler or calls it changes), for reuse_classes and next_visits one that
    evicts by the reuse table, and for plan one whose predictor folds (`linear`: its rows are computed on the
    device; `preds`, the bench's predictors, once they are built)."""
    return ((set(v) <= {"host", "launch"} or _predicting(pol))
            and (not {"reuse_classes", "next_visits"} & set(v) or pol.eviction == "reuse")
            and ("plan" not in v or preds is None or getattr(preds.get(pol.predictor), "linear", False)))


def _prompts(tokenizer, n: int, tokens: int, data: Path | None) -> list[list[int]]:
    from toolkit.embedded.report import HELDOUT

    path = data or HELDOUT
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        ids = tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == n:
            break
    if len(out) < n:
        raise SpecPrefetchError(f"{path}: only {len(out)} documents of at least {tokens} tokens (asked for {n})")
    return out


def gpu_predictors(spec, names, adapter: Path | None) -> dict[str, Any]:
    """The host predictors the GPU tier's policies name (on-demand and the draft need none)."""
    from toolkit.models.routers import load_router_bank
    from toolkit.predictors.registry import build_predictor

    names = set(names) - {"on-demand", "draft"}
    if not names:
        return {}
    bank = load_router_bank(spec)
    ad = None
    if adapter is not None:
        from adapters.checkpoint import load_adapter

        ad, _ = load_adapter(adapter, spec)
    E = spec.geometry.routing.num_experts
    return {n: build_predictor(n, num_experts=E, bank=lambda: bank, adapter=(lambda: ad) if ad is not None else None)
            for n in names}


def gpu_reuse_table(spec, evictions, adapter: Path | None):
    """The adapter's reuse table when a policy evicts by predicted reuse (None when none does), checked
    against the model like the adapter itself (adapters.checkpoint.adapter_reuse_table). Refused in one
    line: `+reuse` without --adapter, or with an adapter whose adapter.json has no table (trained before it
    existed)."""
    if "reuse" not in set(evictions):
        return None
    if adapter is None:
        raise SpecPrefetchError("eviction 'reuse' reads the adapter's reuse table: pass --adapter")
    from adapters.checkpoint import adapter_reuse_table

    return adapter_reuse_table(Path(adapter), spec)   # refuses an adapter of another model, or without a table


def reference_generate(model_dir: Path, prompts: list[list[int]], new_tokens: int, device: str,
                       dtype: torch.dtype, timed: bool = True,
                       margins: list[list[float]] | None = None) -> tuple[list[list[int]], float | None]:
    """transformers' greedy tokens with the whole model on the device (eager experts, the loop the
    GPU tier computes), and the median wall-clock ms per new token of `generate` (prefill included:
    a reference figure, not a TPOT). `margins`, if given, receives per prompt the gap between the two
    best logits at each new token (how near a tie each greedy choice was)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).to(device).eval()
    m.config._experts_implementation = "eager"
    toks, tpots = [], []
    cuda = torch.device(device).type == "cuda"
    with torch.no_grad():
        for rep in range(2 if timed else 1):
            for p in prompts:
                t0 = time.perf_counter()
                scored = rep == 0 and margins is not None   # the untimed pass
                out = m.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=new_tokens,
                                 pad_token_id=0, output_scores=scored, return_dict_in_generate=scored)
                if cuda:
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                if scored:
                    top2 = torch.stack(out.scores)[:, 0].float().topk(2, dim=-1).values
                    margins.append((top2[:, 0] - top2[:, 1]).tolist())
                    out = out.sequences
                if rep == 0:
                    toks.append(out[0, len(p):].tolist())
                else:
                    tpots.append(dt * 1e3 / (out.shape[1] - len(p)))  # prefill included
    del m
    if cuda:
        torch.cuda.empty_cache()
    return toks, median(tpots, ndigits=None)


def first_difference(tokens: list[int], reference: list[int], margins: list[float]) -> str:
    """Where `tokens` first leave transformers' and how near a tie transformers' choice there was
    (the gap between its two best logits): "" where they do not differ before one of them ends."""
    j = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    if j >= len(reference):
        n, m = len(tokens), len(reference)
        return "" if n == m else f" (longer: {n} tokens, transformers' {m})"
    gap = f", transformers' top-2 logit gap there {margins[j]:.4g}" if j < len(margins) else ""
    return f" (first at new token {j}{gap})"


def token_read_bytes(eng) -> int:
    """The device bytes one decode token must read at least (the all-resident HBM floor): every dense
    weight once, except the input embedding table, of which only the token's row (an LM head tied to
    the table still reads all of it), plus k experts per MoE layer."""
    emb = eng.model.get_input_embeddings().weight
    head = eng.model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    es = emb.element_size()
    dense = eng.dense_bytes - (0 if tied else emb.numel() * es) + emb.shape[-1] * es
    return dense + eng.L * eng.k * eng.store.blob_size


PDL_NOTE = (" (the fused kernels launched with programmatic dependent launch: each one's time counts its wait for "
            "the one before, so the sum is not the device's busy time)")


def _pdl(eng, device) -> bool:
    """Whether the engine's fused kernels (its experts', attention's or router's) launch with programmatic
    dependent launch on this device (gpu_kernels.PDL)."""
    from toolkit.runtime.gpu_kernels import pdl_on, triton

    return "fused" in (eng.experts, eng.attention, eng.router) and triton is not None and pdl_on(device)


def profile_resident(eng, prompt: list[int], new_tokens: int, *, short: int = 4, top: int = 25) -> dict[str, Any]:
    """Where an all-resident decode token's time goes, by torch.profiler: one resident run of `short`
    new tokens and one of `new_tokens` (the decode path the bench's all-resident bound takes: one graph
    per token where the static decoder runs), the difference divided by the extra tokens, so the prompt's
    prefill cancels. The engine must be configured with a pool of every expert. Per token: the device
    operations (kernels and copies; inside a CUDA graph they are the graph's nodes, one launch for all)
    and their device time summed over all of them (over every stream; host ops' time without a GPU),
    against the wall-clock TPOT of the same runs: a sum near the TPOT means many small operations
    (fusion would pay), far below it means the device idles between them. Where the fused kernels launch
    with programmatic dependent launch (gpu_kernels.PDL) a kernel's time includes its wait for the one before,
    so the sum can exceed the TPOT and is no longer the device's busy time (the report says so)."""
    from torch.profiler import ProfilerActivity, profile

    if new_tokens <= short:
        raise SpecPrefetchError(f"--profile-resident: needs more than {short} new tokens (got {new_tokens})")
    cuda = eng.dev.cuda
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def one(n: int):
        eng.generate(prompt, n, preload=True, resident_graph=eng.decode != "modules")   # warm (graphs captured)
        with profile(activities=acts) as p:
            t0 = time.perf_counter()
            g = eng.generate(prompt, n, preload=True, resident_graph=eng.decode != "modules")
            wall = time.perf_counter() - t0
        by: dict[str, list[float]] = {}
        for e in p.events():
            on_device = str(e.device_type).endswith("CUDA")
            if cuda and not on_device or not cuda and e.cpu_parent is not None:
                continue   # kernels on a GPU; top-level host ops without one
            t = e.device_time if cuda else e.cpu_time
            c = by.setdefault(e.name, [0, 0.0])
            c[0] += 1
            c[1] += t
        return len(g.tokens), wall, by

    n1, w1, a = one(short)
    n2, w2, b = one(new_tokens)
    extra = n2 - n1
    if extra < 1:
        raise SpecPrefetchError("--profile-resident: the longer run stopped as early as the short one (EOS)")
    rows = []
    for name in b:
        cnt = (b[name][0] - a.get(name, [0, 0.0])[0]) / extra
        us = (b[name][1] - a.get(name, [0, 0.0])[1]) / extra
        if cnt > 0 or us > 0:
            rows.append({"name": name[:120], "per_token": round(cnt, 2), "us_per_token": round(us, 2)})
    rows.sort(key=lambda r: -r["us_per_token"])
    return {"what": "device ops (kernels and copies)" if cuda else "host ops", "tokens": extra,
            "wall_ms_per_token_profiled": round((w2 - w1) / extra * 1e3, 4),   # the profiler's overhead included
            "ops_per_token": round(sum(r["per_token"] for r in rows), 1),
            "device_ms_per_token": round(sum(r["us_per_token"] for r in rows) / 1e3, 4),   # summed
            "top": rows[:top]}


def run_gpu_bench(model: str | Path, *, store: Path | None, adapter: Path | None, policies: list[Policy],
                  fractions: list[float], prompts: int = 4, prompt_tokens: int = 64, new_tokens: int = 64,
                  repeats: int = 2, ks: tuple[int, ...] = (2, 4, 6, 8, 12), device: str = "cuda",
                  window: int = 2, data: Path | None = None, decode: str | None = None,
                  experts: str | None = None, attention: str | None = None, router: str | None = None,
                  verify: str = "exact",
                  strict: bool = True,
                  profile: bool = False, compile: str | None = None, variants: tuple[str, ...] = (),
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """`decode`, `experts`, `attention`, `router`, `verify`: the engine's decode path, expert math,
    one-position attention and routing, and the draft's verification (gpu.GpuEngine). `strict`: refuse to
    report when any run's tokens differ from transformers' (the default); False returns the figures
    with `tokens_match_transformers: false` and the differing runs listed, for diagnosis only. `profile`:
    also where an all-resident token's time goes (`profile_resident`, after the timed runs). `variants`:
    --variant settings (GPU_VARIANT_KEYS), each a row per predicting policy."""
    from toolkit.models.loader import inspect_model_dir, load_model
    from toolkit.runtime.expert_store import ExpertStore
    from toolkit.runtime.gpu import Device, GpuEngine, d2d_bandwidth, h2d_bandwidth, launch_fallback
    from toolkit.runtime.profiles import check_budget_kib, read_budget_kib
    from toolkit.runtime.runner import RunConfig

    if torch.device(device).type == "cuda":   # (a bad SPECPREFETCH_PDL refused before anything is read or built)
        from toolkit.runtime.gpu_kernels import check_pdl_setting

        check_pdl_setting()
    spec = inspect_model_dir(model)
    g = spec.geometry
    L, E = len(g.moe_layers), g.routing.num_experts
    knobs = parse_variants(variants, GPU_VARIANT_KEYS)   # refused before anything loads
    for label, v in knobs.items():
        if v.get("window", 1) > L:
            raise SpecPrefetchError(f"--variant {label}: window {v['window']} is past the model's {L} MoE layers")
    for label, v in knobs.items():
        if not any(_takes(p, v) for p in policies) and "reuse_classes" not in v:   # (reuse_classes: below)
            raise SpecPrefetchError(f"--variant {label}: no policy predicts (on-demand, the draft and the oracle "
                                    "take no scheduler setting but host and launch)")
    if any(v.get("host") == "native" for v in knobs.values()):
        from toolkit.runtime.native_sched import library

        library()   # built (or its build refused) before anything loads
    dev = Device(device)
    fallback = launch_fallback(dev) if any("launch" in v for v in knobs.values()) else None
    for label, v in knobs.items():
        if fallback and v.get("launch") == "torch":
            raise SpecPrefetchError(f"--variant {label}: every row takes torch's calls on this machine already "
                                    f"(the driver's are unavailable: {fallback})")
    # the predictors and the reuse table first: a policy that cannot run is refused before any loading
    preds = gpu_predictors(spec, {p.predictor for p in policies}, adapter)
    reuse = gpu_reuse_table(spec, {p.eviction for p in policies}, adapter)
    for label, v in knobs.items():
        if "plan" in v and not any(_takes(p, v, preds) for p in policies):
            raise SpecPrefetchError(f"--variant {label}: no policy's predictor folds its rows (plan={v['plan']}: "
                                    "the adapter, next-gate or fate)")
        # (a +reuse policy has its table: gpu_reuse_table refused the run otherwise)
        if "reuse_classes" in v and (not any(_takes(p, v) for p in policies) or reuse.classes is None):
            raise SpecPrefetchError(f"--variant {label}: no predicting +reuse policy whose reuse table has "
                                    "frequency classes (an adapter trained with them)")
    if store is None:
        from toolkit.runtime.store_cache import cached_store

        st = cached_store(spec, "fp16")
    else:
        st = ExpertStore(store, spec)
    for label, v in knobs.items():   # as GpuEngine.configure refuses it, before the model loads
        check_budget_kib(v.get("read_budget_kib"), st.blob_size, f"--variant {label}: read_budget_kib")
    dtype = torch.float16 if dev.cuda else torch.float32
    t_start = time.time()
    bw0 = h2d_bandwidth(dev) if dev.cuda else None
    hbm = d2d_bandwidth(dev) if dev.cuda else None
    lm = load_model(spec.path, dtype="float16" if dev.cuda else "float32")
    ids = _prompts(lm.tokenizer, prompts, prompt_tokens, data)
    log(f"reference: transformers generate, whole model on {device}")
    ref_margins: list[list[float]] = []
    ref_tokens, ref_tpot = reference_generate(spec.path, ids, new_tokens, device, dtype, margins=ref_margins)
    all_mib = L * E * st.blob_size / MiB
    eng = GpuEngine(lm, st, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=all_mib, window=window),
                    device=device, predictors=preds, reuse=reuse,
                    with_draft=any(p.predictor == "draft" for p in policies),
                    decode=decode, experts=experts, attention=attention, router=router,
                    verify=verify, compile=compile,
                    progress=lambda i, n: log(f"host tier: layer {i}/{n} read") if i == n else None)
    log(f"model {spec.path}: {L} MoE layers x {E} experts of {st.blob_size / MiB:.2f} MiB "
        f"({all_mib:.0f} MiB of experts), dense {eng.dense_bytes / MiB:.0f} MiB on the GPU")
    rows: list[dict[str, Any]] = []
    mismatches: list[str] = []

    defaults = RunConfig()
    default_launch = eng.launch   # (the driver's calls, or torch's where the driver does not load)
    auto_budget: dict[str, Any] = {}   # read_budget_kib=auto's figures, measured before the rounds

    def settings(knob: dict[str, Any]) -> dict[str, Any]:
        """The scheduler settings of a run: a --variant's, the bench's own where it sets none."""
        budget = knob.get("read_budget_kib")
        return dict(window=knob.get("window", window),
                    min_confidence=knob.get("min_confidence", defaults.min_confidence),
                    candidate_threshold=knob.get("candidate_threshold", defaults.candidate_threshold),
                    read_budget_kib=auto_budget["kib"] if budget == "auto" else budget,
                    reuse_classes=knob.get("reuse_classes", True), copy_depth=knob.get("queue_depth"),
                    next_visits=knob.get("next_visits"),
                    host=knob.get("host", "python"), plan=knob.get("plan", "device"),
                    launch=knob.get("launch", default_launch))

    def one(pol: Policy, mib: float, p: int, *, k: int = 8, preload: bool = False, resident_graph: bool = False,
            recorded=None, next_visit: bool = True, knob: dict[str, Any] | None = None):
        knob = knob or {}
        eng.configure(policy=pol, pool_mib=mib, next_visit=next_visit, **settings(knob))
        r = eng.generate(ids[p], new_tokens, recorded=recorded, k=k, preload=preload, resident_graph=resident_graph)
        if r.tokens != ref_tokens[p]:
            name = pol.name + ("" if next_visit else NO_NEXT_VISIT) + (
                f"{VARIANT_TAG}{variant_label(knob)}" if knob else "") + (
                " (resident, device alone)" if resident_graph else " (resident)" if preload else "")
            what = f"{name} pool {mib:.0f} MiB prompt {p}{first_difference(r.tokens, ref_tokens[p], ref_margins[p])}"
            log(f"TOKENS DIFFER: {what}")
            mismatches.append(what)
        return r

    # the rows: (label, policy, next_visit, scheduler settings); a +reuse policy whose predictor has
    # next-visit heads also runs without them; each predicting policy with each --variant's settings
    variants = [(pol.name, pol, True, {}) for pol in policies]
    variants += [(pol.name + NO_NEXT_VISIT, pol, False, {}) for pol in policies
                 if pol.eviction == "reuse" and getattr(preds.get(pol.predictor), "next_visits", 0)]
    variants += [(f"{pol.name}{VARIANT_TAG}{label}", pol, True, v) for pol in policies
                 for label, v in knobs.items() if _takes(pol, v, preds)]
    for label, pol, _, v in variants:   # a cap that reads fewer heads than the adapter has, or it is no variant
        heads = getattr(preds.get(pol.predictor), "next_visits", 0)
        if "next_visits" in v and v["next_visits"] >= heads:
            raise SpecPrefetchError(f"--variant {label.partition(VARIANT_TAG)[2]}: next_visits must be below the "
                                    f"{heads} next-visit heads of {pol.predictor} (row {label})")

    # the oracle's future: one recorded pass per prompt (routing does not depend on the policy)
    recorded = {p: eng.record(ids[p], new_tokens) for p in range(len(ids))}
    if any(v.get("read_budget_kib") == "auto" for v in knobs.values()):
        # read_budget_kib=auto: what the copies deliver in one MoE layer's step, the CPU runner's rule
        # (profiles.read_budget_kib: at least one slot) with this bench's pinned-copy rate and a layer's
        # share of the synced all-resident decode (the policies' path): the median of three runs after a
        # warm-up one
        one(Policy("on-demand", "lru"), all_mib, 0, preload=True)
        step_ms = median((one(Policy("on-demand", "lru"), all_mib, 0, preload=True).stats.tpot_ms
                          for _ in range(3)), ndigits=None) / L
        rate = bw0 if bw0 else h2d_bandwidth(dev, mib=16)
        auto_budget.update(read_budget_kib(rate * 1e9 / MiB, step_ms / 1e3, st.blob_size), copy_gbps=round(rate, 2))
        log(f"read_budget_kib=auto: {auto_budget['kib']} KiB a layer step ({rate:.1f} GB/s x {step_ms:.4f} ms"
            + (", raised to one expert slot)" if auto_budget["raised"] else ")"))
    # the upper bound: every expert preloaded, nothing copied while decoding; on the device alone (one
    # graph per token) where the static decoder runs, and as the policies decode (a host sync per layer)
    RESIDENT, SYNCED = "all resident", "all resident, synced"
    alone = eng.decode != "modules"
    resident_runs: list = []
    synced_runs: list = []
    ks_by_pool: dict[float, dict[str, Any]] = {}
    drafts = [p for p in policies if p.predictor == "draft"]
    for frac in fractions:
        slots = max(g.routing.top_k, int(round(frac * L * E)))
        mib = slots * st.blob_size / MiB + 1e-9
        # warm-up: every path once (the resident preload, each policy, the draft at every K)
        one(Policy("on-demand", "lru"), all_mib, 0, preload=True)
        if alone:
            one(Policy("on-demand", "lru"), all_mib, 0, preload=True, resident_graph=True)
        for _, pol, nv, kn in variants:
            one(pol, mib, 0, k=ks[0], recorded=recorded[0], next_visit=nv, knob=kn)
        if drafts:
            prof = {}
            for k in ks:   # Specter's profiler: short runs per K on the first prompt, fastest (median) wins
                prof[k] = median((one(drafts[0], mib, 0, k=k).stats.tpot_ms for _ in range(2)), ndigits=3)
            best = min(prof, key=prof.get)
            ks_by_pool[frac] = {"k": best, "profile_tpot_ms": prof}
            log(f"pool {frac:.0%}: draft K profile {', '.join(f'{k}: {v:.2f}' for k, v in prof.items())} -> K={best}")
        runs: dict[str, list] = {label: [] for label, _, _, _ in variants}
        entries = [*variants, SYNCED] + ([RESIDENT] if alone else [])
        for rep in range(repeats):
            order = entries if rep % 2 == 0 else entries[::-1]
            for p in range(len(ids)):
                for entry in order:
                    if entry in (RESIDENT, SYNCED):
                        r = one(Policy("on-demand", "lru"), all_mib, p, preload=True, resident_graph=entry == RESIDENT)
                        (resident_runs if entry == RESIDENT else synced_runs).append(r)
                        continue
                    label, pol, nv, kn = entry
                    r = one(pol, mib, p, k=ks_by_pool.get(frac, {}).get("k", 8), recorded=recorded[p], next_visit=nv,
                            knob=kn)
                    runs[label].append(r)
        for label, pol, _, kn in variants:
            rs = runs[label]
            med = lambda f: median((f(r) for r in rs), ndigits=None)  # noqa: E731
            row = {"policy": label, "pool_fraction": frac, "pool_slots": slots, "pool_mib": round(mib, 1),
                   "tpot_ms": round(med(lambda r: r.stats.tpot_ms), 3),
                   "tpot_p95_ms": round(med(lambda r: r.stats.tpot_p95_ms), 3),
                   "hit_rate": round(med(lambda r: r.stats.hit_rate), 4),
                   "pcie_mib_per_token": round(med(lambda r: r.extra["pcie_bytes_per_token"]) / MiB, 2),
                   "stall_ms_per_token": round(med(lambda r: r.stats.stall_ms_per_token), 3),
                   "copy_ms_per_token": round(med(lambda r: r.extra["copy_ms_per_token"]), 3),
                   "prefetch_precision": round(med(lambda r: r.stats.prefetch_precision), 4),
                   # prefetch copies issued per token, and those the read budget dropped (they could not land
                   # by their layer)
                   "prefetches_per_token": round(med(lambda r: r.stats.counts["prefetch_issued"]
                                                     / max(r.stats.decode_tokens, 1)), 3),
                   "dropped_late_per_token": round(med(lambda r: r.stats.counts["dropped_late"]
                                                       / max(r.stats.decode_tokens, 1)), 3),
                   "gpu_expert_mib": round(mib + (eng.draft_bytes / MiB if pol.predictor == "draft" else 0), 1),
                   # the slot allocation the runs read, and every arena the engine held meanwhile
                   "slot_arena_mib": round(max(r.extra["slot_arena_bytes"] for r in rs) / MiB, 1),
                   "slot_arenas_held_mib": round(max(r.extra["slot_arenas_held_bytes"] for r in rs) / MiB, 1),
                   "runs": len(rs)}
            if kn:
                row["scheduler"] = kn
                if kn.get("read_budget_kib") == "auto":
                    row["read_budget_auto_kib"] = auto_budget["kib"]
            if pol.predictor == "draft":
                row.update({"k": ks_by_pool[frac]["k"], "acceptance": round(med(lambda r: r.extra["acceptance"]), 4),
                            "draft_ms_per_token": round(med(lambda r: r.extra["draft_ms_per_token"]), 3),
                            "verify_ms_per_token": round(med(lambda r: r.extra["verify_ms_per_token"]), 3),
                            "draft_mib": round(eng.draft_bytes / MiB, 1)})
            rows.append(row)
            log(f"pool {frac:.0%} {label}: TPOT {row['tpot_ms']:.3f} ms, hit {row['hit_rate']:.3f}, "
                f"{row['pcie_mib_per_token']:.1f} MiB/token over PCIe, stall {row['stall_ms_per_token']:.3f} ms/token")
    prof, pdl_on = None, _pdl(eng, device)
    if profile:
        eng.configure(policy=Policy("on-demand", "lru"), pool_mib=all_mib, **settings({}))
        prof = profile_resident(eng, ids[0], new_tokens)
        log(f"profile of an all-resident token: {prof['ops_per_token']} {prof['what']}, "
            f"{prof['device_ms_per_token']} ms of their time summed"
            + (PDL_NOTE if pdl_on else "") + "; top: "
            + "; ".join(f"{x['name'][:40]} x{x['per_token']} {x['us_per_token']} us" for x in prof["top"][:6]))
    synced_tpot = median((r.stats.tpot_ms for r in synced_runs), ndigits=None)
    resident_tpot = median((r.stats.tpot_ms for r in resident_runs), ndigits=None) if alone else synced_tpot
    log("all experts resident: TPOT " + (f"{resident_tpot:.3f} ms {ALONE[eng.decode]}, " if alone else "")
        + f"{synced_tpot:.3f} ms with a host sync per MoE layer; transformers generate {ref_tpot:.3f} ms per new "
        "token (wall clock, prefill included)")
    bw1 = h2d_bandwidth(dev) if dev.cuda else None
    bw = statistics.mean([b for b in (bw0, bw1) if b]) if dev.cuda else None
    for row in rows:
        base = next(r for r in rows if r["pool_fraction"] == row["pool_fraction"] and r["policy"] == "on-demand+lru") \
            if any(r["policy"] == "on-demand+lru" for r in rows) else None
        orc = next((r for r in rows if r["pool_fraction"] == row["pool_fraction"] and r["policy"].startswith("oracle")),
                   None)
        row["speedup_vs_on_demand"] = round(base["tpot_ms"] / row["tpot_ms"], 3) if base else None
        row["vs_oracle"] = round(row["tpot_ms"] / orc["tpot_ms"], 3) if orc else None
        row["pcie_floor_ms"] = round(row["pcie_mib_per_token"] * MiB / (bw * 1e9) * 1e3, 3) if bw else None
    if mismatches and strict:
        raise SpecPrefetchError("tokens differ from transformers' greedy decode: " + "; ".join(mismatches[:5]))
    # the all-resident floor: every decode token reads the dense weights (one embedding row) and k experts
    # per MoE layer from device memory
    token_bytes = token_read_bytes(eng)
    floor = token_bytes / (hbm * 1e9) * 1e3 if hbm else None
    hbm_floor = round(floor, 3) if hbm else None
    return {
        "model": {"path": str(spec.path), "family": g.family, "moe_layers": L, "experts": E, "top_k": g.routing.top_k,
                  "hidden_size": g.hidden_size, "moe_intermediate_size": g.moe_intermediate_size,
                  "expert_mib": round(st.blob_size / MiB, 3), "experts_mib": round(all_mib, 1),
                  "dense_mib": round(eng.dense_bytes / MiB, 1)},
        "device": torch.cuda.get_device_name(dev.device) if dev.cuda else "cpu",
        "torch": torch.__version__, "prompts": len(ids), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "repeats": repeats, "h2d_gbps": {"start": bw0, "end": bw1},
        # whose calls the rows without a launch variant made on CUDA (the driver's, or torch's where it did not
        # load: launch_fallback says why)
        "launch": default_launch if dev.cuda else None, "launch_fallback": eng.launch_fallback,
        # --variant read_budget_kib=auto's budget and what it came from (None: no such variant)
        "read_budget_auto": auto_budget or None,
        # every expert resident: on the device alone (one graph per token; the policies' path where the
        # decoder is transformers' modules) and with the policies' host sync per MoE layer
        "resident_tpot_ms": round(resident_tpot, 3), "resident_runs": len(resident_runs) or len(synced_runs),
        "resident_device_alone": alone,
        "resident_synced_tpot_ms": round(synced_tpot, 3), "resident_synced_runs": len(synced_runs),
        "hbm_gbps": hbm, "hbm_floor_bytes": token_bytes, "hbm_floor_ms": hbm_floor, "decode": eng.decode,
        "experts": eng.experts, "attention": eng.attention, "router": eng.router, "verify": eng.verify,
        "compile": eng.compile, "launch_pdl": pdl_on,
        "resident_vs_floor": round(resident_tpot / floor, 2) if floor else None,
        "resident_synced_vs_floor": round(synced_tpot / floor, 2) if floor else None,
        "transformers_ms_per_token_wall": round(ref_tpot, 3),
        "draft_k": {str(k): v for k, v in ks_by_pool.items()}, "tokens_match_transformers": not mismatches,
        "mismatches": mismatches,
        "rows": rows, "seconds": round(time.time() - t_start, 1),
        **({"resident_profile": prof} if prof else {}),
    }


def markdown(r: dict[str, Any]) -> str:
    m = r["model"]
    alone = (f" {ALONE.get(r.get('decode'), 'on the device alone')}, {r['resident_synced_tpot_ms']} ms with a host "
             "sync per MoE layer" if r.get("resident_device_alone") else "")
    lines = []
    calls = ("the driver's calls" if r.get("launch") == "driver" else
             f"torch's calls ({r['launch_fallback']})" if r.get("launch_fallback") else None)
    if not r.get("tokens_match_transformers", True):
        bad = r.get("mismatches") or []
        lines += [f"**TOKENS DIFFER from transformers' greedy decode in {len(bad)} run(s)"
                  + (f" ({'; '.join(bad[:5])}{'; ...' if len(bad) > 5 else ''})" if bad else "")
                  + ": these figures are for diagnosis only, not a measurement.**", ""]
    lines += [f"GPU tier on {r['device']}: {m['family']}, {m['moe_layers']} MoE layers x {m['experts']} experts "
              f"(top-{m['top_k']}) of {m['expert_mib']} MiB; H2D {_bw(r)} GB/s; all resident "
              f"{r['resident_tpot_ms']} ms/token{alone} (TPOT, interleaved with the policies; HBM floor "
              f"{_f(r.get('hbm_floor_ms'))} ms), decode {r.get('decode', 'modules')}, experts "
              f"{r.get('experts', 'eager')}"
              f"{', attention ' + r['attention'] + ', router ' + r['router'] if 'attention' in r else ''}"
              f"{', compiled (' + r['compile'] + ')' if r.get('compile') else ''}"
              f"{', ' + calls if calls else ''}, "
              f"the draft's verification {r.get('verify', 'batched')}, "
              "transformers generate "
              f"{r['transformers_ms_per_token_wall']} ms per new token (wall clock, prefill included)", "",
              "| pool | policy | TPOT ms | p95 | x on-demand | / oracle | hit | PCIe MiB/tok | floor ms | stall ms/tok "
              "| copy ms/tok | K | accept | draft ms/tok | GPU expert MiB | slot arena MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['pool_fraction']:.0%} | {x['policy']} | {x['tpot_ms']} | {x['tpot_p95_ms']} | "
                     f"{_f(x['speedup_vs_on_demand'])} | {_f(x['vs_oracle'])} | {x['hit_rate']} | "
                     f"{x['pcie_mib_per_token']} | {_f(x['pcie_floor_ms'])} | {x['stall_ms_per_token']} | "
                     f"{x['copy_ms_per_token']} | {x.get('k', '')} | {x.get('acceptance', '')} | "
                     f"{x.get('draft_ms_per_token', '')} | {x['gpu_expert_mib']} | {x.get('slot_arena_mib', 'n/a')} |")
    if r.get("read_budget_auto"):
        a = r["read_budget_auto"]
        lines += ["", f"read_budget_kib=auto: {a['kib']} KiB a layer step, the copy rate {a['copy_gbps']} GB/s x a "
                      f"layer's synced resident step {a['step_ms']} ms" + (", raised to one expert slot" if a["raised"]
                                                                          else "")]
    held = [x["slot_arenas_held_mib"] for x in r["rows"] if "slot_arenas_held_mib" in x]
    if held:
        lines += ["", f"(slot arena: the allocation a policy's runs read, exactly its pool; the engine held at most "
                      f"{max(held)} MiB of slot arenas at once, the all-resident bound's included)"]
    if r.get("resident_profile"):
        pr = r["resident_profile"]
        ops = pr.get("ops_per_token", pr.get("launches_per_token"))          # (the name until 2026-12-06)
        ms = pr.get("device_ms_per_token", pr.get("busy_ms_per_token"))
        lines += ["", f"An all-resident decode token, profiled: {ops} {pr['what']}, {ms} ms of their time "
                      "summed (the profiled wall clock "
                      f"{pr['wall_ms_per_token_profiled']} ms)" + (PDL_NOTE if r.get("launch_pdl") else ""), "",
                  "| op | per token | us per token |", "|---|---|---|"]
        lines += [f"| `{x['name'][:80]}` | {x['per_token']} | {x['us_per_token']} |" for x in pr["top"]]
    return "\n".join(lines) + "\n"


def _f(v) -> str:
    return "n/a" if v is None else f"{v}"


def _bw(r) -> str:
    b = [v for v in r["h2d_gbps"].values() if v]
    return f"{statistics.mean(b):.1f}" if b else "n/a"


def plot(r: dict[str, Any], path: Path) -> None:
    from toolkit.reporting import figure, save_figure

    fig, ax = figure((7, 4.2))
    for pol in dict.fromkeys(x["policy"] for x in r["rows"]):
        xs = [x for x in r["rows"] if x["policy"] == pol]
        ax.plot([100 * x["pool_fraction"] for x in xs], [x["tpot_ms"] for x in xs], marker="o", label=pol)
    ax.axhline(r["resident_tpot_ms"], color="k", ls="--", lw=1, label="all experts resident")
    if r.get("resident_device_alone"):
        ax.axhline(r["resident_synced_tpot_ms"], color="grey", ls=":", lw=1,
                   label="all experts resident, a host sync per layer")
    ax.set_xlabel("GPU pool (% of the experts)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title(f"GPU tier, {r['device']}")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def write(r: dict[str, Any], json_out: Path) -> tuple[Path, Path]:
    from toolkit.reporting import write_report

    return write_report(r, json_out, markdown, plot)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from toolkit.runtime.policy import parse_policies

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--store", type=Path)
    ap.add_argument("--adapter", type=Path)
    ap.add_argument("--policies", default="on-demand+lru,next-gate+prediction,draft+prediction,oracle+belady")
    ap.add_argument("--fractions", default="0.1,0.25,0.5")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--draft-k", default="2,4,6,8,12")
    ap.add_argument("--decode", choices=["graph", "static", "modules"], default=None)
    ap.add_argument("--experts", choices=["fused", "eager"], default=None,
                    help="the static decoder's expert math (default: fused with --decode graph on fp16, else eager)")
    ap.add_argument("--attention", choices=["fused", "sdpa"], default=None,
                    help="the static decoder's one-position attention (default: fused with graph where it "
                         "covers the model)")
    ap.add_argument("--router", choices=["fused", "model"], default=None,
                    help="the static decoder's one-position routing (default: fused with graph where it "
                         "covers the model)")
    ap.add_argument("--data", type=Path, help="prompts: a JSONL of {\"text\"} (default: the embedded held-out text)")
    ap.add_argument("--verify", choices=["exact", "batched"], default="exact",
                    help="the draft's verification (gpu.GpuEngine's verify)")
    ap.add_argument("--report-mismatches", action="store_true",
                    help="write the figures even if some run's tokens differ from transformers' (marked so)")
    ap.add_argument("--compile", choices=["inductor", "aot_eager"], default=None,
                    help="the static decoder's step through torch.compile with this backend (gpu.GpuEngine)")
    ap.add_argument("--profile-resident", action="store_true",
                    help="also profile an all-resident decode token (kernels and their time; the JSON's "
                         "resident_profile)")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=V[,KEY=V]",
                    help="also each predicting policy with these scheduler settings (window, queue_depth, "
                         "candidate_threshold, min_confidence, read_budget_kib: KiB a layer step or auto, "
                         "reuse_classes=off: +reuse policies with the whole reuse table; host=native: every "
                         "policy with the native runner's scheduler and pool; plan=host: the planner's rows "
                         "folded on the host, not the device; plan=inline: on the device, on the compute "
                         "stream before the layer's sync; launch=torch: every policy with torch's CUDA calls "
                         "on the per-layer path, not the driver's; repeatable)")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args(argv)
    r = run_gpu_bench(a.model, store=a.store, adapter=a.adapter, policies=parse_policies(a.policies),
                      fractions=[float(x) for x in a.fractions.split(",")], prompts=a.prompts,
                      prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens, repeats=a.repeats, device=a.device,
                      ks=tuple(int(x) for x in a.draft_k.split(",")), decode=a.decode, experts=a.experts,
                      attention=a.attention, router=a.router, data=a.data, verify=a.verify,
                      strict=not a.report_mismatches, profile=a.profile_resident, compile=a.compile,
                      variants=tuple(a.variant))
    md, png = write(r, a.json)
    print(md.read_text())
    print(f"wrote {a.json}, {md}, {png}")


if __name__ == "__main__":
    main()
