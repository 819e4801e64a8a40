// A run's figures, defined as toolkit/runtime/stats.py defines them (RunStats): TTFT to the first
// committed token; TPOT = (t_last - t_first) / (N - 1); every per-token figure counts the N - 1
// decode tokens only (prefill's reads are in TTFT); pool figures from the scheduler's decode counts.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "memwatch.h"
#include "pool.h"
#include "scheduler.h"

namespace spx {

// Decode-token figures of one sequence, counted from the first committed token (there the
// prefetched slots prefill left unused are settled: neither used nor wasted).
class DecodeAccount {
 public:
  void start(const WindowScheduler& sched, ExpertPool& pool);
  nlohmann::ordered_json finish(const std::string& policy, const WindowScheduler& sched, const ExpertPool& pool,
                                const std::vector<double>& token_times_s, double ttft_s) const;

 private:
  bool started_ = false;
  SchedulerStats first_;
  int64_t wasted0_ = 0, evictions0_ = 0;
};

nlohmann::ordered_json counts_json(const SchedulerStats& s);
// `pool_auto` of the run JSON: what was measured at start, the size chosen, each capacity change.
nlohmann::ordered_json pool_auto_json(const PoolSizing& z, const MemWatch& w);
int64_t peak_rss_bytes();  // VmHWM, or -1 where /proc is absent
double percentile(std::vector<double> v, double q);  // numpy's default (linear) interpolation

}  // namespace spx
