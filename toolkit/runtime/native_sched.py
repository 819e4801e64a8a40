"""The native runner's scheduler, pool and reuse eviction (android_runner/src: scheduler.cpp, pool.cpp) behind
the Python scheduler's interface, for the GPU tier's host loop (`host=native`).

The GPU tier's pooled decode runs its scheduling on the host between a MoE layer's routing read and the next
layer's launch; in Python the planning of one MoE layer took about 0.35 ms on an H100 host (the planner's `plan`,
of which the scheduler's `plan_probs` 0.25 ms) and an acquire 0.12 ms, against a layer's 0.07 ms replay
(docs/benchmarks.md section 9). The C++ port makes the same decisions (the native runner's event logs equal the
reference's, line for line); what it saves is measured by `bench gpu --variant host=native` (section 9): every
crossing into it and every callback out of it costs something (about a microsecond, an estimate), so it pays
where the decisions are heavy (the reuse eviction's victim search) and not for on-demand. It is compiled from the
runner's own sources with the machine's C++ compiler into build/native-sched/<key>/ (once per source version,
compiler and flags; about 10 s) and loaded with ctypes through a C ABI (android_runner/src/sched_capi.cpp): no
Python headers, so one build serves any interpreter of the machine.

Reads stay the caller's IO's, and the pool maps no memory of its own: under the CUDA driver's calls the IO is the
library's own (native_io.NativeCopyIO, android_runner/src/cuda_copy_io.cpp), which the C++ scheduler calls with no
crossing into Python; otherwise the C++ scheduler calls back into the Python IO (gpu.CudaCopyIO: submit, landed,
wait, release, take). Either way the copies, streams, slots and stall timing are those the Python scheduler gets.
What the GPU tier calls (`acquire`, `acquire_read`, `release`, `data`, `plan`, `plan_probs`, `plan_ranked`,
`in_flight`, `step`, `stats`, the pool's membership, counters, `preload` and `settle`, the reuse eviction's
`set_next_visits`) has the same meaning here; `plan`'s scores become probabilities
in Python, by the Python scheduler's own arithmetic (`window_probs`). No event log (the GPU tier keeps none) and
no `compute_order`.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import itertools
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Sequence

import torch

from toolkit.artifacts.lock import waiting_lock
from toolkit.errors import SpecPrefetchError
from toolkit.runtime.pool import Key
from toolkit.runtime.runner import scheduler_inputs
from toolkit.runtime.scheduler import SchedulerConfig, SchedulerStats, window_probs

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "android_runner" / "src"
SOURCES = ("sched_capi.cpp", "scheduler.cpp", "pool.cpp", "events.cpp", "memwatch.cpp", "routing.cpp", "fileio.cpp",
           "cuda_copy_io.cpp")
HEADERS = ("scheduler.h", "pool.h", "events.h", "memwatch.h", "routing.h", "fileio.h", "common.h", "cuda_copy_io.h")
BUILD = REPO / "build" / "native-sched"
# libstdc++ linked in and kept private (a version script exports the spx_ entry points alone), so the library
# needs no C++ runtime on the machine and does not clash with the one torch loaded
FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden", "-static-libstdc++",
         "-static-libgcc", "-Wl,--exclude-libs,ALL")
EXPORTS = "{ global: spx_*; local: *; };\n"
LIBS = ("-ldl",)   # after the sources: the copy IO opens the CUDA driver with dlopen (cuda_copy_io.cpp)

_IO_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
SUBMIT_PREFETCH, SUBMIT_DEMAND, LANDED, WAIT, RELEASE, TAKE = range(6)   # sched_capi.cpp's IoOp
_STATS = ("requests", "hits", "prefetch_hits", "late", "misses", "prefetch_issued", "dropped_stale",
          "dropped_low_conf", "dropped_no_slot", "dropped_late", "bytes_read")

_lib: ctypes.CDLL | None = None
_failed: str | None = None   # why the build failed (raised again by library())
_lock = threading.Lock()


NO_COMPILER = "host=native: no C++ compiler ($CXX, or g++ or c++ on PATH) to build the native scheduler"


def _compiler() -> tuple[list[str], str]:
    """The C++ compiler command ($CXX, which may carry arguments such as `ccache g++`; else g++ or c++ on PATH)
    and its version line."""
    env = os.environ.get("CXX")
    cxx = shlex.split(env) if env else [x for x in (shutil.which("g++") or shutil.which("c++"),) if x]
    if not cxx:
        raise SpecPrefetchError(NO_COMPILER)
    try:
        p = subprocess.run([*cxx, "--version"], capture_output=True, text=True)
    except OSError as e:
        raise SpecPrefetchError(f"host=native: the C++ compiler {' '.join(cxx)}: {e.strerror or e}") from None
    return cxx, (p.stdout.splitlines() or [""])[0]


def has_compiler() -> bool:
    """Whether a C++ compiler is there to build the library (a broken $CXX counts as one: its build fails loudly)."""
    try:
        _compiler()
    except SpecPrefetchError as e:
        return str(e) != NO_COMPILER
    return True


def build(out_dir: Path = BUILD) -> Path:
    """The shared library for these sources, this compiler and these flags (built if absent from a copy of
    exactly the bytes its key hashes; written to a temp name and renamed; other builds in `out_dir`, directories
    named by such a key, removed)."""
    cxx, version = _compiler()
    files = {name: (SRC / name).read_bytes() for name in SOURCES + HEADERS}
    h = hashlib.sha256("\0".join((version, platform.machine(), *FLAGS, EXPORTS, *LIBS)).encode())
    for name, data in files.items():
        h.update(name.encode() + b"\0" + data)
    key = h.hexdigest()[:16]
    lib = out_dir / key / "libspxsched.so"
    if lib.exists():
        return lib
    try:
        with waiting_lock(out_dir):   # one build (and pruning) at a time across processes, as the runner's builds
            return lib if lib.exists() else _compile(cxx, files, lib, out_dir)
    except OSError as e:
        raise SpecPrefetchError(f"host=native: cannot build the native scheduler into {lib.parent}: "
                                f"{e.strerror or e}") from None


def _compile(cxx: list[str], files: dict[str, bytes], lib: Path, out_dir: Path) -> Path:
    """Compile `files` (the hashed bytes) into `lib`, then remove the other builds in `out_dir`."""
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        (Path(tmp) / "exports.map").write_text(EXPORTS)
        out = Path(tmp) / lib.name
        p = subprocess.run([*cxx, *FLAGS, f"-Wl,--version-script={tmp}/exports.map", f"-I{tmp}",
                            *(str(Path(tmp) / s) for s in SOURCES), *LIBS, "-o", str(out)], capture_output=True,
                           text=True)
        if p.returncode != 0:
            raise SpecPrefetchError(f"host=native: building the native scheduler with {' '.join(cxx)} failed "
                                    f"(a static libstdc++ is needed: Debian's g++ has it):\n{p.stderr[-3000:]}")
        os.replace(out, lib)
    for old in out_dir.iterdir():   # earlier builds (another source version or compiler): never loaded again
        if old != lib.parent and old.is_dir() and re.fullmatch(r"[0-9a-f]{16}", old.name):
            shutil.rmtree(old, ignore_errors=True)
    return lib


def library() -> ctypes.CDLL:
    """The loaded library (built on first use; a build that failed is not tried again in this process)."""
    global _lib, _failed
    with _lock:
        if _failed is not None:
            raise SpecPrefetchError(_failed)
        if _lib is None:
            try:
                path = build()
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError as e:
                    raise SpecPrefetchError(f"host=native: cannot load {path}: {e}") from None
            except SpecPrefetchError as e:
                _failed = str(e)
                raise
            P, I32, I64, F64 = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64),
                                ctypes.POINTER(ctypes.c_double))
            i, i64 = ctypes.c_int, ctypes.c_int64
            sig = {
                "spx_sched_new": [ctypes.POINTER(P), i64, i64, ctypes.c_char_p, i, i, i, I64, F64, i, I64, I32, i,
                                  I64, I32, i, _IO_FN, P],
                "spx_acquire": [P, i64, I32, i], "spx_acquire_read": [P, i64, I32, i],
                "spx_read_resident": [P, I32, i, ctypes.POINTER(i)],
                "spx_release": [P, i64, I32, i, i],
                "spx_data": [P, i, i], "spx_landed": [P, i, i, ctypes.POINTER(i)],
                "spx_plan_probs": [P, i64, I64, i, P],
                "spx_plan_ranked": [P, i64, I64, i, i, F64, I32], "spx_set_next_visits": [P, i, i64, I32, I32, i],
                "spx_preload": [P, i, i], "spx_has": [P, i, i, ctypes.POINTER(i)], "spx_settle": [P],
                "spx_stats": [P, I64, F64], "spx_pool_info": [P, I64], "spx_unused_prefetches": [P, I64],
                "spx_set_read_budget": [P, i64, i64], "spx_budget_meter": [ctypes.c_double, i64, i, I32, F64, F64, I64],
                # the copy IO through the CUDA driver (native_io.py)
                "spx_cio_new": [ctypes.POINTER(P), ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64), I64,
                                ctypes.POINTER(ctypes.c_uint64)],
                "spx_cio_submit": [P, i, i, i], "spx_cio_landed": [P, i, i, ctypes.POINTER(i)],
                "spx_cio_wait": [P, i, i], "spx_cio_take": [P, i, i, ctypes.POINTER(i)], "spx_cio_release": [P, i, i],
                "spx_cio_set": [P, i, ctypes.c_uint64], "spx_cio_slots": [P, I32, i, I64], "spx_cio_counts": [P, I64],
                "spx_cio_ms": [P, i, i64, F64],
            }
            for name, args in sig.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, ctypes.c_int
            lib.spx_sched_free.argtypes, lib.spx_sched_free.restype = [P], None
            lib.spx_cio_free.argtypes, lib.spx_cio_free.restype = [P], None
            lib.spx_sched_error.argtypes, lib.spx_sched_error.restype = [], ctypes.c_char_p
            _lib = lib
        return _lib


def key_pairs(buf, keys: Sequence[Key]):
    """`keys` as (layer, expert) int32 pairs in `buf`, or in a new buffer where `buf` is None or too small (the
    buffer holding them is returned): the C calls' key arrays, made once and reused."""
    n = 2 * len(keys)
    if buf is None or n > len(buf):
        buf = (ctypes.c_int32 * n)()
    buf[:n] = list(itertools.chain.from_iterable(keys))
    return buf


