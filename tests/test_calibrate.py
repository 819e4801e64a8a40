"""calibrate (toolkit/simulate/calibrate.py): the runtime miss cost it derives from a run, its flash
reads (clamped to the store, counted by the bytes read, closing their file on an error), and its --out
claimed before it measures (the command, on tests/test_artifacts.py's tiny model and store)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import test_artifacts
from test_artifacts import outputs_cache, refused, snapshot  # noqa: F401 - outputs_cache: a fixture
from toolkit.errors import SpecPrefetchError
from toolkit.simulate import calibrate as cal

MiB = 2**20
PAGE = 4096

art = test_artifacts.art  # the fixture (the tiny model and its store), re-exported


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def small_file(tmp_path) -> Path:
    f = tmp_path / "store.bin"
    f.write_bytes(os.urandom(3 * PAGE))
    return f


class TestRuntimeMissCost:
    """The miss cost: stall and misses counted over the same decode tokens."""

    def test_miss_cost_counts_stall_and_misses_over_the_same_decode_tokens(self):
        """8 tokens = 1 from prefill + 7 decode steps; stall (per decode token) and misses (decode-only
        counts) both cover those 7 steps: 7 x 2 ms of stall over 14 misses is 1 ms a miss."""
        run = {"tokens": list(range(8)), "decode_tokens": 7, "stall_ms_per_token": 2.0, "counts": {"misses": 14}}
        assert cal.runtime_miss_ms(run) == pytest.approx(1.0)
        # without the runtime's decode_tokens, the decode steps are the tokens after the first
        del run["decode_tokens"]
        assert cal.runtime_miss_ms(run) == pytest.approx(1.0)
        assert cal.runtime_miss_ms({"tokens": [1, 2], "stall_ms_per_token": 0.0, "counts": {"misses": 0}}) == 0.0


class TestFlashRateAsTheRunnerSeesIt:
    """Where the perfect-prefetch run is flash-bound, the profile's slot reads go at the rate that run got
    from the flash (its bytes over its time) at every queue depth, the table's other sizes scaled alike and
    the burst table kept beside; the latency is what a miss costs beyond that transfer. Otherwise the burst
    table stands."""

    SLOT = 864 * 1024

    def _profile(self, oracle_stall_ms: float, on_demand_extra: dict | None = None, plan_ms: float = 0.0, **oracle):
        burst = {1: {864: 1900.0, 1024: 2000.0}, 8: {864: 2200.0, 1024: 2400.0}}
        run = {"tokens": list(range(9)), "decode_tokens": 8, "counts": {"misses": 80}}
        return cal.runtime_profile(
            "t", "test", flash=(burst, 0.5e-3, self.SLOT / (2200.0 * MiB)), L=16, k=8, slot_bytes=self.SLOT,
            all_resident={"tpot_ms": 6.0, "stall_ms_per_token": 0.0}, expert_ms=0.02, plan_ms=plan_ms,
            on_demand={**run, **(on_demand_extra or {}), "stall_ms_per_token": 60.0},   # 8 x 60 ms over 80 misses
            oracle={"tpot_ms": 80.0, "stall_ms_per_token": oracle_stall_ms, "mib_read_per_token": 112.0, **oracle},
            measured={}, source="test")

    def test_read_costs_split_per_token_and_per_read(self):
        """read_costs: the perfect-prefetch run's remainder (past compute, stall and planning) and the on-demand
        miss run's, as a part per streaming token plus a part per read; remainders that fall as the reads grow
        are all per streaming token; a negative per-token part, reads too close to split, or one run only,
        leave it all per read. The profile takes the planning off and records the inputs."""
        od = {"tpot_ms": 100.0, "stall_ms_per_token": 80.0, "mib_read_per_token": 128 * 864 / 1024}   # 128 reads
        # on-demand: 100 - 80 - 6 ms of compute = 14 ms past compute at 128 reads; the oracle 10 ms at 64
        a, b, how, info = cal.read_costs(10.0, 64.0, od, 6.0, self.SLOT)
        assert a == pytest.approx(6.0) and b == pytest.approx(4.0 / 64) and how.startswith("per streaming token and")
        assert info == {"oracle_rest_ms": 10.0, "on_demand_rest_ms": 14.0, "on_demand_reads_per_token": 128.0}
        a, b, how, _ = cal.read_costs(15.0, 64.0, od, 6.0, self.SLOT)       # 15 ms at 64 reads, 14 at 128
        assert (a, b) == (15.0, 0.0) and how.startswith("all per streaming token")
        a, b, how, _ = cal.read_costs(6.0, 64.0, od, 6.0, self.SLOT)        # a line through -2 ms at no reads
        assert (a, b) == (0.0, pytest.approx(6.0 / 64)) and how.startswith("per read")
        # 100 against 128 reads: too close to split (split, it would be 1/28 ms a read and 9.4 ms a token)
        a, b, how, _ = cal.read_costs(13.0, 100.0, od, 6.0, self.SLOT)
        assert (a, b) == (0.0, pytest.approx(13.0 / 100)) and how.startswith("per read")
        a, b, how, _ = cal.read_costs(10.0, 64.0, {"stall_ms_per_token": 80.0}, 6.0, self.SLOT)   # one run
        assert (a, b) == (0.0, pytest.approx(10.0 / 64)) and how.startswith("per read")
        # in the profile: the oracle run 80 ms - 65 stall - 6 compute - 16 x 0.1 planning = 7.4 ms at 112 MiB
        # (132.7 reads), the miss run 76 - 60 - 6 = 10 ms at 256 reads
        miss = {"tpot_ms": 76.0, "mib_read_per_token": 256 * 864 / 1024}
        prof = self._profile(oracle_stall_ms=65.0, on_demand_extra=miss, plan_ms=0.1)
        b = (10.0 - 7.4) / (256 - 112 * 1024 / 864)
        assert prof.streaming_token_ms == pytest.approx(7.4 - b * 112 * 1024 / 864, abs=1e-4) and \
            prof.read_cpu_us == pytest.approx(b * 1e3, abs=0.1) and prof.token_overhead_ms == 0.0
        assert prof.measured["read_cost_from"].startswith("per streaming token and per read")
        assert prof.measured["oracle_rest_ms"] == pytest.approx(7.4) and prof.measured["on_demand_rest_ms"] == 10.0
        assert self._profile(oracle_stall_ms=65.0).measured["read_cost_from"].startswith("per read")

    def test_the_flash_bound_run_keeps_half_a_token_in_flight(self):
        """flash_pool_mib: half a token's working set of slots (the miss run's two layers at least)."""
        from toolkit.simulate.calibrate import flash_pool_mib, tiny_pool_mib

        assert flash_pool_mib(16, 8, 2**20) == 64 and flash_pool_mib(8, 4, 2**20) == 16
        assert flash_pool_mib(2, 8, 2**20) == flash_pool_mib(3, 8, 2**20) == tiny_pool_mib(8, 2**20) == 16

    def test_a_flash_bound_run_sets_the_rate(self):
        prof = self._profile(oracle_stall_ms=65.0)  # 81% of the token waits on the flash
        rate = 112.0 / 0.080                        # 1400 MiB/s: 112 MiB a token in 80 ms
        assert prof.flash_bw == {1: {864: pytest.approx(rate), 1024: pytest.approx(2000 * rate / 1900, abs=0.1)},
                                 8: {864: pytest.approx(rate), 1024: pytest.approx(2400 * rate / 2200, abs=0.1)}}
        assert prof.measured["flash_rate_from"] == "runner" and prof.measured["runner_flash_mibs"] == 1400.0
        assert prof.measured["flash_mibs"] == 1400.0 and prof.measured["tiny_pool_mib"] == 8 * 2 * 864 / 1024
        # the flash-bound run's pool: half a token's working set (16 layers x top-8 / 2), not the miss run's,
        # where the run does not report its own; where it does, that one
        assert prof.measured["oracle_pool_mib"] == 8 * 8 * 864 / 1024
        assert self._profile(oracle_stall_ms=65.0, budget_bytes=40 * 2**20).measured["oracle_pool_mib"] == 40
        assert prof.measured["burst_flash_bw"][8][864] == 2200.0
        xfer_us = self.SLOT / (rate * MiB) * 1e6
        assert prof.flash_latency_us == pytest.approx(6000 - xfer_us, abs=0.1)  # a miss beyond its transfer

    def test_the_rate_is_fitted_to_the_simulators_replay_of_that_run(self):
        """fit_flash_rate: the slot rate at which the replay of the calibration run takes its measured 80 ms (here
        a stand-in replay: 10 ms of compute plus 112 MiB at the rate, so 1600 MiB/s), between the run's bound
        and four times it; the bound stays where even four times is too slow; a burst profile is not touched."""
        prof = self._profile(oracle_stall_ms=65.0)

        def replay(p):
            return 10.0 + 112.0 / p.flash_bw[8][864] * 1e3

        fitted = cal.fit_flash_rate(prof, replay)
        assert fitted.flash_bw[1][864] == pytest.approx(1600.0, rel=0.01) and fitted.flash_bw[8][864] == \
            pytest.approx(1600.0, rel=0.01)
        assert fitted.measured["flash_rate_from"].startswith("runner, fitted") and \
            fitted.flash_latency_us == pytest.approx(6000 - self.SLOT / (fitted.flash_bw[8][864] * MiB) * 1e6, abs=1)
        slow = cal.fit_flash_rate(prof, lambda p: 1e9)  # 4x too slow: the bound, said so
        assert slow.flash_bw == prof.flash_bw and "slower than the run" in slow.measured["flash_rate_from"]
        fast = cal.fit_flash_rate(prof, lambda p: 1.0)  # the bound already fast enough: the bound, said so
        assert fast.flash_bw == prof.flash_bw and "no longer than the run" in fast.measured["flash_rate_from"]
        # a profile read back from JSON (string keys in measured.burst_flash_bw) fits alike
        import json

        from toolkit.runtime.profiles import DeviceProfile

        d = json.loads(json.dumps(prof.to_json()))
        d["flash_bw"] = {int(q): {int(k): v for k, v in t.items()} for q, t in d["flash_bw"].items()}
        again = cal.fit_flash_rate(DeviceProfile(**d), replay)
        assert again.flash_bw[8][864] == pytest.approx(fitted.flash_bw[8][864])
        burst = self._profile(oracle_stall_ms=30.0)
        assert cal.fit_flash_rate(burst, replay) is burst

    def test_a_compute_bound_run_keeps_the_burst_table(self):
        prof = self._profile(oracle_stall_ms=30.0)  # 38%: the run's time is not the flash's
        assert prof.flash_bw == {1: {864: 1900.0, 1024: 2000.0}, 8: {864: 2200.0, 1024: 2400.0}}
        assert prof.measured["flash_rate_from"] == "burst"
        assert prof.flash_latency_us == pytest.approx(6000 - self.SLOT / (2200.0 * MiB) * 1e6, abs=0.1)


class TestFlashReads:
    """Flash reads stay inside the store, count what they read and close their file."""

    def test_reads_clamp_to_the_file_and_count_what_they_read(self, small_file, monkeypatch):
        """1 MiB reads of a 12 KiB file on a simulated 100 MiB/s device: no request past the end, and
        the bandwidth is the bytes actually read over the time taken (100 MiB/s), not 1 MiB a read."""
        clock = [0.0]
        calls: list[tuple[int, int, int]] = []
        real = os.preadv

        def preadv(fd, bufs, off):
            got = real(fd, bufs, off)
            calls.append((off, sum(len(b) for b in bufs), got))
            clock[0] += got / (100 * MiB)
            return got

        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(cal.time, "perf_counter", lambda: clock[0])
        bw, lat = cal.measure_reads(small_file, [0, PAGE, 2 * PAGE], MiB, qd=1, n=12)
        assert len(calls) == 12
        assert all(off + asked <= 3 * PAGE and got == asked for off, asked, got in calls), calls
        assert bw == pytest.approx(100.0)
        assert lat == pytest.approx(sum(c[2] for c in calls) / 12 / (100 * MiB))

    def test_reads_past_the_end_are_refused(self, small_file):
        with pytest.raises(SpecPrefetchError, match=r"store.bin: .*offset 16384 .*past the end"):
            cal.measure_reads(small_file, [0, 4 * PAGE], PAGE, qd=1, n=4)

    def test_measure_reads_closes_its_file_when_a_read_fails(self, small_file, monkeypatch):
        def eio(fd, bufs, off):
            raise OSError(errno.EIO, "Input/output error")

        before = _open_fds()
        monkeypatch.setattr(os, "preadv", eio)
        for qd in (1, 4):
            with pytest.raises(SpecPrefetchError,
                               match=r"store.bin: read of 4096 bytes at offset \d+ failed.*Input/output"):
                cal.measure_reads(small_file, [0, PAGE], PAGE, qd=qd, n=8)
            assert _open_fds() == before
        monkeypatch.undo()
        with pytest.raises(SpecPrefetchError, match="no offsets"):
            cal.measure_reads(small_file, [], PAGE, qd=1, n=4)
        assert _open_fds() == before

    @pytest.mark.parametrize("data_offset,file_end,size,count", [
        (PAGE, PAGE + 12 * PAGE, 12 * PAGE, 1),          # a store smaller than 1 MiB: one read of all of it
        (2 * PAGE, 2 * PAGE + 5 * MiB, MiB, 5),          # an exact fit: the last MiB is read too
        (2 * PAGE, 2 * PAGE + 5 * MiB + 3 * PAGE, MiB, 5),
    ])
    def test_big_reads_stay_inside_the_store(self, data_offset, file_end, size, count):
        got, offsets = cal.big_reads(data_offset, file_end)
        assert (got, len(offsets)) == (size, count)
        assert got % PAGE == 0 and all(o % PAGE == 0 and data_offset <= o and o + got <= file_end for o in offsets)


@pytest.mark.usefixtures("outputs_cache")
class TestOutputClaim:
    """calibrate's --out is claimed before it measures: a file of the user's is refused and left as it was."""

    def test_calibrate_out_is_claimed_before_measuring(self, art, tmp_path):
        mine = tmp_path / "profile.json"
        mine.write_text('{"mine": true}')
        before = snapshot(tmp_path)
        refused(["calibrate", art["M"], "--store", art["S"], "--out", mine], "not a report written by specprefetch")
        assert snapshot(tmp_path) == before


def test_pooled_runs_keep_their_common_pool():
    """runner bench's `_pooled`: per-token figures weighted by decode tokens, and the runs' pool
    (budget_bytes) where every run had the same one: the calibration profile records it as the oracle
    run's pool; mixed or missing budgets leave it out (the profile then records the intended pool)."""
    from android_runner.bench import _pooled

    def run(tpot, budget=None):
        r = {"decode_tokens": 4, "tpot_ms": tpot, "stall_ms_per_token": 1.0, "mib_read_per_token": 2.0,
             "counts": {"misses": 3}, "expert_ms_per_call": 0.1, "plan_ms_per_layer": 0.0, "direct_io": True}
        return r if budget is None else {**r, "budget_bytes": budget}

    same = _pooled([run(10.0, 64), run(20.0, 64)])
    assert same["budget_bytes"] == 64 and same["tpot_ms"] == 15.0 and same["counts"]["misses"] == 6
    assert "budget_bytes" not in _pooled([run(10.0, 64), run(20.0, 32)])
    assert "budget_bytes" not in _pooled([run(10.0, 64), run(20.0)])
