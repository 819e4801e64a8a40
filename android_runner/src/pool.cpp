#include "pool.h"

#include <cstdio>
#include <cstdlib>
#include <tuple>

#include "events.h"

namespace spx {

static const char* kPolicies[] = {"lru", "lfu", "prediction", "belady"};

ExpertPool::ExpertPool(int64_t budget_bytes, int64_t slot_bytes, const std::string& policy, int min_slots,
                       int max_slots, NextUse next)
    : next_use(std::move(next)), budget_bytes_(budget_bytes), slot_bytes_(slot_bytes), policy_(policy) {
  bool known = false;
  for (const char* p : kPolicies) known = known || policy == p;
  if (!known) throw Error("eviction policy '" + policy + "': choose from lru, lfu, prediction, belady");
  if (policy == "belady" && !next_use) throw Error("eviction policy 'belady' needs the run's recorded routing");
  if (slot_bytes <= 0) throw Error("expert slot of " + std::to_string(slot_bytes) + " bytes");
  capacity_ = budget_bytes / slot_bytes;
  if (capacity_ < min_slots) {
    char buf[320];
    std::snprintf(buf, sizeof buf,
                  "--pool-mib %.2f: holds %lld expert slots of %.0f KiB, but one layer needs %d at once; use at "
                  "least %.2f",
                  budget_bytes / 1048576.0, static_cast<long long>(capacity_), slot_bytes / 1024.0, min_slots,
                  min_slots * slot_bytes / 1048576.0);
    throw Error(buf);
  }
  arena_slots_ = std::min<int64_t>(capacity_, max_slots);
  void* p = nullptr;
  if (posix_memalign(&p, 4096, static_cast<size_t>(arena_slots_ * slot_bytes_)) != 0)
    throw Error("--pool-mib: cannot allocate the pool's " + std::to_string(arena_slots_ * slot_bytes_) + " bytes");
  arena_ = static_cast<uint8_t*>(p);
  for (int64_t i = arena_slots_ - 1; i >= 0; --i) free_.push_back(static_cast<int>(i));
}

ExpertPool::~ExpertPool() { std::free(arena_); }

Slot* ExpertPool::get(Key key) {
  auto it = slots_.find(key);
  return it == slots_.end() ? nullptr : &it->second;
}

void ExpertPool::touch(Slot& s, int64_t now) {
  s.last_use = now;
  s.uses += 1;
  s.prefetched = false;
}

bool ExpertPool::victim(int64_t now, const std::set<Key>& protect, Key& out) const {
  const Slot* best = nullptr;
  double best_next = 0;
  for (const auto& [key, s] : slots_) {
    if (!s.ready || s.pins != 0 || protect.count(key)) continue;
    if (policy_ == "lru") {  // min (last_use, key)
      if (!best || std::tie(s.last_use, s.key) < std::tie(best->last_use, best->key)) best = &s;
    } else if (policy_ == "lfu") {  // min (uses, last_use, key)
      if (!best || std::tie(s.uses, s.last_use, s.key) < std::tie(best->uses, best->last_use, best->key)) best = &s;
    } else {  // prediction / belady: max (next use, -last_use, key)
      double nxt;
      if (predicted != nullptr) {
        auto it = predicted->find(key);
        nxt = (it == predicted->end() || it->second < now) ? kNever : static_cast<double>(it->second);
      } else {
        nxt = next_use(key, now);
      }
      int64_t neg = -s.last_use, bneg = best ? -best->last_use : 0;
      if (!best || std::tie(nxt, neg, s.key) > std::tie(best_next, bneg, best->key)) {
        best = &s;
        best_next = nxt;
      }
    }
  }
  if (!best) return false;
  out = best->key;
  return true;
}

Slot* ExpertPool::reserve(Key key, int64_t now, bool prefetch, const std::set<Key>& protect,
                          const std::function<bool(Key)>& keep) {
  if (slots_.count(key)) throw std::logic_error("expert already has a slot");
  if (static_cast<int64_t>(slots_.size()) >= capacity_) {
    Key v;
    if (!victim(now, protect, v)) return nullptr;
    if (keep && keep(v)) return nullptr;
    evict(v, &key);
  }
  if ((static_cast<int64_t>(slots_.size()) + 1) * slot_bytes_ > budget_bytes_ || free_.empty())
    throw std::logic_error("pool over budget");
  Slot s;
  s.key = key;
  s.prefetched = prefetch;
  s.index = free_.back();
  free_.pop_back();
  Slot& ref = slots_.emplace(key, s).first->second;
  peak_bytes = std::max(peak_bytes, used_bytes());
  return &ref;
}

void ExpertPool::settle() {
  for (auto& kv : slots_) kv.second.prefetched = false;
}

void ExpertPool::evict(Key key, const Key* for_key) {
  auto it = slots_.find(key);
  if (it == slots_.end()) throw std::logic_error("evicting an expert with no slot");
  if (it->second.pins) throw std::logic_error("evicting a pinned expert");
  if (on_evict) on_evict(key);
  const bool unused = it->second.prefetched;
  free_.push_back(it->second.index);
  slots_.erase(it);
  evictions += 1;
  if (unused) wasted_prefetches += 1;
  if (events != nullptr) {
    std::string extra;
    if (for_key != nullptr) extra += " for=" + EventLog::key(*for_key);
    extra += std::string(" prefetched_unused=") + (unused ? "1" : "0");
    events->emit("evict", key, extra);
  }
}

}  // namespace spx
