// The bounded DRAM pool (toolkit/runtime/pool.py): one 4 KiB-aligned arena of fixed-size expert
// slots inside a hard byte budget, with the reference's eviction policies (lru, lfu, prediction,
// belady, reuse) and the same tie-breaking, so both runners evict the same experts.
//
// A slot is free, loading (a read is in flight into it; `landed` false), or ready; it is pinned
// (pins > 0) while the layer computing with it runs. Pinned and not-yet-ready slots are never
// evicted. `ready` is the scheduler's logical state (decisions); `landed` is physical (waits).
//
// Capacity changes (`--pool-mib auto`, memwatch.h): a MemWatch publishes a target number of slots;
// the pool applies it at its next reserve or touch (`apply_target`), evicting by the policy's own
// order (lowest value first; never a pinned or still-loading slot, and a ready slot whose read has
// not landed is cancelled if still queued, else waited for, by on_evict, as any eviction) and giving the freed slots' pages back to
// the OS (madvise MADV_DONTNEED on the arena, an anonymous mapping). Given the same sequence of
// (step, capacity) changes the pool makes the same decisions; it may grow back, never past the
// capacity it started with.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common.h"

namespace spx {

class EventLog;
class MemWatch;

struct Slot {
  Key key;
  int index = -1;           // slot number in the arena
  bool ready = false;
  int pins = 0;
  int64_t last_use = -1;
  int64_t uses = 0;
  bool prefetched = false;  // filled by a prefetch and not yet used
  bool landed = false;      // the read's bytes are in the slot
  bool demand = false;      // read on demand (its wait is a miss's, not a late hit's)
};

// The `reuse` eviction's state (toolkit/runtime/reuse.py, ReuseHistory): every expert's routing
// history at its layer (a shift register of its last `bits` visits, bit 0 the latest) and the score
// of its predicted next use, in sixteenths of a step: 16 * the predicted step inside the prefetch
// window, else 16 * its layer's next visit + L * (visits16[history] - 16). Integers only, so both
// engines rank alike. With the adapter's next-visit heads, a layer's predicted next N visits (set by
// the planner after the layer's acquire; the first at v0, each later one L on) decide while v0 is the
// layer's next visit: 16 * the first of them whose set holds the expert; none, 16 * (v0 + N L) +
// L * (visits16[history << N] - 16). With frequency classes, visits16 is the expert's class's table
// (ReuseTable::of).
// How many of a next-visit head's largest logits count as its visit's prediction: 2k, at most a layer's
// share of the pool (capacity / L slots, at least 1) and E (reuse.py: next_visit_size).
inline int next_visit_size(int top_k, int num_experts, int64_t capacity, int num_layers) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({num_experts, 2 * top_k, capacity / num_layers})));
}

struct ReuseHistory {
  ReuseHistory(ReuseTable table, int num_layers);
  // step routes to `keys`: their layer's history shifts (once per step), then their bit is set
  void observe(int64_t step, const std::vector<Key>& keys);
  int64_t score(Key key, int64_t now, const std::map<Key, int64_t>* predicted) const;
  // layer li's next visits, at steps `target`, `target` + L, ..., are predicted to route to `sets`
  void set_next_visits(int li, int64_t target, std::vector<std::vector<int>> sets);

 private:
  struct NextVisit {
    int64_t target = -1;
    std::vector<std::vector<int>> sets;  // each visit's experts, sorted
  };
  int L_;
  uint32_t mask_;
  ReuseTable table_;
  std::vector<std::map<int, uint32_t>> hist_;  // layer -> expert -> history (zeros absent)
  std::vector<int64_t> last_step_;
  std::vector<NextVisit> next_visit_;  // per layer
};

class ExpertPool {
 public:
  static constexpr double kNever = std::numeric_limits<double>::infinity();
  using NextUse = std::function<double(Key, int64_t)>;

  // capacity = budget / slot_bytes, capped at `max_slots` (every expert of the model) for the
  // arena's size; fewer than min_slots (one layer's top-k) is an error naming --pool-mib.
  // arena false: slots are bookkeeping only (the caller's IO holds the bytes: the GPU tier's device slots,
  // sched_capi.cpp), nothing is mapped and data() is null.
  ExpertPool(int64_t budget_bytes, int64_t slot_bytes, const std::string& policy, int min_slots, int max_slots,
             NextUse next_use = nullptr, bool arena = true);
  ~ExpertPool();
  ExpertPool(const ExpertPool&) = delete;
  ExpertPool& operator=(const ExpertPool&) = delete;

