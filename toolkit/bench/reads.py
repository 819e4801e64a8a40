"""Fewer, larger reads: does an expert store ordered by co-activation pay? (`bench reads`)

Experts that a token routes to together could sit next to each other in the store, so that a step's
reads of one layer merge into fewer, larger requests. This bench measures whether that pays, with real
O_DIRECT reads of an expert store, before any store format or runner is changed for it:

- The order: per MoE layer, a path through the experts that keeps pairs routed together often
  (counted on the trace's train split) next to each other: the heaviest co-activation pairs are
  linked first, each expert to at most two others, without cycles (the greedy heuristic for a
  maximum-weight Hamiltonian path), and the paths are laid end to end.
- The reads: the held-out sequences go through a bounded pool on demand with LRU eviction, one MoE
  layer of one position a step (the prompt fills the pool first); each decode step reads its misses.
  `--pool-frac 0` reads every routed expert (no pool).
- Three layouts of the same reads, timed in interleaved rounds (ABC, CBA, ...): the store's order with one request per
  expert (what the runners do), the store's order with a step's adjacent experts merged into one
  request, and the co-activation order with them merged. A layout's reads are timed at the offsets a
  store in that order would give them (same sizes, same alignment, in the store file given). A step's
  requests go out together on `--lanes` read threads (the native runner's five at its default queue
  depth), and the next step starts when all have landed: the read time alone, no compute to hide it.
- Beside the measurement, the same requests through the simulator's flash model (toolkit/simulate/
  flash.py) for a device profile (default: the phone's): the estimate for hardware that is not here.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from toolkit.errors import SpecPrefetchError
from toolkit.metrics import median
from toolkit.runtime.expert_store import ExpertStore
from toolkit.runtime.profiles import DeviceProfile
from toolkit.simulate.bounds import replay
from toolkit.traces.format import DECODE, TraceReader, routing_sequences

LAYOUTS = ("store", "store-merged", "coactivation-merged")


def coactivation_order(seqs: list[np.ndarray], num_experts: int) -> list[list[int]]:
    """Per MoE layer, the experts in an order that keeps often co-routed pairs adjacent.
    `seqs`: routed ids [positions, L, k] per sequence."""
    ids = np.concatenate(seqs)
    E, L = num_experts, ids.shape[1]
    iu = np.triu_indices(E, 1)
    orders = []
    for li in range(L):
        x = np.zeros((len(ids), E))
        np.put_along_axis(x, ids[:, li], 1.0, axis=1)   # tokens x experts: routed or not
        weights = (x.T @ x).astype(np.int64)[iu]        # co-routed counts of every pair
        parent, deg = list(range(E)), [0] * E
        adj: list[list[int]] = [[] for _ in range(E)]

        def root(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        for t in np.argsort(-weights, kind="stable"):
            if weights[t] == 0:
                break
            i, j = int(iu[0][t]), int(iu[1][t])
            if deg[i] < 2 and deg[j] < 2 and root(i) != root(j):
                parent[root(i)] = root(j)
                deg[i], deg[j] = deg[i] + 1, deg[j] + 1
                adj[i].append(j)
                adj[j].append(i)
        order: list[int] = []
        seen: set[int] = set()
        for start in range(E):  # every path from one of its ends (an isolated expert is a path of one)
            if start in seen or deg[start] == 2:
                continue
            prev, cur = -1, start
            while cur != -1:
                order.append(cur)
                seen.add(cur)
                nxt = [n for n in adj[cur] if n != prev and n not in seen]
                prev, cur = cur, (nxt[0] if nxt else -1)
        assert sorted(order) == list(range(E)), "co-activation order is not a permutation"
        orders.append(order)
    return orders


def decode_misses(ids: np.ndarray, kinds: np.ndarray, capacity: int | None) -> list[tuple[int, list[int]]]:
    """(layer, experts read) of each decode step of one sequence [positions, L, k] through an on-demand
    LRU pool of `capacity` slots (eviction-bounds' replay), or, with None, every routed expert."""
    if capacity is None:
        return [(li, [int(e) for e in ids[p, li]]) for p in range(len(ids)) if kinds[p] == DECODE
                for li in range(ids.shape[1])]
    out: list[tuple[int, list[int]]] = []
    replay(ids, kinds, capacity, "lru", None, reads_out=out)
    return out


def requests(steps: list[tuple[int, list[int]]], position: list[np.ndarray],
             merge: bool) -> list[list[tuple[int, int, int]]]:
    """Per step, its requests as (layer, first slot, experts) runs: slots are each expert's position in
    its layer under `position`; `merge` joins adjacent slots into one request."""
    out = []
    for li, experts in steps:
        slots = sorted(int(position[li][e]) for e in experts)
        runs: list[list[int]] = []
        for s in slots:
            if merge and runs and runs[-1][0] + runs[-1][1] == s:
                runs[-1][1] += 1
            else:
                runs.append([s, 1])
        out.append([(li, a, n) for a, n in runs])
    return out


class DirectReads:
    """Times steps of requests against a store file with O_DIRECT on `lanes` threads."""

    def __init__(self, store: ExpertStore, lanes: int, max_run: int):
        # O_DIRECT where the filesystem allows it; else buffered, the file's cached pages dropped before
        # every timed pass (reported as `direct_io: false`, as `calibrate` does)
        self.fd, self.direct = store.open_direct()
        e0 = store.entry(0, 0)
        self.base, self.read, self.E = e0.offset, e0.read_size, store.num_experts
        for li in range(store.num_layers):  # the offsets below assume `store`'s layout: every slot back to back
            for e in range(self.E):
                x = store.entry(li, e)
                if x.offset != self.base + self.read * (li * self.E + e) or x.read_size != self.read:
                    os.close(self.fd)
                    raise SpecPrefetchError(f"{store.path}: expert {e} of layer {li} is not where a store `store` "
                                            "writes puts it (slots back to back, layer by layer): not measurable here")
        self.max_bytes = self.read * max_run
        self.local = threading.local()
        self.pool = ThreadPoolExecutor(lanes, thread_name_prefix="bench-reads")

    def _one(self, layer: int, slot: int, n: int) -> None:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = mmap.mmap(-1, self.max_bytes)  # page-aligned, as O_DIRECT needs
        want = self.read * n
        got = os.preadv(self.fd, [memoryview(buf)[:want]], self.base + self.read * (layer * self.E + slot))
        if got != want:
            raise SpecPrefetchError(f"short O_DIRECT read ({got} of {want} bytes): the store is truncated")

    def time(self, steps: list[list[tuple[int, int, int]]]) -> float:
        if not self.direct:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for step in steps:
            for f in [self.pool.submit(self._one, *r) for r in step]:
                f.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


def profile_seconds(steps: list[list[tuple[int, int, int]]], read_bytes: int, profile: DeviceProfile,
                    lanes: int) -> float:
    """The same steps through the simulator's flash model: a step's requests queued together (queue
    depth up to `lanes`), served one after another at the profile's rate for their size and depth,
    each landing its fixed latency after its transfer; the next step starts when the last has landed."""
    total = 0.0
    for step in steps:
        busy = 0.0
        for i, (_, _, n) in enumerate(step):
            busy += profile.transfer_s(read_bytes * n, min(len(step) - i, lanes))
        total += busy + profile.flash_latency_us * 1e-6
    return total


def bench_reads(trace: Path, store_path: Path, pool_fracs: list[float], *, max_sequences: int = 10,
                rounds: int = 3, lanes: int = 5, profile: DeviceProfile,
                progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    reader = TraceReader(trace)
    seqs = routing_sequences(reader, "heldout", with_kind=True)[:max_sequences]
    train = routing_sequences(reader, "train")
    if not seqs or not any((k == DECODE).any() for _, k in seqs):
        raise SpecPrefetchError(f"trace {trace}: no held-out decode positions to read for")
    if not train:
        raise SpecPrefetchError(f"trace {trace}: no train split to learn the co-activation order from")
    L, E, k = len(reader.moe_layers), reader.num_experts, reader.top_k
    with ExpertStore(store_path) as store:
        if store.num_experts < 2 or (store.num_layers, store.num_experts) != (L, E):
            raise SpecPrefetchError(f"--store {store_path}: {store.num_layers} MoE layers x {store.num_experts} "
                                    f"experts, but trace {trace} routes over {L} x {E}: not this model's store")
        progress("co-activation order from the train split")
        order = coactivation_order(train, E)
        position = {"store": [np.arange(E)] * L,
                    "coactivation": [np.argsort(np.asarray(o)) for o in order]}
        reads = DirectReads(store, lanes, k)
        try:
            points = []
            tokens = sum(int((kinds == DECODE).sum()) for _, kinds in seqs)
            plans = []  # every pool's reads first: a pool that reads nothing is refused before any timing
            for frac in pool_fracs:
                if not 0 <= frac <= 1:
                    raise SpecPrefetchError(f"--pool-frac {frac}: a share of the experts in [0, 1]")
                cap = max(k, int(round(frac * L * E))) if frac > 0 else None
                steps = [s for ids, kinds in seqs for s in decode_misses(ids, kinds, cap)]
                layouts = {"store": requests(steps, position["store"], False),
                           "store-merged": requests(steps, position["store"], True),
                           "coactivation-merged": requests(steps, position["coactivation"], True)}
                nexp = sum(n for s in layouts["store"] for _, _, n in s)
                if not nexp:
                    raise SpecPrefetchError(f"--pool-frac {frac}: the held-out decode tokens read nothing at this "
                                            "pool (every expert they route to stays resident); give a smaller pool")
                plans.append((frac, cap, layouts, nexp))
            for frac, cap, layouts, nexp in plans:
                times: dict[str, list[float]] = {x: [] for x in LAYOUTS}
                order = list(LAYOUTS)
                for r in range(rounds):
                    for x in order:
                        progress(f"pool {frac:.0%}: round {r + 1}/{rounds}, {x}")
                        times[x].append(reads.time(layouts[x]))
                    order.reverse()  # ABC, CBA, ...: no layout always last
                nbytes = nexp * reads.read
                row = {"pool_frac": frac, "slots": cap, "tokens": tokens, "mib_per_token": nbytes / tokens / 2**20,
                       "layouts": {}}
                for x in LAYOUTS:
                    t = median(times[x])
                    nreq = sum(len(s) for s in layouts[x])
                    row["layouts"][x] = {
                        "experts_per_token": sum(n for s in layouts[x] for _, _, n in s) / tokens,
                        "requests_per_token": nreq / tokens, "mean_request_kib": nbytes / nreq / 1024,
                        "ms_per_token": t / tokens * 1e3, "mib_s": nbytes / t / 2**20,
                        "runs_s": times[x],
                        "profile_ms_per_token": profile_seconds(layouts[x], reads.read, profile, lanes) / tokens * 1e3}
                base = row["layouts"]["store"]
                for x in LAYOUTS:
                    v = row["layouts"][x]
                    v["speedup"] = base["ms_per_token"] / v["ms_per_token"]
                    v["profile_speedup"] = base["profile_ms_per_token"] / v["profile_ms_per_token"]
                points.append(row)
        finally:
            reads.close()
    return {"trace": str(Path(trace).resolve()), "store": str(Path(store_path).resolve()),
            "expert_read_kib": reads.read / 1024, "direct_io": reads.direct, "layers": L, "experts": E, "top_k": k,
            "sequences": len(seqs), "rounds": rounds, "lanes": lanes, "profile": profile.name,
            "layouts": list(LAYOUTS), "points": points}


def markdown(r: dict[str, Any]) -> str:
    how = "O_DIRECT reads" if r["direct_io"] else "buffered reads (no O_DIRECT here; cached pages dropped each pass)"
    lines = [f"{how} of {r['expert_read_kib']:.0f} KiB experts ({r['layers']} MoE layers x {r['experts']}, "
             f"top-{r['top_k']}), {r['sequences']} held-out sequences, {r['lanes']} read lanes, median of "
             f"{r['rounds']} interleaved rounds; `{r['profile']}`: the simulator's flash model for that profile", "",
             "| pool | layout | requests/token | KiB/request | ms/token | MiB/s | speedup | "
             f"{r['profile']} ms/token | its speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in r["points"]:
        pool = "none" if p["slots"] is None else f"{p['pool_frac']:.0%} ({p['slots']})"
        for x in r["layouts"]:
            v = p["layouts"][x]
            lines.append(f"| {pool} | {x} | {v['requests_per_token']:.1f} | {v['mean_request_kib']:.0f} | "
                         f"{v['ms_per_token']:.2f} | {v['mib_s']:.0f} | {v['speedup']:.3f} | "
                         f"{v['profile_ms_per_token']:.2f} | {v['profile_speedup']:.3f} |")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    from toolkit.reporting import figure, save_figure

    fig, ax = figure((7, 4))
    x = np.arange(len(r["points"]))
    w = 0.8 / len(r["layouts"])
    for i, name in enumerate(r["layouts"]):
        ax.bar(x + i * w, [p["layouts"][name]["ms_per_token"] for p in r["points"]], w, label=name)
    ax.set_xticks(x + w * (len(r["layouts"]) - 1) / 2,
                  ["no pool" if p["slots"] is None else f"pool {p['pool_frac']:.0%}" for p in r["points"]])
    ax.set_ylabel("read ms per decode token" + (" (O_DIRECT)" if r["direct_io"] else " (buffered)"))
    ax.set_title(f"Store layouts, {r['expert_read_kib']:.0f} KiB experts")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
