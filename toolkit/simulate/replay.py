"""`specprefetch simulate`: replay a trace's held-out decode tokens through the pool and the
scheduler (the runtime's own code) against a device profile, in virtual time.

Per token and MoE layer: the dense part runs (profile time), the predictor's window is planned,
the layer's real experts are acquired from the pool (a miss or a late prefetch stalls the clock
until flash delivers), the experts compute, the slots are released. Reported per policy
(predictor x eviction): TPOT (mean, p50, p95), stall per token, hit rate, MiB read per token,
wasted prefetch MiB. Geometry (expert and layer bytes) may come from another model's config.json
than the trace's: the routing is then replayed onto that geometry, and the report says so.

TTFT is projected separately (`simulate_prefill`) where the profile states a prefill compute rate: a
prompt of `prompt_tokens` positions made of the held-out prompts' real routing, laid end to end, goes
through a fresh pool in spans of PREFILL_SPAN positions, layer by layer, as both runners feed a prompt:
at each MoE layer of a span the union of its positions' experts is acquired (in groups that fit the
pool) and the window is planned from the span's predictions (each expert's best score over its
positions), while the layer's compute takes its FLOPs at the profile's rate.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from toolkit.errors import SpecPrefetchError
from toolkit.models.info import aligned, expert_bytes, model_info
from toolkit.models.loader import inspect_model_dir
from toolkit.traces.batches import RoutingBatch, iter_batches
from toolkit.traces.format import PREFILL
from toolkit.runtime.backend import PREFILL_SPAN, chunk_plan, prefill_spans
from toolkit.runtime.policy import Policy
from toolkit.runtime.reuse import next_visit_experts, next_visit_size
from toolkit.runtime.runner import RunConfig, open_pool_and_scheduler
from toolkit.runtime.scheduler import SchedulerStats
from toolkit.runtime.stats import DecodeAccount, RunStats, tpot_and_intervals
from toolkit.simulate.flash import SimClock, SimFlash
from toolkit.runtime.profiles import DeviceProfile, check_budget_kib

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
    prefill_layer_params: int = -1   # dense weights per MoE layer at prefill (no LM head); -1: as decode's
    head_params: int = 0             # the LM head's weights, computed once at prefill (the last position)

    @staticmethod
    def from_model(model: str | Path, dtype: str) -> "Geometry":
        spec = inspect_model_dir(model, config_only_ok=True)
        d = model_info(spec)
        g = spec.geometry
        eb = expert_bytes(g, dtype)
        embed = g.vocab_size * g.hidden_size
        dense_params = max(0, d["non_expert_params"] - embed) / max(1, g.num_layers)
        tied = getattr(spec.config, "tie_word_embeddings", None)
        if tied is None:
            tied = getattr(getattr(spec.config, "text_config", None), "tie_word_embeddings", True)
        # prefill: every decoder layer's dense weights (dense layers included) charged to the MoE layers,
        # the untied LM head left out (it runs once, for the last position)
        layers = max(0, d["non_expert_params"] - embed - (0 if tied else embed))
        return Geometry(str(spec.path), len(g.moe_layers), g.routing.num_experts, g.routing.top_k,
                        aligned(eb), eb, int(dense_params * BYTES_PER_PARAM[dtype]), dtype,
                        prefill_layer_params=layers // max(1, len(g.moe_layers)), head_params=embed)

    def prefill_flops(self, tokens: int) -> tuple[float, float]:
        """(dense, expert) FLOPs of one MoE layer over `tokens` prompt positions: two per weight per
        position, every position through the dense part and its top-k experts (attention's
        position-by-position products left out: a few percent at 512 positions; the LM head is
        `head_flops`, once per prompt)."""
        per = BYTES_PER_PARAM[self.dtype]
        dense = (self.prefill_layer_params if self.prefill_layer_params >= 0
                 else self.dense_bytes_per_layer / per)
        return 2.0 * dense * tokens, 2.0 * self.expert_bytes / per * tokens * self.top_k

    def head_flops(self) -> float:
        """The LM head's FLOPs for the prompt's last position (the only one whose logits are used)."""
        return 2.0 * self.head_params


def sequences(b: RoutingBatch) -> list[torch.Tensor]:
    """Row indices of each sequence, in position order."""
    out = []
    for q in torch.unique(b.seq).tolist():
        rows = torch.nonzero(b.seq == q).squeeze(1)
        out.append(rows[torch.argsort(b.pos[rows])])
    return out


def warm_with_prompt(sched, pool, prompt: torch.Tensor, spans: list[int], L: int) -> None:
    """The pool as a runner's prefill leaves it: each span of the prompt (`prompt` [n, L, k], mapped
    expert ids) layer by layer, each MoE layer acquiring the span's union of experts (resident
    ones first, in groups of at most the pool's capacity) at step p0 * L + layer, as both runners
    feed a prompt. Nothing is prefetched here, where the runners' `plan_chunk` also plans during the
    prompt (its predictors would need the prompt positions' router inputs, which a trace keeps for
    decode rows only). Measured against the native runner (docs/benchmarks.md section 19) the decode
    bytes are the runner's for every policy (within 0.6 MiB a token for adapter + prediction)."""
    p0 = 0
    for T in spans:
        for li in range(L):
            users = sorted({int(e) for e in prompt[p0:p0 + T, li].reshape(-1).tolist()})
            order = sorted(users, key=lambda e: (pool.get((li, e)) is None, e))
            G = pool.capacity
            for a in range(0, len(order), G):
                keys = [(li, e) for e in order[a:a + G]]
                sched.acquire(p0 * L + li, keys)
                for key in keys:
                    sched.data(key)
                sched.release(p0 * L + li, keys)
        p0 += T


