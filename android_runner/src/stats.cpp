#include "stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace spx {

using json = nlohmann::ordered_json;
static constexpr double MiB = 1048576.0;

static double round_to(double v, int digits) {  // like Python's round(v, digits); non-finite stays as it is
  if (!std::isfinite(v)) return v;
  char buf[64];  // correctly rounded decimal, as Python's round() (not v * 10^d, which rounds twice)
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return std::strtod(buf, nullptr);
}

static json finite_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

static json num(double v, int digits) { return finite_or_null(round_to(v, digits)); }

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const double idx = q / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(idx)), hi = static_cast<size_t>(std::ceil(idx));
  return v[lo] + (v[hi] - v[lo]) * (idx - static_cast<double>(lo));
}

int64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream ss(line.substr(6));
      int64_t kb = -1;
      ss >> kb;
      return kb * 1024;
    }
  }
  return -1;
}

json counts_json(const SchedulerStats& s) {
  return json{{"requests", s.requests},         {"hits", s.hits},
              {"prefetch_hits", s.prefetch_hits}, {"late", s.late},
              {"misses", s.misses},             {"prefetch_issued", s.prefetch_issued},
              {"dropped_stale", s.dropped_stale}, {"dropped_low_conf", s.dropped_low_conf},
              {"dropped_no_slot", s.dropped_no_slot}, {"dropped_late", s.dropped_late},
              {"bytes_read", s.bytes_read},
              {"wait_s", s.wait_s}};
}

json pool_auto_json(const PoolSizing& z, const MemWatch& w) {
  const MemSample& m = z.sample;
  json cg = nullptr;
  if (m.cgroup_version != 0)
    cg = json{{"version", m.cgroup_version},
              {"dir", m.cgroup_dir},
              {"limited", m.cgroup_limited},
              {"limit_bytes", m.cgroup_limited ? json(m.cgroup_limit) : json(nullptr)},
              {"usage_bytes", m.cgroup_limited ? json(m.cgroup_usage) : json(nullptr)},
              {"reclaimable_file_bytes", m.cgroup_limited ? json(m.cgroup_inactive_file) : json(nullptr)},
              {"room_bytes", m.cgroup_limited ? json(m.cgroup_room) : json(nullptr)}};
  json changes = json::array();
  int64_t final_slots = z.slots;
  for (const auto& c : w.changes()) {
    changes.push_back(json{{"t_ms", num(c.t_ms, 3)},
                           {"pool", c.pool},
                           {"step", c.step},
                           {"kind", c.to < c.from ? "shrink" : "grow"},
                           {"available_bytes", c.available},
                           {"from_slots", c.from},
                           {"to_slots", c.to},
                           {"capacity_mib", num(c.to * z.slot_bytes / MiB, 4)},
                           {"evicted", c.evicted},
                           {"released_bytes", c.released_bytes}});
    final_slots = c.to;
  }
  return json{{"source", m.source},
              {"available_bytes", m.available},
              {"meminfo_available_bytes", m.meminfo_available >= 0 ? json(m.meminfo_available) : json(nullptr)},
              {"meminfo_total_bytes", m.meminfo_total >= 0 ? json(m.meminfo_total) : json(nullptr)},
              {"cgroup", cg},
              {"reserve_bytes", z.reserve_bytes},
              {"reserve_rule", z.reserve_default ? "default: min(512 MiB, available / 4)" : "--pool-reserve-mib"},
              {"program_bytes", z.program_bytes},
              {"slot_bytes", z.slot_bytes},
              {"chosen_slots", z.slots},
              {"chosen_mib", num(z.slots * z.slot_bytes / MiB, 4)},
              {"all_experts_slots", z.all_slots},
              {"capped_at_all_experts", z.capped},
              {"min_slots", z.min_slots},
              {"low_watermark_bytes", z.low_bytes},
              {"high_watermark_bytes", z.high_bytes},
              {"check_ms", z.check_ms},
              {"samples", w.samples()},
              {"min_available_bytes", w.min_available()},
              {"final_slots", final_slots},
              {"changes", changes}};
}

void DecodeAccount::start(const WindowScheduler& sched, ExpertPool& pool) {
  pool.settle();
  first_ = sched.stats;
  wasted0_ = pool.wasted_prefetches;
  evictions0_ = pool.evictions;
  started_ = true;
}

