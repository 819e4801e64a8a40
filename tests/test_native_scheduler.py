"""The native runner's scheduler and pool at unit level: the Python reference (toolkit/runtime/scheduler.py,
pool.py) drives random but reproducible decode steps (acquire, plan, data, release) over a fake IO
backend and records them as a step script; android_runner/tests/check_scheduler.cpp replays the script
through the C++ WindowScheduler and ExpertPool over the same kind of fake backend. The decision logs
must be equal line for line (apart from the printed confidences), and so must the counts. A
scheduling bug in C++ shows here, with the step it happens at, not only as a whole-run difference.
Cases: LRU, LFU and prediction eviction; scores, logits and probabilities (`plan_probs`); a per-step byte
budget and a candidate threshold; tight pools; reads that land later (late hits, waits); prefill-style
spans (a layer's union in groups, the earlier ones released without a pump, targets across spans)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.runtime.events import EventLog, decisions
from toolkit.runtime.pool import ExpertPool
from toolkit.runtime.scheduler import SchedulerConfig, WindowScheduler

SRC = Path(__file__).resolve().parent.parent / "android_runner"
SOURCES = ("scheduler.cpp", "pool.cpp", "events.cpp", "memwatch.cpp", "routing.cpp", "fileio.cpp")
SLOT = 8192
COUNTS = ("requests", "hits", "prefetch_hits", "late", "misses", "prefetch_issued", "dropped_stale",
          "dropped_low_conf", "dropped_no_slot", "dropped_late", "bytes_read")


class FakeIO:
    """A read lands `delay` acquires after it was submitted, or when it is waited for (decisions never
    depend on timing; `late` counts the hits that had to wait); every read is counted."""

    def __init__(self, delay: int = 0):
        self.inflight: dict = {}     # key -> the tick it lands at
        self.delay, self.tick = delay, 0
        self.demand_reads = self.prefetch_reads = 0

    def submit(self, key, *, demand):
        assert key not in self.inflight, f"a second read of {key} in flight"
        self.inflight[key] = self.tick + self.delay
        if demand:
            self.demand_reads += 1
        else:
            self.prefetch_reads += 1

    def landed(self, key):
        return self.inflight.get(key, -1) <= self.tick

    def wait(self, key):
        if key in self.inflight:
            self.inflight[key] = min(self.inflight[key], self.tick)

    def take(self, key):
        return b"x"

    def release(self, key):
        self.inflight.pop(key, None)


@pytest.fixture(scope="module")
def check_scheduler(tmp_path_factory) -> Path:
    if not shutil.which("g++"):
        pytest.skip("g++ not installed (make setup installs it)")
    exe = tmp_path_factory.mktemp("scheduler") / "check_scheduler"
    r = subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", "-I", str(SRC / "src"),
                        str(SRC / "tests" / "check_scheduler.cpp"), *(str(SRC / "src" / f) for f in SOURCES),
                        "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


def _keys(keys) -> str:
    return f"{len(keys)} " + " ".join(f"{li} {e}" for li, e in keys)


def drive(eviction: str, *, L: int, E: int, k: int, slots: int, queue_depth: int, min_confidence: float,
          candidate_threshold: float, step_budget: int | None, W: int, T: int, seed: int, logits: bool, delay: int = 0,
          probs: bool = False, span: int = 1, read_budget: int | None = None):
    """Run the Python scheduler over T positions of skewed random routing and predictions (a prediction
    is the true next routing with probability 0.6, else a random guess); returns (script, events, counts).
    delay: reads land that many acquires later; probs: the window as probabilities (`plan_probs`, the
    softmax-router path) instead of scores; span > 1: prefill-style steps, each layer acquiring the union
    of `span` positions in groups of at most k experts, the earlier groups released without a pump;
    read_budget: the flash's bytes per step (prefetches that could not land by their deadline dropped)."""
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(E, 0.4), size=L)              # each layer's skewed expert popularity
    routes = [[rng.choice(E, k, replace=False, p=pop[li]).tolist() for li in range(L)] for _ in range(T)]
    budget = slots * SLOT
    never = lambda key, now: float("inf")  # noqa: E731
    pool = ExpertPool(budget, SLOT, policy=eviction, min_slots=k, next_use=never)
    cfg = SchedulerConfig(queue_depth=queue_depth, min_confidence=min_confidence,
                          candidate_threshold=candidate_threshold, step_budget_bytes=step_budget,
                          read_budget_bytes=read_budget)
    events = EventLog()
    io = FakeIO(delay)
    sched = WindowScheduler(pool, io, cfg, num_layers=L, top_k=k, events=events, clock=lambda: 0.0)
    if eviction == "prediction":
        pool.next_use = sched.next_predicted_use
    script = [f"config {budget} {SLOT} {eviction} {k} {L * E} {L} {k} {queue_depth} {min_confidence!r} "
              f"{candidate_threshold!r} {-1 if step_budget is None else step_budget} 1 {delay}"
              + ("" if read_budget is None else f" {read_budget}")]
    for t0 in range(0, T, span):
        for li in range(L):
            step = t0 * L + li
            events.at(step, t0, li)
            script.append(f"at {step} {t0} {li}")
            union = list(dict.fromkeys((li, e) for t in range(t0, min(T, t0 + span)) for e in routes[t][li]))
            groups = [union[g: g + k] for g in range(0, len(union), k)]
            for gi, keys in enumerate(groups):
                io.tick += 1
                sched.acquire(step, keys)
                script.append(f"acquire {step} {_keys(keys)}")
                last = gi == len(groups) - 1
                if last:
                    window = []
                    for h in range(1, W + 1):
                        tgt = step + h + ((span - 1) * L if li + h >= L else 0)
                        tt, lj = divmod(tgt, L)
                        if tt >= T:
                            break
                        guess = routes[tt][lj] if rng.random() < 0.6 else rng.choice(E, k, replace=False).tolist()
                        s = rng.random(E).astype(np.float32) * 0.2
                        s[guess] += rng.random(k).astype(np.float32) * 3 + 1
                        if probs:
                            s = (s / s.sum() * 1.5).clip(0, 1).astype(np.float32)   # probabilities, unnormalised
                        elif logits:
                            s = (s * 4 - 6).astype(np.float32)          # negative: the scheduler softmaxes them
                        window.append((tgt, s))
                    if probs:
                        sched.plan_probs(step, [tgt for tgt, _ in window],
                                         torch.from_numpy(np.stack([s for _, s in window])) if window else None)
                        op = "probs"
                    else:
                        sched.plan(step, [(tgt, torch.from_numpy(s)) for tgt, s in window])
                        op = "plan"
                    script.append(f"{op} {step} {len(window)} " + " ".join(
                        f"{tgt} {E} " + " ".join(float(x).hex() for x in s) for tgt, s in window))
                for key in keys:
                    sched.data(key)
                    script.append(f"data {key[0]} {key[1]}")
                sched.release(step, keys, pump=last)
                script.append(f"release {step} {int(last)} {_keys(keys)}")
    counts = {c: getattr(sched.stats, c) for c in COUNTS}
    counts.update(evictions=pool.evictions, wasted_prefetches=pool.wasted_prefetches,
                  demand_reads=io.demand_reads, prefetch_reads=io.prefetch_reads)
    return "\n".join(script) + "\n", events.lines, counts


