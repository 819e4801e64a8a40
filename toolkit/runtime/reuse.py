"""Eviction from predicted reuse (`reuse`): a learned approximation of Belady's rule.

Belady's rule evicts the expert whose next use is farthest away. A MoE model visits its MoE layers in
a cycle, so expert (l, e) can next be used only at its layer's next visit, and then at every visit
after it: its next use is `next visit of l + L * (visits until it is routed to again - 1)`. The
visits until reuse are what has to be predicted. Two sources, the nearer first:

- the prefetch window: an expert the predictor (the adapter's heads, or any registry predictor)
  scores within the next W steps is predicted to be used then (the `prediction` rule's table);
- otherwise, the expert's recent history at its layer: a shift register of its last `bits` visits
  (bit 0: routed at the latest visit of its layer). A table learned from the traces' train split
  (adapters/reuse.py)
  maps each history to the mean number of visits until the expert is routed to again (capped at
  `cap`), in sixteenths of a visit, so every engine computes the same integers.

Scores are integers in sixteenths of a step: `16 * predicted step` inside the window, else
`16 * next visit + L * (table[history] - 16)`; the victim is the largest, ties broken as the
`prediction` rule's (least recently used, then the key); a prediction for the current step is not
counted (its expert, had it been routed to, would have been acquired: the guess was wrong). The
history of a layer shifts once per step that acquires its experts, at the step's first acquire and
before its reads are reserved, in both engines; a prefill span's layer is one step whose experts
(the union of its positions') are acquired in groups that fit the pool, each group's bits set as
it is acquired. Within a span, the next visit is counted one position on, not at the next unit (an
approximation of prefill only, the same in both engines). A prefetch evicts only a victim whose
score is past the prefetch's deadline.

With the adapter's next-visit heads (`train --next-visits N`; a bundle's preds rows of horizons L, 2L,
..., NL), each MoE layer's visit also predicts the layer's *next N* visits: for visit j the largest
logits of the row of horizon jL (`next_visit_size` of them: 2k, at most the layer's share of the pool,
capacity // L; ties: the lower id; for a prefill span, its
last position's rows), set after the step's acquire (`set_next_visits`). An expert scored while that
prediction is for its layer's next visits (the prediction's first target step is the next visit v0)
counts as used at the first visit v0 + (j - 1) L whose set holds it, and if none does, its history N
unused visits on scores it (`16 * (v0 + N L) + L * (table[history << N] - 16)`). Outside the window
and the prediction, the history alone, as above. (A prefill span's last position predicts its visits as
if the next unit were one position; where that unit is a chunk of several, its first visits are one step
in fact: an approximation of prefill only, the same in both engines.)

A table with frequency classes (adapters/reuse.py) scores each expert with its class's table in both
places (`table[history]`), the same integers in every engine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from adapters.reuse import ReuseTable

SCALE = 16  # scores in sixteenths of a step, as the table's entries (adapters/reuse.py: SCALE)


def next_visit_experts(logits, k: int):
    """The next-visit prediction every engine makes from a head's logits [..., E]: the k largest, the
    lower expert id first among equals (indices [..., k])."""
    return (-logits.float()).sort(dim=-1, stable=True).indices[..., :k]


def next_visit_size(top_k: int, num_experts: int, capacity: int, num_layers: int) -> int:
    """How many of a next-visit head's largest logits count as its visit's prediction: 2k, but never more
    than a layer's share of the pool (capacity // L slots, at least 1), nor E. Sets larger than the experts
    a layer can keep tell the eviction little: at a pool of 13% of the phone-class model's experts (8 slots
    a layer, of its 64 experts; k = 8) sets of 2k read 5-6% more than sets of 8 over three or four visits,
    while at 27% (17 slots a layer) the 2k = 16 the share allows read least. (One visit alone reads 1.8%
    less with sets of 2k at 13%: one rule for every N is kept; docs/benchmarks.md section 24.)"""
    return max(1, min(num_experts, 2 * top_k, capacity // num_layers))


class ReuseHistory:
    """Every expert's recent routing history at its layer, and the `reuse` rule's score."""

    def __init__(self, table: ReuseTable, num_layers: int):
        self.table, self.L = table, num_layers
        self.tables = table.layer_tables(num_layers)   # per layer: each expert's class table (None: visits16)
        self.mask = (1 << table.bits) - 1
        self.hist: list[dict[int, int]] = [{} for _ in range(num_layers)]  # layer -> expert -> bits (0s absent)
        self.last_step = [-1] * num_layers
        # layer -> (its next visit's step, the predicted experts of that visit and each later one, L apart)
        self.next_visit: dict[int, tuple[int, tuple[frozenset[int], ...]]] = {}
        self._first: dict[int, tuple] = {}   # layer -> (its prediction's sets, expert -> first visit): farthest

    def set_next_visits(self, li: int, target: int, sets: Iterable[Iterable[int]]) -> None:
        """Layer li's next visits, at steps `target`, `target` + L, ..., are predicted to route to `sets`."""
        self.next_visit[li] = (target, tuple(frozenset(e) for e in sets))

    def _beyond(self, v0: int, sets: tuple, e: int, h: int, tab) -> int:
        """The score of expert e (history h, table tab) of a layer whose next visits from v0 are predicted."""
        for j, predicted in enumerate(sets):
            if e in predicted:
                return (v0 + j * self.L) * SCALE
        n = len(sets)
        return (v0 + n * self.L) * SCALE + self.L * (tab[(h << n) & self.mask] - SCALE)

    def observe(self, step: int, keys: Iterable[tuple[int, int]]) -> None:
        """Step `step` routes to `keys`: their layer's history shifts (once per step), then their bit is set."""
        for li, e in keys:
            h = self.hist[li]
            if self.last_step[li] != step:
                self.last_step[li] = step
                m = self.mask
                for x in list(h):
                    v = (h[x] << 1) & m
                    if v:
                        h[x] = v
                    else:
                        del h[x]
            h[e] = h.get(e, 0) | 1

    def score(self, key: tuple[int, int], now: int, predicted: dict | None) -> int:
        """Sixteenths of a step until `key`'s predicted next use (larger: evicted first)."""
        if predicted is not None:
            v = predicted.get(key)
            if v is not None and v > now:  # one for this step and not acquired was a wrong guess
                return v * SCALE
        li, e = key
        tab = self.table.visits16 if self.tables[li] is None else self.tables[li][e]
        v0 = now + ((li - now % self.L) % self.L or self.L)
        nv = self.next_visit.get(li)
        if nv is not None and nv[0] == v0:  # the next visits are predicted
            return self._beyond(v0, nv[1], e, self.hist[li].get(e, 0), tab)
        return v0 * SCALE + self.L * (tab[self.hist[li].get(e, 0)] - SCALE)

    def _first_visits(self, li: int, sets: tuple) -> dict[int, int]:
        """expert -> the first of layer li's predicted visits (0-based) whose set holds it, for the prediction
        `sets` (made once per prediction: set_next_visits makes a new tuple each time)."""
        cached = self._first.get(li)
        if cached is not None and cached[0] is sets:
            return cached[1]
        first: dict[int, int] = {}
        for j, predicted in enumerate(sets):
            for e in predicted:
                first.setdefault(e, j)
        self._first[li] = (sets, first)
        return first

    def farthest(self, by_layer: dict[int, dict], now: int, predicted: dict | None, protect) -> tuple[int, int] | None:
        """The pool's `reuse` victim among its slots `by_layer` (layer -> key -> pool Slot; the evictable ones:
        ready, unpinned, not in `protect`): max (score, -last_use, key), `score` inlined and its per-layer terms
        (the next visit, its prediction, the layer's history and tables) computed once per layer, not per slot
        (the pool searches at every eviction, over every slot: the GPU tier's host time)."""
        L, S, hist, next_visit, mask = self.L, SCALE, self.hist, self.next_visit, self.mask
        whole, tables = self.table.visits16, self.tables
        pred = predicted.get if predicted else None
        best, top = None, None
        for li, group in by_layer.items():
            v0 = now + ((li - now % L) % L or L)
            nv = next_visit.get(li)
            nxt = nv[1] if nv is not None and nv[0] == v0 else None
            h, tabs = hist[li], tables[li]
            if nxt:   # the first predicted visit that uses it, else its history past them (_beyond)
                first = self._first_visits(li, nxt)
                n = len(nxt)
                far, gap = (v0 + n * L) * S, L * S
            base = v0 * S
            for key, s in group.items():
                if not s.ready or s.pins or key in protect:
                    continue
                v = pred(key) if pred is not None else None
                if v is not None and v > now:  # one for this step and not acquired was a wrong guess
                    v *= S
                else:   # (no prediction, or one of no visits: as none, in both engines)
                    e = key[1]
                    visits = whole if tabs is None else tabs[e]
                    if nxt:
                        j = first.get(e)
                        v = base + j * gap if j is not None else far + L * (visits[(h.get(e, 0) << n) & mask] - S)
                    else:
                        v = base + L * (visits[h.get(e, 0)] - S)
                if top is None or v > top or (v == top and (s.last_use < best.last_use
                                                           or (s.last_use == best.last_use and key > best.key))):
                    best, top = s, v
        return best.key if best is not None else None
