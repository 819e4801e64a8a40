"""`specprefetch calibrate`: measure this machine into the `this-machine` device profile.

Flash: real O_DIRECT reads of random expert blobs from the model's expert store, at queue depths
1, 2, 4 and 8 (threads), for the store's slot size and for 1 MiB reads; the page cache is bypassed,
so these are device reads. Compute: the streaming runtime itself, with a pool that holds every
expert (so nothing is read after warm-up), timed per token; one expert's compute is timed alone,
and the rest of a token's time is spread over its layers as the dense part. The per-read latency
is the larger of the raw device latency and a miss as the runtime experiences it (an on-demand run
with a tiny pool: thread hand-off and Python included), so the simulator charges what a miss
really costs this runtime. What a background read costs the compute thread (`read_cpu_us`) comes
from a perfect-prefetch run (oracle + Belady, same tiny pool): its TPOT minus its stall minus the
all-resident TPOT, per read. The profile is saved
as JSON (default ~/.cache/specprefetch/profiles/this-machine.json) for `simulate --profile
this-machine`.
"""
from __future__ import annotations

import mmap
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import torch

from toolkit.runtime.expert_store import ExpertStore
from toolkit.runtime.io import open_direct
from toolkit.runtime.profiles import DeviceProfile, save_profile

MiB = 2**20


def measure_reads(path: Path, offsets: list[int], size: int, qd: int, n: int, seed: int = 0) -> tuple[float, float]:
    """(MiB/s, mean latency s) of n random O_DIRECT reads of `size` bytes at queue depth qd."""
    fd, direct = open_direct(path)
    if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    rng = random.Random(seed)
    picks = [rng.choice(offsets) for _ in range(n)]
    lat: list[float] = []
    lock = threading.Lock()
    it = iter(picks)

    def work():
        buf = mmap.mmap(-1, size)
        while True:
            with lock:
                off = next(it, None)
            if off is None:
                return
            t0 = time.perf_counter()
            os.preadv(fd, [buf], off)
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(qd)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = time.perf_counter() - t0
    os.close(fd)
    return n * size / total / MiB, float(np.mean(lat))


def big_reads(data_offset: int, file_end: int, big: int = 1 << 20) -> tuple[int, list[int]]:
    return big, [o for o in range(data_offset, file_end - big, big)] or [data_offset]


def runtime_miss_ms(result: dict) -> float:
    return result["stall_ms_per_token"] * len(result["tokens"]) / max(1, result["counts"]["misses"])