  int64_t capacity() const { return capacity_; }
  int64_t start_capacity() const { return start_capacity_; }
  int64_t min_slots() const { return min_slots_; }
  int64_t resident_bytes() const { return touched_count_ * slot_bytes_; }  // slots ever filled, not given back
  int64_t budget_bytes() const { return budget_bytes_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t used_bytes() const { return static_cast<int64_t>(slots_.size()) * slot_bytes_; }
  int64_t arena_bytes() const { return arena_slots_ * slot_bytes_; }
  const std::string& policy() const { return policy_; }

  Slot* get(Key key);
  void touch(Slot& s, int64_t now);
  // A new loading slot for `key`, evicting if needed; nullptr if nothing may be evicted, or if
  // keep(victim) vetoes the eviction.
  Slot* reserve(Key key, int64_t now, bool prefetch, const std::set<Key>& protect,
                const std::function<bool(Key)>& keep = nullptr);
  // A slot for `key`, ready, as a demand read's (its bytes left to the caller): false when the pool is full.
  bool preload(Key key);
  void settle();  // forget which slots came from a prefetch not yet used (decode figures start)
  int64_t unused_prefetches() const;  // slots a prefetch filled that no step has used yet
  void evict(Key key, const Key* for_key);
  // Lower (evicting, releasing pages) or raise the capacity, within min_slots .. the arena's
  // slots; returns the slots evicted. Slots that cannot be evicted now (pinned) go at later reserves.
  int64_t set_capacity(int64_t slots, int64_t now, const std::set<Key>& protect = {});
  // The watcher's target, if it differs from the capacity (cheap: one atomic load otherwise).
  void apply_target(int64_t now, const std::set<Key>& protect = {});
  int64_t released_bytes = 0;  // pages given back to the OS, in all
  int64_t over_target = 0;     // demand slots taken over a lowered capacity (every other slot pinned)
  MemWatch* watch = nullptr;   // MemWatch::active() at construction
  int sequence = 0;            // this pool's number in the watcher's log
  uint8_t* data(const Slot& s) const {
    return arena_ == nullptr ? nullptr : arena_ + static_cast<size_t>(s.index) * slot_bytes_;
  }
  const std::map<Key, Slot>& slots() const { return slots_; }
  // Slot i of the arena's first `arena_slots()` as scratch before any slot is taken (the read-rate
  // probe at start-up: the pages the pool fills first), nullptr without an arena.
  uint8_t* scratch(int64_t i) const {
    return arena_ == nullptr || i < 0 || i >= arena_slots_ ? nullptr : arena_ + static_cast<size_t>(i) * slot_bytes_;
  }
  int64_t arena_slots() const { return arena_slots_; }

  int64_t peak_bytes = 0;
  int64_t evictions = 0;
  int64_t wasted_prefetches = 0;
  std::function<void(Key)> on_evict;          // e.g. wait for the slot's read to land
  EventLog* events = nullptr;
  const std::map<Key, int64_t>* predicted = nullptr;  // "prediction", "reuse": the scheduler's next-use table
  const ReuseHistory* reuse = nullptr;                // "reuse": the scheduler's (set before any eviction)
  NextUse next_use;

 private:
  bool victim(int64_t now, const std::set<Key>& protect, Key& out) const;
  int64_t trim();  // give back the pages of free slots while more slots are touched than the capacity

  int64_t budget_bytes_, slot_bytes_, capacity_, arena_slots_, start_capacity_ = 0, min_slots_ = 0;
  std::string policy_;
  std::map<Key, Slot> slots_;
  std::vector<int> free_touched_, free_clean_;  // free slots whose pages are resident / never used or given back
  std::vector<uint8_t> touched_;
  int64_t touched_count_ = 0;
  uint8_t* arena_ = nullptr;
  size_t map_bytes_ = 0;
};

// Belady's next_use(key, now): the step of the key's next real use after `now` in the recorded routing
// `future` (per position, L x k expert ids); a prompt span's positions (units: prefill_spans) all use
// their experts at the span's step, p0 * L + layer.
ExpertPool::NextUse belady_next_use(const std::vector<std::vector<int>>& future, int L, int k,
                                    const std::vector<int>& units);

}  // namespace spx
