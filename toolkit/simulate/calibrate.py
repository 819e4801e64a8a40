"""`specprefetch calibrate`: measure this machine into the `this-machine` device profile.

Flash: real O_DIRECT reads of random expert blobs from the model's expert store, at queue depths
1, 2, 4 and 8 (threads), for the store's slot size and for 1 MiB reads; the page cache is bypassed,
so these are device reads. Compute: the reference runner itself, with a pool that holds every
expert (so nothing is read after warm-up), timed per token; one expert's compute is timed alone,
and the rest of a token's time is spread over its layers as the dense part. The per-read latency
is the larger of the raw device latency and a miss as the runtime experiences it (an on-demand run
with a tiny pool: thread hand-off and Python included), so the simulator charges what a miss
really costs this runtime. What reading costs the runner beyond compute and waits comes from a
perfect-prefetch run (oracle + Belady, a pool of half a token's working set: flash_pool_mib) and the
on-demand miss run: each one's TPOT minus its stall, the all-resident TPOT and (the former) its planning,
fitted as a part per streaming token (`streaming_token_ms`) plus a part per read (`read_cpu_us`;
`read_costs`). The profile is saved
as JSON (default ~/.cache/specprefetch/profiles/this-machine.json) for `simulate --profile
this-machine`.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import time
from pathlib import Path
from typing import Callable

import torch

from toolkit.errors import SpecPrefetchError
from toolkit.runtime.expert_store import ALIGN, ExpertStore
from toolkit.runtime.io import measure_reads
from toolkit.runtime.profiles import DeviceProfile, save_profile

MiB = 2**20
# the perfect-prefetch calibration run is flash-bound when it waits on the flash for at least this share of
# each token: its bytes over its time are then the flash's rate as the runner drives it (runtime_profile)
FLASH_BOUND = 0.5


def big_reads(data_offset: int, file_end: int, big: int = 1 << 20) -> tuple[int, list[int]]:
    """(size, offsets) of the large sequential reads: `big` bytes each, or the whole data region in
    one read when the store is smaller; every read lies inside the file."""
    size = min(big, (file_end - data_offset) // ALIGN * ALIGN)
    if size <= 0:
        raise SpecPrefetchError(f"expert store has no data to read (data at {data_offset}, file {file_end} bytes)")
    return size, list(range(data_offset, file_end - size + 1, size))


def runtime_miss_ms(result: dict) -> float:
    """What one demand miss costs the runtime (ms): an on-demand run's decode stall over its decode
    misses. `stall_ms_per_token` is per decode step (the tokens after the first, which prefill
    produced) and `counts` are decode-only, so both sides count the same decode tokens."""
    decode = result.get("decode_tokens") or max(1, len(result["tokens"]) - 1)
    return result["stall_ms_per_token"] * decode / max(1, result["counts"]["misses"])


def measure_flash(st: ExpertStore, reads: int) -> tuple[dict[int, dict[int, float]], float, float]:
    """(bandwidth table {qd: {KiB: MiB/s}}, mean qd-1 slot read s, one slot's transfer s at qd 8)
    of O_DIRECT reads of a store's expert slots and of 1 MiB requests."""
    offsets = [e.offset for e in st.entries.values()]
    slot = st.slot_bytes
    big, big_offsets = big_reads(st.data_offset, st.file_size)
    table: dict[int, dict[int, float]] = {}
    lat1 = 0.0
    for qd in (1, 2, 4, 8):
        bw_slot, lat = measure_reads(st.path, offsets, slot, qd, reads, store=st)
        bw_big, _ = measure_reads(st.path, big_offsets, big, qd, max(16, reads // 8), store=st)
        table[qd] = {slot // 1024: round(bw_slot, 1), big // 1024: round(bw_big, 1)}
        if qd == 1:
            lat1 = lat
    # latency: what a qd-1 read takes beyond its transfer at the qd-8 (throughput) rate
    return table, lat1, slot / (table[8][slot // 1024] * MiB)


def tiny_pool_mib(top_k: int, slot_bytes: int) -> float:
    """The pool the miss run uses: two layers' worth of slots (every use a miss)."""
    return top_k * 2 * slot_bytes / MiB


def read_costs(oracle_rest_ms: float, oracle_reads: float, on_demand: dict, per_token_ms: float,
               slot_bytes: int) -> tuple[float, float, str, dict]:
    """(ms a streaming token, ms a read, how, the inputs) of what reading costs the runner beyond its compute
    and its waits: the perfect-prefetch run's time past compute, stall and planning (`oracle_rest_ms`, over
    its `oracle_reads` a token) and the on-demand miss run's past compute and stall, fitted as a part per
    token that reads anything (the simulator's `streaming_token_ms`; an all-resident token costs none) plus
    a part per read (two runs, two unknowns). Where the remainders do not grow with the reads (the per-read
    part would be negative) it is all per streaming token, the perfect-prefetch run's; where the per-token
    part would be negative, or the two runs' reads are within a quarter of each other (the split would be
    noise over a small difference), all per read; with one run (an on-demand result without its TPOT or
    bytes), all per read."""
    rest_o = max(0.0, oracle_rest_ms)
    info: dict = {"oracle_rest_ms": round(oracle_rest_ms, 3)}
    per_read_only = (0.0, rest_o / max(1e-9, oracle_reads), "per read (the perfect-prefetch run)", info)
    if not {"tpot_ms", "stall_ms_per_token", "mib_read_per_token"} <= set(on_demand):
        return per_read_only
    reads_d = on_demand["mib_read_per_token"] * MiB / slot_bytes
    rest_d = on_demand["tpot_ms"] - on_demand["stall_ms_per_token"] - per_token_ms
    info.update(on_demand_rest_ms=round(rest_d, 3), on_demand_reads_per_token=round(reads_d, 2))
    if abs(reads_d - oracle_reads) < 0.25 * max(reads_d, oracle_reads, 1e-9):
        return per_read_only
    b = (rest_d - oracle_rest_ms) / (reads_d - oracle_reads)
    a = oracle_rest_ms - b * oracle_reads
    if b < 0:
        return rest_o, 0.0, "all per streaming token (the two runs' remainders do not grow with their reads)", info
    if a < 0:
        return per_read_only
    return a, b, "per streaming token and per read (the perfect-prefetch and the on-demand miss runs)", info


def flash_pool_mib(num_layers: int, top_k: int, slot_bytes: int) -> float:
    """The pool of the flash-bound perfect-prefetch run (oracle + Belady) that sets the flash rate in
    `calibrate` and `calibrate_native` run alone (runner bench uses its own oracle runs at its smallest pool
    instead): half a token's working set (at least two layers' worth of slots). A pool of
    two layers lets a layer's k reads be in flight and then waits on them, which on a VM draws less from
    the flash than the policies' pools do (1.0 GB/s against 1.2 at 13% of the phone-class model's
    experts; 1.14 with four layers, 1.21 with eight, in thousands of MiB/s: docs/benchmarks.md section
    19); half a token keeps more reads in flight, nearer those pools, while the run stays flash-bound (70%
    of its time waiting there)."""
    return top_k * max(2, num_layers // 2) * slot_bytes / MiB


def with_flash_rate(profile: DeviceProfile, mibs: float, source: str) -> DeviceProfile:
    """`profile` with its slot reads at `mibs` MiB/s at every queue depth (the table's other read sizes scaled
    alike) and its latency what a miss costs the runner beyond that transfer (or a qd-1 read, if more);
    `source` is recorded as measured.flash_rate_from. The burst table stays in measured.burst_flash_bw."""
    m = profile.measured
    slot = int(m["slot_bytes"])
    # int keys again: a profile read back from JSON has them as strings (load_profile converts flash_bw only)
    burst = {int(q): {int(k): float(v) for k, v in t.items()}
             for q, t in (m.get("burst_flash_bw") or profile.flash_bw).items()}
    kib = slot // 1024
    table = {q: {s: round(v * mibs / t[kib], 1) for s, v in t.items()} for q, t in burst.items()}
    xfer_us = slot / (mibs * MiB) * 1e6
    latency_us = max(1.0, m["qd1_read_ms"] * 1e3 - xfer_us, m["runtime_miss_ms"] * 1e3 - xfer_us)
    return dataclasses.replace(profile, flash_bw=table, flash_latency_us=round(latency_us, 1),
                               measured={**m, "burst_flash_bw": burst, "flash_rate_from": source,
                                         "flash_mibs": round(mibs, 1)})


def runtime_profile(name: str, description: str, *, flash: tuple[dict, float, float], L: int, k: int,
                    slot_bytes: int, all_resident: dict, expert_ms: float, plan_ms: float, on_demand: dict,
                    oracle: dict, measured: dict, source: str) -> DeviceProfile:
    """A runner's device profile from its measured runs (RunStats JSON of each): every expert
    resident (the compute per token), on-demand with a tiny pool (what a miss costs it), oracle +
    Belady at flash_pool_mib or runner bench's smallest pool (the flash as the runner draws it; with the
    miss run, what reading costs beyond compute and waits, `read_costs`), and the store's read table
    `flash` = measure_flash(...).

    The flash as the runner drives it: the table is a burst of reads from an otherwise idle process. Where
    the perfect-prefetch run waits on the flash for at least FLASH_BOUND of each token (flash-bound), its
    bytes over its time are what the flash delivered to this runner, reader threads sharing the CPU with its
    compute included (a lower bound: some of its time is compute the flash did not overlap), and the slot
    reads go at that rate (`with_flash_rate`; `fit_flash_rate` then refines it against the simulator's own
    replay of that run, where the routing is at hand); otherwise the burst table stands."""
    table, lat1, xfer = flash
    per_token = all_resident["tpot_ms"] - all_resident["stall_ms_per_token"]
    dense_ms = max(0.0, (per_token - L * k * expert_ms) / L)
    miss_ms = runtime_miss_ms(on_demand)
    # latency: what a qd-1 read takes beyond its transfer, or what a miss costs the runner, if more
    latency_us = max(1.0, (lat1 - xfer) * 1e6, miss_ms * 1e3 - xfer * 1e6)
    reads_per_token = oracle["mib_read_per_token"] * MiB / slot_bytes
    token_ms, read_ms, cost_from, cost_inputs = read_costs(
        oracle["tpot_ms"] - oracle["stall_ms_per_token"] - per_token - plan_ms * L, reads_per_token, on_demand,
        per_token, slot_bytes)
    run_mibs = oracle["mib_read_per_token"] / max(1e-9, oracle["tpot_ms"] * 1e-3)
    prof = DeviceProfile(
        name=name, description=description, flash_latency_us=round(latency_us, 1), flash_bw=table,
        dram_effective_gbs=0.0, dense_ms_per_layer=round(dense_ms, 4), expert_ms=round(expert_ms, 4),
        read_cpu_us=round(read_ms * 1e3, 1), streaming_token_ms=round(token_ms, 4),
        plan_ms_per_layer=round(plan_ms, 4),
        measured={"tpot_all_resident_ms": all_resident["tpot_ms"], "qd1_read_ms": round(lat1 * 1e3, 4),
                  "runtime_miss_ms": round(miss_ms, 4), "oracle_tpot_ms": oracle["tpot_ms"],
                  "oracle_stall_ms_per_token": oracle["stall_ms_per_token"],
                  "oracle_reads_per_token": round(reads_per_token, 2), "slot_bytes": slot_bytes,
                  "read_cost_from": cost_from, **cost_inputs,
                  "tiny_pool_mib": tiny_pool_mib(k, slot_bytes),
                  # the pool the oracle run had (its stats' budget), else the one it is meant to have
                  "oracle_pool_mib": oracle["budget_bytes"] / MiB if oracle.get("budget_bytes")
                  else flash_pool_mib(L, k, slot_bytes),
                  "runner_flash_mibs": round(run_mibs, 1),
                  "flash_rate_from": "burst", **measured},
        sources=[source])
    kib = slot_bytes // 1024
    if oracle["stall_ms_per_token"] >= FLASH_BOUND * oracle["tpot_ms"] and run_mibs > 0 and \
            all(t.get(kib, 0) > 0 for t in table.values()):
        prof = with_flash_rate(prof, run_mibs, "runner")
    return prof


def fit_flash_rate(profile: DeviceProfile, oracle_tpot_ms: Callable[[DeviceProfile], float], *,
                   iterations: int = 12) -> DeviceProfile:
    """A profile whose flash rate came from the runner's flash-bound run (`runtime_profile`), refined so that
    the simulator's own replay of that run (`oracle_tpot_ms(profile)`: oracle + Belady at its pool on
    the same prompts) takes the time it measured: bisection on the slot rate between the run's bytes over
    its time (the lower bound) and four times that. Any other profile is returned as it is."""
    m = profile.measured or {}
    if m.get("flash_rate_from") != "runner" or not float(m.get("runner_flash_mibs", 0)) > 0:
        return profile
    target, lo = float(m["oracle_tpot_ms"]), float(m["runner_flash_mibs"])
    hi = 4 * lo
    if oracle_tpot_ms(with_flash_rate(profile, lo, "fit")) <= target:  # the bound already replays fast enough
        return with_flash_rate(profile, lo, "runner (its replay at that rate takes no longer than the run)")
    if oracle_tpot_ms(with_flash_rate(profile, hi, "fit")) > target:
        # even 4x the bound replays slower than the run: not the flash's doing; the bound, the measured rate, stays
        return with_flash_rate(profile, lo, "runner (its replay is slower than the run at any rate)")
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        if oracle_tpot_ms(with_flash_rate(profile, mid, "fit")) > target:
            lo = mid
        else:
            hi = mid
    return with_flash_rate(profile, (lo * hi) ** 0.5, "runner, fitted to the simulator's replay of its run")


def calibrate(model: str | Path = "embedded", *, store: Path | None = None, reads: int = 200,
              tokens: int = 32, out: Path | None = None, progress: bool = True) -> tuple[DeviceProfile, Path]:
    from export.session import open_session
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.runner import RunConfig

    s = open_session(model, RunConfig(policy=Policy("on-demand", "lru"), pool_mib=1e6), predictors=["oracle"],
                     store=store, progress=progress)
    rt = s.runner
    st: ExpertStore = rt.store
    slot = st.slot_bytes
    table, lat1, xfer = measure_flash(st, reads)
    L, k = rt.model.L, rt.model.routing.top_k
    all_mib = st.slot_bytes * L * rt.model.routing.num_experts / MiB + 1
    # compute: every expert resident after the first token
    prompt = s.encode("The kernel's memory allocator")
    rt.configure(pool_mib=all_mib)
    rt.run(prompt, 4)  # warm-up
    r = rt.run(prompt, tokens).stats
    per_token = r.tpot_ms - r.stall_ms_per_token
    # one expert for one token, from a resident blob, as the runner computes it
    key = next(iter(st.entries))
    buf = mmap.mmap(-1, st.slot_bytes)
    buf[: st.blob_size] = st.read(*key)
    x = torch.randn(1, rt.model.hidden_size)
    for _ in range(20):
        rt.experts.expert(x, buf)
    t0 = time.perf_counter()
    n = 400
    for _ in range(n):
        rt.experts.expert(x, buf)
    expert_ms = (time.perf_counter() - t0) / n * 1e3
    # planning a window costs the compute thread too: oracle prediction, every expert resident
    rt.configure(policy=Policy("oracle", "lru"))
    rec = rt.record(prompt, tokens)
    rt.run(prompt, 4)
    planned = rt.run(prompt, tokens, recorded=rec).stats
    plan_ms = max(0.0, (planned.tpot_ms - planned.stall_ms_per_token - per_token) / L)
    # a miss as the runner sees it (reader hand-off included): on-demand with a tiny pool
    rt.configure(policy=Policy("on-demand", "lru"), pool_mib=tiny_pool_mib(k, st.slot_bytes))
    small = rt.run(prompt, tokens)
    # the flash as this runner draws it, and what a background read costs the compute thread: perfect
    # prefetch with half a token's working set
    rt.configure(policy=Policy("oracle", "belady"), pool_mib=flash_pool_mib(L, k, st.slot_bytes))
    orc = rt.run(prompt, tokens, recorded=rec).stats
    prof = runtime_profile(
        "this-machine", f"measured on {os.uname().nodename} ({os.cpu_count()} CPUs) with {st.path.name}",
        flash=(table, lat1, xfer), L=L, k=k, slot_bytes=slot, all_resident=r.to_json(), expert_ms=expert_ms,
        plan_ms=plan_ms, on_demand=small.stats.to_json(), oracle=orc.to_json(),
        measured={"direct_io": small.direct_io, "reads_per_point": reads, "torch_threads": torch.get_num_threads()},
        source="specprefetch calibrate")
    return prof, save_profile(prof, out)
