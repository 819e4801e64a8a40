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

// A run's figures: mirrors toolkit/runtime/stats.py::RunStats field for field (names, meaning,
// rounding). A figure that is undefined (TPOT of one token, percentiles of no interval) is NaN here
// and null in to_json(). The runner's own per-run figures (prefill_ms, reads_done, ...) are not
// here: they are Generation's fields (runner.h), added after these keys by main.cpp.
struct RunStats {
  std::string policy;
  int64_t decode_tokens = 0;
  double ttft_ms = 0;
  double tpot_ms = 0;
  double tpot_p50_ms = 0;
  double tpot_p95_ms = 0;
  double stall_ms_per_token = 0;
  double hit_rate = 0;
  double late_rate = 0;
  double mib_read = 0;            // the whole run, prefill included
  double mib_read_per_token = 0;  // decode tokens only
  double prefetch_precision = 0;
  double prefetch_recall = 0;
  double wasted_prefetch_mib = 0;
  int64_t evictions = 0;  // decode tokens only
  int64_t peak_pool_bytes = 0;
  int64_t budget_bytes = 0;
  SchedulerStats counts;  // decode-token scheduler counts

  // Figures from decode-token counts; `tpots_ms` has one TPOT per sequence (averaged), and
  // `intervals_ms` every per-token interval (for the percentiles).
  static RunStats from_counts(const std::string& policy, const SchedulerStats& decode, int64_t total_bytes_read,
                              double ttft_s, const std::vector<double>& tpots_ms,
                              const std::vector<double>& intervals_ms, int64_t decode_tokens,
                              int64_t wasted_prefetches, int64_t evictions, int64_t slot_bytes,
                              int64_t peak_pool_bytes, int64_t budget_bytes);
  // The fields in declaration order as JSON values (a non-finite figure is null).
  nlohmann::ordered_json to_json() const;
};

// Decode-token figures of one sequence, counted from the first committed token (there the
// prefetched slots prefill left unused are settled: neither used nor wasted).
class DecodeAccount {
 public:
  void start(const WindowScheduler& sched, ExpertPool& pool);
  RunStats finish(const std::string& policy, const WindowScheduler& sched, const ExpertPool& pool,
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
