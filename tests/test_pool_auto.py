"""`--pool-mib auto` (docs/runner.md, "Pool size: auto"): the native runner's pool sized from the
memory available to the process and shrunk when it runs low.

- Sizing from fake /proc and cgroup trees (SPX_PROC_ROOT): MemAvailable, cgroup v1 and v2 limits
  at the process's cgroup and its ancestors (the least room wins), inactive page cache not counted
  as used, the reserve and the program subtracted, the cap at every expert, the one-line refusals.
- The pool's shrink through a small C++ check program built from the pool's sources: victims in
  the eviction policy's order (lru, lfu, prediction), never a pinned or a loading slot, the freed
  slots' pages given back to the OS (mincore), growth back to the start size only, the watcher's
  target applied at the next reserve, the same decisions for the same sequence of changes.
- A real run under a cgroup v1 memory limit (toolkit/peers/memlimit.py's cgroup helpers): the
  runner sizes its pool from the limit; then a sibling process in the same cgroup allocates memory
  mid-run. The auto pool shrinks and the run completes; the same run with a fixed pool of the same
  size is OOM-killed (the runner is made the OOM killer's choice, oom_score_adj 1000).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from android_runner.build import command

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "android_runner" / "src"
MiB = 1 << 20
PROMPT = ["--prompt-ids", "591,906,531,1274,2295,1062"]

# The pool and the watcher without the rest of the runner: scenarios printed as JSON lines.
CHECK = r"""
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "memwatch.h"
#include "pool.h"

using namespace spx;
static const int64_t SLOT = 16384;

static std::string keys(const std::vector<Key>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i)
    s += (i ? "," : "") + std::string("[") + std::to_string(v[i].first) + "," + std::to_string(v[i].second) + "]";
  return s + "]";
}

// pages of the slot resident (mincore)
static int resident_pages(const ExpertPool& p, const Slot& s) {
  const long page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> v(SLOT / page + 1);
  uint8_t* a = const_cast<uint8_t*>(p.data(s));
  if (mincore(a, SLOT, v.data()) != 0) return -1;
  int n = 0;
  for (long i = 0; i < SLOT / page; ++i) n += v[i] & 1;
  return n;
}

// 8 slots filled, uses / last use set per key; key 3 pinned, key 5 loading (not ready)
static void fill(ExpertPool& p, std::vector<Key>& evicted) {
  p.on_evict = [&evicted](Key k) { evicted.push_back(k); };
  const int last[8] = {50, 10, 70, 5, 30, 1, 60, 20};
  const int uses[8] = {1, 5, 2, 1, 4, 1, 3, 2};
  for (int e = 0; e < 8; ++e) {
    Slot* s = p.reserve({0, e}, e, false, {});
    std::memset(p.data(*s), 0x5a, SLOT);  // the read's bytes: the slot's pages are resident
    s->ready = s->landed = e != 5;
    s->last_use = last[e];
    s->uses = uses[e];
  }
  p.get({0, 3})->pins = 1;
}

static void shrink_case(const char* policy) {
  std::map<Key, int64_t> predicted = {{{0, 0}, 200}, {{0, 1}, 150}, {{0, 2}, 300}, {{0, 4}, 120}, {{0, 7}, 400}};
  ExpertPool p(8 * SLOT, SLOT, policy, 2, 16);
  if (std::string(policy) == "prediction") p.predicted = &predicted;
  std::vector<Key> ev;
  fill(p, ev);
  std::map<Key, const uint8_t*> addr;
  for (const auto& kv : p.slots()) addr[kv.first] = p.data(kv.second);
  const int64_t n = p.set_capacity(4, 100);
  std::vector<Key> left;
  int left_resident = 0;
  for (const auto& kv : p.slots()) {
    left.push_back(kv.first);
    left_resident += resident_pages(p, kv.second);
  }
  // the evicted slots' pages are gone: mincore on their addresses
  const long page = sysconf(_SC_PAGESIZE);
  int gone = 0;
  for (const Key& k : ev) {
    std::vector<unsigned char> v(SLOT / page + 1);
    mincore(const_cast<uint8_t*>(addr[k]), SLOT, v.data());
    for (long i = 0; i < SLOT / page; ++i) gone += (v[i] & 1) ? 0 : 1;
  }
  std::printf("{\"case\":\"shrink\",\"policy\":\"%s\",\"evicted\":%s,\"n\":%lld,\"left\":%s,\"capacity\":%lld,"
              "\"released\":%lld,\"resident_bytes\":%lld,\"left_resident_pages\":%d,\"evicted_pages_gone\":%d,"
              "\"page\":%ld,\"evictions\":%lld}\n",
              policy, keys(ev).c_str(), (long long)n, keys(left).c_str(), (long long)p.capacity(),
              (long long)p.released_bytes, (long long)p.resident_bytes(), left_resident, gone, page,
              (long long)p.evictions);
  // shrink below what can go (pinned + loading): capacity set, the rest waits for later reserves
  ev.clear();
  p.set_capacity(2, 101);
  const size_t after_min = p.slots().size();
  // growing back: capacity only, up to the start capacity
  p.set_capacity(8, 102);
  int refilled = 0;
  for (int e = 8; e < 16 && (int64_t)p.slots().size() < p.capacity(); ++e) {
    Slot* s = p.reserve({1, e}, 103, false, {});
    if (s) { s->ready = s->landed = true; ++refilled; }
  }
  bool threw = false;
  try { p.set_capacity(9, 104); } catch (const std::logic_error&) { threw = true; }
  std::printf("{\"case\":\"floor\",\"policy\":\"%s\",\"evicted\":%s,\"slots_at_2\":%zu,\"refilled\":%d,"
              "\"slots\":%zu,\"capacity\":%lld,\"start\":%lld,\"grow_past_start_refused\":%s}\n",
              policy, keys(ev).c_str(), after_min, refilled, p.slots().size(), (long long)p.capacity(),
              (long long)p.start_capacity(), threw ? "true" : "false");
}