CASES = {
    "lru": dict(eviction="lru", slots=12, queue_depth=4, min_confidence=0.02, candidate_threshold=0.0,
                step_budget=None, logits=False),
    "lfu-logits": dict(eviction="lfu", slots=10, queue_depth=2, min_confidence=0.05, candidate_threshold=0.0,
                       step_budget=None, logits=True),
    "prediction-budget": dict(eviction="prediction", slots=14, queue_depth=6, min_confidence=0.01,
                              candidate_threshold=0.01, step_budget=3 * SLOT, logits=False),
    "prediction-tight": dict(eviction="prediction", slots=8, queue_depth=3, min_confidence=0.1,
                             candidate_threshold=0.0, step_budget=None, logits=True),
    "late-reads": dict(eviction="lru", slots=12, queue_depth=4, min_confidence=0.02, candidate_threshold=0.0,
                       step_budget=None, logits=False, delay=2),
    "probs-prefill": dict(eviction="prediction", slots=10, queue_depth=4, min_confidence=0.05,
                          candidate_threshold=0.02, step_budget=None, logits=False, probs=True, span=4, delay=3),
    # the flash delivers 1 slot a step: prefetches behind the ones already asked for are dropped as late
    "read-budget": dict(eviction="lru", slots=12, queue_depth=6, min_confidence=0.01, candidate_threshold=0.0,
                        step_budget=None, logits=False, delay=2, read_budget=SLOT),
    "read-budget-prefill": dict(eviction="prediction", slots=10, queue_depth=4, min_confidence=0.05,
                                candidate_threshold=0.02, step_budget=None, logits=False, probs=True, span=4,
                                read_budget=SLOT),
    # prefill-style spans under LRU and LFU (the native runner's chunked prefill with those evictions)
    "lru-spans": dict(eviction="lru", slots=12, queue_depth=4, min_confidence=0.02, candidate_threshold=0.0,
                      step_budget=None, logits=False, span=4, delay=2),
    "lfu-in-spans": dict(eviction="lfu", slots=10, queue_depth=2, min_confidence=0.05, candidate_threshold=0.0,
                         step_budget=None, logits=True, span=4),   # (names of other lengths: other seeds)
}


