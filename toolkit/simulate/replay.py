"""`specprefetch simulate`: replay a trace's held-out decode tokens through the pool and the
scheduler (the runtime's own code) against a device profile, in virtual time.

Per token and MoE layer: the dense part runs (profile time), the predictor's window is planned,
the layer's real experts are acquired from the pool (a miss or a late prefetch stalls the clock
until flash delivers), the experts compute, the slots are released. Reported per policy
(predictor x eviction): TPOT (mean, p50, p95), stall per token, hit rate, MiB read per token,
wasted prefetch MiB. Geometry (expert and layer bytes) may come from another model's config.json
than the trace's: the routing is then replayed onto that geometry, and the report says so.
"""
from __future__ import annotations

import bisect
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolkit.errors import SpecPrefetchError
from toolkit.metrics import hit_rate, tpot_ms
from toolkit.models.info import aligned, expert_bytes, model_info
from toolkit.models.loader import inspect_model_dir
from toolkit.traces.batches import RoutingBatch, iter_batches
from toolkit.runtime.pool import ExpertPool
from toolkit.runtime.scheduler import SchedulerConfig, WindowScheduler
from toolkit.simulate.flash import SimClock, SimFlash
from toolkit.runtime.profiles import DeviceProfile

BYTES_PER_PARAM = {"fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5625}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What time and bytes depend on: slot bytes, dense bytes per layer, layers, top-k."""
    source: str
    num_layers: int
    num_experts: int
    top_k: int
    slot_bytes: int
    expert_bytes: int
    dense_bytes_per_layer: int
    dtype: str

    @staticmethod
    def from_model(model: str | Path, dtype: str) -> "Geometry":
        spec = inspect_model_dir(model, config_only_ok=True)
        d = model_info(spec)
        g = spec.geometry
        eb = expert_bytes(g, dtype)
        embed = g.vocab_size * g.hidden_size
        dense_params = max(0, d["non_expert_params"] - embed) / max(1, g.num_layers)
        return Geometry(str(spec.path), len(g.moe_layers), g.routing.num_experts, g.routing.top_k,
                        aligned(eb), eb, int(dense_params * BYTES_PER_PARAM[dtype]), dtype)


@dataclasses.dataclass
class Policy:
    predictor: str          # a predictor name, or "on-demand"
    eviction: str = "lru"

    @property
    def name(self) -> str:
        return f"{self.predictor}+{self.eviction}"


def sequences(b: RoutingBatch) -> list[torch.Tensor]:
    """Row indices of each sequence, in position order."""
    out = []
    for q in torch.unique(b.seq).tolist():
        rows = torch.nonzero(b.seq == q).squeeze(1)
        out.append(rows[torch.argsort(b.pos[rows])])
    return out


def simulate_policy(batches: list[RoutingBatch], predictor, policy: Policy, geo: Geometry,
                    profile: DeviceProfile, pool_bytes: int, cfg: SchedulerConfig,
                    layer_map: list[int]) -> dict[str, Any]:
    """Run every held-out sequence's decode tokens through a fresh pool; aggregate."""
    L = geo.num_layers
    W = cfg.window
    tpots, intervals, stalls, tokens = [], [], 0.0, 0
    agg = {"requests": 0, "hits": 0, "late": 0, "misses": 0, "bytes_read": 0, "wasted": 0,
           "prefetch_issued": 0, "dropped_stale": 0, "dropped_low_conf": 0, "dropped_no_slot": 0}
    flash_busy = 0.0
    total_time = 0.0
    for b in batches:
        # predictions of every row: scores[h][i] -> [B, E] for trace layer i (mapped below)
        Lt = b.num_layers
        preds = {}
        if predictor is not None:
            for h in range(1, W + 1):
                for i in range(Lt):
                    if i + h < 2 * Lt:
                        preds[(i, h)] = predictor.scores(b, i, h)
        for rows in sequences(b):
            ids = b.ids[rows]  # [T, Lt, k]
            T = len(rows)
            if T < 2:
                continue
            # real future uses for Belady: key -> sorted steps
            future: dict[tuple[int, int], list[int]] = {}
            for t in range(T):
                for li in range(L):
                    for e in ids[t, layer_map[li]].tolist():
                        future.setdefault((li, e % geo.num_experts), []).append(t * L + li)
            clock = SimClock()
            flash = SimFlash(profile, clock, geo.slot_bytes)
            sched_holder: dict[str, WindowScheduler] = {}

            def next_use(key, now, _f=future):
                if policy.eviction == "belady":
                    steps = _f.get(key, [])
                    j = bisect.bisect_right(steps, now)
                    return steps[j] if j < len(steps) else float("inf")
                return sched_holder["s"].next_predicted_use(key, now)

            pool = ExpertPool(pool_bytes, geo.slot_bytes, policy=policy.eviction, min_slots=geo.top_k,
                              next_use=next_use)
            scfg = dataclasses.replace(cfg, prefetch=predictor is not None)
            sched = WindowScheduler(pool, flash, scfg, num_layers=L, top_k=geo.top_k)
            sched_holder["s"] = sched
            times = []
            reads_seen = 0
            for t in range(T):
                clock.now += profile.token_overhead_ms * 1e-3
                for li in range(L):
                    step = t * L + li
                    clock.now += profile.dense_s(geo.dense_bytes_per_layer)
                    keys = [(li, e % geo.num_experts) for e in ids[t, layer_map[li]].tolist()]
                    keys = list(dict.fromkeys(keys))
                    before = clock.now
                    waiting = sched.acquire(step, keys)  # demand reads go out first
                    stall = clock.now - before
                    if predictor is not None:
                        ti = layer_map[li]
                        window = []
                        for h in range(1, W + 1):
                            tgt = step + h
                            if tgt // L >= T:
                                break
                            # trace horizon that lands on the same (token offset, trace layer)
                            s = preds.get((ti, _trace_h(li, h, L, layer_map, Lt)))
                            if s is None:
                                continue
                            sc = s[rows[t]]
                            if geo.num_experts > sc.shape[0]:
                                sc = torch.nn.functional.pad(sc, (0, geo.num_experts - sc.shape[0]))
                            window.append((tgt, sc))
                        sched.plan(step, window)
                        clock.now += profile.plan_ms_per_layer * 1e-3
                    before = clock.now
                    for key in waiting:
                        sched.wait_ready(key)
                    if t >= 1:  # as the runtime: the first token warms the pool, TPOT starts after it
                        stalls += stall + clock.now - before
                    issued = sched.stats.bytes_read // geo.slot_bytes
                    clock.now += (issued - reads_seen) * profile.read_cpu_us * 1e-6
                    reads_seen = issued
                    clock.now += profile.expert_s(geo.expert_bytes) * len(keys)
                    sched.release(step, keys)
                times.append(clock.now)
                if t == 0:
                    first = dataclasses.replace(sched.stats)
            tpots.append(tpot_ms(times))
            intervals.extend(np.diff(times) * 1e3)
            tokens += T - 1
            total_time += times[-1]
            flash_busy += flash.busy_s
            st = sched.stats
            for k in ("requests", "hits", "late", "misses", "bytes_read", "prefetch_issued",
                      "dropped_stale", "dropped_low_conf", "dropped_no_slot"):
                agg[k] += getattr(st, k) - getattr(first, k)
            agg["wasted"] += pool.wasted_prefetches + sum(1 for s in pool.slots.values() if s.prefetched)
            assert pool.peak_bytes <= pool_bytes
    if not tpots:
        raise SpecPrefetchError("no held-out sequence has two or more decode tokens to time")
    iv = np.asarray(intervals)
    return {
        "policy": policy.name, "predictor": policy.predictor, "eviction": policy.eviction,
        "tokens": tokens, "sequences": len(tpots),
        "tpot_ms": round(float(np.mean(tpots)), 4),
        "tpot_p50_ms": round(float(np.percentile(iv, 50)), 4),
        "tpot_p95_ms": round(float(np.percentile(iv, 95)), 4),
        "stall_ms_per_token": round(stalls / tokens * 1e3, 4),
        "hit_rate": round(hit_rate(agg["hits"], agg["requests"]), 4),
        "late_rate": round(hit_rate(agg["late"], agg["requests"]), 4),
        "mib_read_per_token": round(agg["bytes_read"] / tokens / 2**20, 4),
        "wasted_prefetch_mib": round(agg["wasted"] * geo.slot_bytes / 2**20, 3),
        "flash_utilisation": round(flash_busy / max(total_time, 1e-12), 4),
        "counts": agg,
    }


def _trace_h(li: int, h: int, L: int, layer_map: list[int], Lt: int) -> int:
    """The trace horizon for geometry layer li + h (identity when geometry = trace)."""
    if L == Lt:
        return h
    tgt = li + h
    tok, layer = divmod(tgt, L)
    return tok * Lt + layer_map[layer] - layer_map[li]


def run_simulation(trace: Path, *, policies: list[Policy], profile: DeviceProfile, pool_mib: float,
                   window: int, queue_depth: int = 4, dtype: str = "fp16", geometry: str | None = None,
                   adapter: Path | None = None, model: str | None = None, min_confidence: float = 0.02,
                   step_budget_kib: int | None = None, max_sequences: int | None = None,
                   split: str = "heldout", floor: float = 0.0) -> dict[str, Any]:
    from toolkit.traces.format import trace_model_spec
    from toolkit.predictors.evaluate import build_predictors
    from toolkit.traces.format import TraceReader

    reader = TraceReader(trace)
    spec = trace_model_spec(reader, model)
    geo = Geometry.from_model(geometry or spec.path, dtype)
    Lt = len(reader.moe_layers)
    layer_map = [li * Lt // geo.num_layers for li in range(geo.num_layers)]
    if geo.top_k != spec.geometry.routing.top_k:
        geo = dataclasses.replace(geo, top_k=spec.geometry.routing.top_k)
    batches = list(iter_batches(reader, split, decode_only=True, with_probs=False))
    if max_sequences:
        keep = set(sorted({int(q) for b in batches for q in b.seq.tolist()})[:max_sequences])
        batches = [b.select(torch.tensor([int(q) in keep for q in b.seq.tolist()])) for b in batches]
        batches = [b for b in batches if len(b)]
    if not batches:
        raise SpecPrefetchError(f"trace {trace}: no {split} decode tokens to replay")
    names = sorted({p.predictor for p in policies if p.predictor != "on-demand"})
    preds, notes = build_predictors(names, reader, spec, adapter)
    pool_bytes = int(pool_mib * 2**20)
    cfg = SchedulerConfig(window=window, queue_depth=queue_depth, min_confidence=min_confidence, floor=floor,
                          step_budget_bytes=step_budget_kib * 1024 if step_budget_kib else None)
    results = [simulate_policy(batches, preds.get(p.predictor), p, geo, profile, pool_bytes, cfg, layer_map)
               for p in policies]
    total = geo.slot_bytes * geo.num_layers * geo.num_experts
    return {
        "profile": profile.name, "emulated_device": profile.name != "this-machine",
        "geometry": dataclasses.asdict(geo),
        "routing_from": {"trace": str(Path(trace).resolve()), "model": str(spec.path),
                         "replayed_onto_other_geometry": geo.source != str(spec.path)},
        "pool_mib": pool_mib, "pool_share_of_experts": round(pool_bytes / total, 4),
        "window": window, "queue_depth": queue_depth, "store_dtype": dtype,
        "results": results, "notes": notes,
    }
