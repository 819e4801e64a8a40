"""The bounded DRAM pool: fixed-size expert slots inside one byte budget.

A slot holds one expert blob. Slots are `loading` (a read is in flight into them), `ready`, and
may be pinned (in use by the layer being computed, or awaited by it): pinned and loading slots are
never evicted. When a new expert needs a slot and the pool is full, the eviction policy picks a
victim among the evictable ones; if there is none the caller must wait (a prefetch is dropped).
The budget is a hard limit: capacity = budget // slot bytes, checked at start against the largest
working set a layer needs (top-k experts of one layer), and `peak_bytes` is tracked.

The pool is plain bookkeeping with no clock and no I/O: the simulator drives it in virtual time and
the reference runner (toolkit/runtime/runner.py) with real reads, so both exercise the same code.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from toolkit.errors import SpecPrefetchError

Key = tuple[int, int]  # (MoE layer position, expert)

EVICTION_POLICIES = ("lru", "lfu", "prediction", "belady", "reuse")


@dataclasses.dataclass
class Slot:
    key: Key
    ready: bool = False
    pins: int = 0
    last_use: int = -1
    uses: int = 0
    prefetched: bool = False   # filled by a prefetch and not yet used
    buffer: object = None      # the blob once its read has landed (runtime); None before / in the simulator
    landed: bool = False       # the read's bytes are in memory (ready is the scheduler's logical state)
    demand: bool = False       # read on demand (its wait is a miss's, not a late hit's)


class ExpertPool:
    def __init__(self, budget_bytes: int, slot_bytes: int, *, policy: str = "lru", min_slots: int = 1,
                 next_use: Callable[[Key, int], float] | None = None):
        """
        Args:
            budget_bytes: the pool's byte budget.
            slot_bytes: bytes of one expert slot (the 4 KiB-aligned blob size).
            policy: lru, lfu, prediction (evict the expert predicted farthest ahead; unpredicted
                first, then LRU), belady (evict the expert whose real next use is farthest) or reuse
                (Belady's rule on a predicted next use: the window's predictions, else the expert's
                history; toolkit/runtime/reuse.py; set `reuse` before the first eviction).
            min_slots: slots the pool must hold at least (top-k of one layer); fewer is an error.
            next_use: for prediction/belady: (key, now) -> step of the next (predicted or real) use,
                inf when none.
        """
        if policy not in EVICTION_POLICIES:
            raise SpecPrefetchError(f"eviction policy {policy!r}: choose from {', '.join(EVICTION_POLICIES)}")
        if policy in ("prediction", "belady") and next_use is None:
            raise SpecPrefetchError(f"eviction policy {policy!r} needs a next-use oracle")
        self.capacity = budget_bytes // slot_bytes
        if self.capacity < min_slots:
            raise SpecPrefetchError(
                f"pool budget {budget_bytes / 2**20:.2f} MiB holds {self.capacity} expert slots of "
                f"{slot_bytes / 2**10:.0f} KiB, but one layer needs {min_slots} (its top-k) at once; "
                f"raise --pool-mib to at least {min_slots * slot_bytes / 2**20:.2f}")
        self.budget_bytes, self.slot_bytes, self.policy = budget_bytes, slot_bytes, policy
        self.next_use = next_use
        self.slots: dict[Key, Slot] = {}
        self.clock = 0
        self.peak_bytes = 0
        self.evictions = 0
        self.wasted_prefetches = 0  # prefetched slots evicted before any use
        self.on_evict: Callable[[Key], None] | None = None  # e.g. free the reader's buffer
        self.events = None  # an EventLog (toolkit/runtime/events.py) records every eviction
        # for "prediction" / "reuse": the scheduler's key -> next predicted step table (faster than next_use)
        self.predicted: dict[Key, int] | None = None
        self.reuse = None  # for "reuse": a ReuseHistory (toolkit/runtime/reuse.py) the scheduler updates

    @property
    def used_bytes(self) -> int:
        return len(self.slots) * self.slot_bytes

    def get(self, key: Key) -> Slot | None:
        return self.slots.get(key)

    def touch(self, slot: Slot, now: int) -> None:
        slot.last_use = now
        slot.uses += 1
        slot.prefetched = False

    def _victim(self, now: int, protect: set[Key]) -> Key | None:
        cands = [s for s in self.slots.values() if s.ready and s.pins == 0 and s.key not in protect]
        if not cands:
            return None
        if self.policy == "lru":
            return min(cands, key=lambda s: (s.last_use, s.key)).key
        if self.policy == "lfu":
            return min(cands, key=lambda s: (s.uses, s.last_use, s.key)).key
        if self.policy == "reuse":
            score, pred = self.reuse.score, self.predicted
            return max(cands, key=lambda s: (score(s.key, now, pred), -s.last_use, s.key)).key
        # prediction / belady: farthest next use first; among never-used-again, least recent
        if self.predicted is not None:  # the scheduler's own table: a dict lookup per slot
            pred, inf = self.predicted, float("inf")

            def nxt(s, _p=pred.get):
                v = _p(s.key)
                return (inf if v is None or v < now else v, -s.last_use, s.key)
            return max(cands, key=nxt).key
        return max(cands, key=lambda s: (self.next_use(s.key, now), -s.last_use, s.key)).key

    def reserve(self, key: Key, now: int, *, prefetch: bool, protect: set[Key] = frozenset(),
                keep: Callable[[Key], bool] | None = None) -> Slot | None:
        """A new loading slot for `key`, evicting if needed; None if nothing can be evicted.

        `keep(victim)`: True vetoes the eviction (the scheduler uses it so a prefetch never evicts
        an expert predicted to be needed before the prefetched one); the reservation then fails.
        """
        if key in self.slots:
            raise RuntimeError(f"expert {key} already has a slot")
        if len(self.slots) >= self.capacity:
            victim = self._victim(now, protect)
            if victim is None:
                return None
            if keep is not None and keep(victim):
                return None
            self.evict(victim, for_key=key)
        if (len(self.slots) + 1) * self.slot_bytes > self.budget_bytes:  # a check, not an assert (python -O)
            raise RuntimeError(f"pool over budget: {len(self.slots) + 1} slots of {self.slot_bytes} B "
                               f"exceed {self.budget_bytes} B")
        slot = Slot(key, prefetched=prefetch)
        self.slots[key] = slot
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return slot

    def settle(self) -> None:
        """Forget which resident slots came from a prefetch not yet used (the decode-token figures
        start here: prefill's prefetches count as neither used nor wasted)."""
        for s in self.slots.values():
            s.prefetched = False

    def evict(self, key: Key, *, for_key: Key | None = None) -> None:
        """Drop `key`'s slot (to make room for `for_key`, which the event log records)."""
        s = self.slots.get(key)
        if s is None:
            raise RuntimeError(f"evicting expert {key}, which has no slot")
        if s.pins:
            raise RuntimeError(f"evicting pinned expert {key}")
        if self.on_evict is not None:  # e.g. wait for its read to land, free the reader's buffer
            self.on_evict(key)
        del self.slots[key]
        self.evictions += 1
        if s.prefetched:
            self.wasted_prefetches += 1
        if self.events is not None:
            self.events.emit("evict", key, **{"for": for_key, "prefetched_unused": s.prefetched})