def simulate_policy(batches: list[RoutingBatch], predictor, geo: Geometry, profile: DeviceProfile,
                    cfg: RunConfig, layer_map: list[int], reuse=None,
                    prompts: dict[int, tuple[np.ndarray, list[int]]] | None = None) -> dict[str, Any]:
    """Run every held-out sequence's decode tokens through a fresh pool; aggregate into RunStats.
    `prompts`, if given: per sequence, its prompt positions' routing [n, Lt, k] and the spans a runner
    feeds them in (`prefill_spans`): the pool starts as that prefill leaves it (`warm_with_prompt`),
    the oracle's and Belady's future includes those positions, and decode steps are numbered from
    position n, as the runners number them; else the pool starts empty at the first decode token."""
    L = geo.num_layers
    W = cfg.window
    policy = cfg.policy
    pool_bytes = cfg.budget_bytes
    tpots, intervals, tokens = [], [], 0
    decode = SchedulerStats()
    wasted = evictions = peak = 0
    flash_busy = total_time = 0.0
    total_bytes = 0
    for b in batches:
        # predictions of every row: scores[h][i] -> [B, E] for trace layer i (mapped below)
        Lt = b.num_layers
        preds = {}
        # the adapter's next-visit heads, for the reuse eviction (toolkit/runtime/reuse.py): horizons Lt, 2Lt, ...
        visits = cfg.visits_read(getattr(predictor, "next_visits", 0))
        if predictor is not None:
            for h in range(1, W + 1):
                for i in range(Lt):
                    if i + h < 2 * Lt:
                        preds[(i, h)] = predictor.scores(b, i, h)
        nv_top = {}  # per trace layer, each visit's predictions [rows, 2k], ranked as the runners rank the graph's rows
        if visits:   # (each set cut to next_visit_size at the pool's capacity, below)
            nv_top = {i: [next_visit_experts(predictor.next_visit_logits(b.hidden[:, i], i, j), 2 * b.ids.shape[-1])
                          % geo.num_experts for j in range(1, visits + 1)] for i in range(Lt)}
        for rows in sequences(b):
            ids = b.ids[rows]  # [T, Lt, k]
            T = len(rows)
            if T < 2:
                continue
            future = [torch.stack([ids[t, layer_map[li]] % geo.num_experts for li in range(L)]) for t in range(T)]
            warm = (prompts or {}).get(int(b.seq[rows[0]]))
            off = 0   # decode row t is position off + t: its steps (off + t) * L + layer
            if warm is not None:
                pids = torch.as_tensor(warm[0], dtype=torch.long)[:, layer_map] % geo.num_experts   # [n, L, k]
                off = len(pids)
                if int(b.pos[rows[0]]) != off:
                    raise SpecPrefetchError(f"sequence {int(b.seq[rows[0]])}: {off} prompt positions of routing, "
                                            f"but its first decode row is position {int(b.pos[rows[0]])}")
                future = list(pids) + future
            clock = SimClock()
            flash = SimFlash(profile, clock, geo.slot_bytes)
            pool, sched = open_pool_and_scheduler(cfg, slot_bytes=geo.slot_bytes, num_layers=L, top_k=geo.top_k,
                                                  io=flash, future=future, prefetch=predictor is not None,
                                                  clock=lambda: clock.now, reuse=reuse,
                                                  units=warm[1] if warm is not None else ())   # Belady's steps
            if warm is not None:
                warm_with_prompt(sched, pool, pids, warm[1], L)
            # each next-visit set's size at this pool (its capacity is fixed in the simulator)
            n_set = next_visit_size(b.ids.shape[-1], predictor.bank.weight.shape[1], pool.capacity, L) if visits else 0
            account = DecodeAccount()
            t_start, busy0 = clock.now, flash.busy_s   # the decode's figures: not the prompt's reads
            # from a prefilled pool the figures count from the first token (the prefill's), as the
            # runner's: every decode row is timed and counted; from an empty pool the first row warms it
            times = [t_start] if warm is not None else []
            if warm is not None:
                account.start(sched, pool)
            reads_seen = sched.stats.bytes_read // geo.slot_bytes
            for t in range(T):
                clock.now += profile.token_overhead_ms * 1e-3
                token_bytes0 = sched.stats.bytes_read
                for li in range(L):
                    step = (off + t) * L + li
                    clock.now += profile.dense_s(geo.dense_bytes_per_layer)
                    keys = list(dict.fromkeys((li, int(e)) for e in future[off + t][li].tolist()))
                    sched.acquire(step, keys)  # demand reads go out first
                    if visits:  # this layer's next visits: the next tokens' same trace layer
                        sched.reuse.set_next_visits(li, step + L,
                                                    [v[rows[t], :n_set].tolist() for v in nv_top[layer_map[li]]])
                    if predictor is not None:
                        ti = layer_map[li]
                        window = []
                        for h in range(1, W + 1):
                            tgt = step + h
                            if tgt // L >= off + T:
                                break
                            # trace horizon that lands on the same (token offset, trace layer)
                            th = _trace_h(li, h, L, layer_map, Lt)
                            if th > 0:
                                sc = preds.get((ti, th))
                                row = rows[t]
                            else:
                                # a geometry layer that replays the current trace layer again (more geometry
                                # layers than trace layers): the prediction of that trace layer made one trace
                                # layer earlier (for trace layer 0, the previous token's cross-token one)
                                sc, row = _copy_prediction(preds, ti, Lt, rows, t)
                            if sc is None:
                                continue
                            sc = sc[row]
                            if geo.num_experts > sc.shape[0]:
                                sc = torch.nn.functional.pad(sc, (0, geo.num_experts - sc.shape[0]))
                            window.append((tgt, sc))
                        sched.plan(step, window)
                        clock.now += profile.plan_ms_per_layer * 1e-3
                    for key in keys:
                        sched.data(key)  # waits (virtual time) for bytes still in flight
                    issued = sched.stats.bytes_read // geo.slot_bytes
                    clock.now += (issued - reads_seen) * profile.read_cpu_us * 1e-6
                    reads_seen = issued
                    clock.now += profile.expert_s(geo.expert_bytes) * len(keys)
                    sched.release(step, keys)
                if sched.stats.bytes_read > token_bytes0:   # a token that issued a read: the cost of streaming
                    clock.now += profile.streaming_token_ms * 1e-3
                times.append(clock.now)
                if t == 0 and warm is None:  # the first row warms the pool; figures count from its token on
                    account.start(sched, pool)
            tpot, iv = tpot_and_intervals(times)
            tpots.append(tpot)
            intervals.extend(iv)
            tokens += len(times) - 1
            total_time += times[-1] - t_start
            flash_busy += flash.busy_s - busy0
            d, w, ev = account.counts(sched, pool)
            decode = decode.plus(d)
            total_bytes += sched.stats.bytes_read
            wasted += w
            evictions += ev
            peak = max(peak, pool.peak_bytes)
            if pool.peak_bytes > pool_bytes:
                raise RuntimeError(f"simulated pool exceeded its budget ({pool.peak_bytes} > {pool_bytes}): a bug")
    if not tpots:
        raise SpecPrefetchError("no held-out sequence has two or more decode tokens to time")
    st = RunStats.from_counts(policy=policy.name, decode=decode, total_bytes_read=total_bytes, ttft_s=0.0,
                              tpots_ms=tpots, intervals_ms=intervals, decode_tokens=tokens,
                              wasted_prefetches=wasted, evictions=evictions, slot_bytes=geo.slot_bytes,
                              peak_pool_bytes=peak, budget_bytes=pool_bytes).to_json()
    del st["ttft_ms"]  # replay starts from recorded routing: there is no prefill to time
    return {**st, "predictor": policy.predictor, "eviction": policy.eviction, "tokens": tokens,
            "sequences": len(tpots), "flash_utilisation": round(flash_busy / max(total_time, 1e-12), 4)}


