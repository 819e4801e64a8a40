// The windowed prefetch scheduler, a port of toolkit/runtime/scheduler.py with the same decisions.
//
// Steps are (position, MoE layer) pairs s = position * L + layer. At step s the planner hands in
// scored expert sets for steps s+1 .. s+W; their top candidates become read requests with a
// deadline (their step) and a confidence, queued by (deadline, -confidence, arrival). Reads are
// issued while the step's queue has room (queue_depth) and its byte budget lasts; a full queue
// drops requests below min_confidence; stale requests (deadline reached) are always dropped; with a
// read budget (bytes the flash delivers per step), so is a prefetch that could not land by its deadline
// behind the bytes already asked of the flash, demand reads included (reason late). A
// prefetch gets a slot only by evicting an expert not predicted to be needed sooner. A miss is
// read on demand, ahead of every prefetch.
//
// Decisions never depend on read timing: a prefetch issued at step s is logically complete from
// step s+1 (a hit, an eviction candidate, out of the queue's count). Physical completion only
// decides how long `data()` waits, and that wait is the stall reported. (A read budget measured in
// the run, ReadBudgetMeter, is the exception: it follows the compute time of the steps.)
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "pool.h"

namespace spx {

class EventLog;

// Where reads go (the Reader's pread lanes, or a test's fake).
class IOBackend {
 public:
  virtual ~IOBackend() = default;
  virtual void submit(Key key, void* dst, bool demand) = 0;
  virtual bool landed(Key key) = 0;  // never blocks
  virtual void wait(Key key) = 0;    // blocks until the bytes are in dst
  // The read has landed (landed() said so): rethrow its error if it failed (the Reader's reads fail
  // asynchronously, so by default wait(), which returns at once); a backend whose reads raise where they
  // are issued or waited for has nothing to check.
  virtual void check(Key key) { wait(key); }
  virtual void release(Key key) = 0; // the pool dropped the key
  // Drop the read of `key` if it has not started (its buffer is never written); false when it is
  // reading or done, or the backend cannot cancel. Never blocks.
  virtual bool cancel(Key) { return false; }
  // Whether a read into a slot is ordered after the slot's old read by the backend itself (the GPU
  // tier's copies, toolkit/runtime/native_sched.py): evicting a key whose read is in flight then need
  // not wait for it.
  virtual bool orders_reuse() const { return false; }
  // The slot's bytes are about to be used for the first time (data() found them not yet used): a
  // backend whose reads are asynchronous to their consumer orders the consumer after the read here.
  virtual void take(Key) {}
};

struct SchedulerConfig {
  int candidates = 0;               // experts per predicted step (0: top-k)
  int queue_depth = 4;
  int64_t step_budget_bytes = -1;   // prefetch bytes issued per step (-1: unbounded)
  int64_t read_budget_bytes = -1;   // bytes the flash delivers per step (-1: no deadline check)
  double min_confidence = 0.02;
  double candidate_threshold = 0.0;
  bool prefetch = true;
};

struct SchedulerStats {
  int64_t requests = 0, hits = 0, prefetch_hits = 0, late = 0, misses = 0, prefetch_issued = 0;
  int64_t dropped_stale = 0, dropped_low_conf = 0, dropped_no_slot = 0, dropped_late = 0, bytes_read = 0;
  double wait_s = 0.0;
  SchedulerStats minus(const SchedulerStats& o) const;
};

// The read budget measured in the run (--read-budget-kib auto; toolkit/runtime/scheduler.py's
// ReadBudgetMeter, the same rule): the flash's rate (measured at start-up) times the compute time of a
// step, measured as the run goes: the time between two consecutive MoE steps of the same span (a
// prefill span's positions; 1 for one position) less what the scheduler waited for reads between
// them, smoothed by 1/8 of each new step; the first step measured after the span changes replaces it.
// The budget is whole KiB, at least one expert slot and at most kMaxBudgetKib (1 TiB: budget x steps stays in
// int64); none (-1) before the first step is measured.
class ReadBudgetMeter {
 public:
  static constexpr int64_t kMaxBudgetKib = int64_t{1} << 30;
  ReadBudgetMeter(double read_bytes_per_s, int64_t slot_bytes);
  // At a MoE step of `span` positions reached at `now_s` seconds with `wait_s` seconds of read waits
  // so far: the budget in bytes a step from this step on (-1: none yet).
  int64_t at(int span, double now_s, double wait_s);
  double step_s() const { return est_; }  // the smoothed compute time of a step (0: none yet)