def _ints(values: Sequence[int], kind=ctypes.c_int32):
    return (kind * len(values))(*values)


class _Slots:
    """The pool's membership (`key in pool.slots`), asked of the C++ pool."""

    def __init__(self, sched: "NativeScheduler"):
        self._s = weakref.proxy(sched)   # (no reference cycle: the scheduler frees its C++ state when dropped)

    def __contains__(self, key: Key) -> bool:
        return self._s._has(key)


class NativePool:
    """What the GPU tier and its figures (stats.DecodeAccount) read of the pool."""

    def __init__(self, sched: "NativeScheduler", budget_bytes: int, slot_bytes: int, policy: str):
        self._s = weakref.proxy(sched)
        self.budget_bytes, self.slot_bytes, self.policy = budget_bytes, slot_bytes, policy
        self.slots = _Slots(sched)

    evictions = property(lambda self: self._s._pool_info(0))
    wasted_prefetches = property(lambda self: self._s._pool_info(1))
    peak_bytes = property(lambda self: self._s._pool_info(2))
    capacity = property(lambda self: self._s._pool_info(5))   # slots (budget // slot bytes, as the Python pool's)

    def unused_prefetches(self) -> int:
        """Slots a prefetch filled that no step has used yet."""
        n = ctypes.c_int64()
        self._s._call("spx_unused_prefetches", ctypes.byref(n))
        return n.value

    def settle(self) -> None:
        self._s._call("spx_settle")

    def preload(self, key: Key) -> None:
        """A slot for `key`, ready and read on demand (the caller submits the read): the resident bound."""
        self._s._call("spx_preload", *key)


