"""The reuse table, learned with the adapter from the traces' train split (`specprefetch train`).

The `reuse` eviction (toolkit/runtime/reuse.py) predicts when an expert is next routed to beyond the
prefetch window from its recent history at its layer: a shift register of its last `bits` visits
(bit 0: routed at the latest visit of its layer). This table maps each history to the mean number
of visits until the expert is routed to again (capped at `cap`), in sixteenths of a visit (integers,
so every engine computes the same scores). It is stored in adapter.json (`reuse`) and copied into a
bundle's manifest (`predictor.reuse`).

Frequency classes (`classes`, `class_visits16`): each layer's experts in `n` shares by how often the train
split routes to them (0 the most routed), and one table per class, learned from that class's samples (a
history the class never shows takes the whole table's entry). A hot expert and a cold one with the same
recent history then score apart: a cold expert idle for a few visits is likely to stay idle longer. The
whole table stays (`visits16`): the classes only refine it. `train --reuse-classes` (default 4; 1: one
table). On the phone-class routing at a 27% pool the history-only rule reads 6.6% less with them
(docs/benchmarks.md section 20).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import numpy as np

from toolkit.errors import SpecPrefetchError
from toolkit.jsonvalues import is_int

SCALE = 16          # table entries are in sixteenths of a visit
BITS = 8            # history length in visits
CAP = 64            # visits until reuse, at most (not routed to again within CAP visits: CAP)
MAX_BITS = 16
CLASSES = 4         # frequency classes per layer (train --reuse-classes)
MAX_CLASSES = 64
MAX_NEXT_VISITS = 4  # the adapter's next-visit heads per layer, at most (train --next-visits)
# train's default with --cross-token: on the phone-class model's routing three visits read 4.4% less than one at
# a 27% pool and 0.5% less at 13%; four read 0.3% less than three at 27%, 0.8% more at 13% (docs/benchmarks.md
# section 24)
NEXT_VISITS = 3


def parse_next_visits(d: dict[str, Any]) -> tuple[int | None, str, str]:
    """(N, the key read, what it must be) of an adapter.json's or a manifest predictor's next-visit heads:
    'next_visits' (0..MAX_NEXT_VISITS), or, absent or null, an older file's 'next_visit' (true: one; neither:
    none); N is None where the value is malformed (the caller names its file)."""
    if d.get("next_visits") is not None:
        v = d["next_visits"]
        return (v if is_int(v) and 0 <= v <= MAX_NEXT_VISITS else None), "next_visits", \
            f"an integer in 0..{MAX_NEXT_VISITS}"
    v = d.get("next_visit")   # written before the heads predicted more than one visit (null: as absent)
    v = False if v is None else v
    return (int(v) if isinstance(v, bool) else None), "next_visit", "true or false"


@dataclasses.dataclass(frozen=True)
class ReuseTable:
    bits: int
    cap: int
    visits16: tuple[int, ...]   # [2**bits]: mean visits until reuse given the history, x SCALE
    # frequency classes: [layers][experts] class ids, and [classes][2**bits] a table per class (None: one table)
    classes: tuple[tuple[int, ...], ...] | None = None
    class_visits16: tuple[tuple[int, ...], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"bits": self.bits, "cap": self.cap, "scale": SCALE, "visits16": list(self.visits16)}
        if self.classes is not None:
            d["classes"] = [list(r) for r in self.classes]
            d["class_visits16"] = [list(t) for t in self.class_visits16]
        return d

    def whole(self) -> "ReuseTable":
        """The table without its frequency classes (every expert scored with `visits16`)."""
        return dataclasses.replace(self, classes=None, class_visits16=None)

    def onto(self, layer_map: list[int], num_experts: int) -> "ReuseTable":
        """The table for a geometry the routing is replayed onto (simulate --geometry): its layer li takes
        the classes of trace layer layer_map[li], its expert e trace expert e's class (the coldest class
        for an expert the trace never routes to: e past the trace's experts). Where the geometry has fewer
        experts than the trace (trace expert e plays geometry expert e mod E, several folded onto one) no
        trace expert's class is the folded one's frequency: the whole table alone."""
        if self.classes is None:
            return self
        if num_experts < len(self.classes[0]):
            return self.whole()
        last = len(self.class_visits16) - 1
        rows = tuple(tuple(self.classes[t][e] if e < len(self.classes[t]) else last for e in range(num_experts))
                     for t in layer_map)
        return dataclasses.replace(self, classes=rows)

    def layer_tables(self, num_layers: int) -> list[tuple[tuple[int, ...], ...] | None]:
        """Per MoE layer, every expert's table (its class's), or None where one table serves all."""
        if self.classes is None:
            return [None] * num_layers
        if len(self.classes) != num_layers:
            raise SpecPrefetchError(f"a reuse table with frequency classes for {len(self.classes)} MoE layers, "
                                    f"not {num_layers}")
        return [tuple(self.class_visits16[c] for c in row) for row in self.classes]

    @staticmethod
    def from_json(d: Any, where: str, *, shape: tuple[int, int]) -> "ReuseTable":
        """Validate a table read from `where` (an adapter.json or a manifest): one-line errors. `shape`:
        the model's (MoE layers, experts), which frequency classes must match."""
        def bad(what: str) -> SpecPrefetchError:
            return SpecPrefetchError(f"{where}: malformed reuse table: {what}")
        if not isinstance(d, dict):
            raise bad("not an object")
        bits, cap, scale, v = d.get("bits"), d.get("cap"), d.get("scale"), d.get("visits16")
        if not (is_int(bits) and 1 <= bits <= MAX_BITS):
            raise bad(f"'bits' must be an integer in 1..{MAX_BITS}")
        if not (is_int(cap) and 1 <= cap <= 1 << 20):
            raise bad("'cap' must be a positive integer")
        if not (is_int(scale) and scale == SCALE):
            raise bad(f"'scale' must be {SCALE}")

        def table(t: Any, what: str) -> tuple[int, ...]:
            if not (isinstance(t, list) and len(t) == 1 << bits and all(is_int(x) and SCALE <= x <= SCALE * cap
                                                                        for x in t)):
                raise bad(f"'{what}' must be {1 << bits} integers in {SCALE}..{SCALE * cap}")
            return tuple(t)
        visits = table(v, "visits16")
        cls, ct = d.get("classes"), d.get("class_visits16")
        if cls is None and ct is None:
            return ReuseTable(bits, cap, visits)
        if not (isinstance(ct, list) and 1 <= len(ct) <= MAX_CLASSES):
            raise bad(f"'class_visits16' must be a list of 1..{MAX_CLASSES} tables, with 'classes'")
        tables = tuple(table(t, f"class_visits16[{i}]") for i, t in enumerate(ct))
        if not (isinstance(cls, list) and cls and all(isinstance(r, list) and r and all(is_int(c) and 0 <= c < len(ct)
                                                                                    for c in r) for r in cls)):
            raise bad(f"'classes' must be a list per MoE layer of class ids in 0..{len(ct) - 1}")
        if len({len(r) for r in cls}) != 1:
            raise bad("'classes' must list as many experts for every layer")
        if (len(cls), len(cls[0])) != tuple(shape):
            raise bad(f"'classes' is for {len(cls)} MoE layers x {len(cls[0])} experts, the model has "
                      f"{shape[0]} x {shape[1]}")
        return ReuseTable(bits, cap, visits, tuple(tuple(r) for r in cls), tables)


