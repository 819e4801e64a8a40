"""The native runner's scheduler and pool behind the Python scheduler's interface (toolkit/runtime/native_sched.py,
through the C ABI of android_runner/src/sched_capi.cpp): the same decisions as toolkit/runtime/scheduler.py, call for
call, for every eviction policy (reuse with its classes and Belady included) and planning entry point. Beside
tests/test_native_scheduler.py, which replays the reference's step scripts through a C++ test binary and compares
event logs, this drives the library the GPU tier loads, callbacks included; the GPU tier's runs with either
scheduler are compared in tests/test_gpu_tier.py."""
from __future__ import annotations

import random

import pytest
import torch

from adapters.reuse import ReuseTable
from toolkit.errors import SpecPrefetchError
from toolkit.runtime.native_sched import NativeScheduler
from toolkit.runtime.policy import Policy
from toolkit.runtime.runner import RunConfig, open_pool_and_scheduler, scheduler_config
from toolkit.runtime.scheduler import SchedulerConfig

L, E, K = 4, 8, 2
SLOT = 4096


class LogIO:
    """An IO that records what the scheduler asks of it; a read lands once `delay` more reads have been submitted
    after it (or when it is waited for), so some uses and evictions find a read in flight and others one landed."""

    def __init__(self, delay: int = 3, orders_reuse: bool = False):
        self.log: list[tuple] = []
        self.delay, self.tick, self.lands = delay, 0, {}
        self.orders_reuse = orders_reuse

    def submit(self, key, *, demand):
        self.log.append(("submit", key, demand))
        self.tick += 1
        self.lands[key] = self.tick + self.delay

    def landed(self, key):
        return self.tick >= self.lands.get(key, 0)

    def wait(self, key):
        self.log.append(("wait", key))
        self.lands[key] = 0

    def take(self, key):
        self.log.append(("take", key))
        return ("bytes", key)

    def release(self, key):
        self.log.append(("release", key))
        self.lands.pop(key, None)


def _table(classes: bool) -> ReuseTable:
    rng = random.Random(3)
    bits = 3
    v16 = tuple(rng.randrange(16, 200) for _ in range(1 << bits))
    if not classes:
        return ReuseTable(bits=bits, cap=12, visits16=v16)
    cls = tuple(tuple(rng.randrange(2) for _ in range(E)) for _ in range(L))
    return ReuseTable(bits=bits, cap=12, visits16=v16, classes=cls,
                      class_visits16=tuple(tuple(rng.randrange(16, 200) for _ in range(1 << bits)) for _ in range(2)))


def _future(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(L)]) for _ in range(n)]


def _pair(policy: str, slots: int, future, *, table=None, orders_reuse=False, **cfg):
    rc = RunConfig(policy=Policy.parse(policy), pool_mib=slots * SLOT / 2**20, **cfg)
    io_py, io_c = LogIO(orders_reuse=orders_reuse), LogIO(orders_reuse=orders_reuse)
    pool, py = open_pool_and_scheduler(rc, slot_bytes=SLOT, num_layers=L, top_k=K, io=io_py, future=future,
                                       prefetch=rc.policy.predictor != "on-demand", reuse=table)
    c = NativeScheduler(budget_bytes=rc.budget_bytes, slot_bytes=SLOT, policy=rc.policy.eviction, num_layers=L,
                        num_experts=E, top_k=K, io=io_c, future=future,
                        reuse=table if table is None or rc.reuse_classes else table.whole(),
                        cfg=scheduler_config(rc, prefetch=rc.policy.predictor != "on-demand", reuse=table))
    return (py, io_py), (c, io_c)