def prompt_rows(b: RoutingBatch, tokens: int) -> torch.Tensor:
    """Rows of a `tokens`-position prompt: the batch's prompt (PREFILL) positions of each sequence in
    position order, sequences laid end to end in id order, cut at `tokens` (fewer if the trace has
    fewer)."""
    out, n = [], 0
    where = torch.nonzero(b.kind == PREFILL).squeeze(1)
    for rows in sequences(b.select(b.kind == PREFILL)):
        out.append(where[rows[: tokens - n]])
        n += len(out[-1])
        if n >= tokens:
            break
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def simulate_prefill(b: RoutingBatch, rows: torch.Tensor, predictor, geo: Geometry, profile: DeviceProfile,
                     cfg: RunConfig, layer_map: list[int], reuse=None) -> dict[str, Any]:
    """TTFT of a prompt whose positions route as `rows` of the prompt batch `b` (prompt_rows), from
    an empty pool, as both runners feed a prompt: spans of PREFILL_SPAN positions, each MoE layer
    acquiring the span's union of experts (in groups of at most the pool's capacity), the window
    planned from the span's best score per expert (the runners' `plan_chunk`: past the last MoE
    layer, the next span's first layers, from the cross-token scores), each expert computed as soon
    as its bytes have landed (`compute_order`, so reads overlap the compute of experts already in),
    compute at `profile.prefill_gflops`, the LM head once. Targets past the prompt are not planned.
    (The oracle's cross-span rows are the next positions of the span's own rows, not the next span's
    union: an approximation of the runners' oracle there.)"""
    L, T = geo.num_layers, len(rows)
    Lt, W = b.num_layers, cfg.window
    gflops = profile.prefill_gflops
    spans = [min(PREFILL_SPAN, T - p0) for p0 in range(0, T, PREFILL_SPAN)]
    ids = b.ids[rows]
    future = [torch.stack([ids[t, layer_map[li]] % geo.num_experts for li in range(L)]) for t in range(T)]
    clock = SimClock()
    flash = SimFlash(profile, clock, geo.slot_bytes)
    pool, sched = open_pool_and_scheduler(cfg, slot_bytes=geo.slot_bytes, num_layers=L, top_k=geo.top_k, io=flash,
                                          future=future, prefetch=predictor is not None, units=spans,
                                          clock=lambda: clock.now, reuse=reuse)
    preds = {}
    if predictor is not None:
        # what the runners' span batch knows (planner.ChunkState.batch): a span's later positions have
        # their previous position inside the span, whose later layers have not run, so only each span's
        # first position has a previous one (the prompt's position before it, none at position 0)
        prev_ids, has_prev = b.prev_ids.clone(), torch.zeros_like(b.has_prev)
        for p0 in range(PREFILL_SPAN, T, PREFILL_SPAN):
            prev_ids[rows[p0]] = b.ids[rows[p0 - 1]]
            has_prev[rows[p0]] = True
        bs = dataclasses.replace(b, prev_ids=prev_ids, has_prev=has_prev)
        for h in range(1, W + 1):
            for i in range(Lt):
                if i + h < 2 * Lt:
                    preds[(i, h)] = predictor.scores(bs, i, h)[rows]
    reads_seen = 0
    p0 = 0
    end = T * L
    for n in spans:
        dense_flops, expert_flops = geo.prefill_flops(n)
        for li in range(L):
            step = p0 * L + li
            clock.now += dense_flops / (gflops * 1e9) + profile.layer_overhead_us * 1e-6
            keys = list(dict.fromkeys((li, int(e)) for t in range(p0, p0 + n) for e in future[t][li].tolist()))
            groups = [keys[g: g + pool.capacity] for g in range(0, len(keys), pool.capacity)]
            for gi, group in enumerate(groups):
                sched.acquire(step, group)
                if gi == len(groups) - 1 and predictor is not None:
                    window = []
                    ti = layer_map[li]
                    for h in range(1, W + 1):
                        target = step + h + ((n - 1) * L if li + h >= L else 0)   # the runners' _target
                        if target >= end:
                            break
                        th = _trace_h(li, h, L, layer_map, Lt)
                        sc = preds.get((ti, th)) if th > 0 else (preds.get((ti - 1, 1)) if ti > 0 else None)
                        if sc is None:
                            continue
                        sc = sc[p0: p0 + n].float().amax(0)
                        if geo.num_experts > sc.shape[0]:
                            sc = torch.nn.functional.pad(sc, (0, geo.num_experts - sc.shape[0]))
                        window.append((target, sc))
                    sched.plan(step, window)
                    clock.now += profile.plan_ms_per_layer * 1e-3
                # each expert as soon as its bytes are in (the others still loading): its share of the
                # layer's expert FLOPs, and its weights from DRAM once
                per_expert = expert_flops / len(keys) / (gflops * 1e9)
                if profile.dram_effective_gbs:
                    per_expert += geo.expert_bytes / (profile.dram_effective_gbs * 1e9)
                for i in sched.compute_order(group):
                    sched.data(group[i])
                    clock.now += per_expert
                issued = sched.stats.bytes_read // geo.slot_bytes
                clock.now += (issued - reads_seen) * profile.read_cpu_us * 1e-6
                reads_seen = issued
                sched.release(step, group, pump=gi == len(groups) - 1)
        p0 += n
    ttft = clock.now + geo.head_flops() / (gflops * 1e9) + profile.token_overhead_ms * 1e-3
    st = sched.stats
    return {"prompt_tokens": T, "ttft_ms": round(ttft * 1e3, 3), "prefill_tokens_per_s": round(T / ttft, 2),
            "prefill_stall_ms": round(st.wait_s * 1e3, 3), "prefill_mib_read": round(st.bytes_read / 2**20, 1),
            "prefill_hit_rate": round(st.hits / max(1, st.requests), 4),
            "prefill_flash_utilisation": round(flash.busy_s / max(ttft, 1e-12), 4)}