def learn_reuse_table(sequences: Iterable[np.ndarray], num_experts: int, *, bits: int = BITS,
                      cap: int = CAP, where: str = "the routing") -> ReuseTable:
    """The table from routed expert ids, one array [positions, layers, k] per sequence (positions in
    order). Each (layer, expert, position) is one sample: its history after that position, and the
    visits until its next use, capped at `cap`; where no use follows, a sample is kept only if `cap`
    positions follow it (the distance is then at least `cap`). Leaving censored samples out biases the
    means near a sequence's end toward short reuse (long reuses there are not seen); counting them as
    `cap` biased them the other way. Every position is one visit (a prompt's too: at run time a
    prefill span's layer is one visit for all its positions, so the first decode tokens' histories
    hold fewer visits than the table assumes). A history never seen takes the mean of the histories
    seen with as many uses."""
    tot, cnt = _reuse_sums(sequences, num_experts, bits, cap, None, 1)
    return _table(tot[0], cnt[0], bits, cap, None, where)


def learn_reuse_tables(sequences: Iterable[np.ndarray], num_experts: int, groups: np.ndarray, *, bits: int = BITS,
                       cap: int = CAP, where: str = "the routing") -> tuple[ReuseTable, list[ReuseTable]]:
    """learn_reuse_table's table over every expert, and one per group of experts (`groups`: [layers,
    experts] group ids 0..G-1), from one pass over `sequences`: a group's table counts its experts' samples
    only, and a history they never show (every one, for a group without samples) takes the whole table's
    entry."""
    n_groups = int(np.max(groups)) + 1
    tot, cnt = _reuse_sums(sequences, num_experts, bits, cap, np.asarray(groups, np.int64), n_groups)
    whole = _table(tot.sum(0), cnt.sum(0), bits, cap, None, where)
    return whole, [_table(tot[g], cnt[g], bits, cap, whole, where) for g in range(n_groups)]


