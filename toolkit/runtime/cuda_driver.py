"""The CUDA driver's few calls on the GPU tier's per-layer path, through ctypes (`launch=driver`, the default).

The pooled decode is host-bound (docs/benchmarks.md sections 29-30): between a MoE layer's sync and the next
launch the host makes a dozen CUDA calls, and torch's API costs microseconds each on top of the driver's own
call: a graph's `replay()` also launches two fill kernels (the random-number generator's seed and offset, which
torch writes before every replay whether or not the graph draws random numbers), a copy on a stream other than
the current one needs `set_stream` twice, an event is a new object made and recorded. This module calls the
driver's entry points (libcuda.so.1: the driver every CUDA machine has, which torch itself loads; a C ABI that is
stable across CUDA versions, so no binding package has to match the toolkit's CUDA version) with the handles torch
already made: its streams (`Stream.cuda_stream`), its graphs' executables (`CUDAGraph.raw_cuda_graph_exec`), its
tensors' addresses (`data_ptr`), on the context torch made current for the device (its primary context).

The same operations, ordered on the same streams, as the torch calls they replace (`launch=torch` keeps those, for
`bench gpu --variant launch=torch` in the same rounds):
- `launch`: cuGraphLaunch, without torch's replay prologue (the decode's graphs draw no random numbers);
- `copy`: cuMemcpyAsync between pinned host memory and the device (unified addressing: the driver reads the
  direction from the addresses), the copy torch issues for a non-blocking `copy_`;
- `DriverEvent`: cuEventCreate / Record / Query / Synchronize / ElapsedTime, with torch.cuda.Event's methods
  (`record(stream)`, `query`, `synchronize`, `elapsed_time`), so the IO's copy and stall timings read either kind;
  `wait`: cuStreamWaitEvent.
"""
from __future__ import annotations

import ctypes
import threading

from toolkit.errors import SpecPrefetchError

CUDA_ERROR_NOT_READY = 600
EVENT_DISABLE_TIMING = 2   # CU_EVENT_DISABLE_TIMING: an event only waited on is cheaper to record and wait for
LIBRARY = "libcuda.so.1"

_lock = threading.Lock()
_driver: "Driver | None" = None


def driver(device) -> "Driver":
    """The driver's calls (loaded once), after checking the current context is the CUDA `device`'s (a
    torch.device): the one torch made current for it (the caller runs under the device's scope)."""
    import torch

    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        raise SpecPrefetchError(f"launch=driver: torch {torch.__version__} does not expose a graph's executable "
                                "(CUDAGraph.raw_cuda_graph_exec)")
    global _driver
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if _driver is None:
            _driver = Driver(_load())
    _driver.check_context(index)
    return _driver


def _load() -> ctypes.CDLL:
    try:
        return ctypes.CDLL(LIBRARY)
    except OSError as e:
        raise SpecPrefetchError(f"launch=driver: cannot load the CUDA driver ({LIBRARY}: {e})") from None