def _trace_h(li: int, h: int, L: int, layer_map: list[int], Lt: int) -> int:
    """The trace horizon for geometry layer li + h (identity when geometry = trace)."""
    if L == Lt:
        return h
    tgt = li + h
    tok, layer = divmod(tgt, L)
    return tok * Lt + layer_map[layer] - layer_map[li]


def _prompt_batch(reader, split: str, tokens: int, profile: DeviceProfile) -> tuple[RoutingBatch, torch.Tensor]:
    """(batch, rows) of a `tokens`-position prompt from the split's prompt positions (TTFT)."""
    if not profile.prefill_gflops:
        raise SpecPrefetchError(f"--prompt-tokens {tokens}: profile {profile.name!r} states no prefill compute "
                                "rate (prefill_gflops); pass --prompt-tokens 0 or a profile that has one")
    parts = list(iter_batches(reader, split, with_probs=False))
    if not parts:
        raise SpecPrefetchError(f"trace {reader.path}: no {split} positions for a --prompt-tokens prompt")
    b = RoutingBatch(**{f.name: (None if getattr(parts[0], f.name) is None
                                 else torch.cat([getattr(x, f.name) for x in parts]))
                        for f in dataclasses.fields(RoutingBatch)})
    rows = prompt_rows(b, tokens)
    if len(rows) < tokens:
        raise SpecPrefetchError(f"--prompt-tokens {tokens}: trace {reader.path}'s {split} prompts hold only "
                                f"{len(rows)} positions")
    return b, rows