def _drive(sched, io, future, seed: int, planner: str) -> list:
    """A decode over `future`'s positions: each MoE layer acquires its routed experts, reads them (data),
    plans the window (random probabilities, the oracle's ranks, or random scores), sets a predicted next visit
    (reuse) and releases; the state after every step is recorded."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    seen = []
    for pos, ids in enumerate(future):
        for li in range(L):
            step = pos * L + li
            keys = [(li, int(e)) for e in ids[li]]
            held = sched.pool.slots
            sched.acquire(step, [k for k in keys if k in held] + [k for k in keys if k not in held])
            bufs = [sched.data(k) for k in keys]
            targets = [step + h for h in (1, 2)]
            if planner == "probs":
                sched.plan_probs(step, targets, torch.softmax(torch.randn(2, E, generator=g) * 3, -1))
            elif planner == "ties":   # equal probabilities: the lower expert id first in both
                x = torch.randint(0, 3, (2, E), generator=g).float()
                sched.plan_probs(step, targets, x / x.sum(-1, keepdim=True).clamp_min(1))
            elif planner == "scores":   # non-negative rows normalised, others softmaxed, all-zero skipped
                rows = [torch.rand(E, generator=g), torch.randn(E, generator=g), torch.zeros(E)]
                sched.plan(step, list(zip(targets + [step + 3], rows)))
            elif planner == "ranked":
                conf = [[2 / 3, 1 / 3], [2 / 3]]
                es = [rng.sample(range(E), 2), rng.sample(range(E), 1)]
                sched.plan_ranked(step, targets, conf, es)
            if sched.reuse is not None and rng.random() < 0.5:   # (else the history alone scores the layer)
                sched.reuse.set_next_visit(li, step + L, rng.sample(range(E), 2 * K))
            sched.release(step, keys)
            st = sched.stats
            seen.append((step, bufs, st.requests, st.hits, st.misses, st.late, st.prefetch_issued, st.dropped_stale,
                         st.dropped_low_conf, st.dropped_no_slot, st.dropped_late, st.bytes_read,
                         sched.in_flight(), sched.pool.evictions, sched.pool.wasted_prefetches,
                         sched.pool.unused_prefetches(), sched.pool.peak_bytes,
                         sorted(k for k in ((a, b) for a in range(L) for b in range(E)) if k in sched.pool.slots)))
    return seen


CASES = [
    ("on-demand+lru", 5, "none", {}),
    ("on-demand+lfu", 5, "none", {}),
    ("next-gate+lru", 6, "probs", {}),
    ("next-gate+prediction", 6, "probs", {"min_confidence": 0.2}),
    ("next-gate+prediction", 7, "scores", {"queue_depth": 1}),
    ("next-gate+lfu", 6, "probs", {"candidate_threshold": 0.1, "read_budget_kib": 4}),
    ("next-gate+lru", 8, "probs", {"queue_depth": 1, "min_confidence": 0.3}),
    ("previous-token+lru", 6, "ties", {"queue_depth": 2}),
    ("oracle+belady", 6, "ranked", {}),
    ("oracle+prediction", 5, "ranked", {"step_budget_kib": 4}),
    ("adapter+reuse", 6, "probs", {}),
    ("adapter+reuse", 7, "probs", {"reuse_classes": False}),
]


@pytest.mark.parametrize("orders_reuse", [False, True])
@pytest.mark.parametrize("policy,slots,planner,cfg", CASES)
def test_native_scheduler_makes_the_python_schedulers_decisions(policy, slots, planner, cfg, orders_reuse):
    """Driven by the same calls, the native scheduler asks the IO for the same reads, waits, takes and releases
    in the same order, and its counts, pool and in-flight prefetches match the Python scheduler's after every
    step: every eviction policy, every planning entry point, the drop rules and budgets, the reuse table with
    and without classes; with an IO that orders a slot's reuse itself, no wait for an evicted read."""
    future = _future(12, seed=slots)
    table = _table(classes=cfg.get("reuse_classes", True)) if policy.endswith("+reuse") else None
    (py, io_py), (c, io_c) = _pair(policy, slots, future, table=table, orders_reuse=orders_reuse, **cfg)
    a = _drive(py, io_py, future, 5, planner)
    b = _drive(c, io_c, future, 5, planner)
    assert a == b
    assert io_py.log == io_c.log
    kinds = {x[0] for x in io_py.log}
    assert {"submit", "take", "release"} <= kinds               # the test reaches evictions and first uses
    assert a[-1][2] == len(future) * L * K and a[-1][13] > 0   # every use asked; something evicted
    if planner != "none":
        assert a[-1][6] > 0                                      # prefetches issued


def test_native_scheduler_raises_the_ios_own_error_and_refuses_bad_input():
    """A failed read (the IO raises) comes back as the IO's own exception, not a crash or a C++ message; a full
    pool's demand read and a reuse policy without its table are one-line errors."""
    future = _future(4, seed=1)
    (_, _), (c, io) = _pair("on-demand+lru", 4, future)

    def broken(key, *, demand):
        raise OSError(f"copy of {key} failed")

    io.submit = broken
    with pytest.raises(OSError, match=r"copy of \(0, \d\) failed"):
        c.acquire(0, [(0, int(e)) for e in future[0][0]])
    for policy, match in (("reuse", "needs a reuse table"), ("belady", "belady eviction needs")):
        with pytest.raises(SpecPrefetchError, match=match):
            NativeScheduler(budget_bytes=4 * SLOT, slot_bytes=SLOT, policy=policy, num_layers=L, num_experts=E,
                            top_k=K, io=LogIO(), cfg=SchedulerConfig())
    (_, _), (c, _) = _pair("on-demand+lru", 2, future)
    c.acquire(0, [(0, 0), (0, 1)])
    with pytest.raises(SpecPrefetchError, match="no evictable slot"):
        c.acquire(1, [(1, 0)])
    with pytest.raises(SpecPrefetchError, match=r"not \[W, 8\]"):
        c.plan_probs(1, [2], torch.ones(1, 3))
