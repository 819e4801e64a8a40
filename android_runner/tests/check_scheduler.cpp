// check_scheduler: the runner's WindowScheduler and ExpertPool (scheduler.cpp, pool.cpp) driven by a
// step script that the Python reference recorded while it drove its own scheduler
// (tests/test_native_scheduler.py), over a fake IOBackend whose reads land DELAY acquires after they
// were submitted, or when waited for (the reference's fake does the same). Writes the decision log and
// the scheduler's counts, for the test to compare with the reference's.
//   check_scheduler SCRIPT EVENTS_OUT STATS_OUT
// SCRIPT, one operation per line (keys as LAYER EXPERT pairs, scores as C99 hex floats):
//   config BUDGET SLOT_BYTES EVICTION MIN_SLOTS MAX_SLOTS L K QUEUE_DEPTH MIN_CONFIDENCE FLOOR STEP_BUDGET PREFETCH DELAY
//   at STEP POS LAYER
//   acquire STEP N L E ...
//   plan STEP W (TARGET E S_0 .. S_E-1) x W      scores (WindowScheduler::plan)
//   probs STEP W (TARGET E P_0 .. P_E-1) x W     probabilities (WindowScheduler::plan_probs)
//   data L E
//   release STEP PUMP N L E ...
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "events.h"
#include "pool.h"
#include "scheduler.h"

namespace {

class FakeIO : public spx::IOBackend {
 public:
  void submit(spx::Key key, void*, bool demand) override {
    if (!inflight.emplace(key, tick + delay).second) fail("a second read of a key already in flight");
    (demand ? demand_reads : prefetch_reads) += 1;
  }
  bool landed(spx::Key key) override {
    auto it = inflight.find(key);
    return it == inflight.end() || it->second <= tick;
  }
  void wait(spx::Key key) override {
    auto it = inflight.find(key);
    if (it != inflight.end()) it->second = std::min(it->second, tick);
  }
  void release(spx::Key key) override { inflight.erase(key); }
  static void fail(const std::string& what) {
    std::fprintf(stderr, "check_scheduler: %s\n", what.c_str());
    std::exit(1);
  }
  std::map<spx::Key, int64_t> inflight;  // key -> the tick it lands at
  int64_t tick = 0, delay = 0;
  int64_t demand_reads = 0, prefetch_reads = 0;
};

std::vector<spx::Key> keys(std::istringstream& in) {
  int n = 0;
  in >> n;
  std::vector<spx::Key> out(n);
  for (auto& k : out) in >> k.first >> k.second;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: check_scheduler SCRIPT EVENTS_OUT STATS_OUT\n");
    return 64;
  }
  std::ifstream script(argv[1]);
  if (!script) FakeIO::fail(std::string(argv[1]) + ": cannot read it");
  FakeIO io;
  spx::EventLog events;
  std::unique_ptr<spx::ExpertPool> pool;
  std::unique_ptr<spx::WindowScheduler> sched;
  std::string line;
  while (std::getline(script, line)) {
    std::istringstream in(line);
    std::string op;
    in >> op;
    if (op == "config") {
      int64_t budget = 0, slot = 0, step_budget = 0;
      std::string eviction;
      int min_slots = 0, max_slots = 0, L = 0, k = 0, prefetch = 1;
      spx::SchedulerConfig cfg;
      in >> budget >> slot >> eviction >> min_slots >> max_slots >> L >> k >> cfg.queue_depth >> cfg.min_confidence >>
          cfg.candidate_threshold >> step_budget >> prefetch >> io.delay;
      cfg.step_budget_bytes = step_budget;
      if (!in.fail() && !(in >> cfg.read_budget_bytes)) {  // optional: the read budget
        if (!in.eof()) FakeIO::fail("cannot parse the read budget: " + line);
        in.clear();
        cfg.read_budget_bytes = -1;
      }
      cfg.prefetch = prefetch != 0;
      pool = std::make_unique<spx::ExpertPool>(budget, slot, eviction, min_slots, max_slots);
      sched = std::make_unique<spx::WindowScheduler>(*pool, io, cfg, L, k, &events);
    } else if (!sched) {
      FakeIO::fail("the script's first line must be its config");
    } else if (op == "at") {
      int64_t step = 0;
      int pos = 0, layer = 0;
      in >> step >> pos >> layer;
      events.at(step, pos, layer);
    } else if (op == "acquire") {
      int64_t step = 0;
      in >> step;
      io.tick += 1;
      sched->acquire(step, keys(in));
    } else if (op == "plan" || op == "probs") {
      int64_t step = 0;
      int w = 0;
      in >> step >> w;
      std::vector<int64_t> targets(w);
      std::vector<std::vector<float>> scores(w);
      for (int i = 0; i < w; ++i) {
        int e = 0;
        in >> targets[i] >> e;
        scores[i].resize(e);
        for (auto& s : scores[i]) {
          std::string hex;
          in >> hex;
          s = std::strtof(hex.c_str(), nullptr);
        }
      }
      if (op == "plan")
        sched->plan(step, targets, scores);
      else
        sched->plan_probs(step, targets, scores);
    } else if (op == "data") {
      spx::Key key;
      in >> key.first >> key.second;
      if (sched->data(key) == nullptr) FakeIO::fail("data() of an acquired expert gave no bytes");
    } else if (op == "release") {
      int64_t step = 0;
      int pump = 1;
      in >> step >> pump;
      sched->release(step, keys(in), pump != 0);
    } else if (!op.empty()) {
      FakeIO::fail("unknown operation: " + line);
    }
    if (in.fail()) FakeIO::fail("cannot parse: " + line);
  }
  events.write(argv[2]);
  const spx::SchedulerStats& s = sched->stats;
  std::ofstream out(argv[3]);
  out << "requests " << s.requests << "\nhits " << s.hits << "\nprefetch_hits " << s.prefetch_hits << "\nlate "
      << s.late << "\nmisses "
      << s.misses << "\nprefetch_issued " << s.prefetch_issued << "\ndropped_stale " << s.dropped_stale
      << "\ndropped_low_conf " << s.dropped_low_conf << "\ndropped_no_slot " << s.dropped_no_slot << "\ndropped_late " << s.dropped_late << "\nbytes_read "
      << s.bytes_read << "\nevictions " << pool->evictions << "\nwasted_prefetches " << pool->wasted_prefetches
      << "\ndemand_reads " << io.demand_reads << "\nprefetch_reads " << io.prefetch_reads << "\n";
  return 0;
}
