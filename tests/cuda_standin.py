"""A stand-in for the CUDA driver (libcuda.so.1), built from C++ here: the entry points the GPU tier calls (through
toolkit/runtime/cuda_driver.py's ctypes and android_runner/src/cuda_copy_io.cpp's dlopen), with host memory for the
device's, so what each caller passes and how it reads the driver's answers is checked without a GPU.

Events are structs of the stand-in's, a "stream" any non-null pointer (0: the legacy default stream), a graph
executable a counter the launch increments (0: an invalid handle), a handle of 0xdead invalid. A copy is a memcpy made
at once; an event completes when it or an event recorded after it is synchronized, when landed (`standin_land`,
`standin_land_all`) or, in instant mode (`standin_instant(1)`: a device that has run everything by the time the host
asks), when recorded.
"""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

STANDIN = r"""
#include <cstdint>
#include <cstring>
#include <cstdlib>
extern "C" {
struct Ev { unsigned flags; int recorded; int ready; long at; };
static long clock_ = 0, landed_upto_ = 0;
static int ctx_ = 1, destroyed_ = 0, created_ = 0, instant_ = 0, copies_ = 0, waits_ = 0;
static void* last_stream_ = nullptr;
int standin_destroyed() { return destroyed_; }
int standin_created() { return created_; }
static std::size_t sized_ = 0;
static int sized_copies_ = 0;
int standin_copies() { return copies_; }
void standin_count_size(std::size_t n) { sized_ = n; sized_copies_ = 0; }   // count the copies of n bytes from now
int standin_sized_copies() { return sized_copies_; }
int standin_waits() { return waits_; }   // stream waits on a recorded event
void standin_instant(int on) { instant_ = on; }
void standin_land_all() { landed_upto_ = clock_; }
static int fail_record_in_ = 0, fail_copy_in_ = 0;
void standin_fail_record_in(int n) { fail_record_in_ = n; }   // the n-th record from now fails (0: none)
void standin_fail_copy_in(int n) { fail_copy_in_ = n; }       // the n-th copy from now fails
void standin_context(int c) { ctx_ = c; }   // 0: none current, else device c - 1's
void* standin_last_stream() { return last_stream_; }
void standin_land(Ev* e) { e->ready = 1; }
int cuCtxGetCurrent(void** c) { *c = ctx_ ? (void*)0x1 : nullptr; return 0; }
int cuCtxGetDevice(int* d) { *d = ctx_ - 1; return 0; }
int cuGetErrorName(int rc, const char** s) {
  if (rc == 400) { *s = "CUDA_ERROR_INVALID_HANDLE"; return 0; }
  if (rc == 1) { *s = "CUDA_ERROR_INVALID_VALUE"; return 0; }
  return 1;
}
// a handle of 0xdead is invalid (stream 0 is the legacy default stream, as in the driver)
#define BAD(p) ((std::uintptr_t)(p) == 0xdead)
int cuGraphLaunch(long* exec, void* stream) {
  if (!exec || BAD(stream)) return 400;
  ++*exec; last_stream_ = stream; return 0;
}
int cuMemcpyAsync(std::uint64_t dst, std::uint64_t src, std::size_t n, void* stream) {
  if (BAD(stream)) return 400;
  if (fail_copy_in_ > 0 && --fail_copy_in_ == 0) return 1;
  std::memcpy((void*)dst, (const void*)src, n); last_stream_ = stream; ++copies_;
  sized_copies_ += n == sized_; return 0;
}
int cuStreamWaitEvent(void* stream, Ev* e, unsigned flags) {
  if (BAD(stream) || !e || flags) return 400;
  waits_ += e->recorded; last_stream_ = stream; return 0;   // (an event never recorded: a no-op, as the driver's)
}
int cuEventCreate(Ev** e, unsigned flags) {
  if (flags & ~2u) return 1;
  *e = (Ev*)std::calloc(1, sizeof(Ev)); (*e)->flags = flags; ++created_; return 0;
}
int cuEventDestroy_v2(Ev* e) { std::free(e); ++destroyed_; return 0; }
int cuEventRecord(Ev* e, void* stream) {
  if (BAD(stream)) return 400;
  if (fail_record_in_ > 0 && --fail_record_in_ == 0) return 1;
  e->recorded = 1; e->ready = instant_; e->at = ++clock_; return 0;
}
static int done(const Ev* e) { return e->ready || e->at <= landed_upto_; }
int cuEventQuery(Ev* e) { return done(e) ? 0 : 600; }
int cuEventSynchronize(Ev* e) {   // everything recorded up to it has run (as one stream's work would have)
  e->ready = 1;
  if (e->at > landed_upto_) landed_upto_ = e->at;
  return 0;
}
int cuEventElapsedTime(float* ms, Ev* a, Ev* b) {
  if ((a->flags | b->flags) & 2u) return 400;
  if (!done(a) || !done(b)) return 600;
  *ms = 0.5f * (float)(b->at - a->at); return 0;
}
}
"""


def build(directory: Path, cxx: list[str]) -> Path:
    """The stand-in's shared library, compiled into `directory` with the C++ compiler `cxx`."""
    src, lib = directory / "standin.cpp", directory / "libcuda-standin.so"
    src.write_text(STANDIN)
    subprocess.run([*cxx, "-std=c++17", "-shared", "-fPIC", "-O1", str(src), "-o", str(lib)], check=True)
    return lib


def load(lib: Path) -> ctypes.CDLL:
    so = ctypes.CDLL(str(lib))
    so.standin_last_stream.restype = ctypes.c_void_p
    return so
