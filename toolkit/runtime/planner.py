"""The prefetch planner: a MoE layer's predictions turned into the scheduler's window.

At MoE layer i of position p (step s = p * L + i) the planner scores the experts of the next W
steps and hands them to the scheduler with their target steps. Scores come either from the layer
graph's own `preds` output (the prefetch adapter's heads, or next-gate heads, folded into the graph
at export: what the phone runs), or from a host predictor of the registry, which looks at the
routing state in a `RoutingBatch` of one row. Every score goes through the family's selection rule,
so bias and group limits apply as they do to the router.

A prefill chunk of T positions (`plan_chunk`) is planned once per MoE layer from every token's
predictions: each token's window rows are computed as for one position, then merged per expert by
the maximum over the chunk's tokens (the chunk's max confidence; for the oracle, each expert's best
router rank over the positions the target layer covers, ties broken by ascending expert id). A horizon
h from layer i targets MoE layer (i + h) of this chunk (i + h < L) or, past the last MoE layer, of the
next unit (the next chunk or position, which starts at position p0 + T): target = step + h + (T - 1) * L
there.

With `next_visits` (the graph's preds rows hold the adapter's next-visit heads, horizons L, 2L, ..., or
a host predictor has them, and the pool evicts by `reuse`), every MoE layer's plan also hands the reuse
eviction that layer's predicted next visits (toolkit/runtime/reuse.py): of each visit's row the
`next_visit_size` largest logits (2k, at most the layer's share of the pool; a host predictor: of
`next_visit_logits` on the layer's router input, decode steps only), the lower id first among equals
(a prefill chunk: its last position's), for the step L later (a chunk: the next unit's) and each visit L
after it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from toolkit.models.families import RoutingSpec, selection_scores
from toolkit.predictors.base import Oracle, Predictor
from toolkit.runtime.reuse import next_visit_experts, next_visit_size
from toolkit.runtime.scheduler import WindowScheduler
from toolkit.traces.batches import RoutingBatch

GRAPH = "graph"  # the predictor source: the layer graph's preds rows


class RoutingState:
    """What host predictors may see at a step: this position's router inputs and choices so far,
    the previous position's choices, and (for the oracle only) the recorded future."""

    def __init__(self, num_layers: int, hidden_size: int, top_k: int):
        self.hidden = torch.zeros(1, num_layers, hidden_size)
        self.ids = torch.zeros(1, num_layers, top_k, dtype=torch.long)
        self.prev_ids = torch.zeros(1, num_layers, top_k, dtype=torch.long)
        self.pos = 0
        self.future: list[torch.Tensor] | None = None  # per position [L, k]

    def record(self, li: int, x: torch.Tensor, ids: torch.Tensor | list[int]) -> None:
        """Layer li's router input x ([1, H] or [H]) and top-k `ids` (a tensor, or a list: the GPU tier's
        host copy, written without making a tensor of it first)."""
        self.hidden[0, li].copy_(x.reshape(-1))   # copy_ converts to float32 as .float() did
        if isinstance(ids, list):
            self.ids.numpy()[0, li] = ids
        else:
            self.ids[0, li] = ids.reshape(-1)

    def next_position(self) -> None:
        self.prev_ids = self.ids.clone()
        self.pos += 1

    def batch(self, oracle: bool) -> RoutingBatch:
        ids, next_ids, has_next = self.ids, torch.zeros_like(self.ids), torch.tensor([False])
        if oracle and self.future is not None:  # only the oracle may see the future
            p = self.pos
            ids = self.future[p].unsqueeze(0) if p < len(self.future) else ids
            if p + 1 < len(self.future):
                next_ids, has_next = self.future[p + 1].unsqueeze(0), torch.tensor([True])
        return RoutingBatch(hidden=self.hidden, ids=ids, next_ids=next_ids, prev_ids=self.prev_ids,
                            has_next=has_next, has_prev=torch.tensor([self.pos > 0]), probs=None,
                            next_probs=None, seq=torch.tensor([0]), pos=torch.tensor([self.pos]),
                            kind=torch.tensor([1]))


