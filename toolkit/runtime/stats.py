"""`RunStats`: the one definition of every figure a run reports (run, bench, simulate).

Timing follows the field's conventions: TTFT is the time to the first committed
token (prefill included); TPOT = (t_last - t_first) / (N - 1) over committed tokens, with p50/p95
of the per-token intervals; every per-token figure counts decode tokens only (the N - 1 after the
first), so prefill's reads are in TTFT and nowhere else. Pool figures:

    hit rate            hits / expert requests (a hit: resident when the layer needs it)
    late rate           hits whose bytes had not landed yet (the use waited) / requests
    prefetch precision  prefetched slots used (first use) / prefetches issued
    prefetch recall     expert loads a prefetch supplied / all expert loads (prefetch hits + misses)
    wasted prefetch     bytes of prefetched slots evicted, or still unused at the end, unused
    stall               time blocked on reads, per decode token
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from toolkit.metrics import prefetch_precision, prefetch_recall, rate, tpot_ms
from toolkit.runtime.scheduler import SchedulerStats

MiB = 2**20


def peak_rss_bytes() -> int | None:
    """The process's peak resident set (VmHWM), or None where /proc is absent."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclasses.dataclass
class RunStats:
    policy: str
    decode_tokens: int
    ttft_ms: float
    tpot_ms: float
    tpot_p50_ms: float
    tpot_p95_ms: float
    stall_ms_per_token: float
    hit_rate: float
    late_rate: float
    mib_read: float                  # the whole run, prefill included
    mib_read_per_token: float        # decode tokens only
    prefetch_precision: float
    prefetch_recall: float
    wasted_prefetch_mib: float
    evictions: int                   # decode tokens only
    peak_pool_bytes: int
    budget_bytes: int
    counts: dict[str, Any]           # decode-token scheduler counts (SchedulerStats)

    @staticmethod
    def from_counts(*, policy: str, decode: SchedulerStats, total_bytes_read: int, ttft_s: float,
                    tpots_ms: list[float], intervals_ms: list[float], decode_tokens: int, wasted_prefetches: int,
                    evictions: int, slot_bytes: int, peak_pool_bytes: int, budget_bytes: int) -> "RunStats":
        """Figures from decode-token counts; `tpots_ms` has one TPOT per sequence (averaged), and
        `intervals_ms` every per-token interval (for the percentiles)."""
        n = max(decode_tokens, 1)
        iv = np.asarray(intervals_ms if len(intervals_ms) else [float("nan")], dtype=np.float64)
        return RunStats(
            policy=policy, decode_tokens=decode_tokens,
            ttft_ms=round(ttft_s * 1e3, 3),
            tpot_ms=round(float(np.mean(tpots_ms)) if tpots_ms else float("nan"), 4),
            tpot_p50_ms=round(float(np.percentile(iv, 50)), 4),
            tpot_p95_ms=round(float(np.percentile(iv, 95)), 4),
            stall_ms_per_token=round(decode.wait_s / n * 1e3, 4),
            hit_rate=round(rate(decode.hits, decode.requests), 4),
            late_rate=round(rate(decode.late, decode.requests), 4),
            mib_read=round(total_bytes_read / MiB, 4),
            mib_read_per_token=round(decode.bytes_read / MiB / n, 4),
            prefetch_precision=round(prefetch_precision(decode.prefetch_hits, decode.prefetch_issued), 4),
            prefetch_recall=round(prefetch_recall(decode.prefetch_hits, decode.misses), 4),
            wasted_prefetch_mib=round(wasted_prefetches * slot_bytes / MiB, 4),
            evictions=evictions, peak_pool_bytes=peak_pool_bytes, budget_bytes=budget_bytes,
            counts=dataclasses.asdict(decode))

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (a figure that is undefined, e.g. TPOT of one token, is null)."""
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v)
                for k, v in dataclasses.asdict(self).items()}


def tpot_and_intervals(token_times_s: list[float]) -> tuple[float, list[float]]:
    """(TPOT ms, per-token intervals ms) of one sequence's commit times."""
    t = np.asarray(token_times_s, dtype=np.float64)
    return tpot_ms(t), (np.diff(t) * 1e3).tolist()


class DecodeAccount:
    """Decode-token figures of one sequence: counts from the first committed token on. There the
    prefetched slots prefill left unused are settled (neither used nor wasted), so precision,
    recall and waste count the decode's own prefetches, and every count has the same span."""

    def __init__(self):
        self.first: SchedulerStats | None = None
        self.wasted0 = self.evictions0 = 0

    def start(self, sched, pool) -> None:
        pool.settle()
        self.first = dataclasses.replace(sched.stats)
        self.wasted0, self.evictions0 = pool.wasted_prefetches, pool.evictions

    def counts(self, sched, pool) -> tuple[SchedulerStats, int, int]:
        """(decode counts, wasted prefetches, evictions) since `start`."""
        first = self.first or SchedulerStats()
        unused = pool.unused_prefetches()
        return (sched.stats.minus(first), pool.wasted_prefetches - self.wasted0 + unused,
                pool.evictions - self.evictions0)

    def finish(self, policy: str, sched, pool, *, token_times: list[float], ttft_s: float) -> RunStats:
        decode, wasted, evictions = self.counts(sched, pool)
        tpot, intervals = tpot_and_intervals(token_times)
        return RunStats.from_counts(
            policy=policy, decode=decode, total_bytes_read=sched.stats.bytes_read, ttft_s=ttft_s,
            tpots_ms=[tpot] if len(token_times) > 1 else [], intervals_ms=intervals,
            decode_tokens=len(token_times) - 1, wasted_prefetches=wasted, evictions=evictions,
            slot_bytes=pool.slot_bytes, peak_pool_bytes=pool.peak_bytes, budget_bytes=pool.budget_bytes)
