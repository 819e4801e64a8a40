"""Real flash reads for the streaming runtime: O_DIRECT preads on background threads.

Each read lands in its own page-aligned anonymous buffer (`mmap`), at a 4 KiB-aligned offset and a
4 KiB-multiple size, so O_DIRECT bypasses the page cache: experts come from the device, never from
memory the OS kept behind the scheduler's back (ARCHITECTURE.md, invariant 3). Demand reads jump
the queue. With a device profile the read is paced: it completes no earlier than the profile's
modelled time for that request (an injected delay on top of the real I/O, as SpecPrefetch's
authors emulated phone flash offline); reports mark such runs as emulated.

Worker threads only read and record completions; the pool and scheduler are touched by the
compute thread alone (it drains `completed()`), so they need no locks.
"""
from __future__ import annotations

import errno
import heapq
import itertools
import mmap
import os
import threading
import time

from toolkit.errors import SpecPrefetchError
from toolkit.runtime.expert_store import ExpertStore
from toolkit.runtime.pool import Key
from toolkit.simulate.profiles import DeviceProfile


def open_direct(path) -> tuple[int, bool]:
    """(fd, direct): O_DIRECT where the filesystem allows it, else buffered with a note."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY), False


class DirectReader:
    def __init__(self, store: ExpertStore, *, workers: int = 4, profile: DeviceProfile | None = None,
                 verify: bool = True):
        self.store, self.profile, self.verify = store, profile, verify
        self.fd, self.direct = open_direct(store.path)
        if not self.direct:  # at least keep earlier runs' pages out of the way
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.cond = threading.Condition()
        self.heap: list[tuple[int, int, Key, float]] = []
        self.seq = itertools.count()
        self.done: dict[Key, mmap.mmap] = {}
        self.fresh: list[Key] = []
        self.running = 0
        self.error: BaseException | None = None
        self.read_s = 0.0
        self.reads = 0
        self.stop = False
        self.threads = [threading.Thread(target=self._work, daemon=True, name=f"expert-io-{i}")
                        for i in range(workers)]
        for t in self.threads:
            t.start()

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.heap and not self.stop:
                    self.cond.wait()
                if self.stop:
                    return
                _, _, key, issued = heapq.heappop(self.heap)
                self.running += 1
                qd = self.running
            try:
                buf = self._read(key, issued, qd)
            except BaseException as e:  # surfaced on the compute thread
                with self.cond:
                    self.error = e
                    self.running -= 1
                    self.cond.notify_all()
                return
            with self.cond:
                self.running -= 1
                self.done[key] = buf
                self.fresh.append(key)
                self.cond.notify_all()

    def _read(self, key: Key, issued: float, qd: int) -> mmap.mmap:
        e = self.store.entry(*key)
        size = e.read_size
        buf = mmap.mmap(-1, size)
        t0 = time.perf_counter()
        n = os.preadv(self.fd, [buf], e.offset)
        if n < e.size:
            raise SpecPrefetchError(f"{self.store.path}: short read of expert {key} ({n} of {e.size} bytes)")
        if self.profile is not None:  # pace to the emulated device
            target = issued + self.profile.read_s(size, qd)
            delay = target - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        self.read_s += time.perf_counter() - t0
        self.reads += 1
        if self.verify:
            self.store.check(key[0], key[1], memoryview(buf)[: e.size])
        return buf

    # -- IOBackend ----------------------------------------------------------------------
    def submit(self, key: Key, *, demand: bool) -> None:
        with self.cond:
            heapq.heappush(self.heap, (0 if demand else 1, next(self.seq), key, time.perf_counter()))
            self.cond.notify()

    def inflight(self) -> int:
        with self.cond:
            return len(self.heap) + self.running

    def completed(self) -> list[Key]:
        with self.cond:
            self._raise()
            out, self.fresh = self.fresh, []
            return out

    def take(self, key: Key) -> mmap.mmap | None:
        with self.cond:
            return self.done.pop(key, None)

    def wait(self, key: Key) -> None:
        with self.cond:
            while key not in self.done:
                self._raise()
                self.cond.wait(timeout=5.0)

    def _raise(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        for t in self.threads:
            t.join(timeout=5)
        os.close(self.fd)