// The watcher's rule and its target applied by the pool at the next reserve.
static void watch_case(const char* root) {
  MemWatchConfig c;
  c.root = root;
  c.slot_bytes = SLOT;
  c.start_slots = 8;
  c.min_slots = 2;
  c.reserve_bytes = 10 * SLOT;
  c.low_bytes = 5 * SLOT;
  c.high_bytes = 15 * SLOT;
  MemWatch w(c, find_memory_cgroup(root), MemWatch::Clock::now());
  // decide(available, resident, current)
  std::printf("{\"case\":\"decide\",\"values\":[%lld,%lld,%lld,%lld,%lld,%lld,%lld]}\n",
              (long long)w.decide(12 * SLOT, 8 * SLOT, -1),   // between watermarks: keep 8
              (long long)w.decide(4 * SLOT, 8 * SLOT, -1),    // under low: 8 + 4 - 10 = 2
              (long long)w.decide(4 * SLOT, 8 * SLOT, 6),     // under low from 6: 2
              (long long)w.decide(0, 4 * SLOT, 6),            // nothing left: the floor, 2
              (long long)w.decide(20 * SLOT, 2 * SLOT, 2),    // over high: 2 + 20 - 10 = 12 -> start 8
              (long long)w.decide(16 * SLOT, 2 * SLOT, 2),    // over high: 8
              (long long)w.decide(16 * SLOT, 2 * SLOT, -1));  // over high, no target: start 8
  MemWatch::set_active(&w);
  ExpertPool p(8 * SLOT, SLOT, "lru", 2, 16);
  std::vector<Key> ev;
  fill(p, ev);
  p.get({0, 3})->pins = 0;
  p.get({0, 5})->ready = true;
  w.tick();  // the fake meminfo: MemAvailable from the file
  const int64_t target = w.target();
  p.get({0, 0});  // a lookup applies nothing
  const int64_t cap_before = p.capacity();
  Slot* s = p.reserve({2, 0}, 200, false, {});  // applies the target, then makes room
  (void)s;
  std::string changes = "[";
  for (const auto& ch : w.changes())
    changes += (changes.size() > 1 ? "," : "") + std::string("[") + std::to_string(ch.step) + "," +
               std::to_string(ch.from) + "," + std::to_string(ch.to) + "," + std::to_string(ch.evicted) + "," +
               std::to_string(ch.released_bytes) + "]";
  changes += "]";
  std::printf("{\"case\":\"watch\",\"target\":%lld,\"cap_before\":%lld,\"capacity\":%lld,\"evicted\":%s,\"slots\":%zu,"
              "\"changes\":%s,\"samples\":%lld}\n",
              (long long)target, (long long)cap_before, (long long)p.capacity(), keys(ev).c_str(), p.slots().size(),
              changes.c_str(), (long long)w.samples());
  MemWatch::set_active(nullptr);
}

