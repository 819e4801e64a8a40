// `--pool-mib auto` (docs/runner.md, "Pool size: auto"): how much memory this process may still
// use, and a watcher thread that turns it into a target capacity for the expert pool.
//
// Available memory is the smaller of
//   - MemAvailable of /proc/meminfo (the kernel's estimate of what can be allocated without
//     swapping: free memory plus reclaimable page cache and slab), and
//   - when the process is in a memory cgroup with a limit (v1 memory.limit_in_bytes, v2
//     memory.max, found through /proc/self/cgroup and /proc/self/mountinfo), the room left under
//     it, at this cgroup and at every ancestor with a limit: limit - (usage - page cache that no
//     process maps), since that page cache is reclaimed before the cgroup's OOM killer runs (as
//     MemAvailable counts it available).
// SPX_PROC_ROOT (an environment variable read by this file only; tests) prefixes every path read:
// $SPX_PROC_ROOT/proc/meminfo, .../proc/self/cgroup, .../proc/self/mountinfo and the cgroup
// directories under the mount points that mountinfo names.
//
// The watcher samples every `check_ms` and publishes a target number of slots (an atomic); the
// pool applies it at its next reserve or touch (pool.h), so no /proc file is read per expert and
// every pool decision stays a function of the sequence of capacity changes (the step each is
// applied at is recorded).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace spx {

struct MemSample {
  int64_t meminfo_available = -1;  // MemAvailable, bytes; -1: no /proc/meminfo or no such line
  int64_t meminfo_total = -1;      // MemTotal
  int cgroup_version = 0;          // 0: none found (or the root cgroup), 1 or 2
  std::string cgroup_dir;          // the process's memory cgroup directory (under SPX_PROC_ROOT)
  bool cgroup_limited = false;     // a limit at this cgroup or an ancestor
  int64_t cgroup_limit = -1;       // the limit that leaves the least room (bytes)
  int64_t cgroup_usage = -1;       // usage there (v1 memory.usage_in_bytes, v2 memory.current)
  int64_t cgroup_inactive_file = 0;  // reclaimable page cache: inactive + active file - mapped file
  int64_t cgroup_room = -1;        // limit - (usage - reclaimable page cache), >= 0
  int64_t available = -1;          // min(meminfo_available, cgroup_room); -1: nothing measured
  std::string source;              // "meminfo", "cgroup v1" or "cgroup v2"
};

// Where this process's memory cgroup is: resolved once (the process does not move), read each sample.
struct CgroupPaths {
  int version = 0;
  std::vector<std::string> dirs;  // the process's cgroup directory, then its ancestors up to the mount
};

std::string proc_root();  // $SPX_PROC_ROOT, or ""
CgroupPaths find_memory_cgroup(const std::string& root);
MemSample sample_memory(const std::string& root, const CgroupPaths& cg);

// The pool size chosen at start, and why (the run JSON's `pool_auto`).
struct PoolSizing {
  MemSample sample;
  int64_t reserve_bytes = 0;
  bool reserve_default = true;   // the default rule, not --pool-reserve-mib
  int64_t program_bytes = 0;     // the program file: its mapped pages may still be faulted in
  int64_t slot_bytes = 0, min_slots = 0, all_slots = 0;
  int64_t slots = 0;             // chosen: (available - reserve - program) / slot, capped at all_slots
  bool capped = false;           // every expert fits
  int64_t low_bytes = 0, high_bytes = 0;
  int check_ms = 100;
};

// The default reserve: 512 MiB, or a quarter of the available memory when that is under 2 GiB.
int64_t default_reserve(int64_t available);
// Sizes the pool from `sample`; fewer than min_slots is an Error naming --pool-mib auto.
// reserve_mib / low_mib / high_mib < 0: the defaults (reserve above, low = reserve / 2,
// high = 1.5 x reserve; high 0: never grow).
PoolSizing size_pool(const MemSample& sample, double reserve_mib, double low_mib, double high_mib, int check_ms,
                     int64_t program_bytes, int64_t slot_bytes, int64_t min_slots, int64_t all_slots);

// One change of the pool's capacity, as applied by the pool.
struct CapacityChange {
  double t_ms = 0;          // since the watcher's clock start (the runner's start)
  int pool = 0;             // the pool's sequence number: one per prompt (two for oracle and belady)
  int64_t step = 0;         // the pool's `now` when applied (-1: before the first step)
  int64_t available = 0;    // the sample that set the target
  int64_t from = 0, to = 0; // capacity in slots
  int64_t evicted = 0;      // slots evicted to get there
  int64_t released_bytes = 0;  // pages given back to the OS (madvise) by this change
};

struct MemWatchConfig {
  std::string root;              // SPX_PROC_ROOT
  int64_t slot_bytes = 0;
  int64_t start_slots = 0;       // the size chosen at start: the pool never grows past it
  int64_t min_slots = 1;         // one layer's top-k
  int64_t reserve_bytes = 0;     // kept free: the pool aims at available == reserve
  int64_t low_bytes = 0;         // shrink when available < low
  int64_t high_bytes = 0;        // grow (back towards start_slots) when available > high; 0: never grow
  int check_ms = 100;
};

class MemWatch {
 public:
  using Clock = std::chrono::steady_clock;
  MemWatch(const MemWatchConfig& cfg, const CgroupPaths& cg, Clock::time_point t0);
  ~MemWatch();  // stops the thread
  MemWatch(const MemWatch&) = delete;
  MemWatch& operator=(const MemWatch&) = delete;

  void start();  // the watcher thread
  void stop();

  // The pool's side: the target in slots (-1: none yet), the available bytes that set it.
  int64_t target() const { return target_.load(std::memory_order_relaxed); }
  int64_t target_available() const { return target_available_.load(std::memory_order_relaxed); }
  void publish_resident(int64_t bytes) { resident_.store(bytes, std::memory_order_relaxed); }
  int next_pool() { return pools_.fetch_add(1); }
  void record(CapacityChange c);  // fills t_ms

  // One sample and the target it gives (the thread's body; public for tests).
  void tick();
  // The target for `available` bytes with the pool holding `resident` bytes of touched slots,
  // from the current target `cur` (slots): the rule in docs/runner.md.
  int64_t decide(int64_t available, int64_t resident, int64_t cur) const;

  const MemWatchConfig& config() const { return cfg_; }
  std::vector<CapacityChange> changes() const;
  int64_t samples() const { return samples_.load(); }
  int64_t min_available() const { return min_available_.load(); }
  double t_ms() const;

  // The process-wide watcher a pool picks up at construction (set by main for --pool-mib auto).
  static MemWatch* active();
  static void set_active(MemWatch* w);

 private:
  void loop();

  MemWatchConfig cfg_;
  CgroupPaths cg_;
  Clock::time_point t0_;
  std::atomic<int64_t> target_{-1}, target_available_{-1}, resident_{0};
  std::atomic<int64_t> samples_{0}, min_available_{-1};
  std::atomic<int> pools_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<CapacityChange> changes_;
  std::thread thread_;
};

}  // namespace spx
