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
- `submit`: one copy issued by the Python scheduler through CudaCopyIO (torch's calls, launch=torch: its stream
  waits, events and the copy's launch); `submit_native` the same through the native library's copy IO (under
  the driver's calls: one call); the native scheduler's copies are made in C++ and counted in its callers' figures.

Then the graph decode's tokens per run label (its policy, pool and the settings that differ from the
defaults; `(resident)` for the all-resident bound as the policies decode; the oracle's recording passes as
on-demand at the whole model's MiB; warm-up runs included, the means over every run of a label; the draft's
speculative rounds do not decode token by token and are not listed): the decode calls' wall time on the host
clock, the host's time in the compute stream's syncs, and the gaps from each MoE layer's sync (everything
enqueued on the compute stream before it has run) to the host's next segment launch call (reading the layer's
experts, a miss's acquire and demand copy, writing their slots), and from a token's last sync to the next
token's first launch. On a GPU the compute stream is idle through these gaps (copies and the planner's rows
stream may run); a host-bound decode waits little and leaves them long. On the CPU nothing is asynchronous: a
segment's compute falls between its launch call and the next sync (in the wall time only), and the gaps hold
the host's work and the demand copies themselves.

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
         ("toolkit.runtime.gpu", "CudaCopyIO", ("submit",)),
         ("toolkit.runtime.native_io", "NativeCopyIO", (("submit", "submit_native"),)))   # (name, its label)


class Timeline:
    """The graph decode's tokens (GraphRunner.decode) by run (`label`): per label a Counter of tokens, wall (each
    decode call's seconds), wait (the host's seconds in the compute stream's syncs, GraphRunner.host_wait), idle
    and idles (the seconds and count of the gaps from a layer's sync to the next segment's launch call) and edge
    and edges (from a token's last sync to the launch of the same sequence's next token). Filled while
    `installed`; a decode that raises is not counted."""

    def __init__(self):
        self.kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.marks: list[tuple[str, float]] | None = None   # (what, host time) of the token running now
        self.preload = False                                # the sequence being generated preloaded every expert
        self.last: tuple[int, float] | None = None          # (sequence id, its last token's last sync)
        self.current: str | None = None                     # the label of the sequence being generated

    def label(self, eng) -> str:
        """The run: its policy, pool and the settings that differ from the defaults (RunConfig's, the engine's)."""
        from toolkit.runtime.runner import RunConfig

        cfg, dflt = eng.cfg, RunConfig()
        parts = [f"{f}={getattr(cfg, f)}" for f in ("window", "min_confidence", "candidate_threshold",
                                                      "read_budget_kib", "next_visit", "next_visits", "reuse_classes")
                 if getattr(cfg, f) != getattr(dflt, f)]
        parts += [f"{k}={v}" for k, v, d in (("queue_depth", eng.copy_depth, None), ("host", eng.host_sched, "python"),
                                             ("plan", eng.plan_rows, "device"), ("launch", eng.launch, "driver"))
                  if v != d]
        extra = f", {', '.join(parts)}" if parts else ""
        return f"{cfg.policy.name}, {cfg.pool_mib:g} MiB{extra}" + (" (resident)" if self.preload else "")

    def mark(self, what: str) -> None:
        if self.marks is not None:
            self.marks.append((what, time.perf_counter()))

    def token(self, label: str, seq: int, t0: float, t1: float) -> None:
        """One decode call of sequence `seq` (an id) from t0 to t1, its marks: ("wait", start), ("waited", end)
        around each sync, ("launch", t) at each segment's launch call."""
        marks, self.marks = self.marks or [], None
        c = self.kinds[label]
        c["tokens"] += 1
        c["wall"] += t1 - t0
        synced = self.last[1] if self.last is not None and self.last[0] == seq else None
        edge = synced is not None   # the first launch's gap is the token boundary's
        for i, (what, t) in enumerate(marks):
            if what == "wait":
                c["wait"] += marks[i + 1][1] - t
                synced = marks[i + 1][1]
            elif what == "launch" and synced is not None:
                key = "edge" if edge else "idle"
                c[key] += t - synced
                c[key + "s"] += 1
                synced, edge = None, False
        self.last = (seq, synced) if synced is not None else None

    def report(self) -> str:
        out = []
        for label, c in sorted(self.kinds.items()):
            n = c["tokens"]
            if not n:
                continue
            out.append(f"{label}: {n} tokens, {c['wall'] * 1e6 / n:.1f} us a decode call; the host waited in the "
                       f"syncs {c['wait'] * 1e6 / n:.1f} us a token; from a sync to the next launch call "
                       f"{c['idle'] * 1e6 / max(1, c['idles']):.1f} us a layer, "
                       f"{c['edge'] * 1e6 / max(1, c['edges']):.1f} us between tokens")
        return "\n".join(out)


def _timeline_hooks(tl: Timeline):
    """GpuEngine's generate and GraphRunner's decode, host_wait and run_segment wrapped to feed `tl`: (class, name,
    original, wrapper) each."""
    from toolkit.runtime.gpu import GpuEngine
    from toolkit.runtime.gpu_graph import GraphRunner

    generate = GpuEngine.generate
    decode, wait, segment = GraphRunner.decode, GraphRunner.host_wait, GraphRunner.run_segment

    @functools.wraps(generate)
    def timed_generate(self, *a, preload: bool = False, **kw):
        tl.preload, tl.last, tl.current = preload, None, None   # (a new sequence: no boundary with the last one's)
        try:
            return generate(self, *a, preload=preload, **kw)
        finally:
            tl.preload = False

    @functools.wraps(decode)
    def timed_decode(self, seq, token, pos):
        tl.marks = []
        t0 = time.perf_counter()
        try:
            out = decode(self, seq, token, pos)
        except BaseException:
            tl.marks = None
            raise
        t1 = time.perf_counter()
        if tl.current is None:   # (once a sequence, after its first token: not inside a measured gap each token)
            tl.current = tl.label(self.eng)
        tl.token(tl.current, id(seq), t0, t1)
        return out

    @functools.wraps(wait)
    def timed_wait(self):
        tl.mark("wait")
        try:
            return wait(self)
        finally:
            tl.mark("waited")

    @functools.wraps(segment)
    def timed_segment(self, s):
        tl.mark("launch")
        return segment(self, s)

    return [(GpuEngine, "generate", generate, timed_generate), (GraphRunner, "decode", decode, timed_decode),
            (GraphRunner, "host_wait", wait, timed_wait), (GraphRunner, "run_segment", segment, timed_segment)]


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
        for entry in names:
            name, label = entry if isinstance(entry, tuple) else (entry, entry.lstrip("_"))
            f = c.__dict__[name]
            saved.append((c, name, f))

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
    try:
        for c, name, f, timed in _timeline_hooks(tl):   # (over read_routing's timer: host_wait runs inside it)
            saved.append((c, name, f))
            setattr(c, name, timed)
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
