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


@contextlib.contextmanager
def installed():
    """The calls above wrapped with timers while inside (restored after); yields (seconds, calls) per call
    name, filled as they run."""
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
    try:
        yield secs, calls
    finally:
        for c, name, f in saved:
            setattr(c, name, f)


def report(secs, calls) -> str:
    return "\n".join(f"{n:14s} {calls[n]:8d} calls {secs[n] * 1e6 / calls[n]:9.1f} us a call"
                     for n in sorted(calls))


def main(argv: list[str]) -> None:
    from toolkit.runtime import gpu_bench

    with installed() as (secs, calls):
        try:
            gpu_bench.main(argv)
        finally:
            print("host time per call (perf_counter; timers included):")
            print(report(secs, calls))


if __name__ == "__main__":
    main(sys.argv[1:])