 private:
  double rate_;
  int64_t slot_kib_;
  int span_ = 0;
  bool fresh_ = true;
  double last_now_ = 0, last_wait_ = 0, est_ = 0;
};

class WindowScheduler {
 public:
  // reuse: the pool's `reuse` eviction state, which every acquire updates (outlives the scheduler)
  WindowScheduler(ExpertPool& pool, IOBackend& io, const SchedulerConfig& cfg, int num_layers, int top_k,
                  EventLog* events, ReuseHistory* reuse = nullptr);

  // Make `keys` resident and pinned for `step`; misses are read on demand, first in line.
  void acquire(int64_t step, const std::vector<Key>& keys);
  // A layer's experts in one call: acquire with the pool's residents first (each group in the given
  // order, as the Python reference's acquire_read), then data() of each key in the given order.
  void acquire_read(int64_t step, const std::vector<Key>& keys);
  // Unpin `keys` after `step` used them, then issue queued reads (`pump`: a prefill chunk's earlier
  // expert groups release without it, so no prefetch takes a slot a later group of the step needs).
  void release(int64_t step, const std::vector<Key>& keys, bool pump = true);
  // The slot's bytes, waiting for its read to land if it has not.
  const uint8_t* data(Key key);
  // Whether the slot's bytes are in memory now (data() would not wait); never blocks.
  bool landed(Key key);
  // Queue reads from probabilities: probs[w] has E values for the step targets[w].
  void plan_probs(int64_t step, const std::vector<int64_t>& targets, const std::vector<std::vector<float>>& probs);
  // Scores (non-negative ones normalised to sum 1, others softmaxed; all-zero rows skipped).
  void plan(int64_t step, const std::vector<int64_t>& targets, std::vector<std::vector<float>> scores);
  // plan_probs with each target's candidates already taken (confidences descending, their experts): what
  // the top-m of its probabilities would give, for a predictor that knows them without [W, E] rows (the
  // oracle: toolkit/runtime/planner.py)
  void plan_ranked(int64_t step, const std::vector<int64_t>& targets, const std::vector<std::vector<double>>& confs,
                   const std::vector<std::vector<int>>& ids);
  int64_t step() const { return step_; }
  size_t in_flight() const { return loading_.size(); }  // prefetches logically in flight
  // The read budget from `step` on (bytes a step; -1: none): the backlog so far drains at the old
  // rate up to `step`; from none, the prefetches in flight are the backlog (ReadBudgetMeter's).
  void set_read_budget(int64_t step, int64_t bytes);
  int64_t read_budget() const { return cfg_.read_budget_bytes; }

  double next_predicted_use(Key key, int64_t now) const;
  // the reuse eviction's state (nullptr: the pool evicts otherwise)
  ReuseHistory* reuse() const { return reuse_; }
  const ExpertPool& pool() const { return pool_; }
  SchedulerStats stats;

 private:
  using Item = std::tuple<int64_t, double, int64_t, Key>;  // (deadline, -confidence, seq, key)
  void retire(int64_t step);
  void advance(int64_t step);  // the read budget's backlog at `step`
  void pump(const std::set<Key>& protect = {});
  void drop_weak();
  void begin_plan(int64_t step);
  void queue_candidate(int64_t target, int e, double c);  // after begin_plan (its step_)
  void wait(Key key);
  void evicting(Key key);
  void emit(const char* kind, Key key, const std::string& extra = "");
  bool loading_has(Key key) const;
  void loading_erase(Key key);

  ExpertPool& pool_;
  IOBackend& io_;
  SchedulerConfig cfg_;
  int L_, k_;
  EventLog* events_;
  ReuseHistory* reuse_;
  std::vector<Item> queue_;                             // a min-heap
  std::map<Key, std::pair<int64_t, double>> pending_;   // queued key -> (deadline, confidence)
  std::vector<std::pair<Key, int64_t>> loading_;        // prefetch in flight -> issue step, in issue order
  std::map<Key, int64_t> predicted_next_;
  int64_t seq_ = 0;
  int64_t step_ = 0;
  int64_t step_bytes_ = 0;
  int64_t backlog_ = 0;       // prefetch bytes asked of the flash not yet delivered at the read budget's rate
  int64_t backlog_step_ = 0;  // the step backlog_ is counted at
};

}  // namespace spx
