"""`python -m toolkit.runtime.cuda_call_timing [--json OUT.json]`: the host time of the CUDA calls on the GPU tier's
per-layer path, torch's API beside the CUDA driver's through ctypes (toolkit/runtime/cuda_driver.py), and a copy
issued and released through each copy IO (gpu.CudaCopyIO with torch's calls, native_io.NativeCopyIO), each call in a
loop of its own on one CUDA device (docs/benchmarks.md section 30; a diagnosis of where host time goes, not a bench:
the pooled decode's own figures come from `bench gpu --variant launch=torch`).

Each line is the mean host time of one call over `--calls` calls (a tenth of them for the 9 MiB copies), timed with
perf_counter after one warm call; the device is synchronized around each loop. The graph lines are bound by the
device (20 small kernels a launch) and show what a launch plus a sync costs end to end; with many calls the copy
loops fill the stream's queue and then time the device as well. The JSON report (`--json`) follows the toolkit's
rule for outputs: claimed before any work, replaced only with `--overwrite` and only if it is this command's."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from toolkit.errors import SpecPrefetchError

MiB = 2**20


def measure(calls: int = 2000) -> list[tuple[str, str, float]]:
    """(group, call, microseconds a call) for each timed call."""
    import torch

    from toolkit.runtime.cuda_driver import driver

    if not torch.cuda.is_available():
        raise SpecPrefetchError("cuda_call_timing: no CUDA device on this machine")
    dev = torch.device("cuda", torch.cuda.current_device())
    rows: list[tuple[str, str, float]] = []

    def t(group: str, label: str, fn, n: int = calls) -> None:
        fn()
        torch.cuda.synchronize(dev)
        a = time.perf_counter()
        for _ in range(n):
            fn()
        b = time.perf_counter()
        torch.cuda.synchronize(dev)
        rows.append((group, label, 1e6 * (b - a) / n))

    cs = torch.cuda.Stream(dev)
    src = torch.empty(9 * MiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.zeros(9 * MiB, dtype=torch.uint8, device=dev)
    small_h = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    small_d = torch.zeros(8, dtype=torch.int64, device=dev)
    e = torch.cuda.Event(enable_timing=True)
    e.record(cs)
    t("torch", "Event(enable_timing=True) made and recorded", lambda: torch.cuda.Event(enable_timing=True).record(cs))
    t("torch", "event recorded again", lambda: e.record(cs))
    t("torch", "event query", e.query)
    t("torch", "stream.wait_event", lambda: cs.wait_event(e))
    t("torch", "current_stream(index)", lambda: torch.cuda.current_stream(dev.index))
    default = torch.cuda.default_stream(dev)
    t("torch", "set_stream twice", lambda: (torch.cuda.set_stream(cs), torch.cuda.set_stream(default)))

    def copy_on_side():   # (as CudaCopyIO's torch path issues a copy on another stream)
        prev = torch.cuda.current_stream(dev.index)
        torch.cuda.set_stream(cs)
        dst.copy_(src, non_blocking=True)
        torch.cuda.set_stream(prev)
    t("torch", "copy_ 9 MiB pinned -> device (current_stream, set_stream twice)", copy_on_side,
      n=max(1, calls // 10))
    t("torch", "copy_ 64 B pinned -> device", lambda: small_d.copy_(small_h, non_blocking=True))
    t("torch", "copy_ 64 B device -> pinned", lambda: small_h.copy_(small_d, non_blocking=True))

    def synced():
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()
    t("torch", "event made, recorded, synchronized", synced)
    t("torch", "tolist() of 4 int64 (pinned)", lambda: small_h[:4].tolist())

    drv = driver(dev)
    side = cs.cuda_stream
    de = drv.event(side)
    t("driver", "cuMemcpyAsync 9 MiB pinned -> device", lambda: drv.copy(dst.data_ptr(), src.data_ptr(), src.nbytes,
                                                                         side), n=max(1, calls // 10))
    t("driver", "event made (timing on) and recorded, destroyed", lambda: drv.event(side))
    t("driver", "cuEventRecord", lambda: de.record(side))
    t("driver", "cuStreamWaitEvent", lambda: drv.wait(side, de))
    t("driver", "cuEventQuery", de.query)
    t("driver", "cuMemcpyAsync 64 B pinned -> device", lambda: drv.copy(small_d.data_ptr(), small_h.data_ptr(), 64,
                                                                        side))
    t("driver", "cuMemcpyAsync 64 B device -> pinned", lambda: drv.copy(small_h.data_ptr(), small_d.data_ptr(), 64,
                                                                        side))
    t("driver", "event made (timing off) and destroyed", lambda: drv.event(timing=False))
    arr = small_h.numpy()
    t("driver", "numpy view [:4].tolist() (pinned)", lambda: arr[:4].tolist())

    # a copy issued and its slot released through each copy IO (a 64 B blob: the host's cost, not the copy's)
    from toolkit.runtime.gpu import CudaCopyIO, Device
    from toolkit.runtime.native_io import NativeCopyIO

    class Store:
        blob_size, num_layers, num_experts = 64, 1, 1

    class Host:
        store, buf = Store(), torch.zeros(1, 64, dtype=torch.uint8, pin_memory=True)

        def blob(self, key):
            return self.buf[0]
    gdev, slots = Device(dev), torch.zeros(1, 64, dtype=torch.uint8, device=dev)
    for group, io in (("torch", CudaCopyIO(Host(), 1, gdev, slots=slots)),
                      ("native IO", NativeCopyIO(Host(), 1, gdev, slots, drv))):
        t(group, "copy IO: a 64 B copy submitted, its slot released",
          lambda io=io: (io.submit((0, 0), demand=False), io.release((0, 0))))

    x = torch.zeros(1024, device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            x.add_(1)
    t("torch", "graph (20 kernels): replay(), then a new event's sync", lambda: (g.replay(), synced()))
    exe, cur = g.raw_cuda_graph_exec(), torch.cuda.current_stream(dev.index).cuda_stream
    kept = drv.event(timing=False)
    t("driver", "graph (20 kernels): cuGraphLaunch, then a kept event's sync",
      lambda: (drv.launch(exe, cur), kept.record(cur), kept.synchronize()))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cuda_call_timing", description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls a loop (a tenth for the 9 MiB copies)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here (replaced only with --overwrite)")
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.calls < 1:
            raise SpecPrefetchError(f"--calls {a.calls}: must be >= 1")
        if a.json is not None:   # (before any work: refused unless it may be written)
            from toolkit.artifacts import claim_report

            claim_report(a.json, kind="cuda_call_timing", overwrite=a.overwrite, siblings=())
        rows = measure(a.calls)
        import torch

        print(f"host time a call on {torch.cuda.get_device_name()} (torch {torch.__version__}):")
        print("| API | call | us |\n|---|---|---|")
        for group, label, us in rows:
            print(f"| {group} | {label} | {us:.2f} |")
        if a.json is not None:
            from toolkit.reporting import write_json_report

            write_json_report(a.json, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                       "calls": a.calls, "rows": [dict(api=g, call=c, us=round(u, 3))
                                                                  for g, c, u in rows]})
    except SpecPrefetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
