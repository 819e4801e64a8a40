"""Real flash reads for the runner: O_DIRECT preads in a reader process (or threads).

Each read lands in its own page-aligned anonymous buffer (`mmap`), at a 4 KiB-aligned offset and a
4 KiB-multiple size, so O_DIRECT bypasses the page cache: experts come from the device, never from
memory the OS kept behind the scheduler's back (the pool is the only cache of expert bytes). Demand reads jump
the queue. With a device profile the read is paced: it completes no earlier than the profile's
modelled time for that request (an injected delay on top of the real I/O, as SpecPrefetch's
authors emulated phone flash offline); reports mark such runs as emulated.

Every read is of the store's own open file (`ExpertStore.open_direct` reopens that file through
its held descriptor, never the path), so a store replaced on disk mid-run does not change what a
running reader reads.

Worker threads only read and record completions; the pool and scheduler are touched by the
compute thread alone (it asks `landed` / `wait` for the key it needs), so they need no locks.
"""
from __future__ import annotations

import errno
import heapq
import itertools
import mmap
import os
import random
import select
import struct
import threading
import time
from pathlib import Path
from typing import Callable

from toolkit.errors import SpecPrefetchError
from toolkit.runtime.expert_store import ALIGN, ExpertStore
from toolkit.runtime.pool import Key
from toolkit.runtime.profiles import DeviceProfile


def open_direct(path) -> tuple[int, bool]:
    """(fd, direct) of a file by path: O_DIRECT where the filesystem allows it, else buffered.
    (An expert store's readers use `ExpertStore.open_direct`, which never reopens the path.)"""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY), False


class ThreadReader:
    def __init__(self, store: ExpertStore, *, workers: int = 4, profile: DeviceProfile | None = None,
                 verify: bool = True):
        self.store, self.profile, self.verify = store, profile, verify
        self.fd, self.direct = store.open_direct()
        if not self.direct:  # at least keep earlier runs' pages out of the way
            store.drop_cache()
        self.cond = threading.Condition()
        self.heap: list[tuple[int, int, Key, float]] = []
        self.seq = itertools.count()
        self.done: dict[Key, mmap.mmap] = {}
        self.running = 0
        self.error: BaseException | None = None
        self.busy_until = 0.0
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
            except BaseException as e:  # surfaced on the compute thread; this worker stays
                with self.cond:
                    self.error = e
                    self.running -= 1
                    self.cond.notify_all()
                continue
            with self.cond:
                self.running -= 1
                self.done[key] = buf
                self.cond.notify_all()

    def _read(self, key: Key, issued: float, qd: int) -> mmap.mmap:
        e = self.store.entry(*key)
        size = e.read_size
        buf = mmap.mmap(-1, size)
        n = os.preadv(self.fd, [buf], e.offset)
        if n < e.size:
            raise SpecPrefetchError(f"{self.store.path}: short read of expert {key} ({n} of {e.size} bytes)")
        if self.profile is not None:  # pace to the emulated device, transfers one at a time
            with self.cond:
                start = max(issued, self.busy_until)
                self.busy_until = start + self.profile.transfer_s(size, qd)
                target = self.busy_until + self.profile.flash_latency_us * 1e-6
            delay = target - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        if self.verify:
            self.store.check(key[0], key[1], memoryview(buf)[: e.size])
        return buf

    # -- IOBackend ----------------------------------------------------------------------
    def submit(self, key: Key, *, demand: bool) -> None:
        with self.cond:
            heapq.heappush(self.heap, (0 if demand else 1, next(self.seq), key, time.perf_counter()))
            self.cond.notify()

    def landed(self, key: Key) -> bool:
        with self.cond:
            self._raise()
            return key in self.done

    def take(self, key: Key) -> mmap.mmap | None:
        with self.cond:
            return self.done.pop(key, None)

    def wait(self, key: Key) -> None:
        with self.cond:
            while key not in self.done:
                self._raise()
                self.cond.wait(timeout=5.0)

    def _raise(self) -> None:
        if self.error is not None:  # stays set: a failed read leaves its key loading for good
            raise self.error

    def release(self, key: Key) -> None:
        with self.cond:
            self.done.pop(key, None)

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        for t in self.threads:
            t.join(timeout=5)
        os.close(self.fd)


REQ = struct.Struct("<III")    # arena slot, MoE layer, expert
DONE = struct.Struct("<IIII")  # arena slot, MoE layer, expert, status
STOP = 0xFFFFFFFF
OK, SHORT, BADCRC, OSERR = 0, 1, 2, 3