class Driver:
    """cuGraphLaunch, cuMemcpyAsync, cuStreamWaitEvent and the events, each checked: a failure raises one line
    naming the call and the driver's error."""

    def __init__(self, lib: ctypes.CDLL):
        H, c = ctypes.c_void_p, ctypes.c_int
        self.lib = lib
        self.path = lib._name   # (what the native copy IO opens: the same library, already loaded)

        def fn(name, *args):
            try:
                f = getattr(lib, name)
            except AttributeError:
                raise SpecPrefetchError(f"launch=driver: the CUDA driver ({LIBRARY}) has no {name}") from None
            f.argtypes, f.restype = list(args), c
            return f

        self._launch = fn("cuGraphLaunch", H, H)
        self._copy = fn("cuMemcpyAsync", ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, H)
        self._wait = fn("cuStreamWaitEvent", H, H, ctypes.c_uint)
        self._create = fn("cuEventCreate", ctypes.POINTER(H), ctypes.c_uint)
        self._destroy = fn("cuEventDestroy_v2", H)
        self._record = fn("cuEventRecord", H, H)
        self._query = fn("cuEventQuery", H)
        self._sync = fn("cuEventSynchronize", H)
        self._elapsed = fn("cuEventElapsedTime", ctypes.POINTER(ctypes.c_float), H, H)
        self._ctx = fn("cuCtxGetCurrent", ctypes.POINTER(H))
        self._ctx_device = fn("cuCtxGetDevice", ctypes.POINTER(c))
        self._name = fn("cuGetErrorName", c, ctypes.POINTER(ctypes.c_char_p))

    def fail(self, rc: int, what: str):
        s = ctypes.c_char_p()
        name = s.value.decode() if self._name(rc, ctypes.byref(s)) == 0 and s.value else f"error {rc}"
        raise SpecPrefetchError(f"launch=driver: {what} failed: {name}")

    def check_context(self, index: int) -> None:
        """The current context is CUDA device `index`'s (the events made here belong to it)."""
        ctx, dev = ctypes.c_void_p(), ctypes.c_int(-1)
        rc = self._ctx(ctypes.byref(ctx))
        if rc:
            self.fail(rc, "cuCtxGetCurrent")
        if not ctx.value:
            raise SpecPrefetchError("launch=driver: no CUDA context is current on this thread (torch has not used "
                                    "the device here)")
        rc = self._ctx_device(ctypes.byref(dev))
        if rc:
            self.fail(rc, "cuCtxGetDevice")
        if dev.value != index:
            raise SpecPrefetchError(f"launch=driver: the current CUDA context is device {dev.value}'s, not "
                                    f"cuda:{index}'s")

    # -- the per-layer calls (stream, executable and event handles are ints) ---------------------
    def launch(self, graph_exec: int, stream: int) -> None:
        rc = self._launch(graph_exec, stream)
        if rc:
            self.fail(rc, "cuGraphLaunch")

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """`nbytes` from address src to dst, ordered on `stream` (unified addressing: pinned host or device)."""
        rc = self._copy(dst, src, nbytes, stream)
        if rc:
            self.fail(rc, "cuMemcpyAsync")

    def wait(self, stream: int, event: "DriverEvent") -> None:
        rc = self._wait(stream, event.h, 0)
        if rc:
            self.fail(rc, "cuStreamWaitEvent")

    def event(self, stream: int | None = None, *, timing: bool = True) -> "DriverEvent":
        """A new event, recorded on `stream` (none: not recorded)."""
        ev = DriverEvent(self, timing=timing)
        if stream is not None:
            ev.record(stream)
        return ev


class DriverEvent:
    """A CUDA event made by the driver, with torch.cuda.Event's methods (the stream is a handle); destroyed with
    the object."""

    __slots__ = ("drv", "h")

    def __init__(self, drv: Driver, *, timing: bool = True):
        self.drv, self.h = drv, None
        h = ctypes.c_void_p()
        rc = drv._create(ctypes.byref(h), 0 if timing else EVENT_DISABLE_TIMING)
        if rc:
            drv.fail(rc, "cuEventCreate")
        self.h = h.value

    def record(self, stream: int) -> None:
        rc = self.drv._record(self.h, stream)
        if rc:
            self.drv.fail(rc, "cuEventRecord")

    def query(self) -> bool:
        rc = self.drv._query(self.h)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        if rc:
            self.drv.fail(rc, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        rc = self.drv._sync(self.h)
        if rc:
            self.drv.fail(rc, "cuEventSynchronize")

    def elapsed_time(self, end: "DriverEvent") -> float:
        """Milliseconds from this event to `end` (both recorded and complete)."""
        ms = ctypes.c_float()
        rc = self.drv._elapsed(ctypes.byref(ms), self.h, end.h)
        if rc:
            self.drv.fail(rc, "cuEventElapsedTime")
        return ms.value

    def __del__(self):
        if self.h is not None:
            try:
                self.drv._destroy(self.h)
            except Exception:   # pragma: no cover - the library unloaded at interpreter exit
                pass
            self.h = None