// Every slot pinned when the capacity drops (a prefill group sized by the old capacity): demand
// reads still get a slot, over the target; prefetches do not; unpinned, the extra slots go.
static void pinned_case() {
  MemWatchConfig c;
  c.slot_bytes = SLOT;
  c.start_slots = 4;
  c.min_slots = 2;
  MemWatch w(c, CgroupPaths{}, MemWatch::Clock::now());
  MemWatch::set_active(&w);
  ExpertPool p(4 * SLOT, SLOT, "lru", 2, 16);
  for (int e = 0; e < 3; ++e) {
    Slot* s = p.reserve({0, e}, 1, false, {});
    s->ready = s->landed = true;
    s->pins = 1;
  }
  const int64_t evicted = p.set_capacity(2, 2);
  Slot* d = p.reserve({0, 3}, 2, false, {});
  if (d) { d->ready = d->landed = true; d->pins = 1; }
  Slot* f = p.reserve({0, 4}, 2, true, {});
  const size_t held = p.slots().size();
  for (int e = 0; e < 4; ++e) p.get({0, e})->pins = 0;
  p.touch(*p.get({0, 3}), 3);
  std::printf("{\"case\":\"pinned\",\"evicted\":%lld,\"demand\":%s,\"prefetch\":%s,\"held\":%zu,\"over\":%lld,"
              "\"after_touch\":%zu,\"capacity\":%lld}\n",
              (long long)evicted, d ? "true" : "false", f ? "true" : "false", held, (long long)p.over_target,
              p.slots().size(), (long long)p.capacity());
  MemWatch::set_active(nullptr);
}