def frequency_classes(counts: np.ndarray, classes: int = CLASSES) -> np.ndarray:
    """[L, E] class of every expert, 0 the most routed: each layer's experts ranked by their routing
    counts ([L, E], e.g. summary.expert_load of the train split; ties: the lower id first), in
    min(classes, E) shares as equal as E allows."""
    L, E = counts.shape
    n = min(classes, E)
    out = np.zeros((L, E), np.int64)
    for li in range(L):
        out[li, np.argsort(-counts[li], kind="stable")] = np.arange(E) * n // E
    return out


def learn_class_reuse_table(sequences: list[np.ndarray], num_experts: int, *, classes: int = CLASSES,
                            bits: int = BITS, cap: int = CAP, where: str = "the routing") -> ReuseTable:
    """The whole table with one per frequency class (frequency_classes of the sequences' routing counts;
    learn_reuse_tables), in one ReuseTable; `classes` 1: the whole table alone (learn_reuse_table's)."""
    if not 1 <= classes <= MAX_CLASSES:
        raise SpecPrefetchError(f"--reuse-classes {classes}: 1..{MAX_CLASSES}")
    if classes == 1 or not sequences:   # (none: learn_reuse_table's one-line error)
        return learn_reuse_table(sequences, num_experts, bits=bits, cap=cap, where=where)
    from toolkit.traces.summary import add_expert_load   # (here: it imports torch, this module numpy only)

    load = np.zeros((np.asarray(sequences[0]).shape[1], num_experts), np.int64)
    for ids in sequences:
        add_expert_load(load, ids)
    groups = frequency_classes(load, classes)
    whole, tables = learn_reuse_tables(sequences, num_experts, groups, bits=bits, cap=cap, where=where)
    return dataclasses.replace(whole, classes=tuple(tuple(int(c) for c in r) for r in groups),
                               class_visits16=tuple(t.visits16 for t in tables))


def _reuse_sums(sequences: Iterable[np.ndarray], num_experts: int, bits: int, cap: int, groups: np.ndarray | None,
                n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group and history: the summed visits until reuse of its samples, and their count ([G, 2**bits])."""
    n = 1 << bits
    mask = n - 1
    tot = np.zeros((n_groups, n), np.float64)
    cnt = np.zeros((n_groups, n), np.int64)
    for ids in sequences:
        ids = np.asarray(ids)
        N, L = ids.shape[0], ids.shape[1]
        if N == 0:
            continue
        for li in range(L):
            used = np.zeros((N, num_experts), bool)
            used[np.arange(N)[:, None], ids[:, li]] = True
            nextd = np.full((N, num_experts), cap, np.int64)
            known = np.zeros((N, num_experts), bool)
            last = np.full(num_experts, -1, np.int64)
            for t in range(N - 1, -1, -1):
                nextd[t] = np.where(last >= 0, np.minimum(last - t, cap), cap)
                known[t] = (last >= 0) | (N - 1 - t >= cap)
                last = np.where(used[t], t, last)
            hist = np.zeros((N, num_experts), np.int64)
            h = np.zeros(num_experts, np.int64)
            for t in range(N):
                h = ((h << 1) | used[t]) & mask
                hist[t] = h
            idx = hist[known] if groups is None else (np.broadcast_to(groups[li], hist.shape)[known] * n
                                                      + hist[known])
            tot += np.bincount(idx, weights=nextd[known].astype(np.float64), minlength=n_groups * n).reshape(-1, n)
            cnt += np.bincount(idx, minlength=n_groups * n).reshape(-1, n)
    return tot, cnt


def _table(tot: np.ndarray, cnt: np.ndarray, bits: int, cap: int, prior: ReuseTable | None,
           where: str) -> ReuseTable:
    n = 1 << bits
    if prior is not None:   # a history never seen (every one, where there are no samples) takes the prior's
        unseen = np.array(prior.visits16) / SCALE
    else:   # the mean of the histories seen with as many uses (then the mean of all)
        if not cnt.sum():
            raise SpecPrefetchError(f"{where}: no routing to learn the reuse table from (sequences too short?)")
        pop = np.array([bin(i).count("1") for i in range(n)])
        overall = tot.sum() / cnt.sum()
        by_pop = {p: (tot[pop == p].sum() / cnt[pop == p].sum()) if cnt[pop == p].sum() else overall
                  for p in range(bits + 1)}
        unseen = np.array([by_pop[p] for p in pop])
    mean = np.where(cnt > 0, tot / np.maximum(cnt, 1), unseen)
    v16 = np.clip(np.rint(mean * SCALE), SCALE, SCALE * cap).astype(np.int64)
    return ReuseTable(bits, cap, tuple(int(x) for x in v16))
