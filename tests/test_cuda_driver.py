"""toolkit/runtime/cuda_driver.py on the CPU: its calls against a stand-in for libcuda.so.1 built here (the same C
entry points, host memory for the device's), so what each wrapper passes and how it reads the driver's answers is
checked without a GPU. The real driver's path (the pooled decode with launch=driver, tokens equal to
transformers') is tests/test_gpu_tier.py's CUDA tests."""
from __future__ import annotations

import ctypes
import gc
import subprocess

import numpy as np
import pytest

from toolkit.errors import SpecPrefetchError
from toolkit.runtime import cuda_driver
from toolkit.runtime.native_sched import _compiler, has_compiler

# the driver's entry points as the wrapper declares them; events are structs of the stand-in's, a "stream" any
# non-null pointer, a graph executable a counter the launch increments (0: an invalid handle)
STANDIN = r"""
#include <cstdint>
#include <cstring>
#include <cstdlib>
extern "C" {
struct Ev { unsigned flags; int recorded; int ready; long at; };
static long clock_ = 0;
static int ctx_ = 1, destroyed_ = 0;
static void* last_stream_ = nullptr;
int standin_destroyed() { return destroyed_; }
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
  std::memcpy((void*)dst, (const void*)src, n); last_stream_ = stream; return 0;
}
int cuStreamWaitEvent(void* stream, Ev* e, unsigned flags) {
  return (BAD(stream) || !e || flags) ? 400 : 0;   // (an event never recorded: a no-op, as the driver's)
}
int cuEventCreate(Ev** e, unsigned flags) {
  if (flags & ~2u) return 1;
  *e = (Ev*)std::calloc(1, sizeof(Ev)); (*e)->flags = flags; return 0;
}
int cuEventDestroy_v2(Ev* e) { std::free(e); ++destroyed_; return 0; }
int cuEventRecord(Ev* e, void* stream) {
  if (BAD(stream)) return 400;
  e->recorded = 1; e->ready = 0; e->at = ++clock_; return 0;
}
int cuEventQuery(Ev* e) { return e->ready ? 0 : 600; }
int cuEventSynchronize(Ev* e) { e->ready = 1; return 0; }
int cuEventElapsedTime(float* ms, Ev* a, Ev* b) {
  if ((a->flags | b->flags) & 2u) return 400;
  if (!a->ready || !b->ready) return 600;
  *ms = 0.5f * (float)(b->at - a->at); return 0;
}
}
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    if not has_compiler():
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("libcuda")
    src, lib = d / "standin.cpp", d / "libcuda-standin.so"
    src.write_text(STANDIN)
    cxx, _ = _compiler()
    subprocess.run([*cxx, "-std=c++17", "-shared", "-fPIC", "-O1", str(src), "-o", str(lib)], check=True)
    so = ctypes.CDLL(str(lib))
    so.standin_last_stream.restype = ctypes.c_void_p
    return so, cuda_driver.Driver(so)


STREAM = 0x5000
BAD = 0xdead   # the stand-in's invalid handle


def test_copy_passes_addresses_and_size_on_the_stream(standin):
    so, drv = standin
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    drv.copy(dst.ctypes.data + 8, src.ctypes.data + 16, 40, STREAM)
    assert dst[8:48].tolist() == list(range(16, 56)) and not dst[:8].any() and not dst[48:].any()
    assert so.standin_last_stream() == STREAM
    drv.copy(dst.ctypes.data, src.ctypes.data, 2, 0)   # stream 0, the legacy default stream, reaches it as NULL
    assert dst[:2].tolist() == [0, 1] and so.standin_last_stream() is None
    with pytest.raises(SpecPrefetchError, match=r"^launch=driver: cuMemcpyAsync failed: CUDA_ERROR_INVALID_HANDLE$"):
        drv.copy(dst.ctypes.data, src.ctypes.data, 1, BAD)


def test_launch_runs_the_executable_on_the_stream(standin):
    so, drv = standin
    counter = ctypes.c_long(0)
    drv.launch(ctypes.addressof(counter), STREAM)
    drv.launch(ctypes.addressof(counter), STREAM + 1)
    assert counter.value == 2 and so.standin_last_stream() == STREAM + 1
    with pytest.raises(SpecPrefetchError, match="cuGraphLaunch failed: CUDA_ERROR_INVALID_HANDLE"):
        drv.launch(ctypes.addressof(counter), BAD)


def test_events_as_torch_reads_them(standin):
    so, drv = standin
    a = drv.event(STREAM)
    b = drv.event()                     # made, not recorded
    with pytest.raises(SpecPrefetchError, match="cuStreamWaitEvent failed"):
        drv.wait(BAD, b)
    b.record(STREAM)
    drv.wait(STREAM, b)
    assert not a.query() and not b.query()   # CUDA_ERROR_NOT_READY reads as False, not an error
    so.standin_land(ctypes.c_void_p(a.h))
    assert a.query()
    b.synchronize()
    assert b.query()
    assert a.elapsed_time(b) == pytest.approx(0.5)   # the stand-in's clock: one record apart
    quiet = drv.event(STREAM, timing=False)
    quiet.synchronize()
    with pytest.raises(SpecPrefetchError, match="cuEventElapsedTime failed"):
        a.elapsed_time(quiet)           # an event made without timing has none


def test_an_unnamed_error_and_the_events_destroyed(standin):
    so, drv = standin
    with pytest.raises(SpecPrefetchError, match=r"^launch=driver: cuEventCreate failed: error 7$"):
        drv.fail(7, "cuEventCreate")
    before = so.standin_destroyed()
    evs = [drv.event(STREAM) for _ in range(5)]
    del evs
    gc.collect()
    assert so.standin_destroyed() == before + 5


def test_the_current_context_must_be_the_devices(standin):
    so, drv = standin
    drv.check_context(0)
    try:
        so.standin_context(0)
        with pytest.raises(SpecPrefetchError, match="no CUDA context is current"):
            drv.check_context(0)
        so.standin_context(2)
        drv.check_context(1)
        with pytest.raises(SpecPrefetchError, match=r"the current CUDA context is device 1's, not cuda:0's"):
            drv.check_context(0)
    finally:
        so.standin_context(1)


def test_no_driver_library_is_one_line(monkeypatch):
    monkeypatch.setattr(cuda_driver, "LIBRARY", "libcuda-absent.so.404")
    with pytest.raises(SpecPrefetchError, match=r"^launch=driver: cannot load the CUDA driver \(libcuda-absent"):
        cuda_driver._load()


def test_a_torch_without_graph_executables_is_one_line(monkeypatch):
    import torch

    class Graph:   # a CUDAGraph without raw_cuda_graph_exec (an older torch)
        pass
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    with pytest.raises(SpecPrefetchError, match=r"^launch=driver: torch .* does not expose a graph's executable"):
        cuda_driver.driver(torch.device("cuda", 0))


def test_a_driver_without_a_call_is_one_line(standin):
    class Partial:   # a library with one entry point missing
        def __getattr__(self, name):
            if name == "cuEventElapsedTime":
                raise AttributeError(name)
            return getattr(standin[0], name)
    with pytest.raises(SpecPrefetchError, match=r"^launch=driver: the CUDA driver \(libcuda.so.1\) has no "
                                                r"cuEventElapsedTime$"):
        cuda_driver.Driver(Partial())


def test_the_call_timing_refuses_in_one_line(tmp_path, capsys):
    """`python -m toolkit.runtime.cuda_call_timing` (docs/benchmarks.md section 30's micro-timings): a bad count or
    a machine without CUDA is one line and exit 2; a file that is not its report is never replaced, --overwrite or
    not; on CUDA it times every call and writes its report, replaced only with --overwrite."""
    import json

    import torch

    from toolkit.runtime import cuda_call_timing

    out = tmp_path / "calls.json"
    out.write_text("kept")
    assert cuda_call_timing.main(["--calls", "0"]) == 2
    assert cuda_call_timing.main(["--json", str(out), "--overwrite"]) == 2 and out.read_text() == "kept"
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: --calls 0: must be >= 1" and len(err) == 2
    assert err[1].startswith(f"error: --json {out} is a JSON file that is not a report written by specprefetch")
    new = tmp_path / "new.json"
    if not torch.cuda.is_available():
        assert cuda_call_timing.main(["--json", str(new)]) == 2 and not new.exists()
        assert capsys.readouterr().err.strip() == "error: cuda_call_timing: no CUDA device on this machine"
        return
    assert cuda_call_timing.main(["--calls", "4", "--json", str(new)]) == 0
    r = json.loads(new.read_text())
    assert r["specprefetch_report"] == "cuda_call_timing" and r["calls"] == 4
    assert {x["api"] for x in r["rows"]} == {"torch", "driver"} and all(x["us"] > 0 for x in r["rows"])
    assert cuda_call_timing.main(["--calls", "4", "--json", str(new)]) == 2   # (exists: --overwrite needed)
    assert cuda_call_timing.main(["--calls", "4", "--json", str(new), "--overwrite"]) == 0