// Sizing from a (fake) root: the sample and the size chosen, or the refusal.
static void size_case(const char* root, double reserve, int64_t program) {
  const CgroupPaths cg = find_memory_cgroup(root);
  const MemSample s = sample_memory(root, cg);
  std::string dirs = "[";
  for (size_t i = 0; i < cg.dirs.size(); ++i) dirs += (i ? ",\"" : "\"") + cg.dirs[i] + "\"";
  dirs += "]";
  std::string err;
  PoolSizing z;
  try {
    z = size_pool(s, reserve, -1, -1, 100, program, SLOT, 4, 64);
  } catch (const Error& e) {
    err = e.what();
  }
  std::printf("{\"case\":\"size\",\"version\":%d,\"dirs\":%s,\"meminfo\":%lld,\"limited\":%s,\"limit\":%lld,\"usage\":%lld,"
              "\"inactive\":%lld,\"room\":%lld,\"available\":%lld,\"source\":\"%s\",\"reserve\":%lld,\"low\":%lld,"
              "\"high\":%lld,\"slots\":%lld,\"capped\":%s,\"error\":\"%s\"}\n",
              cg.version, dirs.c_str(), (long long)s.meminfo_available, s.cgroup_limited ? "true" : "false",
              (long long)s.cgroup_limit, (long long)s.cgroup_usage, (long long)s.cgroup_inactive_file,
              (long long)s.cgroup_room, (long long)s.available, s.source.c_str(), (long long)z.reserve_bytes,
              (long long)z.low_bytes, (long long)z.high_bytes, (long long)z.slots, z.capped ? "true" : "false",
              err.c_str());
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "shrink") {
    for (const char* p : {"lru", "lfu", "prediction"}) shrink_case(p);
  } else if (mode == "pinned") {
    pinned_case();
  } else if (mode == "watch") {
    watch_case(argv[2]);
  } else if (mode == "size") {
    size_case(argv[2], std::atof(argv[3]), std::atoll(argv[4]));
  } else {
    return 2;
  }
  return 0;
}
"""

SLOT = 16384


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Path:
    if not shutil.which("g++"):
        pytest.skip("g++ not on PATH")
    d = tmp_path_factory.mktemp("check_pool")
    (d / "check_pool.cpp").write_text(CHECK)
    srcs = [SRC / f for f in ("pool.cpp", "memwatch.cpp", "events.cpp", "fileio.cpp")]
    r = subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{SRC}",
                        str(d / "check_pool.cpp"), *map(str, srcs), "-o", str(d / "check_pool"), "-pthread"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d / "check_pool"


def _check(binary: Path, *args) -> list[dict]:
    r = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _meminfo(avail_kib: int, total_kib: int = 8 << 20) -> str:
    return f"MemTotal:       {total_kib} kB\nMemFree:         1000 kB\nMemAvailable:   {avail_kib} kB\nCached: 5 kB\n"


def fake_v1(root: Path, avail_kib: int, leaf: tuple[int | None, int, int], parent: tuple[int | None, int, int],
            active: int = 0, mapped: int = 0) -> Path:
    """A cgroup v1 tree: the process in /apps/runner, (limit, usage, total_inactive_file) at each
    level, and total_active_file / total_mapped_file."""
    _write(root, "proc/meminfo", _meminfo(avail_kib))
    _write(root, "proc/self/cgroup", "12:pids:/\n4:memory:/apps/runner\n3:cpu,cpuacct:/\n1:name=systemd:/\n0::/\n")
    _write(root, "proc/self/mountinfo",
           "24 29 0:22 / /sys rw,nosuid - sysfs sysfs rw\n"
           "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
           "36 31 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n")
    base = "sys/fs/cgroup/memory"
    _write(root, f"{base}/memory.limit_in_bytes", "9223372036854771712\n")
    _write(root, f"{base}/memory.usage_in_bytes", str(6 << 30) + "\n")
    _write(root, f"{base}/memory.stat", "cache 0\n")
    for rel, (limit, usage, inactive) in (("apps", parent), ("apps/runner", leaf)):
        _write(root, f"{base}/{rel}/memory.limit_in_bytes", f"{limit if limit is not None else 9223372036854771712}\n")
        _write(root, f"{base}/{rel}/memory.usage_in_bytes", f"{usage}\n")
        _write(root, f"{base}/{rel}/memory.stat",
               f"cache 1\ninactive_file 1\nactive_file 7\nmapped_file 3\nhierarchical_memory_limit 1\n"
               f"total_inactive_file {inactive}\ntotal_active_file {active}\ntotal_mapped_file {mapped}\n")
    return root


def fake_v2(root: Path, avail_kib: int, leaf: tuple[int | None, int, int], parent: tuple[int | None, int, int]) -> Path:
    """A cgroup v2 tree: the process in /user.slice/app.scope, (memory.max, memory.current, inactive_file)."""
    _write(root, "proc/meminfo", _meminfo(avail_kib))
    _write(root, "proc/self/cgroup", "0::/user.slice/app.scope\n")
    _write(root, "proc/self/mountinfo", "30 24 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    _write(root, "sys/fs/cgroup/cgroup.controllers", "memory\n")
    for rel, (limit, cur, inactive) in (("user.slice", parent), ("user.slice/app.scope", leaf)):
        _write(root, f"sys/fs/cgroup/{rel}/memory.max", f"{limit if limit is not None else 'max'}\n")
        _write(root, f"sys/fs/cgroup/{rel}/memory.current", f"{cur}\n")
        _write(root, f"sys/fs/cgroup/{rel}/memory.stat",
               f"anon 1\nfile 2\nfile_mapped 5\ninactive_file {inactive}\nactive_file 3\n")
    return root


def test_sizing_from_meminfo_and_cgroups(check, tmp_path):
    # meminfo only (no cgroup files): MemAvailable - reserve - program, in whole slots
    only = tmp_path / "meminfo"
    _write(only, "proc/meminfo", _meminfo(800))  # 800 KiB = 50 slots
    s = _check(check, "size", only, 0.0625, 2 * SLOT)[0]  # reserve 64 KiB = 4 slots, program 2 slots
    assert (s["version"], s["source"], s["available"], s["limited"]) == (0, "meminfo", 800 * 1024, False)
    assert s["slots"] == 50 - 4 - 2 and not s["capped"] and s["error"] == ""
    # default reserve: a quarter of the available memory below 2 GiB (low / high at 1/2 and 3/2 of it)
    s = _check(check, "size", only, -1, 0)[0]
    assert s["reserve"] == 800 * 1024 // 4 and s["low"] == s["reserve"] // 2 and s["high"] == s["reserve"] * 3 // 2
    assert s["slots"] == (800 * 1024 - 800 * 1024 // 4) // SLOT
    big = tmp_path / "big"
    _write(big, "proc/meminfo", _meminfo(16 << 20))  # 16 GiB: the reserve is 512 MiB, the pool capped at all experts
    s = _check(check, "size", big, -1, 0)[0]
    assert s["reserve"] == 512 * MiB and s["slots"] == 64 and s["capped"]

    # cgroup v1: the leaf has no limit, the parent's limit leaves the least room; inactive file
    # pages are not counted as used
    v1 = fake_v1(tmp_path / "v1", 4 << 20, leaf=(None, 300 * SLOT, 0), parent=(400 * SLOT, 360 * SLOT, 20 * SLOT))
    s = _check(check, "size", v1, 0, 0)[0]
    assert s["version"] == 1 and s["dirs"] == [str(v1 / "sys/fs/cgroup/memory/apps/runner"),
                                              str(v1 / "sys/fs/cgroup/memory/apps"), str(v1 / "sys/fs/cgroup/memory")]
    assert s["limited"] and s["limit"] == 400 * SLOT and s["usage"] == 360 * SLOT and s["inactive"] == 20 * SLOT
    assert s["room"] == s["available"] == (400 - 340) * SLOT and s["source"] == "cgroup v1"
    assert s["slots"] == 60
    # active page cache no process maps is reclaimable too; mapped file pages are not
    v1m = fake_v1(tmp_path / "v1m", 4 << 20, leaf=(None, 300 * SLOT, 0), parent=(400 * SLOT, 360 * SLOT, 20 * SLOT),
                  active=30 * SLOT, mapped=40 * SLOT)
    s = _check(check, "size", v1m, 0, 0)[0]
    assert s["inactive"] == 10 * SLOT and s["available"] == (400 - 350) * SLOT  # 20 + 30 - 40 reclaimable
    # a tighter leaf limit wins over the parent's
    v1b = fake_v1(tmp_path / "v1b", 4 << 20, leaf=(320 * SLOT, 300 * SLOT, 0),
                  parent=(400 * SLOT, 360 * SLOT, 20 * SLOT))
    s = _check(check, "size", v1b, 0, 0)[0]
    assert s["limit"] == 320 * SLOT and s["available"] == 20 * SLOT and s["slots"] == 20
    # MemAvailable below the cgroup's room: meminfo decides
    v1c = fake_v1(tmp_path / "v1c", 160, leaf=(None, 0, 0), parent=(400 * SLOT, 0, 0))
    s = _check(check, "size", v1c, 0, 0)[0]
    assert s["source"] == "meminfo" and s["available"] == 160 * 1024 and s["slots"] == 10 and s["room"] == 400 * SLOT

    # cgroup v2: memory.max "max" at the leaf, a number at the parent
    v2 = fake_v2(tmp_path / "v2", 4 << 20, leaf=(None, 100 * SLOT, 0), parent=(120 * SLOT, 90 * SLOT, 30 * SLOT))
    s = _check(check, "size", v2, 0, SLOT)[0]  # the program: one slot
    assert s["version"] == 2 and s["source"] == "cgroup v2" and s["limit"] == 120 * SLOT
    assert s["inactive"] == 30 * SLOT + 3 - 5  # inactive + active - mapped
    assert s["available"] == 120 * SLOT - (90 * SLOT - s["inactive"]) and not s["capped"]
    assert s["slots"] == (s["available"] - SLOT) // SLOT == 58  # the program: one slot
    # usage over the limit (reclaim pending): no room, never negative; then the one-line refusal
    v2b = fake_v2(tmp_path / "v2b", 4 << 20, leaf=(50 * SLOT, 60 * SLOT, 0), parent=(None, 0, 0))
    s = _check(check, "size", v2b, 0, 0)[0]
    assert s["room"] == 0 and s["available"] == 0 and s["slots"] == 0
    assert s["error"].startswith("--pool-mib auto: 0.0 MiB available (cgroup v2) minus the 0.0 MiB reserve")
    assert "one layer needs 4 at once" in s["error"] and "\n" not in s["error"]
    # nothing to measure
    empty = tmp_path / "empty"
    empty.mkdir()
    s = _check(check, "size", empty, 0, 0)[0]
    assert s["available"] == -1 and "cannot measure the available memory" in s["error"]


@pytest.mark.parametrize("policy", ["lru", "lfu", "prediction"])
def test_shrink_order_and_page_release(check, policy):
    got = {(c["case"], c["policy"]): c for c in _check(check, "shrink")}
    s, f = got["shrink", policy], got["floor", policy]
    # slots 0..7: last use 50 10 70 5 30 1 60 20, uses 1 5 2 1 4 1 3 2; 3 pinned, 5 loading
    # lru: by last use; lfu: by (uses, last use); prediction: the unpredicted first (6; 3 and 5 are
    # pinned / loading), then the farthest predicted use: 7 (400), 2 (300), 0 (200)
    order = {"lru": [1, 7, 4, 0], "lfu": [0, 7, 2, 6], "prediction": [6, 7, 2, 0]}[policy]
    assert [k for _, k in s["evicted"]] == order
    assert s["n"] == 4 and s["capacity"] == 4 and s["evictions"] == 4
    assert sorted(k for _, k in s["left"]) == sorted(set(range(8)) - set(order))
    assert {3, 5} <= {k for _, k in s["left"]}  # never the pinned or the loading slot
    # the freed slots' pages are given back (mincore: none resident), the kept ones stay
    assert s["released"] == 4 * SLOT and s["resident_bytes"] == 4 * SLOT
    assert s["evicted_pages_gone"] == 4 * SLOT // s["page"]
    assert s["left_resident_pages"] == 4 * SLOT // s["page"]
    # below what can go: the pinned and the loading slot stay, the capacity is the floor (2)
    assert f["slots_at_2"] == 2
    # grown back to 8: refilled up to the start capacity, never past it
    assert f["capacity"] == f["start"] == 8 and f["slots"] == 8 and f["refilled"] == 6
    assert f["grow_past_start_refused"]
    # the same sequence of capacity changes, the same decisions
    assert _check(check, "shrink") == list(got.values())


def test_watcher_target_applied_at_the_next_reserve(check, tmp_path):
    root = tmp_path / "root"
    _write(root, "proc/meminfo", _meminfo(4 * SLOT // 1024))  # 4 slots available: under the low watermark (5)
    w = _check(check, "watch", root)
    decide, watch = w[0]["values"], w[1]
    assert decide == [8, 2, 2, 2, 8, 8, 8]
    # resident 8 slots + 4 available - reserve 10 = 2 slots
    assert watch["samples"] == 1 and watch["target"] == 2 and watch["cap_before"] == 8
    # applied at the reserve (step 200): LRU evicts 5, 3, 7, 1, 4, 0 down to 2, then one more for the new key
    assert watch["capacity"] == 2 and watch["slots"] == 2
    assert [k for _, k in watch["evicted"]] == [5, 3, 1, 7, 4, 0, 6]
    assert watch["changes"] == [[200, 8, 2, 6, 6 * SLOT]]


def test_a_shrink_never_fails_a_demand_read(check):
    c = _check(check, "pinned")[0]
    assert (c["evicted"], c["demand"], c["prefetch"], c["held"], c["over"]) == (0, True, False, 4, 1)
    assert (c["after_touch"], c["capacity"]) == (2, 2)  # unpinned: back down to the target at the next touch


# ---------------------------------------------------------------------------------------------
# the runner: fake roots end to end, then a real cgroup v1 limit


@pytest.fixture(scope="module")
def native(native_host) -> tuple[Path, Path]:
    return native_host


def _runner(native, *args, env=None, timeout=300):
    bundle, out = native
    return subprocess.run([*command(out, "host"), str(bundle), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_runner_auto_from_a_fake_root(native, tmp_path):
    bundle, _ = native
    v1 = fake_v1(tmp_path / "v1", 8 << 20, leaf=(None, 0, 0), parent=(2048 * MiB, 1000 * MiB, 0))
    env = {**os.environ, "SPX_PROC_ROOT": str(v1)}
    js = tmp_path / "run.json"
    r = _runner(native, *PROMPT, "--max-new-tokens", 3, "--policy", "on-demand+lru", "--pool-mib", "auto",
                "--pool-reserve-mib", 1030, "--pool-high-watermark-mib", 0, "--json", js, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(js.read_text())
    pa = out["pool_auto"]
    assert pa["source"] == "cgroup v1" and pa["available_bytes"] == 1048 * MiB == pa["cgroup"]["room_bytes"]
    assert pa["cgroup"]["limit_bytes"] == 2048 * MiB and pa["reserve_rule"] == "--pool-reserve-mib"
    m = json.loads((bundle / "manifest.json").read_text())
    assert pa["program_bytes"] == m["files"][m["graphs"]["file"]]["size"] > 0
    want = (pa["available_bytes"] - pa["reserve_bytes"] - pa["program_bytes"]) // pa["slot_bytes"]
    assert pa["chosen_slots"] == min(want, pa["all_experts_slots"]) and 4 <= pa["chosen_slots"]
    assert out["pool_mib"] == pa["chosen_slots"] * pa["slot_bytes"] / MiB == pytest.approx(pa["chosen_mib"], abs=1e-4)
    assert out["runs"][0]["budget_bytes"] == pa["chosen_slots"] * pa["slot_bytes"]
    assert pa["high_watermark_bytes"] == 0 and pa["low_watermark_bytes"] == 1030 * MiB // 2
    assert pa["changes"] == [] and pa["samples"] >= 1  # the fake file does not change
    # with no capacity change, the decisions of a fixed pool of that size
    from toolkit.runtime.events import decisions

    logs = {}
    for name, pool in (("auto", ["--pool-mib", "auto", "--pool-reserve-mib", "1030"]),
                       ("fixed", ["--pool-mib", repr(out["pool_mib"])])):
        ev = tmp_path / f"{name}.log"
        r = _runner(native, *PROMPT, "--max-new-tokens", 6, "--policy", "on-demand+lfu", *pool, "--events", ev,
                    "--json", tmp_path / f"{name}.json", env=env)
        assert r.returncode == 0, r.stderr
        logs[name] = decisions(ev.read_text().splitlines())
    assert logs["auto"] == logs["fixed"] and any(" evict " in ln for ln in logs["auto"])

    # refusals: one line, exit 1
    r = _runner(native, *PROMPT, "--pool-mib", "auto", "--pool-reserve-mib", 2000, env=env)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        "specprefetch-runner: error: --pool-mib auto: 1048.0 MiB available (cgroup v1) minus the 2000.0 MiB reserve")
    r = _runner(native, *PROMPT, "--pool-mib", "4", "--pool-reserve-mib", 10)
    assert r.returncode == 1 and r.stderr.strip().endswith("--pool-reserve-mib: only with --pool-mib auto")
    r = _runner(native, *PROMPT, "--pool-mib", "auto", "--pool-reserve-mib", 100, "--pool-low-watermark-mib", 200)
    assert r.returncode == 1 and "--pool-low-watermark-mib 200: above the reserve" in r.stderr
    r = _runner(native, *PROMPT, "--pool-mib", "autox")
    assert r.returncode == 1 and "--pool-mib 'autox': not a finite number" in r.stderr


def test_cli_pool_mib_auto_refusals(tmp_path):
    from click.testing import CliRunner

    from toolkit.cli import main

    bundle = "embedded"  # refused before anything is loaded
    for args, msg in ((["--pool-mib", "auto"], "--pool-mib auto: only with --engine native"),
                      (["--pool-mib", "4", "--pool-reserve-mib", "64"],
                       "--pool-reserve-mib: only with --pool-mib auto"),
                      (["--pool-mib", "auto", "--engine", "native", "--pool-low-watermark-mib", "-1"],
                       "must be a finite")):
        r = CliRunner().invoke(main, ["run", str(bundle), "--prompt", "hi", "--json", str(tmp_path / "x.json"), *args])
        assert r.exit_code != 0 and msg in r.output, r.output
        assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # ~10 s: the CLI, transformers' tokenizer and a run
def test_cli_run_native_pool_auto(native, tmp_path):
    bundle, _ = native
    js = tmp_path / "run.json"
    r = subprocess.run(["specprefetch", "run", str(bundle), "--engine", "native", "--policy", "on-demand+lru",
                        "--pool-mib", "auto", "--pool-reserve-mib", "64", "--pool-low-watermark-mib", "16",
                        "--prompt", "The kernel's memory", "--max-new-tokens", "4", "--json", str(js)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr
    out = json.loads(js.read_text())
    pa = out["pool_auto"]
    assert pa["reserve_bytes"] == 64 * MiB and pa["low_watermark_bytes"] == 16 * MiB
    assert out["pool_mib"] == pa["chosen_slots"] * pa["slot_bytes"] / MiB
    assert out["runs"][0]["budget_bytes"] == pa["chosen_slots"] * pa["slot_bytes"]


SIBLING = r"""
import sys, time
n = int(sys.argv[1])
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()
held = []
for i in range(n):  # 1 MiB every 10 ms, each page written
    held.append(bytearray(b"\x01") * (1 << 20))
    time.sleep(0.01)
