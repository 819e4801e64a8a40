"""What knowledge of the future buys an eviction: reads per decode token on a trace's routing.

Every position of each held-out sequence goes through a bounded pool one MoE layer at a time (a step
is one layer of one position; misses read on demand, no prefetch), with these evictions:

- `lru`, and `reuse` (toolkit/runtime/reuse.py: histories and the table learned from the train split);
- Belady's rule knowing the real routing only so far ahead: `belady-token` (the rest of the current
  token), `belady-next-token` (and all of the next token), and `belady` (everything); beyond what
  it knows, each variant scores by the reuse rule.

`belady` is what the oracle policy's eviction knows, and its reads are the fewest any on-demand
eviction can have (Belady's rule is optimal; counted at decode positions only, that holds in
practice, not as a theorem). The other two are estimates, neither bounds: what exact knowledge of
the current token's later layers, or also of the next token's, buys with the reuse rule beyond it
(a better rule past the horizon could read less; an engine cannot know the next token's routing
exactly, only predict it). What they say is how much of the oracle's advantage lies in knowledge of
tokens after the next one, which only a predictor of the longer future (as the reuse table is) can
recover in part.

Reads are counted at decode positions, the prompt's positions filling the pool first one position a
step (the runners prefill in spans, one step per span and layer, and `simulate` replays decode
tokens only: these figures compare with each other, not with theirs). Rules are on demand (no
window predictions: `reuse` is history only). No timing: bytes only (`reads x slot bytes`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from adapters.reuse import SCALE, learn_reuse_table
from toolkit.errors import SpecPrefetchError
from toolkit.runtime.pool import ExpertPool
from toolkit.runtime.reuse import ReuseHistory
from toolkit.runtime.runner import belady_next_use
from toolkit.traces.format import DECODE, TraceReader, routing_sequences

RULES = ("lru", "reuse", "belady-token", "belady-next-token", "belady")


def replay(ids: np.ndarray, kinds: np.ndarray, capacity: int, rule: str, table,
           true_next: Callable[[tuple[int, int], int], float] | None = None,
           reads_out: list | None = None) -> tuple[int, int]:
    """(reads at decode positions, decode positions) of one sequence [positions, L, k] under `rule`.
    `true_next`: the sequence's real next use (belady_next_use of it; built here if not given);
    `reads_out`: gets (layer, [experts read]) of every decode step that reads (`bench reads`)."""
    N, L, k = ids.shape
    if true_next is None and rule.startswith("belady"):
        true_next = belady_next_use(list(ids), L)
    hist = ReuseHistory(table, L) if rule != "lru" and rule != "belady" else None  # the rules that read it

    horizon = {"belady-token": 1, "belady-next-token": 2, "belady": None}.get(rule)

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
    elif rule == "reuse":
        pool = ExpertPool(capacity, 1, policy="reuse", min_slots=k)
        pool.reuse, pool.predicted = hist, None
    elif rule in RULES:
        pool = ExpertPool(capacity, 1, policy="belady", min_slots=k, next_use=next_use)
    else:
        raise SpecPrefetchError(f"eviction rule {rule!r}: choose from {', '.join(RULES)}")
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


def eviction_bounds(trace: Path, pool_fracs: list[float], *, max_sequences: int | None = None,
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
    table = learn_reuse_table(train, reader.num_experts, where=f"trace {trace}")
    L, E = len(reader.moe_layers), reader.num_experts
    nexts = [belady_next_use(list(ids), L) for ids, _ in seqs]  # each sequence's real next uses, once
    points = []
    for frac in pool_fracs:
        if not 0 < frac <= 1:
            raise SpecPrefetchError(f"--pool-frac {frac}: a share of the experts in (0, 1]")
        cap = max(reader.top_k, int(round(frac * L * E)))
        row = {"pool_frac": frac, "slots": cap, "reads_per_token": {}}
        for rule in RULES:
            progress(f"pool {cap} slots: {rule}")
            r = d = 0
            for (ids, kinds), nu in zip(seqs, nexts):
                a, b = replay(ids, kinds, cap, rule, table, nu)
                r, d = r + a, d + b
            row["reads_per_token"][rule] = round(r / max(d, 1), 3)
        rp = row["reads_per_token"]
        gap = rp["lru"] - rp["belady"]
        row["share_of_lru_belady_gap"] = {x: round((rp["lru"] - rp[x]) / gap, 3) if gap > 0 else None
                                          for x in ("reuse", "belady-token", "belady-next-token")}
        points.append(row)
    return {"trace": str(Path(trace).resolve()), "sequences": len(seqs), "layers": L, "experts": E,
            "top_k": reader.top_k, "rules": list(RULES), "points": points}


def markdown(r: dict[str, Any]) -> str:
    lines = [f"Reads per decode token, on demand, {r['sequences']} held-out sequences ({r['layers']} MoE layers x "
             f"{r['experts']} experts, top-{r['top_k']}):", "",
             "| pool (experts) | " + " | ".join(r["rules"]) +
             " | share of the LRU-Belady gap closed: reuse / belady-next-token |",
             "|---|" + "---|" * (len(r["rules"]) + 1)]
    for p in r["points"]:
        g = p["share_of_lru_belady_gap"]
        lines.append(f"| {p['pool_frac']:.0%} ({p['slots']}) | " +
                     " | ".join(f"{p['reads_per_token'][x]:.1f}" for x in r["rules"]) +
                     f" | {g['reuse']} / {g['belady-next-token']} |")
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