def _mapping_note(Lt: int, Et: int, geo: Geometry) -> str | None:
    """How the trace's layers and experts land on another geometry, in words (None when they are the same)."""
    if Lt == geo.num_layers and Et == geo.num_experts:
        return None
    parts = []
    if Lt != geo.num_layers:
        parts.append(f"geometry MoE layer i replays trace layer floor(i x {Lt} / {geo.num_layers}) (each trace layer "
                     f"drives {geo.num_layers / Lt:g} consecutive layers; a layer that repeats the trace layer "
                     "before it is predicted by that trace layer's prediction made one trace layer earlier)")
    if Et < geo.num_experts:
        parts.append(f"trace expert e is geometry expert e: only {Et} of each layer's {geo.num_experts} experts are "
                     f"ever routed to, so a pool's share of the experts routed to is {geo.num_experts / Et:g}x its "
                     "share of all experts (hit rates are optimistic; an expert the trace never routes to is in the "
                     "reuse table's coldest frequency class)")
    elif Et > geo.num_experts:
        parts.append(f"trace expert e is geometry expert e mod {geo.num_experts} (the reuse eviction scores by "
                     "its whole table: the frequency classes are the trace's experts', not the folded ones')")
    return "; ".join(parts)


def _copy_prediction(preds: dict, ti: int, Lt: int, rows: torch.Tensor, t: int):
    """(scores, row) of trace layer ti predicted one trace layer before it: (ti-1, h=1) of the same token,
    or (Lt-1, h=1) of the previous token for ti = 0; (None, None) where there is none."""
    if ti > 0:
        return preds.get((ti - 1, 1)), rows[t]
    if t > 0:
        return preds.get((Lt - 1, 1)), rows[t - 1]
    return None, None


