"""The windowed prefetch scheduler: predictions in, a prioritised queue of flash reads out.

Steps are (token, MoE layer) positions numbered s = token * L + layer. At step s the predictor's
scored expert sets for steps s+1 .. s+W arrive; the scheduler turns each set's top candidates into
read requests with a deadline (their step) and a confidence (their predicted probability), and
keeps them in a queue ordered by deadline, then confidence. It issues reads while the flash queue
has room (`queue_depth`) and the step's prefetch byte budget lasts; when flash is saturated it drops
requests below `min_confidence`, and it always drops stale ones (deadline already reached). A
prefetch gets a pool slot only by evicting something not needed sooner. A miss is read on demand
at top priority. Unbudgeted prefetch has been seen to slow decode (ANCHORS.md): the budget and the
confidence floor are what keep prefetch from starving the reads the model is waiting for.

The scheduler talks to flash through an `IOBackend` (virtual-time model in toolkit/simulate, real
O_DIRECT threads in toolkit/runtime/io.py) and to memory through `ExpertPool`: the same code runs
in the simulator and in the streaming runtime.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Protocol

import torch

from toolkit.runtime.pool import ExpertPool, Key


class IOBackend(Protocol):
    def submit(self, key: Key, *, demand: bool) -> None: ...
    def completed(self) -> list[Key]: ...
    def inflight(self) -> int: ...
    def wait(self, key: Key) -> None: ...


@dataclasses.dataclass
class SchedulerConfig:
    window: int = 4                 # steps ahead the predictor is asked about
    candidates: int | None = None   # experts per predicted step (default: top-k)
    queue_depth: int = 4            # flash reads in flight at most
    step_budget_bytes: int | None = None  # prefetch bytes issued per step (None: unbounded)
    min_confidence: float = 0.02    # below this a request is dropped when flash is saturated
    floor: float = 0.0              # below this a candidate is never queued at all
    prefetch: bool = True           # False: on-demand only


@dataclasses.dataclass
class SchedulerStats:
    requests: int = 0        # expert uses asked of the pool
    hits: int = 0            # ready when needed
    late: int = 0            # prefetch in flight when needed (partial hide)
    misses: int = 0          # read on demand
    prefetch_issued: int = 0
    dropped_stale: int = 0
    dropped_low_conf: int = 0
    dropped_no_slot: int = 0
    bytes_read: int = 0


class WindowScheduler:
    def __init__(self, pool: ExpertPool, io: IOBackend, cfg: SchedulerConfig, *, num_layers: int,
                 top_k: int):
        self.pool, self.io, self.cfg = pool, io, cfg
        self.L, self.k = num_layers, top_k
        self.queue: list[tuple[int, float, int, Key]] = []  # (deadline, -confidence, seq, key)
        self.pending: dict[Key, tuple[int, float]] = {}      # queued key -> (deadline, confidence)
        self.loading: set[Key] = set()
        self.predicted_next: dict[Key, int] = {}             # latest predicted use of each key
        self.seq = itertools.count()
        self.stats = SchedulerStats()
        self.step = 0
        self.step_bytes = 0
        if pool.policy == "prediction":
            pool.predicted = self.predicted_next

    # -- bookkeeping ---------------------------------------------------------------------
    def next_predicted_use(self, key: Key, now: int) -> float:
        s = self.predicted_next.get(key)
        return s if s is not None and s >= now else float("inf")

    def retire(self) -> None:
        """Mark finished reads ready in the pool."""
        take = getattr(self.io, "take", None)
        for key in self.io.completed():
            self.loading.discard(key)
            slot = self.pool.get(key)
            if slot is not None:
                slot.ready = True
                if take is not None:
                    slot.buffer = take(key)

    # -- predictions -> queue ------------------------------------------------------------
    def plan(self, step: int, window: list[tuple[int, torch.Tensor]]) -> None:
        """Queue reads for the predicted steps: window = [(target step, scores [E])]."""
        if not window:
            self.plan_probs(step, [], None)
            return
        s = torch.stack([sc for _, sc in window]).float()             # [W, E]
        nonneg = (s >= 0).all(-1, keepdim=True) & (s.sum(-1, keepdim=True) > 0)
        p = torch.where(nonneg, s / s.sum(-1, keepdim=True).clamp_min(1e-20), torch.softmax(s, -1))
        self.plan_probs(step, [t for t, _ in window], p)

    def plan_probs(self, step: int, targets: list[int], probs: torch.Tensor | None) -> None:
        """Queue reads from predicted probabilities [W, E] of the steps `targets`."""
        self.step = step
        self.step_bytes = 0
        if not self.cfg.prefetch or probs is None:
            self.pump()
            return
        m = self.cfg.candidates or self.k
        conf, ids = torch.topk(probs, m, dim=-1)
        for target, cs, es in zip(targets, conf.tolist(), ids.tolist()):
            layer = target % self.L
            for c, e in zip(cs, es):
                if c <= 0 or c < self.cfg.floor:
                    continue
                key = (layer, e)
                prev = self.predicted_next.get(key)
                if prev is None or prev < step or target < prev:
                    self.predicted_next[key] = target
                if key in self.loading or (self.pool.get(key) is not None):
                    continue
                old = self.pending.get(key)
                if old is not None and (old[0], -old[1]) <= (target, -c):
                    continue
                self.pending[key] = (target, c)
                heapq.heappush(self.queue, (target, -c, next(self.seq), key))
        self.pump()

    def pump(self, protect: set[Key] = frozenset()) -> None:
        """Issue queued reads while flash has room; drop stale and (when saturated) weak ones."""
        self.retire()
        while self.queue:
            deadline, negc, _, key = self.queue[0]
            if self.pending.get(key) != (deadline, -negc):
                heapq.heappop(self.queue)  # superseded entry
                continue
            if deadline <= self.step:
                heapq.heappop(self.queue)
                del self.pending[key]
                self.stats.dropped_stale += 1
                continue
            budget_left = (self.cfg.step_budget_bytes is None
                           or self.step_bytes + self.pool.slot_bytes <= self.cfg.step_budget_bytes)
            if self.io.inflight() >= self.cfg.queue_depth or not budget_left:
                self._drop_weak()
                return
            heapq.heappop(self.queue)
            del self.pending[key]
            if key in self.loading or self.pool.get(key) is not None:
                continue
            slot = self.pool.reserve(key, self.step, prefetch=True, protect=protect,
                                     keep=lambda v, d=deadline: self.next_predicted_use(v, self.step) <= d)
            if slot is None:
                self.stats.dropped_no_slot += 1
                continue
            self.loading.add(key)
            self.io.submit(key, demand=False)
            self.stats.prefetch_issued += 1
            self.stats.bytes_read += self.pool.slot_bytes
            self.step_bytes += self.pool.slot_bytes

    def _drop_weak(self) -> None:
        keep = []
        for item in self.queue:
            deadline, negc, _, key = item
            if self.pending.get(key) != (deadline, -negc):
                continue
            if -negc < self.cfg.min_confidence:
                del self.pending[key]
                self.stats.dropped_low_conf += 1
            else:
                keep.append(item)
        heapq.heapify(keep)
        self.queue = keep

    # -- the model asks for experts -------------------------------------------------------
    def acquire(self, step: int, keys: list[Key]) -> list[Key]:
        """Make `keys` resident and pinned for step `step`; returns the keys that were not ready
        (the caller waits for them with `wait_ready`). Misses are read on demand, first in line."""
        self.step = step
        self.retire()
        need = set(keys)
        not_ready = []
        for key in keys:
            self.stats.requests += 1
            slot = self.pool.get(key)
            if slot is not None and slot.ready:
                self.stats.hits += 1
            elif slot is not None:
                self.stats.late += 1
                not_ready.append(key)
            else:
                self.stats.misses += 1
                if key in self.pending:
                    del self.pending[key]
                slot = self.pool.reserve(key, step, prefetch=False, protect=need)
                while slot is None:  # every slot is pinned or still loading: let a prefetch land
                    busy = [k for k in self.loading if k not in need]
                    if not busy:
                        raise RuntimeError("pool has no evictable slot for a demand read; capacity < top-k?")
                    self.io.wait(busy[0])
                    self.retire()
                    slot = self.pool.reserve(key, step, prefetch=False, protect=need)
                self.loading.add(key)
                self.io.submit(key, demand=True)
                self.stats.bytes_read += self.pool.slot_bytes
                not_ready.append(key)
            slot.pins += 1
        return not_ready

    def wait_ready(self, key: Key) -> None:
        if key in self.loading:
            self.io.wait(key)
            self.retire()

    def release(self, step: int, keys: list[Key]) -> None:
        for key in keys:
            slot = self.pool.get(key)
            slot.pins -= 1
            self.pool.touch(slot, step)
        self.pump()