class ProcessReader:
    """O_DIRECT reads in a forked reader process, straight into a shared arena of pool slots.

    Reads done by threads of the compute process cost it ~0.26 ms of CPU each on a 2-vCPU machine
    (GIL hand-offs after every pread), about twice the latency they hide; the same reads from
    another process cost it ~0.02 ms (measured: docs/benchmarks.md). So the reader lives in its own
    process: requests and completions are fixed-size records on pipes (atomic below PIPE_BUF),
    and data lands in an anonymous shared mapping sized to the pool's slots, so nothing is copied.
    `workers` threads in the reader keep up to that many reads in flight; demand reads go down a
    pipe of their own that a free worker always serves before any queued prefetch.
    """

    def __init__(self, store: ExpertStore, *, slots: int, workers: int = 5, profile: DeviceProfile | None = None,
                 verify: bool = True):
        self.store, self.slot_bytes = store, store.slot_bytes
        self.arena = mmap.mmap(-1, max(1, slots) * self.slot_bytes, flags=mmap.MAP_SHARED)
        self.free = list(range(slots))
        self.index: dict[Key, int] = {}
        self.pending: set[Key] = set()
        req_r, self.req_w = os.pipe()
        dem_r, self.dem_w = os.pipe()  # demand reads: a pipe of their own, which workers serve first
        self.done_r, done_w = os.pipe()
        fd, self.direct = store.open_direct()
        self.pid = os.fork()
        if self.pid == 0:  # the reader process: threads, preadv, CRC, completion records
            os.close(self.req_w)
            os.close(self.dem_w)
            os.close(self.done_r)
            code = 0
            try:
                _reader_main(store, fd, self.arena, req_r, dem_r, done_w, workers, profile, verify)
            except BaseException:
                code = 1
            os._exit(code)
        os.close(req_r)
        os.close(dem_r)
        os.close(done_w)
        os.close(fd)
        os.set_blocking(self.done_r, False)
        self.workers = workers
        self.buf = b""

    # -- IOBackend ----------------------------------------------------------------------
    def submit(self, key: Key, *, demand: bool) -> None:
        if not self.free:
            raise RuntimeError("reader arena has no free slot: the pool over-committed")
        idx = self.free.pop()
        self.index[key] = idx
        self.pending.add(key)
        os.write(self.dem_w if demand else self.req_w, REQ.pack(idx, key[0], key[1]))

    def _drain(self, block: bool) -> None:
        if block:  # wait for a record, checking now and then that the reader still lives
            while not select.select([self.done_r], [], [], 2.0)[0]:
                if os.waitpid(self.pid, os.WNOHANG)[0] != 0:
                    self.pid = 0
                    raise SpecPrefetchError("the expert reader process exited unexpectedly")
        try:
            data = os.read(self.done_r, DONE.size * 256)
        except BlockingIOError:
            data = b""
        if block and not data:
            raise SpecPrefetchError("the expert reader process closed its pipe unexpectedly")
        self.buf += data
        while len(self.buf) >= DONE.size:
            idx, layer, expert, status = DONE.unpack_from(self.buf)
            self.buf = self.buf[DONE.size:]
            key = (layer, expert)
            if status != OK:
                what = {SHORT: "short read", BADCRC: "failed its checksum (corrupt blob)"}.get(status, "I/O error")
                raise SpecPrefetchError(f"{self.store.path}: expert {key} {what}")
            self.pending.discard(key)

    def landed(self, key: Key) -> bool:
        if key in self.pending:
            self._drain(False)
        return key not in self.pending

    def take(self, key: Key) -> memoryview:
        idx = self.index[key]
        return memoryview(self.arena)[idx * self.slot_bytes:(idx + 1) * self.slot_bytes]

    def wait(self, key: Key) -> None:
        while key in self.pending:
            self._drain(True)

    def release(self, key: Key) -> None:
        """The pool evicted `key`: its arena slot is free again."""
        idx = self.index.pop(key, None)
        if idx is not None:
            self.free.append(idx)

    def close(self) -> None:
        try:
            for _ in range(self.workers):
                os.write(self.req_w, REQ.pack(STOP, 0, 0))
        except OSError:  # the reader is already gone: keep the error that brought us here
            pass
        finally:
            os.close(self.req_w)
            os.close(self.dem_w)
            if self.pid:
                os.waitpid(self.pid, 0)
            os.close(self.done_r)