sys.stdout.write("done\n"); sys.stdout.flush()
sys.stdin.read()
"""


@pytest.mark.slow  # timing-dependent (the OOM killer against the watcher): make test-all
def test_cgroup_limit_sizes_the_pool_and_a_squeeze_shrinks_it(native, tmp_path):
    """Under a real cgroup v1 limit: sized from the limit; a sibling in the cgroup takes memory
    mid-run; the auto pool shrinks and the run ends well, a fixed pool of that size is OOM-killed."""
    from toolkit.peers import memlimit

    why = memlimit.unavailable_reason()
    if why:
        pytest.skip(f"no writable cgroup v1 memory controller: {why}")
    bundle, out = native
    runner = command(out, "host")
    reserve_mib, sib_mib, pool_mib = 8, 31, 16

    def start(cg, argv, *, victim=False, **kw):
        procs = os.fsencode(cg / "cgroup.procs")

        def join():  # between fork and exec: os calls only
            fd = os.open(procs, os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            if victim:  # the OOM killer's choice if the cgroup runs out (raising it needs no privilege)
                fd = os.open(b"/proc/self/oom_score_adj", os.O_WRONLY)
                os.write(fd, b"1000")
                os.close(fd)

        return subprocess.Popen(argv, preexec_fn=join, **kw)  # noqa: PLW1509 (os calls only)

    prompts = [a for i in range(8) for a in ("--prompt-ids", f"{591 + i},906,531,1274,2295,1062")]

    def squeeze(pool_args: list[str], js: Path) -> tuple[int, str, int | None, int]:
        """One run under the limit, the sibling allocating after the first prompt: (rc, stderr, OOM kills, limit)."""
        cg = memlimit._make_cgroup(None)
        sib = None
        try:
            sib = start(cg, [sys.executable, "-c", SIBLING, str(sib_mib)], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
            assert sib.stdout.readline() == "ready\n"
            (cg / "memory.limit_in_bytes").write_text(str(512 * MiB))
            # calibration: what the runner and the idle sibling hold before the pool, under this cgroup
            cal = tmp_path / "cal.json"
            r = start(cg, [*runner, str(bundle), *PROMPT, "--max-new-tokens", "2", "--policy", "on-demand+lru",
                           "--pool-mib", "auto", "--pool-reserve-mib", "0", "--json", str(cal)],
                      stderr=subprocess.DEVNULL)
            assert r.wait(timeout=120) == 0
            pa = json.loads(cal.read_text())["pool_auto"]
            c = pa["cgroup"]
            assert pa["source"] == "cgroup v1" and c["limit_bytes"] == 512 * MiB
            limit = (c["usage_bytes"] - c["reclaimable_file_bytes"] + (reserve_mib + pool_mib) * MiB
                     + pa["program_bytes"])
            (cg / "memory.limit_in_bytes").write_text(str(limit))
            limit = int((cg / "memory.limit_in_bytes").read_text())  # in whole pages
            p = start(cg, [*runner, str(bundle), *prompts, "--max-new-tokens", "58", "--policy", "on-demand+lru",
                           *pool_args, "--json", str(js)], victim=True, stderr=subprocess.PIPE, text=True)
            err = []
            while True:  # the first prompt's summary line: its pool has filled
                line = p.stderr.readline()
                err.append(line)
                if not line or "TTFT" in line:
                    break
            assert p.poll() is None, "the run ended before the squeeze: " + "".join(err)
            sib.stdin.write("go\n")
            sib.stdin.flush()
            assert sib.stdout.readline() == "done\n"
            alive = p.poll() is None or p.returncode != 0  # still running when the sibling got its memory
            err.append(p.stderr.read())
            rc = p.wait(timeout=300)
            assert alive, "the run ended before the sibling had its memory: make the run longer"
            return rc, "".join(err), memlimit._oom_kills(cg), limit
        finally:
            if sib is not None:
                sib.kill()
                sib.wait()
            memlimit._remove_cgroup(cg)

    js = tmp_path / "auto.json"
    rc, err, oom, limit = squeeze(["--pool-mib", "auto", "--pool-reserve-mib", str(reserve_mib),
                                   "--pool-check-ms", "5"], js)
    assert rc == 0 and oom == 0, err
    out = json.loads(js.read_text())
    pa = out["pool_auto"]
    # sized from the limit
    assert pa["source"] == "cgroup v1" and pa["cgroup"]["limit_bytes"] == limit
    assert pa["available_bytes"] == pa["cgroup"]["room_bytes"] <= limit
    want = (pa["available_bytes"] - reserve_mib * MiB - pa["program_bytes"]) // pa["slot_bytes"]
    assert pa["chosen_slots"] == want < pa["all_experts_slots"] and not pa["capped_at_all_experts"]
    # shrunk when the sibling took its memory: pages given back, the capacity lowered, below low water
    shrinks = [c for c in pa["changes"] if c["kind"] == "shrink"]
    assert shrinks and sum(c["released_bytes"] for c in shrinks) >= 4 * MiB, pa["changes"]
    assert all(c["available_bytes"] < pa["low_watermark_bytes"] and c["to_slots"] < c["from_slots"] for c in shrinks)
    assert pa["final_slots"] < pa["chosen_slots"] and pa["min_available_bytes"] < pa["low_watermark_bytes"]
    assert len(out["runs"]) == 8 and all(len(r["tokens"]) == 58 for r in out["runs"])

    # the same run with a fixed pool of the size auto chose: the OOM killer ends it
    fixed = pa["chosen_slots"] * pa["slot_bytes"] / MiB
    rc, err, oom, _ = squeeze(["--pool-mib", repr(fixed)], tmp_path / "fixed.json")
    assert rc == -9 and oom and oom >= 1, f"a fixed pool survived the squeeze (rc {rc}, OOM kills {oom}): {err[-300:]}"