class ChunkState:
    """A prefill chunk's router inputs [T, L, H] and choices [T, L, k] so far, for the planner."""

    def __init__(self, T: int, num_layers: int, hidden_size: int, top_k: int, before: torch.Tensor | None = None):
        """before: the choices of the position before the chunk ([1, L, k]; RoutingState.ids when the
        chunk starts), kept because the chunk's own records overwrite RoutingState.ids layer by layer."""
        self.hidden = torch.zeros(T, num_layers, hidden_size)
        self.ids = torch.zeros(T, num_layers, top_k, dtype=torch.long)
        self.before = before.clone() if before is not None else torch.zeros(1, num_layers, top_k, dtype=torch.long)

    def record(self, li: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        self.hidden[:, li] = x.reshape(self.hidden.shape[0], -1).float()
        self.ids[:, li] = ids

    def batch(self, state: RoutingState) -> RoutingBatch:
        """One row per chunk token for host predictors: the previous position's choices are the
        token before it (the position before the chunk for the first), as far as they are known."""
        T = self.ids.shape[0]
        prev = torch.cat([self.before, self.ids[:-1]]) if T > 1 else self.before.clone()
        pos = torch.arange(state.pos, state.pos + T)
        # a later position's previous one is in the chunk, whose layers past the current one have
        # not run: only the first position's previous choices are known there
        known = (pos > 0) & (torch.arange(T) == 0)
        return RoutingBatch(hidden=self.hidden, ids=self.ids, next_ids=torch.zeros_like(self.ids), prev_ids=prev,
                            has_next=torch.zeros(T, dtype=torch.bool), has_prev=known, probs=None,
                            next_probs=None, seq=torch.zeros(T, dtype=torch.long), pos=pos,
                            kind=torch.zeros(T, dtype=torch.long))


class PrefetchPlanner:
    def __init__(self, source: Predictor | str | None, *, num_layers: int, window: int, routing: RoutingSpec,
                 score_bias: torch.Tensor | None, preds_horizons: dict[int, Sequence[int]] | None = None,
                 next_visits: int = 0):
        """
        Args:
            source: a registry Predictor, GRAPH (the layer graphs' preds rows), or None (on-demand).
            num_layers: MoE layers per position (L).
            window: steps ahead (W).
            routing / score_bias: the family's selection rule and its bias [L, E].
            preds_horizons: MoE layer -> the horizons of its preds rows, in row order (GRAPH only).
            next_visits: hand the reuse eviction each layer's predicted next visits, this many (GRAPH: its
                rows of horizons L, 2L, ..., which the preds rows must hold; a host predictor: its
                `next_visit_logits`, at most its `next_visits`, in `plan` only); 0: none.
        """
        self.source, self.L, self.W = source, num_layers, window
        self.routing, self.score_bias = routing, score_bias
        self.rows = {li: list(hs) for li, hs in (preds_horizons or {}).items()}
        self.oracle = getattr(source, "reads_future", False)   # source: a Predictor, GRAPH or None
        # a plain softmax router (no selection bias, groups or top-k-first): the window's
        # probabilities are one softmax of its logits, and linear host predictors fold into one
        # [W*E, H] matrix per layer (a whole window in one matmul)
        self.softmax_router = (score_bias is None and (routing.n_group or 0) <= 1
                               and not routing.topk_before_softmax and routing.score_func == "softmax")
        # a host predictor's next-visit heads (the adapter's), read from the layer's router input; a
        # folded window carries them as one more block of rows (the same matmul)
        self.host_visits = min(next_visits, getattr(source, "next_visits", 0)) if source != GRAPH else 0
        self.visit_hs = [j * num_layers for j in range(1, self.host_visits + 1)]  # the host heads' horizons
        self.folded = self._fold() if self.softmax_router and getattr(source, "linear", False) else None
        self.graph_rows = {li: [rows.index(h) for h in range(1, window + 1) if h in rows]
                           for li, rows in self.rows.items()}
        # MoE layer -> its preds rows of horizons L, 2L, ... (the next-visit heads), where the reuse eviction
        # reads them
        self.next_visit_rows = ({li: [rows.index(j * num_layers) for j in range(1, next_visits + 1)]
                                 for li, rows in self.rows.items()} if next_visits and source == GRAPH else {})
        self._visit_n: int | None = None   # a next-visit set's size (_visit_size)
        self._future = None       # (the recorded future, position -> its rows as lists): the oracle's
        self._oracle_conf: dict[int, list[float]] = {}   # k -> the oracle's confidences, rank k first

    def _visit_size(self, sched: WindowScheduler) -> int:
        """How many of a next-visit row's largest logits make its visit's set (next_visit_size; the pool's
        capacity is fixed for the planner's sequence, so computed once)."""
        if self._visit_n is None:
            self._visit_n = next_visit_size(self.routing.top_k, self.routing.num_experts, sched.pool.capacity, self.L)
        return self._visit_n

    def _note_next_visits(self, sched: WindowScheduler, li: int, target: int, rows: torch.Tensor) -> None:
        """The reuse eviction's prediction of layer li's next visits (the first at step `target`) from their
        logits rows [visits, E]."""
        sched.reuse.set_next_visits(li, target, next_visit_experts(rows, self._visit_size(sched)).tolist())

    def _fold(self) -> list[tuple[torch.Tensor, int, torch.Tensor, list[int]]]:
        bank = self.source.bank
        E = bank.weight.shape[1]
        out = []
        hs = list(range(1, self.W + 1)) + [h for h in self.visit_hs if h > self.W]
        for i in range(self.L):
            mats, srcs, biases = [], [], []
            for h in hs:
                m, src = self.source.effective_router(i, h)
                mats.append(m)
                srcs.append(src)
                biases.append(bank.bias[(i + h) % self.L] if bank.bias is not None else torch.zeros(E))
            if len(set(srcs)) != 1:
                return None
            out.append((torch.cat(mats).float().contiguous(), srcs[0], torch.cat(biases).float(), hs))
        return out

    @property
    def active(self) -> bool:
        return self.source is not None

    def _graph_window(self, li: int, step: int, preds: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        out = []
        rows = self.rows.get(li, [])
        for h in range(1, self.W + 1):
            if h not in rows:
                continue
            j = (li + h) % self.L
            sb = self.score_bias[j] if self.score_bias is not None else None
            logits = preds.reshape(len(rows), -1)[rows.index(h)].float().unsqueeze(0)
            out.append((step + h, selection_scores(logits, self.routing, sb)[0]))
        return out

    def plan_chunk(self, sched: WindowScheduler, li: int, step: int, span: tuple[int, int], chunk: "ChunkState",
                   state: RoutingState, preds: torch.Tensor | None, end: int) -> None:
        """Queue the window's reads after MoE layer li of a prefill chunk (step = p0 * L + li).
        span = (T, T_next): this chunk's positions and the next unit's; `chunk` holds the chunk's
        router inputs and choices so far; preds [T, P, E] (GRAPH). Targets at or past `end` are not
        planned."""
        T, T_next = span
        L = self.L
        r = self.next_visit_rows.get(li)
        if r is not None and preds is not None and sched.reuse is not None:
            P = len(self.rows[li])
            self._note_next_visits(sched, li, self._target(li, step, L, T), preds.reshape(T, P, -1)[T - 1, r])
        hs = [h for h in range(1, self.W + 1) if self._target(li, step, h, T) < end]
        if self.source is None or not hs:
            sched.plan_probs(step, [], None)
            return
        targets = [self._target(li, step, h, T) for h in hs]
        if self.oracle:
            fut = state.future
            rows = []
            k = chunk.ids.shape[-1]
            p0 = state.pos
            for h in hs:
                j = li + h
                lo, n, jj = (p0, T, j) if j < L else (p0 + T, T_next, j - L)
                s = torch.zeros(self.routing.num_experts)
                rank = torch.arange(k, 0, -1, dtype=torch.float32)
                for p in range(lo, lo + n):
                    # only a recorded future says what a later layer routes to (the chunk's own layers
                    # past li have not run yet)
                    if fut is None or p >= len(fut):
                        continue
                    ids = fut[p][jj]
                    s = torch.maximum(s, torch.zeros_like(s).scatter_(0, ids.long(), rank))
                # many experts share the best rank: ties broken by ascending id, so every engine
                # picks the same candidates (steps of 0.5 / E, far above rounding)
                E = s.shape[0]
                tie = torch.arange(E, dtype=torch.float32) * torch.tensor(0.5 / E, dtype=torch.float32)
                rows.append(torch.where(s > 0, s - tie, s))
            sched.plan(step, list(zip(targets, rows)))
            return
        if self.source == GRAPH:
            rows_of = self.rows.get(li)
            if not rows_of:
                sched.plan_probs(step, [], None)
                return
            if preds is None:
                raise RuntimeError(f"MoE layer {li}: the layer graph returned no preds rows")
            P = len(rows_of)
            pr = preds.reshape(T, P, -1).float()
            hs2 = [h for h in hs if h in rows_of]
            targets = [self._target(li, step, h, T) for h in hs2]
            if not hs2:
                sched.plan_probs(step, [], None)
                return
            logits = pr[:, [rows_of.index(h) for h in hs2]]                    # [T, W', E]
            if self.softmax_router:
                sched.plan_probs(step, targets, logits.softmax(-1).amax(0))
                return
            rows = []
            for w, h in enumerate(hs2):
                j = (li + h) % L
                sb = self.score_bias[j] if self.score_bias is not None else None
                rows.append(selection_scores(logits[:, w], self.routing, sb).amax(0))
            sched.plan(step, list(zip(targets, rows)))
            return
        if self.folded is not None:
            mat, src, bias, fhs = self.folded[li]
            x = chunk.hidden[:, src]                                              # [T, H]
            logits = (x @ mat.t() + bias).view(T, len(fhs), -1)[:, [fhs.index(h) for h in hs]]
            sched.plan_probs(step, targets, logits.softmax(-1).amax(0))
            return
        b = chunk.batch(state)
        rows = [self.source.scores(b, li, h).float().amax(0) for h in hs]
        sched.plan(step, list(zip(targets, rows)))

    def _oracle_ranked(self, sched: WindowScheduler, li: int, state: RoutingState, W: int):
        """The oracle's window as `plan_ranked` takes it, without its [W, E] tensors: each target's
        recorded top-k scores rank k..1 (Oracle.scores), which the scheduler normalises to rank / (1 + ..
        + k) and ranks by that. None where the generic path must decide (a target past the recorded
        future, whose stand-in ids may repeat, or a candidate count past the experts)."""
        fut = state.future
        p = state.pos
        if fut is None or p + (1 if li + W >= self.L else 0) >= len(fut):
            return None
        E = self.routing.num_experts
        m = sched.cfg.candidates or sched.k
        if m > E:
            return None
        if self._future is None or self._future[0] is not fut:
            self._future = (fut, {})
        rows = self._future[1]
        for q in [q for q in rows if q < p]:  # positions behind the run: never read again
            del rows[q]
        confs, ids = [], []
        for h in range(1, W + 1):
            j = li + h
            q, jj = (p, j) if j < self.L else (p + 1, j - self.L)
            row = rows.get(q)
            if row is None:
                row = rows[q] = fut[q].tolist()
            es = row[jj]
            k = len(es)
            if len(set(es)) != k or not all(0 <= e < E for e in es):
                return None
            conf = self._oracle_conf.get(k)
            if conf is None:   # the scheduler's arithmetic: float32 ranks over their float32 sum
                r = torch.arange(k, 0, -1, dtype=torch.float32)
                conf = self._oracle_conf[k] = (r / r.sum().clamp_min(1e-20)).tolist()
            confs.append(conf[:m])
            ids.append(es[:m])
        return confs, ids

    def device_fold(self) -> tuple[list[tuple[torch.Tensor, int, torch.Tensor]], int, list[int]] | None:
        """What a device computes in place of `plan`'s fold on the host (the GPU tier: gpu_graph.DevicePlan),
        None where the planner does not fold: (per MoE layer (matrix [R * E, H], its source layer, bias
        [R * E]); the window's rows, the first W of the R; the next-visit heads' row indices). From the source
        layer's router input x: logits = (matrix @ x + bias) viewed [R, E]; each window row's softmax sorted
        descending (the lower expert first among equals: `stable_topk`), and each next-visit row's experts by
        descending logit (`next_visit_experts`), as `plan_sorted` takes them."""
        if self.folded is None:
            return None
        fhs = self.folded[0][3]
        return ([(mat, src, bias) for mat, src, bias, _ in self.folded], self.W,
                [fhs.index(h) for h in self.visit_hs])

    def sorted_widths(self, sched: WindowScheduler) -> tuple[int, int]:
        """How much of each sorted row `plan_sorted` reads for `sched`: a window row's first m (its candidates),
        a next-visit row's first n (next_visit_size)."""
        return sched.cfg.candidates or sched.k, self._visit_size(sched)

    def plan_sorted(self, sched: WindowScheduler, li: int, step: int, confs: list[list[float]],
                    ids: list[list[int]], visits: list[list[int]], end: int | None = None) -> None:
        """`plan` of a folding planner from its rows already computed, sorted and cut to `sorted_widths`
        (`device_fold`; gpu_graph.DevicePlan.rows): `confs` / `ids` the W window rows' first m probabilities,
        descending, and their experts (plan_probs' stable_topk); `visits` each next-visit row's first n experts by
        descending logit. The same decisions as `plan` (which computes them on the host)."""
        W = self.W if end is None else min(self.W, end - 1 - step)
        if self.host_visits > 0 and sched.reuse is not None:
            sched.reuse.set_next_visits(li, step + self.L, visits)
        if W < 1:
            sched.plan_probs(step, [], None)
            return
        sched.plan_ranked(step, [step + h for h in range(1, W + 1)], confs[:W], ids[:W])

    def _target(self, li: int, step: int, h: int, T: int) -> int:
        """The step horizon h from MoE layer li targets: this unit's layer li + h, or past the last
        MoE layer the next unit's (which starts T positions on)."""
        return step + h + ((T - 1) * self.L if li + h >= self.L else 0)

    def plan(self, sched: WindowScheduler, li: int, step: int, state: RoutingState,
             preds: torch.Tensor | None, end: int | None = None) -> None:
        """Queue the window's reads after MoE layer li's graph ran (its experts are pinned).
        Targets at or past step `end` (positions the run will not reach) are not planned."""
        r = self.next_visit_rows.get(li)
        if r is not None and preds is not None and sched.reuse is not None:
            self._note_next_visits(sched, li, step + self.L, preds.reshape(len(self.rows[li]), -1)[r])
        W = self.W if end is None else min(self.W, end - 1 - step)
        host_nv = self.host_visits > 0 and sched.reuse is not None
        folded = None
        if self.folded is not None and (W >= 1 or host_nv):   # the window (and the next visit) in one matmul
            mat, src, bias, fhs = self.folded[li]
            folded = (mat @ state.hidden[0, src] + bias).view(len(fhs), -1), fhs
        if host_nv:
            rows = (folded[0][[folded[1].index(h) for h in self.visit_hs]] if folded is not None
                    else torch.stack([self.source.next_visit_logits(state.hidden[:, li], li, j)[0]
                                      for j in range(1, self.host_visits + 1)]))
            self._note_next_visits(sched, li, step + self.L, rows)
        if self.source is None or W < 1:
            sched.plan_probs(step, [], None)
            return
        if self.source == GRAPH:
            if not self.rows.get(li):  # the adapter has no heads for this layer: nothing to plan
                sched.plan_probs(step, [], None)
                return
            if preds is None:
                raise RuntimeError(f"MoE layer {li}: the layer graph returned no preds rows")
            if self.softmax_router:
                rows = [r for r in self.graph_rows[li] if self.rows[li][r] <= W]
                hs = [self.rows[li][r] for r in rows]
                logits = preds.reshape(len(self.rows[li]), -1)[rows].float()
                sched.plan_probs(step, [step + h for h in hs], logits.softmax(-1) if rows else None)
                return
            sched.plan(step, [(t, sc) for t, sc in self._graph_window(li, step, preds) if t - step <= W])
            return
        if folded is not None:
            logits, hs = folded
            sched.plan_probs(step, [step + h for h in hs[:W]], logits[:W].softmax(-1))
            return
        if type(self.source) is Oracle:
            ranked = self._oracle_ranked(sched, li, state, W)
            if ranked is not None:
                sched.plan_ranked(step, [step + h for h in range(1, W + 1)], *ranked)
                return
        b = state.batch(self.oracle)
        sched.plan(step, [(step + h, self.source.scores(b, li, h)[0]) for h in range(1, W + 1)])
