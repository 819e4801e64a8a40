"""What knowledge of the future buys an eviction: reads per decode token on a trace's routing.

Every position of each held-out sequence goes through a bounded pool one MoE layer at a time (a step
is one layer of one position; misses read on demand, no prefetch), with these evictions:

- `lru`, and `reuse` (toolkit/runtime/reuse.py: histories and the table learned from the train split);
- `reuse-freq`: `reuse` with one table per frequency class of experts (each layer's experts in quarters
  by how often the train split routes to them, a table learned from each quarter's samples, a history
  a quarter never shows taking `reuse`'s entry: adapters/reuse.py), so a hot expert and a cold one
  with the same recent history are told apart (what `train` learns by default);
- Belady's rule knowing the real routing only so far ahead: `belady-token` (the rest of the current
  token), `belady-next-token` (and all of the next token), `belady-next-2-tokens` and
  `belady-next-4-tokens` (and the next 2 or 4 tokens: what a look-ahead of several tokens, a draft's,
  could know at best), and `belady` (everything); beyond what it knows, each variant scores by the
  reuse rule.

`belady` is what the oracle policy's eviction knows, and its reads are the fewest any on-demand
eviction can have (Belady's rule is optimal; counted at decode positions only, that holds in
practice, not as a theorem). The partial ones are estimates, not bounds: what exact knowledge of
the current token's later layers, or also of the next one, two or four tokens', buys with the reuse
rule beyond it (a better rule past the horizon could read less; an engine cannot know later tokens' routing
exactly, only predict it, or draft those tokens and read the draft's routing). What they say is how
much of the oracle's advantage lies in knowledge of tokens after the next one, which only a predictor
of the longer future (as the reuse table is) can recover in part.

Two more rules know each MoE layer's *next visit* only (the next token's routing at that layer, as seen
from the layer's latest visit), and past it score by the reuse rule with the history one unused visit
on: `next-visit` knows it exactly (a ceiling), `adapter-next-visit` predicts it with the adapter's
next-visit heads (`train --next-visit`): the experts among the head's top 2k scores at that layer
count as used at the next visit (a visit whose router input the trace did not store falls back to the
reuse rule); `adapter-next-visit-freq` the same with `reuse-freq`'s tables (as the runners do with
an adapter trained with the default `--reuse-classes 4`, its tables learned here from the same train
split). The adapter rules need `--adapter`, trained with those heads.

Reads are counted at decode positions, the prompt's positions filling the pool first one position a
step (the runners prefill in spans, one step per span and layer, and `simulate` replays decode
tokens only: these figures compare with each other, not with theirs). Rules are on demand (no
window predictions: `reuse` is history only). No timing: bytes only (`reads x slot bytes`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from adapters.reuse import SCALE, learn_class_reuse_table
from toolkit.errors import SpecPrefetchError
from toolkit.runtime.pool import ExpertPool
from toolkit.runtime.reuse import ReuseHistory, next_visit_experts
from toolkit.runtime.runner import belady_next_use
from toolkit.traces.format import DECODE, TraceReader, routing_sequences

# Belady's rule knowing the real routing this many tokens ahead (the current token counts as 1); None: all
HORIZONS = {"belady-token": 1, "belady-next-token": 2, "belady-next-2-tokens": 3, "belady-next-4-tokens": 5,
            "belady": None}
RULES = ("lru", "reuse", "reuse-freq", *HORIZONS, "next-visit")
ADAPTER_RULE = "adapter-next-visit"
ADAPTER_RULES = (ADAPTER_RULE, "adapter-next-visit-freq")
CLASS_RULES = ("reuse-freq", "adapter-next-visit-freq")   # read the frequency-class table


def exact_next_sets(ids: np.ndarray) -> dict[tuple[int, int], set[int]]:
    """The real next visit of every (position, layer) of one sequence [positions, L, k]: the `next-visit` rule."""
    N, L = ids.shape[0], ids.shape[1]
    return {(p, li): set(ids[p + 1, li].tolist()) for p in range(N - 1) for li in range(L)}


def replay(ids: np.ndarray, kinds: np.ndarray, capacity: int, rule: str, table,
           true_next: Callable[[tuple[int, int], int], float] | None = None,
           reads_out: list | None = None,
           next_sets: dict[tuple[int, int], set[int]] | None = None) -> tuple[int, int]:
    """(reads at decode positions, decode positions) of one sequence [positions, L, k] under `rule`.
    `true_next`: the sequence's real next use (belady_next_use of it; built here if not given);
    `reads_out`: gets (layer, [experts read]) of every decode step that reads (`bench reads`);
    `next_sets`: the adapter's next-visit sets for ADAPTER_RULES: {(position, layer): the experts layer
    `layer` routes to at position + 1, as predicted at `position`}; `table`: the reuse table (with
    frequency classes for CLASS_RULES)."""
    N, L, k = ids.shape
    if true_next is None and rule.startswith("belady"):
        true_next = belady_next_use(list(ids), L)
    if rule in CLASS_RULES and (table is None or table.classes is None):
        raise SpecPrefetchError(f"eviction rule {rule!r} needs a reuse table with frequency classes")
    if rule not in CLASS_RULES and table is not None:
        table = table.whole()   # the other rules score by the whole table
    hist = ReuseHistory(table, L) if rule != "lru" and rule != "belady" else None  # the rules that read it
    if rule == "next-visit" and next_sets is None:
        next_sets = exact_next_sets(ids)
    elif rule in ADAPTER_RULES and next_sets is None:
        raise SpecPrefetchError(f"eviction rule {rule!r} needs the adapter's next-visit sets")
    elif rule not in ("next-visit", *ADAPTER_RULES):
        next_sets = None  # the other rules know no next visit

    horizon = HORIZONS.get(rule)

    def next_use(key, now) -> float:
        """A step (in sixteenths) for the pool's belady rule: exact as far as the rule knows, else the
        reuse rule's estimate past that point."""
        t = true_next(key, now)
        lim = None if horizon is None else (now // L + horizon) * L
        if t != float("inf") and (lim is None or t < lim):
            return float(t * SCALE)
        if lim is None:
            return float("inf")
        # not used before `lim`: its layer's first visit from there on, plus the table's estimate for
        # the history those unused visits leave
        v0 = now + ((key[0] - now % L) % L or L)
        v = v0
        while v < lim:
            v += L
        h = (hist.hist[key[0]].get(key[1], 0) << ((v - v0) // L)) & hist.mask
        return float(v * SCALE + L * (table.visits16[h] - SCALE))

    if rule == "lru":
        pool = ExpertPool(capacity, 1, policy="lru", min_slots=k)
    elif rule in ("reuse", "reuse-freq", "next-visit", *ADAPTER_RULES):
        # (the next-visit rules: the runners' ReuseHistory.set_next_visit after the step's acquire, below)
        pool = ExpertPool(capacity, 1, policy="reuse", min_slots=k)
        pool.reuse, pool.predicted = hist, None
    elif rule in RULES:
        pool = ExpertPool(capacity, 1, policy="belady", min_slots=k, next_use=next_use)
    else:
        raise SpecPrefetchError(f"eviction rule {rule!r}: choose from {', '.join((*RULES, *ADAPTER_RULES))}")
    reads = decode = 0
    for p in range(N):
        for li in range(L):
            now = p * L + li
            keys = [(li, int(e)) for e in ids[p, li]]
            if hist is not None:
                hist.observe(now, keys)
            missed = []
            for key in keys:
                s = pool.get(key)
                if s is None:
                    s = pool.reserve(key, now, prefetch=False, protect=set(keys))
                    s.ready = True
                    missed.append(key[1])
                s.pins += 1
            if next_sets is not None and (p, li) in next_sets:  # after the step's acquire, as the runners
                hist.set_next_visit(li, now + L, next_sets[(p, li)])
            if kinds[p] == DECODE:
                reads += len(missed)
                if reads_out is not None and missed:
                    reads_out.append((li, missed))
            for key in keys:
                s = pool.get(key)
                s.pins -= 1
                pool.touch(s, now)
        decode += int(kinds[p] == DECODE)
    return reads, decode


def adapter_next_sets(reader: TraceReader, adapter: Path, seq_ids: list[int],
                      model: str | Path | None = None) -> list[dict[tuple[int, int], set[int]]]:
    """Per held-out sequence (in `seq_ids`' order): {(position, layer): the 2k experts the adapter's
    next-visit head scores highest for that layer at position + 1}, at every position whose router
    input the trace stored."""
    import torch

    from adapters.checkpoint import load_adapter
    from toolkit.models.routers import load_router_bank
    from toolkit.traces.format import trace_model_spec

    spec = trace_model_spec(reader, model)
    ad, _ = load_adapter(Path(adapter), spec)
    if not ad.next_visit:
        raise SpecPrefetchError(f"--adapter {adapter}: it has no next-visit heads (train it with --next-visit)")
    bank = load_router_bank(spec)
    L, M = ad.num_layers, min(ad.num_experts, 2 * reader.top_k)
    where = {q: n for n, q in enumerate(seq_ids)}
    out: list[dict[tuple[int, int], set[int]]] = [{} for _ in seq_ids]
    with torch.no_grad():
        for a in reader.iter_hidden("heldout"):
            keep = np.array([int(q) in where for q in a["seq"]], bool)
            if not keep.any():
                continue
            x = torch.from_numpy(a["hidden"][keep].astype(np.float32))          # [M, L, H]
            seq, pos = a["seq"][keep], a["pos"][keep]
            for li in range(L):  # ranked by raw logit, the lower id first among equals (as the runners)
                s = ad.logits(bank, x[:, li], li, L)                              # [M, E]
                top = next_visit_experts(s, M).numpy()
                for r in range(len(seq)):
                    out[where[int(seq[r])]][(int(pos[r]), li)] = set(top[r].tolist())
    return out


def eviction_bounds(trace: Path, pool_fracs: list[float], *, max_sequences: int | None = None,
                    adapter: Path | None = None, model: str | Path | None = None,
                    progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    reader = TraceReader(trace)
    seqs = routing_sequences(reader, "heldout", with_kind=True)[:max_sequences]
    if not seqs:
        raise SpecPrefetchError(f"trace {trace}: no held-out sequences to replay")
    train = routing_sequences(reader, "train")
    if not train:
        raise SpecPrefetchError(f"trace {trace}: no train split to learn the reuse table from")
    if not any((kinds == DECODE).any() for _, kinds in seqs):
        raise SpecPrefetchError(f"trace {trace}: no held-out decode positions to count reads at (traced with "
                                "--decode-tokens 0?)")
    L, E = len(reader.moe_layers), reader.num_experts
    # the reuse table with reuse-freq's one per frequency class, from one pass over the train split
    # (replay scores by the whole table where the rule takes no classes)
    by_class = learn_class_reuse_table(train, E, where=f"trace {trace}")
    nexts = [belady_next_use(list(ids), L) for ids, _ in seqs]  # each sequence's real next uses, once
    exact = [exact_next_sets(ids) for ids, _ in seqs]              # and its real next visits
    rules = RULES
    sets: list = [None] * len(seqs)
    if adapter is not None:  # routing_sequences orders sequences by id
        seq_ids = sorted({int(q) for q in reader.load("heldout", ("seq",))["seq"]})[:len(seqs)]
        progress("the adapter's next-visit predictions")
        sets = adapter_next_sets(reader, adapter, seq_ids, model)
        if not any(sets):
            raise SpecPrefetchError(f"trace {trace}: its held-out sequences store no router inputs, which the "
                                    "adapter's next-visit heads read")
        rules = (*RULES, *ADAPTER_RULES)
    points = []
    for frac in pool_fracs:
        if not 0 < frac <= 1:
            raise SpecPrefetchError(f"--pool-frac {frac}: a share of the experts in (0, 1]")
        cap = max(reader.top_k, int(round(frac * L * E)))
        row = {"pool_frac": frac, "slots": cap, "reads_per_token": {}}
        for rule in rules:
            progress(f"pool {cap} slots: {rule}")
            r = d = 0
            for (ids, kinds), nu, ns, ex in zip(seqs, nexts, sets, exact):
                a, b = replay(ids, kinds, cap, rule, by_class, nu,
                              next_sets=ns if rule in ADAPTER_RULES else {"next-visit": ex}.get(rule))
                r, d = r + a, d + b
            row["reads_per_token"][rule] = round(r / max(d, 1), 3)
        rp = row["reads_per_token"]
        gap = rp["lru"] - rp["belady"]
        row["share_of_lru_belady_gap"] = {x: round((rp["lru"] - rp[x]) / gap, 3) if gap > 0 else None
                                          for x in rules if x not in ("lru", "belady")}
        points.append(row)
    return {"trace": str(Path(trace).resolve()), "sequences": len(seqs), "layers": L, "experts": E,
            "top_k": reader.top_k, "rules": list(rules), "points": points,
            "adapter": str(Path(adapter).resolve()) if adapter is not None else None}


def markdown(r: dict[str, Any]) -> str:
    if not r["points"]:
        return "No pools replayed."
    lines = [f"Reads per decode token, on demand, {r['sequences']} held-out sequences ({r['layers']} MoE layers x "
             f"{r['experts']} experts, top-{r['top_k']}):", "",
             "| pool (experts) | " + " | ".join(r["rules"]) + " |",
             "|---|" + "---|" * len(r["rules"])]
    for p in r["points"]:
        lines.append(f"| {p['pool_frac']:.0%} ({p['slots']}) | " +
                     " | ".join(f"{p['reads_per_token'][x]:.1f}" for x in r["rules"]) + " |")
    lines += ["", "Share of the LRU-Belady gap each rule closes:", "",
              "| pool (experts) | " + " | ".join(r["points"][0]["share_of_lru_belady_gap"]) + " |",
              "|---|" + "---|" * len(r["points"][0]["share_of_lru_belady_gap"])]
    for p in r["points"]:
        lines.append(f"| {p['pool_frac']:.0%} ({p['slots']}) | " +
                     " | ".join(str(v) for v in p["share_of_lru_belady_gap"].values()) + " |")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from toolkit.reporting import save_figure

    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(r["rules"]))
    w = 0.8 / max(len(r["points"]), 1)
    for i, p in enumerate(r["points"]):
        ax.bar(x + i * w, [p["reads_per_token"][q] for q in r["rules"]], w, label=f"pool {p['pool_frac']:.0%}")
    ax.set_xticks(x + w * (len(r["points"]) - 1) / 2, r["rules"], rotation=15)
    ax.set_ylabel("expert reads per decode token")
    ax.set_title("Eviction knowledge vs reads (on demand)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
