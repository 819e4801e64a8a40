"""toolkit/runtime/cuda_driver.py and the native copy IO (toolkit/runtime/native_io.py) on the CPU: their calls
against a stand-in for libcuda.so.1 (tests/cuda_standin.py: the same C entry points, host memory for the device's),
so what each passes and how it reads the driver's answers is checked without a GPU. The real driver's path (the
pooled decode with launch=driver, tokens equal to transformers') is tests/test_gpu_tier.py's CUDA tests."""
from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

from toolkit.errors import SpecPrefetchError
from toolkit.runtime import cuda_driver


@pytest.fixture(scope="module")
def standin(cuda_standin):
    """(the stand-in's library, a Driver over it): tests/cuda_standin.py"""
    return cuda_standin, cuda_driver.Driver(cuda_standin)


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
    gc.collect()   # (the session's other users of the stand-in: their garbage first)
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
    assert {x["api"] for x in r["rows"]} == {"torch", "driver", "native IO"} and all(x["us"] > 0 for x in r["rows"])
    assert cuda_call_timing.main(["--calls", "4", "--json", str(new)]) == 2   # (exists: --overwrite needed)
    assert cuda_call_timing.main(["--calls", "4", "--json", str(new), "--overwrite"]) == 0


def test_native_copy_io_orders_a_slots_reuse_itself(cuda_standin, monkeypatch):
    """native_io.NativeCopyIO (android_runner/src/cuda_copy_io.cpp) against the stand-in: a prefetch on the copy
    stream and a demand copy on the demand stream, each the blob's bytes into the slot; a copy into a slot waits
    for every incomplete event of the slot's last use (the evicted key's own copy, and unless fenced an event
    recorded on the compute stream at the eviction), none that has completed; a wait on a copy in flight is a
    timed stall on the compute stream, on a landed one nothing; errors are one line naming the call or the
    expert, and leave the IO as it was."""
    import torch

    from toolkit.runtime.native_io import NativeCopyIO

    so = cuda_standin
    so.standin_instant(0)
    L, E, n = 2, 4, 24

    class Stream:
        def __init__(self, h):
            self.cuda_stream = h

    class Dev:   # a CUDA device's streams, by handle
        cuda, device = True, "cuda:0"
        copy_stream, demand_stream = Stream(0x5001), Stream(0x5002)

    class Store:
        blob_size, num_layers, num_experts = n, L, E

    class Host:
        store = Store()
        buf = torch.arange(L * E * n, dtype=torch.int64).remainder(251).to(torch.uint8).view(L * E, n)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(0x5003))
    slots = torch.zeros(1, n + 8, dtype=torch.uint8)   # one slot, wider than a blob
    io = NativeCopyIO(Host(), 1, Dev(), slots, cuda_driver.Driver(so))
    assert io.orders_reuse and io.compute == 0x5003
    waits = so.standin_waits

    def blob(key):
        return Host.buf[key[0] * E + key[1]]

    w = waits()
    io.submit((0, 1), demand=False)                     # a prefetch, in flight
    assert so.standin_last_stream() == 0x5001 and torch.equal(slots[0, :n], blob((0, 1))) and not slots[0, n:].any()
    assert not io.landed((0, 1)) and io.where == {(0, 1): 0}
    io.fenced = True
    io.release((0, 1))                                  # evicted while fenced: only its copy is waited for
    io.submit((1, 2), demand=True)
    assert so.standin_last_stream() == 0x5002 and waits() == w + 1 and torch.equal(slots[0, :n], blob((1, 2)))
    io.fenced = False
    io.release((1, 2))                                  # not fenced: an event on the compute stream too
    io.submit((0, 3), demand=False)
    assert waits() == w + 3
    so.standin_land_all()                               # everything so far has run
    assert io.landed((0, 3))
    io.release((0, 3))
    so.standin_land_all()                               # the kernels that read it too
    io.submit((1, 0), demand=False)                     # nothing left to wait for
    assert waits() == w + 3
    io.wait((1, 0))                                     # in flight: the compute stream waits, timed
    assert waits() == w + 4 and so.standin_last_stream() == 0x5003 and io.mark() == (4, 1)
    assert torch.equal(io.take((1, 0))[:n], blob((1, 0))) and io.views_of([(1, 0)])[0].data_ptr() == slots.data_ptr()
    so.standin_land_all()
    assert io.landed((1, 0))
    w = waits()
    io.wait((1, 0))                                     # landed: no stall
    assert waits() == w and io.mark() == (4, 1)
    assert io.copy_ms() == pytest.approx(4 * 0.5) and io.stall_ms() == pytest.approx(0.5)   # the stand-in's clock
    assert io.copy_ms(3) == pytest.approx(0.5) and io.copied_bytes == 4 * n
    out = np.zeros(4, dtype=np.int64)
    io.slot_numbers([(1, 0)], out)
    assert out.tolist() == [0, 0, 0, 0]
    # errors: one line; the IO unchanged
    with pytest.raises(SpecPrefetchError, match=r"^internal: a copy with every slot of the arena taken$"):
        io.submit((0, 0), demand=True)
    with pytest.raises(SpecPrefetchError, match=r"^expert \(2, 0\) is outside the copy IO's 2 MoE layers x 4 experts$"):
        io.landed((2, 0))
    with pytest.raises(SpecPrefetchError, match=r"^internal: expert \(0, 0\) released with no slot$"):
        io.release((0, 0))
    with pytest.raises(SpecPrefetchError, match=r"^internal: an expert of \[\(0, 0\)\] has no slot$"):
        io.slot_numbers([(0, 0)], out)
    io.release((1, 0))
    Dev.demand_stream = Stream(BAD)
    bad = NativeCopyIO(Host(), 1, Dev(), slots, cuda_driver.Driver(so))
    with pytest.raises(SpecPrefetchError, match=r"^launch=driver: cuEventRecord failed: CUDA_ERROR_INVALID_HANDLE$"):
        bad.submit((0, 1), demand=True)
    assert bad.where == {} and bad.mark() == (0, 0)
    bad.submit((0, 1), demand=False)                    # the slot still free
    assert bad.where == {(0, 1): 0}
    bad.release((0, 1))
    so.standin_fail_copy_in(1)                          # the copy refused: the IO unchanged
    with pytest.raises(SpecPrefetchError, match=r"^launch=driver: cuMemcpyAsync failed: CUDA_ERROR_INVALID_VALUE$"):
        bad.submit((0, 2), demand=False)
    assert bad.where == {} and bad.mark() == (1, 0)
    so.standin_fail_record_in(2)                        # the copy queued, its end event refused: the slot out of use
    with pytest.raises(SpecPrefetchError, match=r"^launch=driver: cuEventRecord failed: CUDA_ERROR_INVALID_VALUE$"):
        bad.submit((0, 2), demand=False)
    assert bad.where == {} and bad.mark() == (1, 0)
    with pytest.raises(SpecPrefetchError, match=r"^internal: a copy with every slot of the arena taken$"):
        bad.submit((0, 3), demand=False)
    drv = cuda_driver.Driver(so)
    drv.path = "libcuda-absent.so.404"
    with pytest.raises(SpecPrefetchError, match=r"^launch=driver: cannot load the CUDA driver \(libcuda-absent"):
        NativeCopyIO(Host(), 1, Dev(), slots, drv)


def test_the_fallback_for_a_library_that_cannot_be_built_is_one_line():
    """gpu.launch_fallback's reason where the native library (the copy IO's) cannot be built: one line, the build's
    first and the compiler's last, without the scheduler's setting."""
    from toolkit.runtime.gpu import no_copy_io
    from toolkit.runtime.native_sched import NO_COMPILER

    assert no_copy_io(SpecPrefetchError(NO_COMPILER)) == (
        "launch=driver: the native copy IO cannot be built: no C++ compiler ($CXX, or g++ or c++ on PATH) to build "
        "the native scheduler")
    failed = SpecPrefetchError("host=native: building the native scheduler with g++ failed (a static libstdc++ is "
                               "needed: Debian's g++ has it):\nx.cpp:1:1: error: one\n  2 | two\nfatal: the last\n")
    assert no_copy_io(failed) == (
        "launch=driver: the native copy IO cannot be built: building the native scheduler with g++ failed (a static "
        "libstdc++ is needed: Debian's g++ has it): fatal: the last")

