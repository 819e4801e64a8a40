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

import bisect
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
        # the slots by last use (last_use -> key -> slot) and those last uses ascending: the victim search
        # walks them oldest first and stops at the first group that decides, instead of scoring every slot
        # (the host's work per MoE layer on the GPU tier). Kept by reserve / touch / evict, the only
        # writers of a slot's last_use.
        self._by_use: dict[int, dict[Key, Slot]] = {}
        self._uses: list[int] = []
        # the slots by layer (layer -> key -> slot), kept by reserve / evict: the reuse search's per-layer terms
        # computed once per layer
        self.by_layer: dict[int, dict[Key, Slot]] = {}

    @property
    def used_bytes(self) -> int:
        return len(self.slots) * self.slot_bytes

    def get(self, key: Key) -> Slot | None:
        return self.slots.get(key)

    def touch(self, slot: Slot, now: int) -> None:
        if slot.last_use != now and self.slots.get(slot.key) is slot:
            self._unlist(slot)
            slot.last_use = now
            self._list(slot)
        else:
            slot.last_use = now
        slot.uses += 1
        slot.prefetched = False

    def _list(self, slot: Slot) -> None:
        group = self._by_use.get(slot.last_use)
        if group is None:
            group = self._by_use[slot.last_use] = {}
            bisect.insort(self._uses, slot.last_use)   # decode touches the newest step: an append
        group[slot.key] = slot

    def _unlist(self, slot: Slot) -> None:
        group = self._by_use[slot.last_use]
        del group[slot.key]
        if not group:
            del self._by_use[slot.last_use]
            del self._uses[bisect.bisect_left(self._uses, slot.last_use)]

    def _victim(self, now: int, protect: set[Key]) -> Key | None:
        """The evictable slot (ready, unpinned, not protected) the policy evicts: lru the least recently
        used (then the lowest key), lfu the least used (then lru), prediction / belady / reuse the one
        used farthest ahead (then the least recently used, then the highest key). The scans go oldest
        use first, so lru, and prediction / belady whenever an evictable slot is never used again, stop
        at the first group of slots of one last use that holds an answer."""
        if self.policy == "lru":
            for u in self._uses:
                best = None
                for key, s in self._by_use[u].items():
                    if s.ready and not s.pins and key not in protect and (best is None or key < best):
                        best = key
                if best is not None:
                    return best
            return None
        if self.policy == "lfu":
            cands = [s for s in self.slots.values() if s.ready and s.pins == 0 and s.key not in protect]
            return min(cands, key=lambda s: (s.uses, s.last_use, s.key)).key if cands else None
        if self.policy == "reuse":   # max (score, -last_use, key), scored in one pass
            return self.reuse.farthest(self.by_layer, now, self.predicted, protect)
        return self._victim_farthest(now, protect)

    def _victim_farthest(self, now: int, protect: set[Key]) -> Key | None:
        """prediction / belady: max (next use, -last_use, key), a next use of inf for one never used
        again (prediction: not predicted, or predicted for a step already past). Walked by last use,
        oldest first: the first group holding an evictable slot never used again decides (its highest
        key); if none is, the farthest finite next use over every evictable slot."""
        inf = float("inf")
        pred = self.predicted.get if self.predicted is not None else None
        nu = self.next_use
        seen = []   # (next use, -last_use, key) of the evictable slots with a finite next use
        for u in self._uses:
            best = None
            for key, s in self._by_use[u].items():
                if not s.ready or s.pins or key in protect:
                    continue
                if pred is not None:   # the scheduler's own table: a dict lookup per slot
                    v = pred(key)
                    if v is None or v < now:
                        v = inf
                else:
                    v = nu(key, now)
                if v == inf:
                    if best is None or key > best:
                        best = key
                elif best is None:
                    seen.append((v, -u, key))
            if best is not None:
                return best
        return max(seen)[2] if seen else None

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
        self._list(slot)
        group = self.by_layer.get(key[0])
        if group is None:
            group = self.by_layer[key[0]] = {}
        group[key] = slot
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return slot

    def preload(self, key: Key) -> None:
        """A slot for `key`, ready and read on demand (the caller submits the read): the resident bound."""
        slot = self.reserve(key, -1, prefetch=False)
        if slot is None:
            raise RuntimeError(f"preload of {key}: the pool is full")
        slot.ready = slot.demand = True

    def unused_prefetches(self) -> int:
        """Slots a prefetch filled that no step has used yet."""
        return sum(1 for s in self.slots.values() if s.prefetched)

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
        self._unlist(s)
        group = self.by_layer[key[0]]
        del group[key]
        if not group:
            del self.by_layer[key[0]]
        self.evictions += 1
        if s.prefetched:
            self.wasted_prefetches += 1
        if self.events is not None:
            self.events.emit("evict", key, **{"for": for_key, "prefetched_unused": s.prefetched})
