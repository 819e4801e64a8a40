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

With the adapter's next-visit heads (`train --next-visit`; a bundle's preds rows of horizon L), each MoE
layer's visit also predicts the layer's *next* visit: the 2k largest logits of that row (ties: the
lower id; for a prefill span, its last position's row), set after the step's acquire
(`set_next_visit`). An expert scored while that prediction is for its layer's next visit (the
prediction's target step is that visit) counts as used at that visit if predicted, else its history
one unused visit on scores it (`16 * (next visit + L) + L * (table[history << 1] - 16)`). Outside the
window and the prediction, the history alone, as above.

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


class ReuseHistory:
    """Every expert's recent routing history at its layer, and the `reuse` rule's score."""

    def __init__(self, table: ReuseTable, num_layers: int):
        self.table, self.L = table, num_layers
        self.tables = table.layer_tables(num_layers)   # per layer: each expert's class table (None: visits16)
        self.mask = (1 << table.bits) - 1
        self.hist: list[dict[int, int]] = [{} for _ in range(num_layers)]  # layer -> expert -> bits (0s absent)
        self.last_step = [-1] * num_layers
        self.next_visit: dict[int, tuple[int, frozenset[int]]] = {}  # layer -> (target step, predicted experts)

    def set_next_visit(self, li: int, target: int, experts: Iterable[int]) -> None:
        """Layer li's next visit, at step `target`, is predicted to route to `experts`."""
        self.next_visit[li] = (target, frozenset(experts))

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
        if nv is not None and nv[0] == v0:  # the next visit is predicted
            if e in nv[1]:
                return v0 * SCALE
            h = (self.hist[li].get(e, 0) << 1) & self.mask
            return (v0 + self.L) * SCALE + self.L * (tab[h] - SCALE)
        return v0 * SCALE + self.L * (tab[self.hist[li].get(e, 0)] - SCALE)

    def farthest(self, slots, now: int, predicted: dict | None, protect) -> tuple[int, int] | None:
        """The pool's `reuse` victim among `slots` (pool Slots; the evictable ones: ready, unpinned, not
        in `protect`): max (score, -last_use, key), `score` inlined and its per-layer terms (the next
        visit, its prediction) computed once per layer, not per slot (the pool searches at every
        eviction, over every slot)."""
        L, S, mask, hist, next_visit = self.L, SCALE, self.mask, self.hist, self.next_visit
        whole, tables = self.table.visits16, self.tables
        pred = predicted.get if predicted is not None else None
        layer: dict[int, tuple] = {}
        best, top = None, None
        for s in slots:
            key = s.key
            if not s.ready or s.pins or key in protect:
                continue
            v = pred(key) if pred is not None else None
            if v is not None and v > now:  # one for this step and not acquired was a wrong guess
                v *= S
            else:
                li, e = key
                t = layer.get(li)
                if t is None:
                    v0 = now + ((li - now % L) % L or L)
                    nv = next_visit.get(li)
                    t = layer[li] = (v0, nv[1] if nv is not None and nv[0] == v0 else None, hist[li], tables[li])
                v0, nxt, h, tabs = t
                visits = whole if tabs is None else tabs[e]
                if nxt is None:
                    v = v0 * S + L * (visits[h.get(e, 0)] - S)
                elif e in nxt:   # the next visit is predicted to use it
                    v = v0 * S
                else:
                    v = (v0 + L) * S + L * (visits[(h.get(e, 0) << 1) & mask] - S)
            if best is None or v > top or (v == top and (-s.last_use, key) > (-best.last_use, best.key)):
                best, top = s, v
        return best.key if best is not None else None
