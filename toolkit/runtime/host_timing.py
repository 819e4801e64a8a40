"""Where a pooled decode's host time goes: `python -m toolkit.runtime.host_timing MODEL [gpu_bench options]`
runs `bench gpu` (toolkit/runtime/gpu_bench.py, the same options) with the scheduler's and planner's
per-layer calls timed on the host (perf_counter around each call; a diagnosis, not a bench: the timers
add about a microsecond a call), then prints each call's count and mean microseconds:

- `acquire` / `release`: the scheduler's per-step calls (every policy, prefill included);
- `plan` (the planner's window: the adapter's scores, the queue, the evictions and the copies it issues),
  and within it `plan_probs` and the reuse eviction's `farthest` search;
- `read_routing`: the graph decode's one sync per MoE layer (it waits for the device);
- `submit`: one copy issued (CudaCopyIO: its stream waits, events and the copy's launch).

docs/benchmarks.md section 9 ("2026-12-06 (eighth)") has a run on an H100 host.
"""
from __future__ import annotations

import collections
import functools
import runpy
import sys
import time

TIMED = (("toolkit.runtime.scheduler", "WindowScheduler", ("acquire", "release", "plan_probs")),
         ("toolkit.runtime.planner", "PrefetchPlanner", ("plan",)),
         ("toolkit.runtime.reuse", "ReuseHistory", ("farthest",)),
         ("toolkit.runtime.gpu_graph", "GraphRunner", ("read_routing",)),
         ("toolkit.runtime.gpu", "CudaCopyIO", ("submit",)))


def install() -> tuple[collections.Counter, collections.Counter]:
    """Wrap the calls above with timers; returns (seconds, calls) per call name, filled as they run."""
    import importlib

    secs: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for mod, cls, names in TIMED:
        c = getattr(importlib.import_module(mod), cls)
        for name in names:
            f = getattr(c, name)

            @functools.wraps(f)
            def timed(*a, _f=f, _n=name, **kw):
                t = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    secs[_n] += time.perf_counter() - t
                    calls[_n] += 1
            setattr(c, name, timed)
    return secs, calls


def report(secs, calls) -> str:
    return "\n".join(f"{n:14s} {calls[n]:8d} calls {secs[n] * 1e6 / calls[n]:9.1f} us a call"
                     for n in sorted(calls))


def main(argv: list[str]) -> None:
    secs, calls = install()
    sys.argv = ["gpu_bench", *argv]
    try:
        runpy.run_module("toolkit.runtime.gpu_bench", run_name="__main__")
    finally:
        print("host time per call (perf_counter; timers included):")
        print(report(secs, calls))


if __name__ == "__main__":
    main(sys.argv[1:])