def calibrate(model: str | Path = "embedded", *, store: Path | None = None, reads: int = 200,
              tokens: int = 32, out: Path | None = None, progress: bool = True) -> tuple[DeviceProfile, Path]:
    from toolkit.runtime.streaming import RunConfig, open_runtime

    cfg = RunConfig(predictor="on-demand", eviction="lru", pool_mib=1e6)
    rt, ref = open_runtime(model, cfg, store=store, progress=progress)
    st: ExpertStore = rt.store
    offsets = [e.offset for e in st.entries.values()]
    slot = st.slot_bytes
    big, big_offsets = big_reads(st.data_offset, st.path.stat().st_size)
    table: dict[int, dict[int, float]] = {}
    lat1 = None
    for qd in (1, 2, 4, 8):
        bw_slot, lat = measure_reads(st.path, offsets, slot, qd, reads)
        bw_big, _ = measure_reads(st.path, big_offsets, big, qd, max(16, reads // 8))
        table[qd] = {slot // 1024: round(bw_slot, 1), big // 1024: round(bw_big, 1)}
        if qd == 1:
            lat1 = lat
    # latency: what a qd-1 read takes beyond its transfer at the qd-8 (throughput) rate
    xfer = slot / (table[8][slot // 1024] * MiB)
    latency_us = max(1.0, (lat1 - xfer) * 1e6)
    # compute: all experts resident after the first token
    prompt = ref.tokenizer("The kernel's memory allocator", add_special_tokens=False)["input_ids"]
    rt.generate(prompt, 4)  # warm-up
    r = rt.generate(prompt, tokens)
    per_token = r["tpot_ms"] - r["stall_ms_per_token"]
    # one expert for one token, from a resident blob, as the runtime computes it
    key = next(iter(st.entries))
    buf = mmap.mmap(-1, st.slot_bytes)
    buf[: st.blob_size] = st.read(*key)
    from toolkit.runtime.pool import Slot

    s = Slot(key, ready=True, buffer=buf)
    rt.pool = type("P", (), {"get": lambda self, k: s})()
    h = torch.randn(1, ref.geometry.hidden_size)
    idx = torch.tensor([[key[1]] + [0] * (rt.k - 1)])
    wts = torch.ones(1, rt.k)
    from toolkit.runtime.streaming import StreamingExperts

    exp_mod = next(m for m in rt.lm.model.modules() if isinstance(m, StreamingExperts))
    acc = torch.zeros_like(h)
    for _ in range(20):
        rt._compute(exp_mod, key, h, idx, wts, acc)
    t0 = time.perf_counter()
    n = 400
    for _ in range(n):
        rt._compute(exp_mod, key, h, idx, wts, acc)
    expert_ms = (time.perf_counter() - t0) / n * 1e3
    L, k = rt.L, rt.k
    dense_ms = max(0.0, (per_token - L * k * expert_ms) / L)
    # planning a window costs the compute thread too: oracle prediction, every expert resident
    from toolkit.runtime.streaming import reference_generate

    ref_toks, routing = reference_generate(ref, prompt, tokens)
    rt.set_reference(ref_toks, routing)
    rt.cfg.predictor, rt.cfg.eviction = "oracle", "lru"
    rt.predictor = rt._predictor()
    rt.generate(prompt, 4)
    planned = rt.generate(prompt, tokens)
    plan_ms = max(0.0, (planned["tpot_ms"] - planned["stall_ms_per_token"] - per_token) / rt.L)
    rt.cfg.predictor, rt.predictor = "on-demand", None
    # a miss as the runtime sees it (thread hand-off included): on-demand with a tiny pool
    rt.budget = k * 2 * st.slot_bytes
    rt.pool = None
    small = rt.generate(prompt, tokens)
    miss_ms = runtime_miss_ms(small)
    latency_us = max(latency_us, miss_ms * 1e3 - xfer * 1e6)
    # what a background read costs the compute thread (interrupts, hand-offs): perfect prefetch
    # (oracle + Belady) with the same tiny pool, against the all-resident time with planning
    rt.cfg.predictor, rt.cfg.eviction = "oracle", "belady"
    rt.predictor = rt._predictor()
    orc = rt.generate(prompt, tokens)
    reads_per_token = orc["mib_read_per_token"] * MiB / st.slot_bytes
    read_cpu_us = max(0.0, (orc["tpot_ms"] - orc["stall_ms_per_token"] - per_token - plan_ms * rt.L) * 1e3
                      / max(1e-9, reads_per_token))
    prof = DeviceProfile(
        name="this-machine", description=f"measured on {os.uname().nodename} ({os.cpu_count()} CPUs) "
                                         f"with {st.path.name}",
        flash_latency_us=round(latency_us, 1), flash_bw=table, dram_effective_gbs=0.0,
        dense_ms_per_layer=round(dense_ms, 4), expert_ms=round(expert_ms, 4), read_cpu_us=round(read_cpu_us, 1),
        plan_ms_per_layer=round(plan_ms, 4),
        measured={"tpot_all_resident_ms": r["tpot_ms"], "qd1_read_ms": round(lat1 * 1e3, 4),
                  "runtime_miss_ms": round(miss_ms, 4),
                  "oracle_tpot_ms": orc["tpot_ms"], "oracle_reads_per_token": round(reads_per_token, 2),
                  "slot_bytes": slot, "direct_io": r["direct_io"], "reads_per_point": reads,
                  "torch_threads": torch.get_num_threads()},
        sources=["specprefetch calibrate"])
    return prof, save_profile(prof, out)
