"""Device profiles: how fast flash reads and compute are on a device, for the simulator and for
pacing real reads (`run --flash-profile`).

Flash: a fixed per-request latency plus a transfer at a bandwidth that depends on the request size
and the queue depth (interpolated in log-size from a small table). Compute at batch 1 is memory
bound, so a layer's time is the bytes of weights it touches divided by an effective DRAM bandwidth,
plus a fixed per-layer overhead; `this-machine` replaces those with measured times.

Sources for `snapdragon-8-elite` (see docs/device-profiles.md): published figures (UFS 4.0 ~2.3 GiB/s
with 512 KiB direct reads, ~3.5 GB/s at 512 KiB random, ~0.45 GB/s at 4 KiB random; LPDDR5X-10667
~85 GB/s peak).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from toolkit.artifacts import profile_dir, read_json, write_json_atomic  # noqa: F401  (profile_dir re-exported)
from toolkit.errors import SpecPrefetchError
from toolkit.jsonvalues import is_number

MiB = 2**20


def read_budget_kib(read_mibs: float, step_s: float, slot_bytes: int) -> dict:
    """The scheduler's read budget a device supports (`--read-budget-kib auto`): the KiB its flash
    delivers in one step of compute, `read_mibs` x `step_s`, rounded down, and at least one expert slot
    (a budget below it would prefetch nothing; `raised` says so)."""
    kib = int(read_mibs * MiB * step_s // 1024)
    slot_kib = -(-slot_bytes // 1024)
    return {"kib": max(kib, slot_kib), "raised": kib < slot_kib, "read_mibs": round(read_mibs, 1),
            "step_ms": round(step_s * 1e3, 4)}


def check_budget_kib(kib: int | str | None, slot_bytes: int, option: str) -> None:
    """A step or read budget is at least one expert slot a step, in every engine (the native runner checks
    its own alike); refused in one line naming `option`. None (no budget) and "auto" (measured, at least one
    slot by its rule) pass."""
    if isinstance(kib, int) and kib * 1024 < slot_bytes:
        raise SpecPrefetchError(f"{option} {kib}: below one expert slot ({-(-slot_bytes // 1024)} KiB); a budget is "
                                "at least one slot a step")


def read_lanes(queue_depth: int) -> int:
    """The native runner's read threads for a queue depth (its Reader: min(queue depth + 1, 64)), as far
    as a profile's bandwidth table goes (queue depths up to 8)."""
    return max(1, min(queue_depth + 1, 8))


@dataclasses.dataclass
class DeviceProfile:
    name: str
    description: str
    flash_latency_us: float
    # bandwidth table: {queue depth: {request KiB: MiB/s}}
    flash_bw: dict[int, dict[int, float]]
    dram_effective_gbs: float
    layer_overhead_us: float = 0.0
    token_overhead_ms: float = 0.0
    # compute-thread time each read costs (completion hand-off, interrupts); ~0 with a DMA engine
    read_cpu_us: float = 0.0
    # what a decode token that reads anything costs the runtime beyond its compute, waits and reads' own
    # costs (measured runtimes: reader threads sharing the CPU; calibrate's read_costs); 0 where it reads nothing
    streaming_token_ms: float = 0.0
    # compute-thread time a predictor's planning costs per MoE layer (measured runtimes only)
    plan_ms_per_layer: float = 0.0
    # measured compute (this-machine): when set, these replace the bandwidth model
    dense_ms_per_layer: float | None = None
    expert_ms: float | None = None
    # prefill: effective matmul throughput (GFLOP/s) when many positions go through a layer at once
    # (compute bound, unlike batch-1 decode); None: no TTFT projection
    prefill_gflops: float | None = None
    measured: dict | None = None
    sources: list[str] = dataclasses.field(default_factory=list)

    def bandwidth_mibs(self, size_bytes: int, qd: int) -> float:
        qds = sorted(int(q) for q in self.flash_bw)
        q = max([x for x in qds if x <= qd] or [qds[0]])
        table = self.flash_bw[q]
        sizes = sorted(table)
        kib = size_bytes / 1024
        if kib <= sizes[0]:
            return table[sizes[0]]
        if kib >= sizes[-1]:
            return table[sizes[-1]]
        for a, b in zip(sizes, sizes[1:]):
            if a <= kib <= b:
                t = (math.log(kib) - math.log(a)) / (math.log(b) - math.log(a))
                return table[a] + t * (table[b] - table[a])
        return table[sizes[-1]]

    def transfer_s(self, size_bytes: int, qd: int) -> float:
        return size_bytes / (self.bandwidth_mibs(size_bytes, qd) * MiB)

    def read_s(self, size_bytes: int, qd: int = 1) -> float:
        return self.flash_latency_us * 1e-6 + self.transfer_s(size_bytes, qd)

    def dense_s(self, dense_bytes_per_layer: int) -> float:
        if self.dense_ms_per_layer is not None:
            return self.dense_ms_per_layer * 1e-3
        return dense_bytes_per_layer / (self.dram_effective_gbs * 1e9) + self.layer_overhead_us * 1e-6

    def expert_s(self, expert_bytes: int) -> float:
        if self.expert_ms is not None:
            return self.expert_ms * 1e-3
        return expert_bytes / (self.dram_effective_gbs * 1e9)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def read_budget(self, slot_bytes: int, step_s: float, queue_depth: int) -> dict:
        """`read_budget_kib` from this profile: its flash rate for slot-sized reads at the runner's read
        lanes for `queue_depth`, over one step of `step_s`."""
        lanes = read_lanes(queue_depth)
        return {**read_budget_kib(self.bandwidth_mibs(slot_bytes, lanes), step_s, slot_bytes), "lanes": lanes}


