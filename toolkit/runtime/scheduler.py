"""The windowed prefetch scheduler: predictions in, a prioritised queue of flash reads out.

Steps are (position, MoE layer) pairs numbered s = position * L + layer. At step s the predictor's
scored expert sets for steps s+1 .. s+W arrive; the scheduler turns each set's top candidates into
read requests with a deadline (their step) and a confidence (their predicted probability), and
keeps them in a queue ordered by deadline, then confidence. It issues reads while the step's queue
has room (`queue_depth`) and the step's prefetch byte budget lasts; when the queue is full it drops
requests below `min_confidence`, and it always drops stale ones (deadline already reached). With a
read budget (`read_budget_bytes`: what the flash delivers in one step's compute time) it also drops a
prefetch that could not land by its deadline behind the prefetch bytes already asked of the flash
(reason `late`): those bytes would only delay the reads the model waits for. Demand reads are not
counted: their step waits for them, so it lasts as long as they take (until 2026-12-03 they were, and
where the misses alone exceeded the budget, every prefetch came out late). A
prefetch gets a pool slot only by evicting something not needed sooner. A miss is read on demand
at top priority. Unbudgeted prefetch has been seen to slow decode (published phone engines): the budget and the
candidate threshold are what keep prefetch from starving the reads the model is waiting for.

Decisions never depend on when a read happens to finish, so the same prompt, policy and budget
give the same decisions on any machine, in the simulator and in the C++ runner (the event log,
toolkit/runtime/events.py, is that contract); a read budget measured in the run (ReadBudgetMeter, set
through `set_read_budget`) is the exception: it follows the steps' compute time. A prefetch issued at
step s is *logically* complete from step s+1 on: it is then a hit, an eviction candidate, and no longer
counts against the queue. Whether its bytes have physically landed matters only when they are used (or their slot is
reused, unless the IO orders the slot's next read after them itself): then the scheduler waits for
them, and that wait is the stall it reports.

The scheduler talks to flash through an `IOBackend` (virtual time in toolkit/simulate/flash.py,
real O_DIRECT reads in toolkit/runtime/io.py) and to memory through `ExpertPool`.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from typing import Callable, Protocol

import torch

from toolkit.runtime.pool import ExpertPool, Key
from toolkit.runtime.reuse import SCALE


class IOBackend(Protocol):
    # (optional) orders_reuse = True: a read into a slot is ordered after the slot's old read by the IO
    # itself, so evicting a key whose read is in flight need not wait for it (the GPU tier's copies)
    def submit(self, key: Key, *, demand: bool) -> None: ...
    def landed(self, key: Key) -> bool: ...      # the read's bytes are in memory (never blocks)
    def wait(self, key: Key) -> None: ...        # block (or advance virtual time) until they are
    def take(self, key: Key) -> object: ...      # the bytes (None in the simulator)
    def release(self, key: Key) -> None: ...     # the pool dropped the key: forget its buffer


@dataclasses.dataclass
class SchedulerConfig:
    """How the scheduler turns a window's predictions into reads (how far ahead the window looks is
    the planner's: RunConfig.window)."""
    candidates: int | None = None   # experts per predicted step (default: top-k)
    queue_depth: int = 4            # prefetch reads issued per step at most (logically in flight)
    step_budget_bytes: int | None = None  # prefetch bytes issued per step (None: unbounded)
    read_budget_bytes: int | None = None  # bytes the flash delivers per step (None: no deadline check)
    min_confidence: float = 0.02    # below this a request is dropped when the queue is full
    candidate_threshold: float = 0.0  # below this a candidate is never queued at all
    prefetch: bool = True           # False: on-demand only


@dataclasses.dataclass
class SchedulerStats:
    """Counts since the scheduler started (summable; RunStats turns them into rates)."""
    requests: int = 0          # expert uses asked of the pool
    hits: int = 0              # resident (logically) when needed
    prefetch_hits: int = 0     # ... of which the first use of a prefetched slot
    late: int = 0              # hits whose bytes had not yet landed (the use waited: timing)
    misses: int = 0            # read on demand
    prefetch_issued: int = 0
    dropped_stale: int = 0
    dropped_low_conf: int = 0
    dropped_no_slot: int = 0
    dropped_late: int = 0      # could not land by their deadline at the read budget
    bytes_read: int = 0
    wait_s: float = 0.0        # time blocked on reads (real or virtual seconds)

    def minus(self, other: "SchedulerStats") -> "SchedulerStats":
        return SchedulerStats(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                                 for f in dataclasses.fields(self)})

    def plus(self, other: "SchedulerStats") -> "SchedulerStats":
        return SchedulerStats(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                                 for f in dataclasses.fields(self)})