def reuse_for(reader, adapter: Path | None, spec):
    """The reuse eviction's table: the adapter's (checked against the trace's model `spec` as every adapter
    is, by its metadata, without loading its weights), or without an adapter learned from the trace's train
    split now (what `train` stores in an adapter trained on it)."""
    from adapters.checkpoint import adapter_reuse_table
    from adapters.reuse import learn_class_reuse_table
    from toolkit.traces.format import routing_sequences

    if adapter is not None:
        return adapter_reuse_table(Path(adapter), spec)
    seqs = routing_sequences(reader, "train")
    if not seqs:
        raise SpecPrefetchError(f"trace {reader.path}: eviction 'reuse' learns its table from the train split, "
                                "which this trace lacks; pass --adapter (one trained with its reuse table)")
    return learn_class_reuse_table(seqs, reader.num_experts, where=f"trace {reader.path}")


def decode_step_s(profile: DeviceProfile, geo) -> float:
    """One decode step's compute in the simulator (a MoE layer of one token, nothing waited for): the
    dense part and the top-k experts, as simulate_policy charges them."""
    return profile.dense_s(geo.dense_bytes_per_layer) + geo.top_k * profile.expert_s(geo.expert_bytes)


def with_routing(b: RoutingBatch, routing: dict[int, np.ndarray], trace: Path) -> RoutingBatch:
    """The batch with its selected experts (this token's, the next's and the previous one's) taken from
    `routing` [positions, L, k] per sequence, at the rows' own positions."""
    ids, nxt, prv = b.ids.clone(), b.next_ids.clone(), b.prev_ids.clone()
    for i, (q, p) in enumerate(zip(b.seq.tolist(), b.pos.tolist())):
        r = routing.get(q)
        if r is None or p >= len(r) or tuple(r.shape[1:]) != tuple(ids.shape[1:]):
            raise SpecPrefetchError(f"trace {trace}: sequence {q} position {p} has no routing to replace "
                                    f"({'none given' if r is None else f'{len(r)} positions of {tuple(r.shape[1:])}'}"
                                    f", the trace's rows are {tuple(ids.shape[1:])})")
        ids[i] = torch.as_tensor(r[p], dtype=ids.dtype)
        if bool(b.has_next[i]):   # (run_simulation checked the lengths: position p + 1 is there)
            nxt[i] = torch.as_tensor(r[p + 1], dtype=ids.dtype)
        if bool(b.has_prev[i]):
            prv[i] = torch.as_tensor(r[p - 1], dtype=ids.dtype)
    return dataclasses.replace(b, ids=ids, next_ids=nxt, prev_ids=prv)