class _Reuse:
    """The reuse eviction's state as the planner reaches it (`sched.reuse.set_next_visits`)."""

    def __init__(self, sched: "NativeScheduler"):
        self._s = weakref.proxy(sched)

    def set_next_visits(self, li: int, target: int, sets: Sequence[Sequence[int]]) -> None:
        sets = [list(e) for e in sets]
        flat = [e for s in sets for e in s]
        self._s._call("spx_set_next_visits", li, target, _ints(flat), _ints([len(s) for s in sets]), len(sets))


def _io_trampoline(ref: weakref.ref, op: int, layer: int, expert: int) -> int:
    sched = ref()
    return -1 if sched is None else sched._io_call(op, layer, expert)


def open_native_scheduler(cfg, *, slot_bytes: int, num_layers: int, num_experts: int, top_k: int, io,
                          future: list[torch.Tensor] | None, prefetch: bool,
                          reuse=None) -> tuple[NativePool, "NativeScheduler"]:
    """runner.open_pool_and_scheduler's pool and scheduler (RunConfig `cfg`) on the native host. The pool (and
    `sched.reuse`) are views of the scheduler's C++ state, usable while the scheduler is referenced (a sequence
    keeps both); the C++ state is freed as soon as the scheduler is dropped."""
    scfg, table = scheduler_inputs(cfg, prefetch=prefetch, reuse=reuse, future=future)
    sched = NativeScheduler(budget_bytes=cfg.budget_bytes, slot_bytes=slot_bytes, policy=cfg.policy.eviction,
                            num_layers=num_layers, num_experts=num_experts, top_k=top_k, cfg=scfg, io=io,
                            reuse=table, future=future)
    return sched.pool, sched


