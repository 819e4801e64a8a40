"""Flash in virtual time: the simulator's IOBackend.

Transfers are served one at a time in submission order at the profile's bandwidth for the request
size and the queue depth at submission (so a deeper queue moves more bytes per second), and each
read completes a fixed latency after its transfer. A demand read therefore waits behind the
prefetches already in the device queue: the cost that makes unbudgeted prefetch slow decode down.
"""
from __future__ import annotations

from toolkit.runtime.pool import Key
from toolkit.runtime.profiles import DeviceProfile


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0


class SimFlash:
    def __init__(self, profile: DeviceProfile, clock: SimClock, read_bytes: int):
        self.profile, self.clock, self.read_bytes = profile, clock, read_bytes
        self.busy_until = 0.0
        self.done_at: dict[Key, float] = {}
        self.busy_s = 0.0

    def inflight(self) -> int:
        return sum(1 for t in self.done_at.values() if t > self.clock.now)

    def submit(self, key: Key, *, demand: bool) -> None:
        now = self.clock.now
        qd = self.inflight() + 1
        start = max(now, self.busy_until)
        transfer = self.profile.transfer_s(self.read_bytes, qd)
        self.busy_until = start + transfer
        self.busy_s += transfer
        self.done_at[key] = self.busy_until + self.profile.flash_latency_us * 1e-6

    def landed(self, key: Key) -> bool:
        t = self.done_at.get(key)
        return t is None or t <= self.clock.now

    def wait(self, key: Key) -> None:
        t = self.done_at.get(key)
        if t is not None and t > self.clock.now:
            self.clock.now = t

    def take(self, key: Key) -> None:
        self.done_at.pop(key, None)

    def release(self, key: Key) -> None:
        self.done_at.pop(key, None)
