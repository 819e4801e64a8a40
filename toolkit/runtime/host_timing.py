"""Where a pooled decode's host time goes: `python -m toolkit.runtime.host_timing MODEL [options]` runs the
GPU tier's bench module (`python -m toolkit.runtime.gpu_bench`: its options, `--help` lists them, `--json`
required) with these calls timed on the host (perf_counter around each: a diagnosis, not
a bench; the timers add about a microsecond a call), then prints each call's count and mean microseconds:

- `acquire` / `release`: the scheduler's per-step calls (every policy, the prefill's steps included; a
  release issues the queued prefetches);
- `plan`: the planner's window for one MoE layer (the adapter's scores, the queue, the evictions and the
  copies it issues), with `plan_probs` and `plan_ranked` inside it (plan_probs ranks through plan_ranked;
  the oracle's candidates go to plan_ranked directly); `plan_sorted` in its place where a folding
  planner's rows come from the device (the static decoder: gpu_graph.DevicePlan), with plan_ranked inside;
- `victim`: one eviction's choice (the pool's rule; for the reuse eviction a search over every evictable
  slot);
- `read_routing`: the graph decode's one sync per MoE layer on the compute stream (it waits for the device,
  so it is device time as much as host time);
- `rows`: a DevicePlan's rows read back (on a GPU its wait for their stream, then the lists);
- `submit`: one copy issued (CudaCopyIO: its stream waits, events and the copy's launch).

Then, per graph-decode token of each run kind (the policy, its pool's slots, the scheduler's host and where a
folding planner's rows are computed; `resident` for the all-resident bound as the policies decode), its wall
time on the host clock, the time the host waited in the layers' syncs for the device, and the device's certain
idle time before each replay: from the end of a layer's sync (everything enqueued before it has run) to the
host's launch of the next segment (acquiring the layer's experts, writing their slots). A host-bound decode
waits little and leaves the device idle long.

The means are inclusive and the calls nest (`victim` and `submit` run inside acquire, plan and release): do
not add the lines. Run one policy at a time for per-policy figures (the counts pool every run of the
bench, the all-resident and transformers' references included). docs/benchmarks.md section 9 ("2026-12-06
(eighth)") has a run of its predecessor on an H100 host.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import sys
import time

TIMED = (("toolkit.runtime.scheduler", "WindowScheduler", ("acquire", "release", "plan_probs", "plan_ranked")),
         ("toolkit.runtime.planner", "PrefetchPlanner", ("plan", "plan_sorted")),
         ("toolkit.runtime.pool", "ExpertPool", ("_victim",)),
         ("toolkit.runtime.gpu_graph", "GraphRunner", ("read_routing",)),
         ("toolkit.runtime.gpu_graph", "DevicePlan", ("rows",)),
         ("toolkit.runtime.gpu", "CudaCopyIO", ("submit",)))


class Timeline:
    """Per graph-decode token (GraphRunner.decode), by run kind: tokens, wall seconds, seconds the host waited in
    the syncs (GraphRunner.host_wait), seconds from each sync's end to the next segment's launch and their
    count (filled while `installed`)."""

    def __init__(self):
        self.kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.marks: list[tuple[str, float]] | None = None   # (what, host time) of the token running now

    @staticmethod
    def kind(runner, seq) -> str:
        eng = runner.eng
        if seq.pool.capacity >= eng.L * eng.E:
            return "resident"
        extra = "" if eng.host_sched == "python" else f", host={eng.host_sched}"
        extra += "" if seq.device_plan is None or eng.plan_rows == "device" else f", plan={eng.plan_rows}"
        return f"{eng.cfg.policy.name} ({seq.pool.capacity} slots{extra})"

    def mark(self, what: str) -> None:
        if self.marks is not None:
            self.marks.append((what, time.perf_counter()))

    def token(self, kind: str, t0: float, t1: float) -> None:
        marks, self.marks = self.marks or [], None
        c = self.kinds[kind]
        c["tokens"] += 1
        c["wall"] += t1 - t0
        synced = None
        for i, (what, t) in enumerate(marks):
            if what == "wait":       # (a wait's start, then its end)
                c["wait"] += marks[i + 1][1] - t
                synced = marks[i + 1][1]
            elif what == "launched" and synced is not None:
                c["idle"] += t - synced
                c["idles"] += 1
                synced = None

    def report(self) -> str:
        out = []
        for kind, c in sorted(self.kinds.items()):
            n = c["tokens"]
            out.append(f"{kind}: {n} tokens, {c['wall'] * 1e6 / n:.1f} us a token; the host waited for the device "
                       f"{c['wait'] * 1e6 / n:.1f} us a token; the device idle from a sync to the next replay "
                       f"{c['idle'] * 1e6 / max(1, c['idles']):.1f} us a layer ({c['idle'] * 1e6 / n:.1f} us a token)")
        return "\n".join(out)


def _timeline_hooks(tl: Timeline):
    """GraphRunner's decode, host_wait and run_segment wrapped to feed `tl`; (class, name, original) each."""
    from toolkit.runtime.gpu_graph import GraphRunner

    decode, wait, segment = GraphRunner.decode, GraphRunner.host_wait, GraphRunner.run_segment

    @functools.wraps(decode)
    def timed_decode(self, seq, token, pos):
        tl.marks = []
        t0 = time.perf_counter()
        try:
            return decode(self, seq, token, pos)
        finally:
            tl.token(Timeline.kind(self, seq), t0, time.perf_counter())

    @functools.wraps(wait)
    def timed_wait(self):
        tl.mark("wait")
        try:
            return wait(self)
        finally:
            tl.mark("waited")

    @functools.wraps(segment)
    def timed_segment(self, s):
        try:
            return segment(self, s)
        finally:
            tl.mark("launched")

    return [(GraphRunner, "decode", decode, timed_decode), (GraphRunner, "host_wait", wait, timed_wait),
            (GraphRunner, "run_segment", segment, timed_segment)]


@contextlib.contextmanager
def installed():
    """The calls above wrapped with timers while inside (restored after); yields (seconds, calls) per call
    name and the graph decode's Timeline, filled as they run."""
    import importlib

    secs: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    saved = []
    for mod, cls, names in TIMED:
        c = getattr(importlib.import_module(mod), cls)
        for name in names:
            f = c.__dict__[name]
            saved.append((c, name, f))
            label = name.lstrip("_")

            @functools.wraps(f)
            def timed(*a, _f=f, _n=label, **kw):
                t = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    secs[_n] += time.perf_counter() - t
                    calls[_n] += 1
            setattr(c, name, timed)
    tl = Timeline()
    for c, name, f, timed in _timeline_hooks(tl):   # (over read_routing's timer: host_wait runs inside it)
        saved.append((c, name, f))
        setattr(c, name, timed)
    try:
        yield secs, calls, tl
    finally:
        for c, name, f in reversed(saved):
            setattr(c, name, f)


def report(secs, calls) -> str:
    return "\n".join(f"{n:14s} {calls[n]:8d} calls {secs[n] * 1e6 / calls[n]:9.1f} us a call"
                     for n in sorted(calls))


def main(argv: list[str]) -> None:
    from toolkit.runtime import gpu_bench

    with installed() as (secs, calls, tl):
        try:
            gpu_bench.main(argv)
        finally:
            print("host time per call (perf_counter; timers included):")
            print(report(secs, calls))
            print("graph decode per token (perf_counter; timers included):")
            print(tl.report())


if __name__ == "__main__":
    main(sys.argv[1:])
