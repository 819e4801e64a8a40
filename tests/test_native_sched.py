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
from toolkit.runtime.native_sched import NativeScheduler, has_compiler, open_native_scheduler
from toolkit.runtime.policy import Policy
from toolkit.runtime.runner import RunConfig, open_pool_and_scheduler
from toolkit.runtime.scheduler import SchedulerConfig

L, E, K = 4, 8, 2
SLOT = 4096


pytestmark = pytest.mark.skipif(not has_compiler(), reason="no C++ compiler to build the native scheduler")


class LogIO:
    """An IO that records what the scheduler asks of it, landed() queries included; a read lands once `delay`
    more reads have been submitted after it (or when it is waited for), so some uses and evictions find a read in
    flight and others one landed. `fail`: the operation (and the how-many-th call of it) that raises."""

    def __init__(self, delay: int = 1, orders_reuse: bool = False, fail: tuple[str, int] | None = None):
        self.log: list[tuple] = []
        self.delay, self.tick, self.lands = delay, 0, {}
        self.orders_reuse = orders_reuse
        self.fail, self.calls = fail, {}

    def _note(self, *entry):
        self.log.append(entry)
        n = self.calls[entry[0]] = self.calls.get(entry[0], 0) + 1
        if self.fail == (entry[0], n):
            raise OSError(f"{entry[0]} of {entry[1]} failed")

    def submit(self, key, *, demand):
        self._note("submit", key, demand)
        self.tick += 1
        self.lands[key] = self.tick + self.delay

    def landed(self, key):
        done = self.tick >= self.lands.get(key, 0)
        self._note("landed", key, done)
        return done

    def wait(self, key):
        self._note("wait", key)
        self.lands[key] = 0

    def take(self, key):
        self._note("take", key)
        return ("bytes", key)

    def release(self, key):
        self._note("release", key)
        self.lands.pop(key, None)


def _table(classes: bool, dims=(L, E)) -> ReuseTable:
    rng = random.Random(3)
    bits = 3
    v16 = tuple(rng.randrange(16, 200) for _ in range(1 << bits))
    if not classes:
        return ReuseTable(bits=bits, cap=12, visits16=v16)
    cls = tuple(tuple(rng.randrange(2) for _ in range(dims[1])) for _ in range(dims[0]))
    return ReuseTable(bits=bits, cap=12, visits16=v16, classes=cls,
                      class_visits16=tuple(tuple(rng.randrange(16, 200) for _ in range(1 << bits)) for _ in range(2)))


def _future(n: int, seed: int, dims=(L, E, K)) -> list[torch.Tensor]:
    nl, ne, k = dims
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(ne, generator=g)[:k] for _ in range(nl)]) for _ in range(n)]


def _pair(policy: str, slots: int, future, *, table=None, dims=(L, E, K), io=LogIO, **cfg):
    """The Python scheduler and the native one for the same run, each over its own IO (made by `io`)."""
    nl, ne, k = dims
    rc = RunConfig(policy=Policy.parse(policy), pool_mib=slots * SLOT / 2**20, **cfg)
    io_py, io_c = io(), io()
    prefetch = rc.policy.predictor != "on-demand"
    pool, py = open_pool_and_scheduler(rc, slot_bytes=SLOT, num_layers=nl, top_k=k, io=io_py, future=future,
                                       prefetch=prefetch, reuse=table)
    _, c = open_native_scheduler(rc, slot_bytes=SLOT, num_layers=nl, num_experts=ne, top_k=k, io=io_c,
                                 future=future, prefetch=prefetch, reuse=table)
    return (py, io_py), (c, io_c)


def _state(sched, step, bufs, dims):
    nl, ne, _ = dims
    st = sched.stats
    return (step, bufs, st.requests, st.hits, st.misses, st.late, st.prefetch_issued, st.dropped_stale,
            st.dropped_low_conf, st.dropped_no_slot, st.dropped_late, st.bytes_read, sched.in_flight(),
            sched.pool.evictions, sched.pool.wasted_prefetches, sched.pool.unused_prefetches(), sched.pool.peak_bytes,
            sorted(k for k in ((a, b) for a in range(nl) for b in range(ne)) if k in sched.pool.slots))