def resident_first(keys: list[Key], held) -> list[Key]:
    """`keys` with the ones the pool holds (`held`: its slots) first, each group in its order: the order a step
    acquires them in, so no read is asked for an expert before every resident one is pinned."""
    inside = [k in held for k in keys]   # (once a key: the native pool answers each across its C ABI)
    return [k for k, x in zip(keys, inside) if x] + [k for k, x in zip(keys, inside) if not x]


def stable_topk(x: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest along `dim`, descending, the lower index first among equal values (as the native runner's
    topk): a stable sort's first k (`torch.topk` orders ties arbitrarily)."""
    v, i = torch.sort(x, dim=dim, descending=True, stable=True)
    return v.narrow(dim, 0, min(k, x.shape[dim])), i.narrow(dim, 0, min(k, x.shape[dim]))


def window_probs(window: list[tuple[int, torch.Tensor]]) -> tuple[list[int], torch.Tensor | None]:
    """`plan`'s window as `plan_probs` takes it (both schedulers: this one and native_sched.py's): the rows that
    predict anything (an all-zero row is no prediction), non-negative ones normalised to sum 1, others softmaxed."""
    window = [(t, sc) for t, sc in window if bool(sc.ne(0).any())]
    if not window:
        return [], None
    s = torch.stack([sc for _, sc in window]).float()             # [W, E]
    nonneg = (s >= 0).all(-1, keepdim=True) & (s.sum(-1, keepdim=True) > 0)
    p = torch.where(nonneg, s / s.sum(-1, keepdim=True).clamp_min(1e-20), torch.softmax(s, -1))
    return [t for t, _ in window], p


MAX_BUDGET_KIB = 1 << 30   # a measured budget at most 1 TiB a step (no overflow of budget x steps in C++)


class ReadBudgetMeter:
    """The read budget measured in the run (`--read-budget-kib auto`, both engines: the native runner's
    ReadBudgetMeter is the same rule): the flash's rate (measured at start-up) times the compute time of
    a step, measured as the run goes: the time between two consecutive MoE steps of the same span (a
    prefill span's positions; 1 for one position) less what the scheduler waited for reads between them,
    smoothed by 1/8 of each new step; the first step measured after the span changes replaces it. The
    budget is whole KiB, at least one expert slot (and at most MAX_BUDGET_KIB); None before the first step
    is measured."""

    def __init__(self, read_bytes_per_s: float, slot_bytes: int):
        self.rate, self.slot_kib = read_bytes_per_s, -(-slot_bytes // 1024)
        self.span, self.fresh = 0, True
        self.last_now = self.last_wait = self.step_s = 0.0

    def at(self, span: int, now_s: float, wait_s: float) -> int | None:
        """At a MoE step of `span` positions reached at `now_s` seconds with `wait_s` seconds of read
        waits so far: the budget in bytes a step from this step on (None: none yet)."""
        if span == self.span:
            dt = max(0.0, (now_s - self.last_now) - (wait_s - self.last_wait))
            self.step_s = dt if self.fresh else self.step_s + (dt - self.step_s) / 8.0
            self.fresh = False
        else:  # another span: its first step's time replaces the estimate
            self.span, self.fresh = span, True
        self.last_now, self.last_wait = now_s, wait_s
        if self.step_s <= 0:
            return None
        kib = int(min(self.rate * self.step_s / 1024.0, MAX_BUDGET_KIB))
        return min(max(kib, self.slot_kib), MAX_BUDGET_KIB) * 1024


class WindowScheduler:
    def __init__(self, pool: ExpertPool, io: IOBackend, cfg: SchedulerConfig, *, num_layers: int,
                 top_k: int, events=None, clock: Callable[[], float] = time.perf_counter, reuse=None):
        """
        Args:
            pool: the bounded pool the reads go into.
            io: where reads go (real or simulated flash).
            cfg: window, queue depth and the drop rules.
            num_layers / top_k: MoE layers per token and experts per layer.
            events: an EventLog, or None.
            clock: seconds now (virtual in the simulator), to time blocking waits.
            reuse: a ReuseHistory (toolkit/runtime/reuse.py) for the pool's `reuse` eviction: every
                acquire records its experts into it.
        """
        self.pool, self.io, self.cfg = pool, io, cfg
        self.io_orders_reuse = getattr(io, "orders_reuse", False)   # (IOBackend: optional)
        self.L, self.k = num_layers, top_k
        self.events, self.clock = events, clock
        self.queue: list[tuple[int, float, int, Key]] = []  # (deadline, -confidence, seq, key)
        self.pending: dict[Key, tuple[int, float]] = {}      # queued key -> (deadline, confidence)
        self.loading: dict[Key, int] = {}                    # prefetch in flight -> step it was issued
        self.predicted_next: dict[Key, int] = {}             # latest predicted use of each key
        self.seq = itertools.count()
        self.stats = SchedulerStats()
        self.step = 0
        self.step_bytes = 0
        self.backlog = 0          # prefetch bytes asked of the flash not yet delivered at the read budget's rate
        self.backlog_step = 0     # the step `backlog` is counted at
        if pool.policy in ("prediction", "reuse"):
            pool.predicted = self.predicted_next
        if pool.policy == "reuse" and reuse is None:
            raise RuntimeError("the reuse eviction needs a ReuseHistory")
        self.reuse = reuse
        pool.reuse = reuse
        pool.on_evict = self._evicting
        pool.events = events

    def _emit(self, kind: str, key: Key, **fields) -> None:
        if self.events is not None:
            self.events.emit(kind, key, **fields)

    # -- bookkeeping ---------------------------------------------------------------------
    def _advance(self, step: int) -> None:
        """The read budget's backlog at `step`: each step since the last one delivered a budget's bytes."""
        rate = self.cfg.read_budget_bytes
        if rate is not None and step > self.backlog_step:
            self.backlog = max(0, self.backlog - rate * (step - self.backlog_step))
            self.backlog_step = step

    def set_read_budget(self, step: int, nbytes: int | None) -> None:
        """The read budget from `step` on (bytes a step; None: none): the backlog so far drains at the
        old rate up to `step`; from none, the prefetches in flight are the backlog (ReadBudgetMeter's)."""
        if self.cfg.read_budget_bytes is not None:
            self._advance(step)
        else:
            self.backlog, self.backlog_step = len(self.loading) * self.pool.slot_bytes, step
        self.cfg.read_budget_bytes = nbytes   # (the sequence's own config: scheduler_inputs makes one per run)

    def in_flight(self) -> int:
        """Prefetches logically in flight (issued, not yet retired)."""
        return len(self.loading)

    def next_predicted_use(self, key: Key, now: int) -> float:
        s = self.predicted_next.get(key)
        return s if s is not None and s >= now else float("inf")

    def retire(self, step: int) -> None:
        """Prefetches issued before `step` are logically complete (in issue order)."""
        done = [k for k, s in self.loading.items() if s < step]
        for key in done:
            del self.loading[key]
            self.pool.get(key).ready = True
            self._emit("ready", key)

    def _wait(self, key: Key) -> None:
        t0 = self.clock()
        self.io.wait(key)
        self.stats.wait_s += self.clock() - t0

    def _evicting(self, key: Key) -> None:
        """The pool is about to drop `key`: bytes still in flight into its slot must land first (unless the
        IO orders the slot's next read after them itself: `orders_reuse`, the GPU tier's copies)."""
        if not self.io_orders_reuse and not self.pool.get(key).landed and not self.io.landed(key):
            self._wait(key)
        self.io.release(key)

    def data(self, key: Key):
        """The bytes of a resident expert, waiting for its read to land if it has not."""
        slot = self.pool.get(key)
        if not slot.landed:
            if not self.io.landed(key):
                if not slot.demand:   # a hit whose read is still on its way
                    self.stats.late += 1
                self._wait(key)
            slot.buffer = self.io.take(key)
            slot.landed = True
        return slot.buffer

    def landed(self, key: Key) -> bool:
        """Whether a resident expert's bytes are in memory now (`data` would not wait); never blocks."""
        slot = self.pool.get(key)
        return slot.landed or self.io.landed(key)

    def compute_order(self, keys: list[Key]):
        """Yield the indices of `keys` (acquired experts) in the order to compute them while the
        missing ones load: every expert whose bytes have landed first, in the given order, then
        each other one as soon as its read lands (polling; when none has, the first of them, whose
        `data` then waits: the stall)."""
        waiting = []
        for i, key in enumerate(keys):
            if self.landed(key):
                yield i
            else:
                waiting.append(i)
        while waiting:
            pick = next((w for w, i in enumerate(waiting) if self.landed(keys[i])), 0)
            yield waiting.pop(pick)

    # -- predictions -> queue ------------------------------------------------------------
    def plan(self, step: int, window: list[tuple[int, torch.Tensor]]) -> None:
        """Queue reads for the predicted steps: window = [(target step, scores [E])]. Scores that
        are non-negative are normalised to sum 1; others go through a softmax. An all-zero row is
        no prediction at all (e.g. previous-token at the first position) and queues nothing."""
        self.plan_probs(step, *window_probs(window))

    def plan_probs(self, step: int, targets: list[int], probs: torch.Tensor | None) -> None:
        """Queue reads from predicted probabilities [W, E] of the steps `targets`."""
        if not self.cfg.prefetch or probs is None:
            self.plan_ranked(step, [], [], [])
            return
        # (the order among equal probabilities decides which of equal candidates is queued first)
        conf, ids = stable_topk(probs, self.cfg.candidates or self.k)
        self.plan_ranked(step, targets, conf.tolist(), ids.tolist())

    def plan_ranked(self, step: int, targets: list[int], confs: list[list[float]], ids: list[list[int]]) -> None:
        """`plan_probs` with each target's candidates already taken: per target, what the top-m of its
        probabilities would give (confidences descending, their experts; entries of confidence 0 may
        be left out). For a predictor whose candidates are known without a [W, E] tensor (the oracle)."""
        self.step = step
        self.step_bytes = 0
        self._advance(step)
        if not self.cfg.prefetch:
            self.pump()
            return
        self._queue(step, targets, confs, ids)

    def _queue(self, step: int, targets: list[int], confs: list[list[float]], ids: list[list[int]]) -> None:
        """Queue each target's candidates (confidences descending), then pump."""
        L, threshold = self.L, self.cfg.candidate_threshold
        predicted, loading, slots, pending = self.predicted_next, self.loading, self.pool.slots, self.pending
        for target, cs, es in zip(targets, confs, ids):
            layer = target % L
            for c, e in zip(cs, es):
                if c <= 0 or c < threshold:
                    continue
                key = (layer, e)
                prev = predicted.get(key)
                if prev is None or prev < step or target < prev:
                    predicted[key] = target
                if key in loading or key in slots:
                    continue
                old = pending.get(key)
                if old is not None and (old[0], -old[1]) <= (target, -c):
                    continue
                pending[key] = (target, c)
                heapq.heappush(self.queue, (target, -c, next(self.seq), key))
        self.pump()

    def pump(self, protect: set[Key] = frozenset()) -> None:
        """Issue queued reads while this step's queue has room; drop stale and (when full) weak ones."""
        while self.queue:
            deadline, negc, _, key = self.queue[0]
            if self.pending.get(key) != (deadline, -negc):
                heapq.heappop(self.queue)  # superseded entry
                continue
            if deadline <= self.step:
                heapq.heappop(self.queue)
                del self.pending[key]
                self.stats.dropped_stale += 1
                self._emit("drop", key, reason="stale", target=deadline)
                continue
            budget_left = (self.cfg.step_budget_bytes is None
                           or self.step_bytes + self.pool.slot_bytes <= self.cfg.step_budget_bytes)
            if len(self.loading) >= self.cfg.queue_depth or not budget_left:
                self._drop_weak()
                return
            heapq.heappop(self.queue)
            del self.pending[key]
            if key in self.loading or self.pool.get(key) is not None:
                continue
            rate = self.cfg.read_budget_bytes
            if rate is not None and self.backlog + self.pool.slot_bytes > rate * (deadline - self.step):
                self.stats.dropped_late += 1  # it would land after its step: it only delays other reads
                self._emit("drop", key, reason="late", target=deadline)
                continue
            slot = self.pool.reserve(key, self.step, prefetch=True, protect=protect, keep=self._keeper(deadline))
            if slot is None:
                self.stats.dropped_no_slot += 1
                self._emit("drop", key, reason="no_slot", target=deadline)
                continue
            self.loading[key] = self.step
            self.io.submit(key, demand=False)
            self.backlog += self.pool.slot_bytes
            self.stats.prefetch_issued += 1
            self.stats.bytes_read += self.pool.slot_bytes
            self.step_bytes += self.pool.slot_bytes
            self._emit("prefetch", key, target=deadline, conf=f"{-negc:.4f}")

    def _keeper(self, deadline: int):
        """The veto of a prefetch's eviction: the victim is predicted to be needed by `deadline` (by the
        window; with the reuse eviction, by its score, so a history that says "soon" is kept too)."""
        if self.reuse is not None:
            score, pred, now = self.reuse.score, self.predicted_next, self.step
            return lambda v: score(v, now, pred) <= deadline * SCALE
        return lambda v: self.next_predicted_use(v, self.step) <= deadline

    def _drop_weak(self) -> None:
        keep = []
        for item in sorted(self.queue):  # queue order, so drops are logged in a fixed order
            deadline, negc, _, key = item
            if self.pending.get(key) != (deadline, -negc):
                continue
            if -negc < self.cfg.min_confidence:
                del self.pending[key]
                self.stats.dropped_low_conf += 1
                self._emit("drop", key, reason="low_confidence", target=deadline)
            else:
                keep.append(item)
        heapq.heapify(keep)
        self.queue = keep

    # -- the model asks for experts -------------------------------------------------------
    def acquire(self, step: int, keys: list[Key]) -> None:
        """Make `keys` resident and pinned for step `step`. Misses are read on demand, first in
        line; `data(key)` then waits for the bytes."""
        self.step = step
        self._advance(step)
        self.retire(step)
        if self.reuse is not None:  # before any reservation: the histories this step's evictions read
            self.reuse.observe(step, keys)
        need = set(keys)
        for key in keys:
            self.stats.requests += 1
            slot = self.pool.get(key)
            if slot is not None:
                if not slot.ready:  # prefetched this very step (only when a plan ran before acquire)
                    del self.loading[key]
                    slot.ready = True
                self.stats.hits += 1
                self.stats.prefetch_hits += int(slot.prefetched)
                self._emit("hit", key, prefetched=slot.prefetched)
            else:
                self.stats.misses += 1
                if key in self.pending:
                    del self.pending[key]
                slot = self.pool.reserve(key, step, prefetch=False, protect=need)
                if slot is None:
                    raise RuntimeError(f"pool has no evictable slot for a demand read of {key}: "
                                       "every slot is pinned (capacity < top-k?)")
                slot.ready = True  # logically complete within this step: it is waited for before use
                slot.demand = True
                self.io.submit(key, demand=True)
                # a demand read is not part of the read budget's backlog: its step waits for it, so the
                # step lasts as long as the read, and the prefetches' schedule (in steps) is not pushed back
                self.stats.bytes_read += self.pool.slot_bytes
                self._emit("miss", key)
            slot.pins += 1

    def acquire_read(self, step: int, keys: list[Key]) -> list:
        """A MoE layer's experts made resident, pinned and read: `acquire` with the pool's residents first (each
        group in the given order), then `data` of each key in the given order; their bytes."""
        self.acquire(step, resident_first(keys, self.pool.slots))
        return [self.data(k) for k in keys]

    def read_resident(self, keys: list[Key]) -> bool:
        """If every key has a slot in the pool: `data` of each in the given order (a read still landing waited
        for), nothing else, and True; the step's `acquire` of the same keys follows (it then evicts and reads
        nothing). False, and nothing done, if any key has none."""
        slots = self.pool.slots
        if not all(key in slots for key in keys):
            return False
        for key in keys:
            self.data(key)
        return True

    def release(self, step: int, keys: list[Key], *, pump: bool = True) -> None:
        """Unpin `keys` after step `step` used them, then issue queued reads (`pump`). A prefill
        chunk's MoE layer acquires its experts in groups that fit the pool and pumps only after the
        last group, so no prefetch takes a slot a later group of the same step needs."""
        for key in keys:
            slot = self.pool.get(key)
            slot.pins -= 1
            self.pool.touch(slot, step)
        if pump:
            self.pump()