def _reader_main(store, fd, arena, req_r, dem_r, done_w, workers, profile, verify) -> None:
    import zlib

    slot = store.slot_bytes
    lock = threading.Lock()
    busy = [0.0]  # when the emulated device finishes its queued transfers
    pace_lock = threading.Lock()  # not `lock`: a worker may sit in os.read holding that one
    entries = store.entries

    def work():
        view = memoryview(arena)
        while True:
            with lock:
                ready = select.select([dem_r, req_r], [], [])[0]  # demand reads first
                raw = os.read(dem_r if dem_r in ready else req_r, REQ.size)
            if len(raw) < REQ.size:
                return
            idx, layer, expert = REQ.unpack(raw)
            if idx == STOP:
                return
            t0 = time.perf_counter()
            status = OK
            try:
                e = entries[(layer, expert)]
                n = os.preadv(fd, [view[idx * slot:idx * slot + e.read_size]], e.offset)
                if n < e.size:
                    status = SHORT
                elif verify and zlib.crc32(view[idx * slot:idx * slot + e.size]) != e.crc32:
                    status = BADCRC
                if profile is not None:  # pace to the emulated device, transfers one at a time
                    with pace_lock:
                        start = max(t0, busy[0])
                        busy[0] = start + profile.transfer_s(e.read_size, 1)
                        target = busy[0] + profile.flash_latency_us * 1e-6
                    delay = target - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
            except BaseException:  # noqa: BLE001 - every failure must reach the parent as a record
                status = OSERR
            os.write(done_w, DONE.pack(idx, layer, expert, status))

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure_reads(path: Path, offsets: list[int], size: int, qd: int, n: int, seed: int = 0, *,
                  store: ExpertStore | None = None, in_order: bool = False,
                  check: Callable[[int, memoryview], None] | None = None) -> tuple[float, float]:
    """(MiB/s, mean latency s) of n random O_DIRECT reads of up to `size` bytes at queue depth qd
    (`in_order`: each of `offsets` once, in order, n ignored).

    A read never asks past the end of the file (it is clamped there, to a whole 4 KiB block for
    O_DIRECT), the bandwidth counts the bytes actually read, and an offset at or past the end is
    refused. A failed read stops the measurement and is raised, as is what `check(offset, bytes)` raises
    for a read (e.g. a checksum); the file is closed either way. The page cache is dropped before the
    reads (a buffered file). With `store`, its own open file is read (never `path` again, which may name
    another file by now)."""
    path = Path(path)
    if not offsets:
        raise SpecPrefetchError(f"{path}: no offsets to read")
    try:
        file_end = store.file_size if store is not None else path.stat().st_size
    except OSError as e:
        raise SpecPrefetchError(f"{path}: cannot read ({e.strerror or e})") from None
    past = [o for o in offsets if o >= file_end]
    if past:
        raise SpecPrefetchError(f"{path}: read at offset {past[0]} lies past the end of the file ({file_end} bytes)")
    rng = random.Random(seed)
    picks = list(offsets) if in_order else [rng.choice(offsets) for _ in range(n)]
    lat: list[float] = []
    done = [0]
    errors: list[BaseException] = []
    lock = threading.Lock()
    it = iter(picks)
    try:
        fd, direct = store.open_direct() if store is not None else open_direct(path)
    except OSError as e:
        raise SpecPrefetchError(f"{path}: cannot open ({e.strerror or e})") from None
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def work():
            buf = mmap.mmap(-1, size)
            try:
                while True:
                    with lock:
                        off = None if errors else next(it, None)
                    if off is None:
                        return
                    want = min(size, -(-(file_end - off) // ALIGN) * ALIGN)
                    t0 = time.perf_counter()
                    try:
                        got = os.preadv(fd, [memoryview(buf)[:want]], off)
                    except OSError as e:
                        raise SpecPrefetchError(f"{path}: read of {want} bytes at offset {off} failed ({e})") from e
                    dt = time.perf_counter() - t0
                    if check is not None:
                        check(off, memoryview(buf)[:got])
                    with lock:
                        lat.append(dt)
                        done[0] += got
            except BaseException as e:  # raised on the calling thread once every worker stopped
                with lock:
                    errors.append(e)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=work) for _ in range(max(1, qd))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = time.perf_counter() - t0
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return done[0] / max(total, 1e-12) / 2**20, sum(lat) / len(lat) if lat else 0.0
