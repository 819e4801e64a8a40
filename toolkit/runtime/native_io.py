"""The GPU tier's copy IO in C++ (android_runner/src/cuda_copy_io.cpp, in the native scheduler's library): under the
CUDA driver's calls (`launch=driver`, the default) the expert copies into the pool's slots, the streams' waits and
the copy and stall events are made by the library through the driver's entry points, not by Python.

The pooled decode is host-bound (docs/benchmarks.md sections 29-30) and a MoE layer's scheduling asks its IO for
about seven operations (copies, completion checks, reads, releases): in Python each cost a crossing into the
interpreter and a handful of ctypes calls (two events made and recorded, a copy, the slot's waits). Here each is
one C call from the Python scheduler, and none at all from the native one (`host=native`): its scheduler calls
this IO directly, so its acquire, planning and release make their copies within their one crossing each (the graph
decode then reads the layer's slot numbers with one call). The events come from a pool (made once, recorded again)
instead of one made and destroyed per copy and stall.

The same ordering on the same streams as gpu.py's `CudaCopyIO` (which keeps torch's calls, `launch=torch`, and the
CPU's synchronous copies), with fewer calls (a copy known to have landed is not waited for again): a copy on the
copy stream (a prefetch) or the high-priority demand stream, after the slot's last readers and its old copy where
they have not completed; the compute stream's waits timed as stalls; `fenced` (gpu_graph.GraphRunner.decode from its
sync to the release: a copy into a slot evicted then waits for no kernel). The figures (`mark`, `copy_ms`,
`stall_ms`, `copied_bytes`) read the same events.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from toolkit.errors import SpecPrefetchError
from toolkit.runtime.native_sched import key_pairs, library
from toolkit.runtime.pool import Key

COMPUTE, FENCED = 0, 1   # spx_cio_set's settings


class NativeCopyIO:
    """The scheduler's IOBackend for the GPU through the native library (see the module's text); `native_handle` is
    what a NativeScheduler is given to call it without Python."""

    orders_reuse = True   # a copy into a slot waits for the slot's old copy itself (release)

    def __init__(self, host, capacity: int, dev, slots: torch.Tensor, drv):
        """`host`: gpu.HostExperts (every blob in one pinned buffer); `slots`: the pool's arena of exactly
        `capacity` slots (the graphs read it at a fixed address); `dev`: gpu.Device (its copy and demand streams;
        the compute stream is the current one now, and GraphRunner sets it again at each decode call); `drv`: the
        cuda_driver.Driver whose library the IO opens too (the graphs' launches stay its)."""
        self.host, self.dev, self.drv = host, dev, drv
        self.slots = slots
        blob = host.store.blob_size
        if slots.shape[0] != capacity:
            raise SpecPrefetchError(f"internal: {slots.shape[0]} slots allocated for a pool of {capacity}")
        if not slots.is_contiguous() or slots.shape[1] * slots.element_size() < blob or not host.buf.is_contiguous():
            raise SpecPrefetchError(f"internal: a slot arena of {tuple(slots.shape)} {slots.dtype} for blobs of "
                                    f"{blob} bytes")
        self.views = list(slots)
        self.lib = lib = library()
        self.L, self.E = host.store.num_layers, host.store.num_experts
        cuda = dev.cuda
        streams = (dev.copy_stream.cuda_stream, dev.demand_stream.cuda_stream,
                   torch.cuda.current_stream(dev.device).cuda_stream) if cuda else (0, 0, 0)
        h = ctypes.c_void_p()
        self._h = None
        self._check(lib.spx_cio_new(
            ctypes.byref(h), drv.path.encode(), (ctypes.c_uint64 * 2)(slots.data_ptr(), host.buf.data_ptr()),
            (ctypes.c_int64 * 6)(capacity, slots.stride(0) * slots.element_size(),
                                 host.buf.stride(0) * host.buf.element_size(), blob, self.L, self.E),
            (ctypes.c_uint64 * 3)(*streams)))
        self._h = h
        self._fenced, self._compute = False, streams[2]
        self._flag = ctypes.c_int()
        self._msec = ctypes.c_double()
        self._counts = (ctypes.c_int64 * 4)()
        self._keys = (ctypes.c_int32 * 64)()
        self._slots = (ctypes.c_int64 * 32)()

    @property
    def native_handle(self) -> ctypes.c_void_p:
        return self._h

    def __del__(self):
        if getattr(self, "_h", None) is not None:
            self.lib.spx_cio_free(self._h)
            self._h = None

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise SpecPrefetchError(self.lib.spx_sched_error().decode())

    # -- the scheduler's IOBackend ---------------------------------------------------------------
    def submit(self, key: Key, *, demand: bool) -> None:
        self._check(self.lib.spx_cio_submit(self._h, key[0], key[1], int(demand)))

    def landed(self, key: Key) -> bool:
        self._check(self.lib.spx_cio_landed(self._h, key[0], key[1], ctypes.byref(self._flag)))
        return bool(self._flag.value)

    def wait(self, key: Key) -> None:
        self._check(self.lib.spx_cio_wait(self._h, key[0], key[1]))

    def take(self, key: Key) -> torch.Tensor:
        self._check(self.lib.spx_cio_take(self._h, key[0], key[1], ctypes.byref(self._flag)))
        return self.views[self._flag.value]

    def release(self, key: Key) -> None:
        self._check(self.lib.spx_cio_release(self._h, key[0], key[1]))

    def views_of(self, keys: Sequence[Key]) -> list[torch.Tensor]:
        """The slots' bytes of experts the scheduler has read (its take, made by the native scheduler itself): one
        call."""
        self._slot_of(keys)
        return [self.views[i] for i in self._slots[:len(keys)]]

    def close(self) -> None:
        pass

    # -- what the graph decode sets and reads ------------------------------------------------------
    @property
    def fenced(self) -> bool:
        return self._fenced

    @fenced.setter
    def fenced(self, value: bool) -> None:
        self._check(self.lib.spx_cio_set(self._h, FENCED, int(value)))
        self._fenced = bool(value)

    @property
    def compute(self) -> int:
        """The compute stream's handle (the stream waits and the release's events go on it)."""
        return self._compute

    @compute.setter
    def compute(self, stream: int) -> None:
        self._check(self.lib.spx_cio_set(self._h, COMPUTE, stream))
        self._compute = stream

    def _slot_of(self, keys: Sequence[Key]) -> None:
        """self._slots[i] = the slot of keys[i] (each must have one): one call."""
        n = len(keys)
        self._keys = key_pairs(self._keys, keys)
        if n > len(self._slots):
            self._slots = (ctypes.c_int64 * n)()
        self._check(self.lib.spx_cio_slots(self._h, self._keys, n, self._slots))
        if min(self._slots[:n], default=0) < 0:
            raise SpecPrefetchError(f"internal: an expert of {list(keys)} has no slot")

    def slot_numbers(self, keys: Sequence[Key], out: np.ndarray) -> None:
        """out[i] = the slot of keys[i] (each has one): one call."""
        self._slot_of(keys)
        out[:len(keys)] = self._slots[:len(keys)]

    @property
    def where(self) -> dict[Key, int]:
        """Every expert with a slot -> its slot (one call; for the resident graph's slot table, made once)."""
        keys = [(li, e) for li in range(self.L) for e in range(self.E)]
        slots = np.empty(len(keys), dtype=np.int64)
        self._check(self.lib.spx_cio_slots(self._h, key_pairs(None, keys), len(keys), slots.ctypes.data_as(
            ctypes.POINTER(ctypes.c_int64))))
        return {k: int(s) for k, s in zip(keys, slots) if s >= 0}

    # -- the figures ---------------------------------------------------------------------------
    def _count(self, i: int) -> int:
        self._check(self.lib.spx_cio_counts(self._h, self._counts))
        return self._counts[i]

    @property
    def copied_bytes(self) -> int:
        return self._count(2)

    @property
    def events_made(self) -> int:
        """Events the IO has made (its pool's size): bounded by what is in flight, not by the copies."""
        return self._count(3)

    def mark(self) -> tuple[int, int]:
        """Where decode starts: the figures count copies and stalls from here."""
        self._check(self.lib.spx_cio_counts(self._h, self._counts))
        return self._counts[0], self._counts[1]

    def _ms(self, which: int, since: int) -> float:
        self._check(self.lib.spx_cio_ms(self._h, which, since, ctypes.byref(self._msec)))
        return self._msec.value

    def copy_ms(self, since: int = 0) -> float:
        return self._ms(0, since)

    def stall_ms(self, since: int = 0) -> float:
        return self._ms(1, since)