def _drive(sched, future, seed: int, planner: str, dims=(L, E, K), groups: int = 1, one_call: bool = False,
           budgets=None) -> list:
    """A decode over `future`'s positions: each MoE layer acquires its routed experts (in `groups` groups, the
    earlier ones released without a pump, as a prefill chunk's), queries and reads them, plans the window (random
    probabilities, tied ones, the oracle's ranks, or random scores), sets a predicted next visit (reuse) and
    releases; the state after every step is recorded. `one_call`: acquire and read through `acquire_read`;
    "resident": as the GPU tier's graph decode, `read_resident` first, then `acquire` where it read them all.
    `budgets`: the read budget (bytes a step or None) set before each step's acquire, by step, as a measured
    budget changes it."""
    nl, ne, k = dims
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    seen = []
    for pos, ids in enumerate(future):
        for li in range(nl):
            step = pos * nl + li
            if budgets is not None:
                sched.set_read_budget(step, budgets[step % len(budgets)])
            keys = [(li, int(e)) for e in ids[li]]
            size = -(-len(keys) // groups)
            bufs = []
            for j in range(0, len(keys), size):
                part = keys[j:j + size]
                if one_call == "resident":   # the graph decode's: read first where all are in the pool
                    n_io = len(sched.io.log)
                    if sched.read_resident(part):
                        bufs.append(("resident", len(sched.io.log) - n_io))
                        sched.acquire(step, part)
                    else:
                        assert len(sched.io.log) == n_io, "read_resident refused but asked the IO"
                        bufs += sched.acquire_read(step, part)
                elif one_call:
                    bufs += sched.acquire_read(step, part)
                else:
                    held = sched.pool.slots
                    sched.acquire(step, [x for x in part if x in held] + [x for x in part if x not in held])
                    bufs += [(sched.landed(x), sched.data(x)) for x in part]
                if j + size < len(keys):
                    sched.release(step, part, pump=False)
                    keys_left = keys[j + size:]
                else:
                    keys_left = part
            targets = [step + h for h in (1, 2)]
            if planner == "probs":
                sched.plan_probs(step, targets, torch.softmax(torch.randn(2, ne, generator=g) * 3, -1))
            elif planner == "ties":   # equal probabilities: the lower expert id first in both
                x = torch.randint(0, 3, (2, ne), generator=g).float()
                sched.plan_probs(step, targets, x / x.sum(-1, keepdim=True).clamp_min(1))
            elif planner == "scores":   # non-negative rows normalised, others softmaxed, all-zero skipped
                rows = [torch.rand(ne, generator=g), torch.randn(ne, generator=g) * 4, torch.zeros(ne)]
                sched.plan(step, list(zip(targets + [step + 3], rows)))
            elif planner == "ranked":   # rows of other lengths, one longer in experts than in confidences
                conf = [[2 / 3, 1 / 3], [2 / 3]]
                es = [rng.sample(range(ne), 2), rng.sample(range(ne), 2)]
                sched.plan_ranked(step, targets, conf, es)
            if sched.reuse is not None and rng.random() < 0.5:   # (else the history alone scores the layer)
                visits = rng.randint(1, 3)   # one to three visits' sets, of varied sizes
                sched.reuse.set_next_visits(li, step + nl, [rng.sample(range(ne), rng.randint(1, 2 * k))
                                                            for _ in range(visits)])
            sched.release(step, keys_left)
            seen.append(_state(sched, step, bufs, dims))
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


def _compare(policy, slots, planner, cfg, *, dims=(L, E, K), orders_reuse=False, groups=1, n=12, one_call=False):
    future = _future(n, seed=slots, dims=dims)
    table = _table(classes=True, dims=dims[:2]) if policy.endswith("+reuse") else None
    (py, io_py), (c, io_c) = _pair(policy, slots, future, table=table, dims=dims,
                                   io=lambda: LogIO(orders_reuse=orders_reuse), **cfg)
    a = _drive(py, future, 5, planner, dims, groups, one_call)
    b = _drive(c, future, 5, planner, dims, groups, one_call)
    assert a == b
    assert io_py.log == io_c.log
    return a, io_py


@pytest.mark.parametrize("orders_reuse", [False, True])
@pytest.mark.parametrize("policy,slots,planner,cfg", CASES)
def test_native_scheduler_makes_the_python_schedulers_decisions(policy, slots, planner, cfg, orders_reuse):
    """Driven by the same calls, the native scheduler asks the IO for the same reads, queries, waits, takes and
    releases in the same order, and its counts, pool and in-flight prefetches match the Python scheduler's after
    every step: every eviction policy, every planning entry point, the drop rules and budgets, the reuse table
    with and without classes; with an IO that orders a slot's reuse itself, no wait for an evicted read."""
    a, io = _compare(policy, slots, planner, cfg, orders_reuse=orders_reuse)
    kinds = {x[0] for x in io.log}
    assert {"submit", "take", "release", "landed", "wait"} <= kinds   # evictions, first uses, waits reached
    assert a[-1][2] == 12 * L * K and a[-1][13] > 0                     # every use asked; something evicted
    if planner != "none":
        assert a[-1][6] > 0                                               # prefetches issued
        assert any(x[0] == "landed" and x[2] for x in io.log)           # some landed before their use


@pytest.mark.parametrize("policy,planner", [("next-gate+prediction", "scores"), ("adapter+reuse", "probs"),
                                            ("oracle+belady", "ranked")])
def test_native_scheduler_in_groups_and_at_many_experts(policy, planner):
    """A step's experts acquired in groups, the earlier released without a pump (a prefill chunk's), also through
    `acquire_read` (acquire and read in one call, the graph decode's), and a model of 128 experts (softmax and
    normalisation of long rows round alike: `plan` takes the Python scheduler's probabilities)."""
    _compare(policy, 6, planner, {}, groups=2)
    _compare(policy, 40, planner, {}, dims=(3, 128, 8), n=6)
    _compare(policy, 6, planner, {}, groups=2, one_call=True)   # acquire_read: one call a group
    a, _ = _compare(policy, 6, planner, {}, one_call="resident")   # read_resident, then acquire
    reads = [b for st in a for b in st[1] if b[0] == "resident"]
    assert 0 < len(reads) < len(a), len(reads)   # both branches ran: every expert in the pool, and a miss
    assert any(n > 0 for _, n in reads)          # a read still in flight: the reads asked the IO (landed, take)


def test_native_scheduler_follows_a_changing_read_budget():
    """The read budget measured in the run changes step by step (`set_read_budget`): from none, the prefetches in
    flight become the backlog; from a budget, the backlog drains at the old one up to the step; both schedulers
    decide alike through every change, and the late drops depend on the budgets."""
    future = _future(12, seed=6)
    got = {}
    for name, budgets in (("tight", [None, SLOT, SLOT, 2 * SLOT, None, SLOT, 3 * SLOT]), ("loose", [None, 64 * SLOT])):
        (py, io_py), (c, io_c) = _pair("next-gate+lru", 6, future, io=LogIO)
        a = _drive(py, future, 5, "probs", budgets=budgets)
        assert a == _drive(c, future, 5, "probs", budgets=budgets) and io_py.log == io_c.log, name
        got[name] = a[-1]
    assert got["tight"][10] > 0 == got["loose"][10]   # dropped_late
    # from none: the prefetches in flight are the backlog, counted from that step
    (py, _), _ = _pair("next-gate+lru", 6, future)
    _drive(py, future[:1], 5, "probs")
    assert py.in_flight() > 0
    py.set_read_budget(9, SLOT)
    assert (py.backlog, py.backlog_step) == (py.in_flight() * SLOT, 9)


def test_the_read_budget_meter_is_the_same_rule_in_both():
    """ReadBudgetMeter (toolkit/runtime/scheduler.py) and the runner's (scheduler.h), fed the same steps (spans
    changing, read waits, steps shorter than their waits): the same budget at every step."""
    import ctypes

    from toolkit.runtime.native_sched import library
    from toolkit.runtime.scheduler import ReadBudgetMeter

    rng = random.Random(7)
    for rate, slot in ((1.5e9, 884736), (2.0e8, 4096), (1.0, 8192)):
        spans = [64] * 10 + [1] * 120 + [32] * 6 + [1] * 60
        now, wait, t, w = [], [], 0.0, 0.0
        for _ in spans:
            t += rng.uniform(1e-5, 5e-3)
            if rng.random() < 0.3:
                d = rng.uniform(0, 6e-3)
                t, w = t + d * rng.choice((1.0, 0.5)), w + d   # some waits longer than the step's time
            now.append(t)
            wait.append(w)
        n = len(spans)
        out = (ctypes.c_int64 * n)()
        assert library().spx_budget_meter(rate, slot, n, (ctypes.c_int32 * n)(*spans), (ctypes.c_double * n)(*now),
                                          (ctypes.c_double * n)(*wait), out) == 0
        m = ReadBudgetMeter(rate, slot)
        want = [m.at(s, a, b) for s, a, b in zip(spans, now, wait)]
        assert list(out) == [-1 if x is None else x for x in want], rate
        assert want[0] is None and all(x >= -(-slot // 1024) * 1024 for x in want if x is not None)
        assert sum(x is None for x in want) < n // 10   # none only until a step of some compute is measured


def test_native_pool_preloads_and_settles():
    """The resident bound's preload (every expert a ready slot, read on demand) and `settle` (the prefill's unused
    prefetches no longer counted) as the Python pool's."""
    future = _future(3, seed=1)
    (py, io_py), (c, io_c) = _pair("next-gate+lru", L * E, future)
    for s, io in ((py, io_py), (c, io_c)):
        for li in range(L):
            for e in range(0, E, 2):
                s.pool.preload((li, e))
                io.submit((li, e), demand=True)
        s.plan_probs(0, [1, 2], torch.softmax(torch.arange(2 * E, dtype=torch.float32).view(2, E), -1))
    assert py.pool.unused_prefetches() == c.pool.unused_prefetches() > 0
    for s in (py, c):
        s.pool.settle()
    assert py.pool.unused_prefetches() == c.pool.unused_prefetches() == 0
    assert _drive(py, future, 1, "probs") == _drive(c, future, 1, "probs") and io_py.log == io_c.log
    with pytest.raises(SpecPrefetchError, match="already has a slot"):
        c.pool.preload((0, 0))


@pytest.mark.parametrize("op,nth", [("submit", 3), ("take", 2), ("release", 1), ("landed", 4), ("wait", 2)])
def test_native_scheduler_raises_the_ios_own_error(op, nth):
    """A failing IO call (a copy, a query, a wait, a release during an eviction) comes back from the native
    scheduler as the IO's own exception, as it does from the Python one, not as a crash or a C++ message."""
    future = _future(6, seed=2)
    for sched, _ in _pair("next-gate+lru", 4, future, io=lambda: LogIO(fail=(op, nth))):
        with pytest.raises(OSError, match=f"{op} of .* failed"):
            _drive(sched, future, 3, "probs")


def test_a_dropped_native_scheduler_is_freed_at_once():
    """No reference cycle keeps a native scheduler (and its C++ pool) alive: dropped, it is freed without the
    garbage collector; its pool view then refuses to answer instead of reading freed memory."""
    import gc
    import weakref

    future = _future(2, seed=1)
    (_, _), (c, _) = _pair("adapter+reuse", 4, future, table=_table(True))
    _drive(c, future, 1, "probs")
    ref, pool = weakref.ref(c), c.pool
    gc.disable()
    try:
        del c
        assert ref() is None
    finally:
        gc.enable()
    with pytest.raises(ReferenceError):
        _ = pool.evictions


def test_native_scheduler_refuses_bad_input():
    """Keys outside the model, a key the pool does not hold, rows that do not match their targets, mismatched
    ranked rows and malformed reuse tables: one-line errors, never a crash (each in this process)."""
    future = _future(4, seed=1)
    (_, _), (c, _) = _pair("on-demand+lru", 2, future)
    c.acquire(0, [(0, 0), (0, 1)])
    for call, match in [(lambda: c.acquire(1, [(1, 0)]), "no evictable slot"),
                        (lambda: c.acquire(1, [(L, 0)]), "outside the model's 4 MoE layers x 8 experts"),
                        (lambda: c.acquire(1, [(0, -1)]), "outside the model"),
                        (lambda: c.data((1, 5)), "has no slot"), (lambda: c.landed((1, 5)), "has no slot"),
                        (lambda: c.release(1, [(1, 5)]), "not acquired"),
                        (lambda: c.plan_probs(1, [2], torch.ones(1, 3)), r"not \[1, 8\]"),
                        (lambda: c.plan_probs(1, [2, 3], torch.ones(1, E)), r"for 2 targets"),
                        (lambda: c.plan_ranked(1, [2, 3], [[1.0]], [[1]]), "2 targets, 1 rows"),
                        (lambda: c.plan_ranked(1, [2], [[1.0]], [[E]]), "outside the model")]:
        with pytest.raises(SpecPrefetchError, match=match):
            call()
    (_, _), (r, _) = _pair("next-gate+reuse", 4, future, table=_table(False))
    with pytest.raises(SpecPrefetchError, match="outside the model"):
        r.reuse.set_next_visits(L + 1000, 5, [[0, 1]])
    with pytest.raises(SpecPrefetchError, match="outside the model"):
        r.reuse.set_next_visits(0, 5, [[0], [E]])
    for policy, match in (("reuse", "needs a reuse table"), ("belady", "belady eviction needs")):
        with pytest.raises(SpecPrefetchError, match=match):
            NativeScheduler(budget_bytes=4 * SLOT, slot_bytes=SLOT, policy=policy, num_layers=L, num_experts=E,
                            top_k=K, io=LogIO(), cfg=SchedulerConfig())
    t = _table(True)
    for bad in (ReuseTable(bits=3, cap=12, visits16=(16,) * 7),
                ReuseTable(bits=3, cap=12, visits16=t.visits16, classes=t.classes[:1] * L,
                           class_visits16=(t.class_visits16[0][:4],) * 2),
                ReuseTable(bits=3, cap=12, visits16=t.visits16, classes=tuple(r[:3] for r in t.classes),
                           class_visits16=t.class_visits16)):
        with pytest.raises(SpecPrefetchError, match="reuse table whose sizes"):
            NativeScheduler(budget_bytes=4 * SLOT, slot_bytes=SLOT, policy="reuse", num_layers=L, num_experts=E,
                            top_k=K, io=LogIO(), cfg=SchedulerConfig(), reuse=bad)
    # an empty recorded routing is Belady's "never used again" for every expert, as in Python
    NativeScheduler(budget_bytes=4 * SLOT, slot_bytes=SLOT, policy="belady", num_layers=L, num_experts=E, top_k=K,
                    io=LogIO(), cfg=SchedulerConfig(), future=[])