SNAPDRAGON_8_ELITE = DeviceProfile(
    name="snapdragon-8-elite",
    description="Snapdragon 8 Elite (SM8750) phone: UFS 4.0 flash, LPDDR5X-10667 DRAM, CPU/NPU decode",
    flash_latency_us=80.0,
    flash_bw={1: {4: 110.0, 64: 700.0, 128: 1000.0, 512: 1800.0, 1024: 2000.0},
              2: {4: 200.0, 64: 1200.0, 128: 1600.0, 512: 2355.0, 1024: 2600.0},
              4: {4: 330.0, 64: 1900.0, 128: 2300.0, 512: 3340.0, 1024: 3500.0},
              8: {4: 430.0, 64: 2400.0, 128: 2900.0, 512: 3340.0, 1024: 3700.0}},
    dram_effective_gbs=40.0,
    layer_overhead_us=60.0,
    token_overhead_ms=2.0,
    prefill_gflops=150.0,
    sources=["published: UFS 4.0 ~4.2 GB/s rated sequential; ~2.3 GiB/s measured with 512 KiB direct "
             "reads; ~3.5 GB/s at 512 KiB random; ~0.45 GB/s at 4 KiB random",
             "published: LPDDR5X-10667 ~85 GB/s peak; effective 40 GB/s assumed for batch-1 GEMV",
             "per-request latency 80 us and per-layer dispatch 60 us: assumptions, see docs/device-profiles.md",
             "prefill 150 GFLOP/s: CPU prefill of a 3B-active MoE with streamed experts published at 22 tok/s "
             "(~145 GFLOP/s at two FLOPs per active weight)"],
)

# the same phone with prefill on the Hexagon NPU (decode stays on the CPU: each CPU-NPU crossing costs
# 0.3-0.5 ms, too much per decode layer): only the prefill rate differs
SNAPDRAGON_8_ELITE_NPU = dataclasses.replace(
    SNAPDRAGON_8_ELITE, name="snapdragon-8-elite-npu",
    description="Snapdragon 8 Elite (SM8750) phone as snapdragon-8-elite, prefill on the Hexagon NPU",
    prefill_gflops=1100.0,
    sources=SNAPDRAGON_8_ELITE.sources + [
        "prefill 1100 GFLOP/s: Hexagon NPU prefill of a 3B-active MoE with streamed experts published at 172 tok/s "
        "(~1.1 TFLOP/s at two FLOPs per active weight); decode on the CPU"])

BUILTIN = {p.name: p for p in (SNAPDRAGON_8_ELITE, SNAPDRAGON_8_ELITE_NPU)}


def load_profile(name: str, option: str = "--profile") -> DeviceProfile:
    """A built-in profile, a profile saved by `calibrate` (this-machine), or a JSON file path."""
    if name in BUILTIN:
        return BUILTIN[name]
    path = Path(name)
    if not path.suffix:
        path = profile_dir() / f"{name}.json"
    if not path.exists():
        hint = " (run `specprefetch calibrate` first)" if name == "this-machine" else ""
        raise SpecPrefetchError(f"{option} {name!r}: no such profile{hint}; built in: "
                                f"{', '.join(BUILTIN)}; saved: {path}")
    d = read_json(path, "device profile")
    try:
        d["flash_bw"] = {int(q): {int(s): float(v) for s, v in t.items()} for q, t in d["flash_bw"].items()}
        profile = DeviceProfile(**d)
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise SpecPrefetchError(f"{path}: not a valid device profile ({e})") from None
    g = profile.prefill_gflops
    if g is not None and (not is_number(g) or g <= 0):
        raise SpecPrefetchError(f"{path}: not a valid device profile (prefill_gflops {g!r}: a positive number "
                                "of GFLOP/s, or null)")
    return profile


def save_profile(p: DeviceProfile, path: Path | None = None) -> Path:
    path = path or profile_dir() / f"{p.name}.json"
    write_json_atomic(path, p.to_json())
    return path