def run_simulation(trace: Path, *, policies: list[Policy], profile: DeviceProfile, pool_mib: float,
                   window: int, queue_depth: int = 4, dtype: str = "fp16", geometry: str | None = None,
                   adapter: Path | None = None, model: str | None = None, min_confidence: float = 0.02,
                   step_budget_kib: int | None = None, read_budget_kib: int | str | None = None,
                   max_sequences: int | None = None,
                   split: str = "heldout", candidate_threshold: float = 0.0, prompt_tokens: int = 0,
                   next_visit: bool = True, routing: dict[int, np.ndarray] | None = None,
                   prefill_chunks: Sequence[int] | None = None, reuse_classes: bool = True,
                   next_visits: int | None = None) -> dict[str, Any]:
    """Replay the trace's `split` decode tokens under each policy. `routing`, if given: per traced
    sequence, the experts [positions, L, k] another engine selected at each position of the same tokens
    (a bundle's, from its runs), replayed instead of the trace's own (whose router inputs the
    predictors still read). `prefill_chunks`, with `routing`: each sequence's pool starts as a runner's
    prefill of its prompt leaves it, the prompt fed in chunks of these sizes (a bundle's
    `graphs.prefill_chunks`; () feeds one position at a time), instead of empty."""
    from toolkit.traces.format import trace_model_spec
    from toolkit.predictors.evaluate import build_predictors
    from toolkit.traces.format import TraceReader

    if max_sequences is not None and max_sequences < 1:
        raise SpecPrefetchError(f"--max-sequences {max_sequences}: must be at least 1 "
                                "(leave it out to replay every sequence)")
    reader = TraceReader(trace)
    spec = trace_model_spec(reader, model)
    geo = Geometry.from_model(geometry or spec.path, dtype)
    Lt = len(reader.moe_layers)
    layer_map = [li * Lt // geo.num_layers for li in range(geo.num_layers)]
    if geo.top_k != spec.geometry.routing.top_k:
        geo = dataclasses.replace(geo, top_k=spec.geometry.routing.top_k)
    batches = list(iter_batches(reader, split, decode_only=True, with_probs=False))
    warm = None
    if routing is not None:
        span: dict[int, tuple[int, int]] = {}   # per sequence: its first and last decode positions
        for b in batches:
            for q, pos in zip(b.seq.tolist(), b.pos.tolist()):
                lo, hi = span.get(q, (pos, pos))
                span[q] = (min(lo, pos), max(hi, pos))
        for q, (_, n) in span.items():   # the same positions: a routing per position the trace replays
            r = routing.get(q)
            if r is None or len(r) != n + 1:
                raise SpecPrefetchError(f"trace {trace}: sequence {q} replays positions 0..{n}, but the routing "
                                        f"given for it covers {'none' if r is None else len(r)}: not the same "
                                        "tokens (another tokenization, or a run of another length)")
        batches = [with_routing(b, routing, trace) for b in batches]
        if prefill_chunks is not None:   # each sequence's prompt: the positions before its first decode row
            warm = {q: (routing[q][:n], prefill_spans(chunk_plan(n, prefill_chunks))) for q, (n, _) in span.items()}
    if max_sequences is not None:
        keep = set(sorted({int(q) for b in batches for q in b.seq.tolist()})[:max_sequences])
        batches = [b.select(torch.tensor([int(q) in keep for q in b.seq.tolist()])) for b in batches]
        batches = [b for b in batches if len(b)]
    if not batches:
        raise SpecPrefetchError(f"trace {trace}: no {split} decode tokens to replay")
    names = sorted({p.predictor for p in policies if p.predictor != "on-demand"})
    preds, notes = build_predictors(names, reader, spec, adapter)
    pool_bytes = int(pool_mib * 2**20)
    if pool_bytes // geo.slot_bytes < geo.top_k:
        raise SpecPrefetchError(f"--pool-mib {pool_mib:g}: holds {pool_bytes // geo.slot_bytes} expert slots of "
                                f"{geo.slot_bytes / 2**10:.0f} KiB, but one layer needs {geo.top_k}; use at least "
                                f"{geo.top_k * geo.slot_bytes / 2**20:.2f}")
    auto_budget = None
    if read_budget_kib == "auto":  # what the profile's flash delivers in one decode step of its compute
        auto_budget = profile.read_budget(geo.slot_bytes, decode_step_s(profile, geo), queue_depth)
        read_budget_kib = auto_budget["kib"]
    check_budget_kib(read_budget_kib, geo.slot_bytes, "--read-budget-kib")
    reuse = reuse_for(reader, adapter, spec) if any(p.eviction == "reuse" for p in policies) else None
    if reuse is not None and (geo.num_layers, geo.num_experts) != (Lt, reader.num_experts):
        reuse = reuse.onto(layer_map, geo.num_experts)   # frequency classes of the routing's own layers
    prompt = _prompt_batch(reader, split, prompt_tokens, profile) if prompt_tokens else None
    results = []
    for p in policies:
        rc = RunConfig(policy=p, pool_mib=pool_mib, window=window, queue_depth=queue_depth,
                       min_confidence=min_confidence, candidate_threshold=candidate_threshold,
                       step_budget_kib=step_budget_kib, read_budget_kib=read_budget_kib, next_visit=next_visit,
                       next_visits=next_visits, reuse_classes=reuse_classes)
        r = simulate_policy(batches, preds.get(p.predictor), geo, profile, rc, layer_map, reuse=reuse, prompts=warm)
        if prompt is not None:
            r.update(simulate_prefill(*prompt, preds.get(p.predictor), geo, profile, rc, layer_map, reuse=reuse))
        results.append(r)
    total = geo.slot_bytes * geo.num_layers * geo.num_experts
    return {
        "profile": profile.name, "emulated_device": profile.name != "this-machine",
        "geometry": dataclasses.asdict(geo),
        "routing_from": {"trace": str(Path(trace).resolve()), "model": str(spec.path),
                         "replaced": routing is not None,   # the experts another engine selected
                         "pool_warmed_by_prefill": warm is not None,

                         "replayed_onto_other_geometry": geo.source != str(spec.path),
                         "trace_layers": Lt, "trace_experts": reader.num_experts,
                         "mapping": _mapping_note(Lt, reader.num_experts, geo)},
        "pool_mib": pool_mib, "pool_share_of_experts": round(pool_bytes / total, 4),
        # the trace routes to at most its own model's experts per layer: against those, the pool's share
        "pool_share_of_routed_experts": round(pool_bytes / (geo.slot_bytes * geo.num_layers
                                                            * min(geo.num_experts, reader.num_experts)), 4),
        "window": window, "queue_depth": queue_depth, "store_dtype": dtype,
        "next_visit": next_visit,  # whether adapter+reuse read the adapter's next-visit heads (where it has them)
        "next_visits": next_visits,   # at most this many of them (None: all the adapter has)
        # whether the reuse eviction scored by the table's frequency classes (asked for, and the table has them
        # on this geometry: not where experts fold, replay's onto)
        "reuse_classes": bool(reuse_classes and reuse is not None and reuse.classes is not None),
        "read_budget_kib": read_budget_kib, "read_budget_auto": auto_budget,
        "prefill": None if prompt is None else {
            "prompt_tokens": len(prompt[1]), "prefill_gflops": profile.prefill_gflops, "span": PREFILL_SPAN,
            "routing": f"the {split} prompts' positions laid end to end (each sequence's prompt in order)"},
        "results": results, "notes": notes,
    }