class NativeScheduler:
    """WindowScheduler's interface over the C++ one (the same decisions); reads through `io`."""

    def __init__(self, *, budget_bytes: int, slot_bytes: int, policy: str, num_layers: int, num_experts: int,
                 top_k: int, cfg: SchedulerConfig, io, reuse=None, future: list[torch.Tensor] | None = None):
        """`reuse`: the ReuseTable the reuse eviction reads (the one the run chose: with or without its classes);
        `future`: every position's routing [L, k] (Belady's). open_native_scheduler takes a RunConfig."""
        lib = library()
        self.lib, self.io, self.cfg = lib, io, cfg
        self.L, self.E, self.k = num_layers, num_experts, top_k
        self._buffers: dict[Key, Any] = {}   # (the callback IO's reads, by its take)
        native_io = getattr(io, "native_handle", None)   # the library's own IO (NativeCopyIO): called without Python
        self._native_io = native_io is not None
        self._error: BaseException | None = None
        # kept alive as long as the C++ scheduler, which calls it; it reaches this object through a weak reference
        self._cb = _IO_FN() if self._native_io else _IO_FN(functools.partial(_io_trampoline, weakref.ref(self)))
        cfg_i = _ints([cfg.candidates or 0, cfg.queue_depth,
                       -1 if cfg.step_budget_bytes is None else cfg.step_budget_bytes,
                       -1 if cfg.read_budget_bytes is None else cfg.read_budget_bytes,
                       int(cfg.prefetch), int(getattr(io, "orders_reuse", False))], ctypes.c_int64)
        cfg_d = (ctypes.c_double * 2)(cfg.min_confidence, cfg.candidate_threshold)
        bits, v16, classes, n_classes, cv16 = 0, None, None, 0, None
        if policy == "reuse" and reuse is not None:   # (none: the C++ constructor refuses it)
            bits, v16 = reuse.bits, _ints(list(reuse.visits16), ctypes.c_int64)
            n = 1 << bits
            bad = len(reuse.visits16) != n
            if reuse.classes is not None:
                reuse.layer_tables(num_layers)   # its layer count checked, as ReuseHistory does
                n_classes = len(reuse.class_visits16)
                bad = bad or any(len(r) != num_experts for r in reuse.classes) or any(
                    len(t) != n for t in reuse.class_visits16)
                classes = _ints([c for row in reuse.classes for c in row])
                cv16 = _ints([v for t in reuse.class_visits16 for v in t], ctypes.c_int64)
            if bad:
                raise SpecPrefetchError(f"a reuse table whose sizes are not {1 << bits} histories"
                                        f"{'' if reuse.classes is None else f' and {num_experts} experts a layer'}")
        fut, P = None, -1   # (P < 0: no recorded routing; only Belady's eviction reads it)
        if future is not None and policy == "belady":
            P = len(future)
            fut = _ints(torch.stack([f.reshape(num_layers, top_k) for f in future]).reshape(-1).tolist()
                        if P else [])
        h = ctypes.c_void_p()
        self._handle = None
        self._check(lib.spx_sched_new(ctypes.byref(h), budget_bytes, slot_bytes, policy.encode(), num_layers,
                                      num_experts, top_k, cfg_i, cfg_d, bits, v16, classes, n_classes, cv16, fut, P,
                                      self._cb, native_io))
        self._handle = h
        self.pool = NativePool(self, budget_bytes, slot_bytes, policy)
        self.reuse = _Reuse(self) if policy == "reuse" else None
        self._info = (ctypes.c_int64 * 6)()
        self._stats = (ctypes.c_int64 * 11)()
        self._wait = ctypes.c_double()
        self._flag = ctypes.c_int()
        self._key_buf = (ctypes.c_int32 * (2 * num_layers * num_experts))()   # a step's keys (each at most once)

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            self.lib.spx_sched_free(self._handle)
            self._handle = None

    # -- the C calls ----------------------------------------------------------------------------
    def _check(self, rc: int) -> None:
        if rc == 0:
            return
        err, self._error = self._error, None
        if err is not None:   # the IO callback's own exception (a failed copy), as the Python scheduler raises it
            raise err
        raise SpecPrefetchError(f"native scheduler: {self.lib.spx_sched_error().decode()}")

    def _call(self, name: str, *args) -> None:
        self._check(getattr(self.lib, name)(self._handle, *args))

    def _io_call(self, op: int, layer: int, expert: int) -> int:
        try:
            key = (layer, expert)
            io = self.io
            if op == LANDED:
                return int(bool(io.landed(key)))
            if op == SUBMIT_DEMAND or op == SUBMIT_PREFETCH:
                io.submit(key, demand=op == SUBMIT_DEMAND)
            elif op == WAIT:
                io.wait(key)
            elif op == TAKE:
                self._buffers[key] = io.take(key)
            elif op == RELEASE:
                self._buffers.pop(key, None)
                io.release(key)
            return 0
        except BaseException as e:   # raised again by _check once the C++ call has unwound
            self._error = e
            return -1

    def _keys(self, keys: Sequence[Key]):
        """`keys` as (layer, expert) pairs in the scheduler's one buffer (no array made per call)."""
        self._key_buf = key_pairs(self._key_buf, keys)
        return self._key_buf

    def _has(self, key: Key) -> bool:
        self._check(self.lib.spx_has(self._handle, key[0], key[1], ctypes.byref(self._flag)))
        return bool(self._flag.value)

    def _pool_info(self, i: int) -> int:
        """Field i of spx_pool_info (sched_capi.cpp)."""
        self._check(self.lib.spx_pool_info(self._handle, self._info))
        return self._info[i]

    # -- WindowScheduler's interface ----------------------------------------------------------------
    @property
    def step(self) -> int:
        return self._pool_info(4)

    @property
    def stats(self) -> SchedulerStats:
        self._check(self.lib.spx_stats(self._handle, self._stats, ctypes.byref(self._wait)))
        return SchedulerStats(**dict(zip(_STATS, self._stats)), wait_s=self._wait.value)

    def in_flight(self) -> int:
        """Prefetches logically in flight (issued, not yet retired)."""
        return self._pool_info(3)

    def set_read_budget(self, step: int, nbytes: int | None) -> None:
        self._call("spx_set_read_budget", step, -1 if nbytes is None else nbytes)
        self.cfg = dataclasses.replace(self.cfg, read_budget_bytes=nbytes)

    def acquire(self, step: int, keys: list[Key]) -> None:
        self._call("spx_acquire", step, self._keys(keys), len(keys))

    def acquire_read(self, step: int, keys: list[Key]) -> list:
        """WindowScheduler.acquire_read in one call: the layer's experts resident, pinned and read; their bytes."""
        self._call("spx_acquire_read", step, self._keys(keys), len(keys))
        return self.io.views_of(keys) if self._native_io else [self._buffers[k] for k in keys]

    def read_resident(self, keys: list[Key]) -> bool:
        """WindowScheduler.read_resident in one call."""
        self._call("spx_read_resident", self._keys(keys), len(keys), ctypes.byref(self._flag))
        return bool(self._flag.value)

    def release(self, step: int, keys: list[Key], *, pump: bool = True) -> None:
        self._call("spx_release", step, self._keys(keys), len(keys), int(pump))

    def data(self, key: Key):
        self._call("spx_data", *key)
        return self.io.views_of([key])[0] if self._native_io else self._buffers[key]

    def landed(self, key: Key) -> bool:
        self._check(self.lib.spx_landed(self._handle, key[0], key[1], ctypes.byref(self._flag)))
        return bool(self._flag.value)

    def plan_probs(self, step: int, targets: list[int], probs: torch.Tensor | None) -> None:
        """Queue reads from predicted probabilities [W, E] of the steps `targets`."""
        if probs is None or not targets:
            self._call("spx_plan_probs", step, _ints([], ctypes.c_int64), 0, None)
            return
        p = probs.detach().to("cpu", torch.float32).contiguous()
        if p.shape != (len(targets), self.E):
            raise SpecPrefetchError(f"native scheduler: probabilities of shape {tuple(p.shape)} for {len(targets)} "
                                    f"targets, not [{len(targets)}, {self.E}]")
        self._call("spx_plan_probs", step, _ints(targets, ctypes.c_int64), len(targets), p.data_ptr())

    def plan(self, step: int, window: list[tuple[int, torch.Tensor]]) -> None:
        """Queue reads for the predicted steps: window = [(target step, scores [E])], as WindowScheduler.plan."""
        self.plan_probs(step, *window_probs(window))

    def plan_ranked(self, step: int, targets: list[int], confs: list[list[float]], ids: list[list[int]]) -> None:
        """`plan_probs` with each target's candidates already taken (WindowScheduler.plan_ranked)."""
        if not len(targets) == len(confs) == len(ids):
            raise SpecPrefetchError(f"native scheduler: {len(targets)} targets, {len(confs)} rows of confidences "
                                    f"and {len(ids)} of experts")
        pairs = [list(zip(c, e)) for c, e in zip(confs, ids)]   # (as the Python scheduler's zip)
        m = max((len(r) for r in pairs), default=0)
        # rows of m candidates: a shorter one padded with confidence 0 (never queued, as plan_ranked skips it)
        rows = [r + [(0.0, 0)] * (m - len(r)) for r in pairs]
        self._call("spx_plan_ranked", step, _ints(targets, ctypes.c_int64), len(targets), m,
                   (ctypes.c_double * (len(rows) * m))(*(c for r in rows for c, _ in r)),
                   _ints([e for r in rows for _, e in r]))