@pytest.mark.parametrize("case", list(CASES))
def test_cpp_scheduler_replays_the_reference(check_scheduler, tmp_path, case):
    script, ref_events, ref_counts = drive(L=4, E=16, k=2, W=3, T=40, seed=len(case), **CASES[case])
    (tmp_path / "script.txt").write_text(script)
    r = subprocess.run([str(check_scheduler), str(tmp_path / "script.txt"), str(tmp_path / "events.log"),
                        str(tmp_path / "stats.txt")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = (tmp_path / "events.log").read_text().splitlines()
    want = decisions(ref_events)
    for i, (a, b) in enumerate(zip(decisions(got), want)):
        assert a == b, f"{case}: decision {i} differs (C++ {a!r}, Python {b!r}); before it: {want[max(0, i - 5):i]}"
    assert len(got) == len(want)
    counts = {k: int(v) for k, v in (ln.split() for ln in (tmp_path / "stats.txt").read_text().splitlines())}
    assert counts == ref_counts
    # the script exercised what it is there for: hits, misses, prefetches, evictions, drops
    assert ref_counts["prefetch_hits"] > 0 and ref_counts["misses"] > 0 and ref_counts["evictions"] > 0
    assert ref_counts["dropped_stale"] + ref_counts["dropped_low_conf"] + ref_counts["dropped_no_slot"] > 0
    if CASES[case].get("delay"):   # reads still in flight when used: late hits waited for
        assert ref_counts["late"] > 0
    if CASES[case].get("read_budget"):  # the budget dropped some prefetches, and let others through
        assert ref_counts["dropped_late"] > 0 and ref_counts["prefetch_issued"] > 0
    else:
        assert ref_counts["dropped_late"] == 0


def test_check_scheduler_catches_a_different_decision(check_scheduler, tmp_path):
    """The comparison can fail: the same script with the pool one slot smaller decides differently."""
    script, ref_events, _ = drive(L=4, E=16, k=2, W=3, T=40, seed=3, **CASES["lru"])
    budget = 12 * SLOT
    assert script.startswith(f"config {budget} ")
    (tmp_path / "script.txt").write_text(script.replace(f"config {budget} ", f"config {budget - SLOT} ", 1))
    r = subprocess.run([str(check_scheduler), str(tmp_path / "script.txt"), str(tmp_path / "events.log"),
                        str(tmp_path / "stats.txt")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert decisions((tmp_path / "events.log").read_text().splitlines()) != decisions(ref_events)