RunStats RunStats::from_counts(const std::string& policy, const SchedulerStats& decode, int64_t total_bytes_read,
                               double ttft_s, const std::vector<double>& tpots_ms,
                               const std::vector<double>& intervals_ms, int64_t decode_tokens,
                               int64_t wasted_prefetches, int64_t evictions, int64_t slot_bytes,
                               int64_t peak_pool_bytes, int64_t budget_bytes) {
  const double n = static_cast<double>(std::max<int64_t>(decode_tokens, 1));
  double tpot = NAN;
  if (!tpots_ms.empty()) {
    tpot = 0;
    for (double v : tpots_ms) tpot += v;
    tpot /= static_cast<double>(tpots_ms.size());
  }
  // toolkit/metrics.py's rate, prefetch_precision, prefetch_recall: 0 where the denominator is 0
  auto ratio = [](int64_t a, int64_t b) { return b != 0 ? static_cast<double>(a) / static_cast<double>(b) : 0.0; };
  RunStats r;
  r.policy = policy;
  r.decode_tokens = decode_tokens;
  r.ttft_ms = round_to(ttft_s * 1e3, 3);
  r.tpot_ms = round_to(tpot, 4);
  r.tpot_p50_ms = round_to(percentile(intervals_ms, 50), 4);
  r.tpot_p95_ms = round_to(percentile(intervals_ms, 95), 4);
  r.stall_ms_per_token = round_to(decode.wait_s / n * 1e3, 4);
  r.hit_rate = round_to(ratio(decode.hits, decode.requests), 4);
  r.late_rate = round_to(ratio(decode.late, decode.requests), 4);
  r.mib_read = round_to(static_cast<double>(total_bytes_read) / MiB, 4);
  r.mib_read_per_token = round_to(static_cast<double>(decode.bytes_read) / MiB / n, 4);
  r.prefetch_precision = round_to(ratio(decode.prefetch_hits, decode.prefetch_issued), 4);
  r.prefetch_recall = round_to(ratio(decode.prefetch_hits, decode.prefetch_hits + decode.misses), 4);
  r.wasted_prefetch_mib = round_to(static_cast<double>(wasted_prefetches * slot_bytes) / MiB, 4);
  r.evictions = evictions;
  r.peak_pool_bytes = peak_pool_bytes;
  r.budget_bytes = budget_bytes;
  r.counts = decode;
  return r;
}

json RunStats::to_json() const {
  return json{
      {"policy", policy},
      {"decode_tokens", decode_tokens},
      {"ttft_ms", finite_or_null(ttft_ms)},
      {"tpot_ms", finite_or_null(tpot_ms)},
      {"tpot_p50_ms", finite_or_null(tpot_p50_ms)},
      {"tpot_p95_ms", finite_or_null(tpot_p95_ms)},
      {"stall_ms_per_token", finite_or_null(stall_ms_per_token)},
      {"hit_rate", finite_or_null(hit_rate)},
      {"late_rate", finite_or_null(late_rate)},
      {"mib_read", finite_or_null(mib_read)},
      {"mib_read_per_token", finite_or_null(mib_read_per_token)},
      {"prefetch_precision", finite_or_null(prefetch_precision)},
      {"prefetch_recall", finite_or_null(prefetch_recall)},
      {"wasted_prefetch_mib", finite_or_null(wasted_prefetch_mib)},
      {"evictions", evictions},
      {"peak_pool_bytes", peak_pool_bytes},
      {"budget_bytes", budget_bytes},
      {"counts", counts_json(counts)},
  };
}

RunStats DecodeAccount::finish(const std::string& policy, const WindowScheduler& sched, const ExpertPool& pool,
                               const std::vector<double>& t, double ttft_s) const {
  const SchedulerStats d = sched.stats.minus(started_ ? first_ : SchedulerStats{});
  const int64_t unused = pool.unused_prefetches();
  std::vector<double> iv;  // stats.py's tpot_and_intervals
  for (size_t i = 1; i < t.size(); ++i) iv.push_back((t[i] - t[i - 1]) * 1e3);
  std::vector<double> tpots;
  if (t.size() > 1) tpots.push_back((t.back() - t.front()) / static_cast<double>(t.size() - 1) * 1e3);
  return RunStats::from_counts(policy, d, sched.stats.bytes_read, ttft_s, tpots, iv,
                               static_cast<int64_t>(t.size()) - 1, pool.wasted_prefetches - wasted0_ + unused,
                               pool.evictions - evictions0_, pool.slot_bytes(), pool.peak_bytes, pool.budget_bytes());
}

}  // namespace spx
