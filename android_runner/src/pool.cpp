#include "pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <tuple>

#include "events.h"
#include "memwatch.h"

namespace spx {

static const char* kPolicies[] = {"lru", "lfu", "prediction", "belady", "reuse"};

ReuseHistory::ReuseHistory(ReuseTable table, int num_layers)
    : L_(num_layers), mask_((1u << table.bits) - 1), table_(std::move(table)),
      hist_(static_cast<size_t>(num_layers)), last_step_(static_cast<size_t>(num_layers), -1),
      next_visit_(static_cast<size_t>(num_layers)) {
  const size_t n = size_t{1} << table_.bits;
  bool ok = table_.bits >= 1 && table_.bits <= 16 && table_.visits16.size() == n && num_layers >= 1 &&
            (table_.classes.empty() || table_.classes.size() == static_cast<size_t>(num_layers));
  for (const auto& t : table_.class_visits16) ok = ok && t.size() == n;
  for (const auto& row : table_.classes)
    for (int c : row) ok = ok && c >= 0 && static_cast<size_t>(c) < table_.class_visits16.size();
  if (!ok) throw std::logic_error("reuse table of the wrong size");
}

void ReuseHistory::observe(int64_t step, const std::vector<Key>& keys) {
  for (const Key& key : keys) {
    auto& h = hist_[static_cast<size_t>(key.first)];
    if (last_step_[static_cast<size_t>(key.first)] != step) {
      last_step_[static_cast<size_t>(key.first)] = step;
      for (auto it = h.begin(); it != h.end();) {
        it->second = (it->second << 1) & mask_;
        it = it->second ? std::next(it) : h.erase(it);
      }
    }
    h[key.second] |= 1u;
  }
}

int64_t ReuseHistory::score(Key key, int64_t now, const std::map<Key, int64_t>* predicted) const {
  if (predicted != nullptr) {
    auto it = predicted->find(key);
    if (it != predicted->end() && it->second > now) return it->second * 16;  // == now, not acquired: wrong
  }
  const auto& h = hist_[static_cast<size_t>(key.first)];
  auto it = h.find(key.second);
  const uint32_t bits = it == h.end() ? 0u : it->second;
  int64_t d = ((key.first - now % L_) % L_ + L_) % L_;
  if (d == 0) d = L_;
  const int64_t v0 = now + d;
  const std::vector<int64_t>& visits16 = table_.of(key.first, key.second);
  const NextVisit& nv = next_visit_[static_cast<size_t>(key.first)];
  if (nv.target == v0) {  // the next visits are predicted
    const int64_t n = static_cast<int64_t>(nv.sets.size());
    for (int64_t j = 0; j < n; ++j) {
      const auto& s = nv.sets[static_cast<size_t>(j)];
      if (std::binary_search(s.begin(), s.end(), key.second)) return (v0 + j * L_) * 16;
    }
    return (v0 + n * L_) * 16 + static_cast<int64_t>(L_) * (visits16[(bits << n) & mask_] - 16);
  }
  return v0 * 16 + static_cast<int64_t>(L_) * (visits16[bits] - 16);
}

void ReuseHistory::set_next_visits(int li, int64_t target, std::vector<std::vector<int>> sets) {
  for (auto& s : sets) std::sort(s.begin(), s.end());
  next_visit_[static_cast<size_t>(li)] = {target, std::move(sets)};
}

ExpertPool::ExpertPool(int64_t budget_bytes, int64_t slot_bytes, const std::string& policy, int min_slots,
                       int max_slots, NextUse next, bool arena)
    : next_use(std::move(next)), budget_bytes_(budget_bytes), slot_bytes_(slot_bytes), policy_(policy) {
  bool known = false;
  for (const char* p : kPolicies) known = known || policy == p;
  if (!known) throw Error("eviction policy '" + policy + "': choose from lru, lfu, prediction, belady, reuse");
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
  start_capacity_ = capacity_;
  min_slots_ = min_slots;
  // an anonymous mapping (page-aligned, so 4096-aligned for O_DIRECT): pages are committed as slots
  // are first filled, and a freed slot's pages can be given back with madvise
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096);
  if (arena) {
    map_bytes_ = (static_cast<size_t>(arena_slots_ * slot_bytes_) + page - 1) / page * page;
    void* p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw Error("--pool-mib: cannot allocate the pool's " + std::to_string(arena_slots_ * slot_bytes_) + " bytes");
    arena_ = static_cast<uint8_t*>(p);
  }
  touched_.assign(static_cast<size_t>(arena_slots_), 0);
  for (int64_t i = arena_slots_ - 1; i >= 0; --i) free_clean_.push_back(static_cast<int>(i));
  watch = MemWatch::active();
  if (watch != nullptr) {
    sequence = watch->next_pool();
    watch->publish_resident(0);
  }
}

ExpertPool::~ExpertPool() {
  if (watch != nullptr) watch->publish_resident(0);  // before the pages go: the watcher errs low
  if (arena_ != nullptr) munmap(arena_, map_bytes_);
}

Slot* ExpertPool::get(Key key) {
  auto it = slots_.find(key);
  return it == slots_.end() ? nullptr : &it->second;
}

void ExpertPool::touch(Slot& s, int64_t now) {
  s.last_use = now;
  s.uses += 1;
  s.prefetched = false;
  if (watch == nullptr) return;
  apply_target(now);  // after `s`'s update: the caller does not use it after this
  Key v;  // slots taken over the target (see reserve) go as soon as they are unpinned
  while (static_cast<int64_t>(slots_.size()) > capacity_ && victim(now, {}, v)) evict(v, nullptr);
}

void ExpertPool::apply_target(int64_t now, const std::set<Key>& protect) {
  if (watch == nullptr || now < 0) return;  // not before the first step (--preload fills every slot)
  const int64_t t = watch->target();
  if (t < 0) return;
  const int64_t want = std::min(std::max(t, min_slots_), std::min(start_capacity_, arena_slots_));
  if (want == capacity_) return;
  CapacityChange c;
  c.pool = sequence;
  c.step = now;
  c.available = watch->target_available();
  c.from = capacity_;
  const int64_t released0 = released_bytes;
  c.evicted = set_capacity(want, now, protect);
  c.to = capacity_;
  c.released_bytes = released_bytes - released0;
  watch->record(c);
}

int64_t ExpertPool::set_capacity(int64_t slots, int64_t now, const std::set<Key>& protect) {
  if (slots < min_slots_ || slots > arena_slots_)
    throw std::logic_error("pool capacity " + std::to_string(slots) + " outside " + std::to_string(min_slots_) +
                           ".." + std::to_string(arena_slots_));
  capacity_ = slots;
  int64_t evicted = 0;
  Key v;
  while (static_cast<int64_t>(slots_.size()) > capacity_ && victim(now, protect, v)) {
    evict(v, nullptr);
    ++evicted;
  }
  trim();
  return evicted;
}

int64_t ExpertPool::trim() {
  int64_t n = 0;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096);
  while (touched_count_ > capacity_ && !free_touched_.empty()) {
    const int i = free_touched_.back();
    free_touched_.pop_back();
    // whole pages inside the slot (a slot is a multiple of 4 KiB; pages may be larger)
    const uintptr_t a = reinterpret_cast<uintptr_t>(arena_) + static_cast<uintptr_t>(i) * slot_bytes_;
    const uintptr_t lo = (a + page - 1) / page * page, hi = (a + slot_bytes_) / page * page;
    if (arena_ != nullptr && hi > lo && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) == 0) {
      released_bytes += static_cast<int64_t>(hi - lo);
      n += static_cast<int64_t>(hi - lo);
    }
    touched_[static_cast<size_t>(i)] = 0;
    --touched_count_;
    free_clean_.push_back(i);
  }
  if (watch != nullptr) watch->publish_resident(resident_bytes());
  return n;
}

bool ExpertPool::victim(int64_t now, const std::set<Key>& protect, Key& out) const {
  const Slot* best = nullptr;
  double best_next = 0;
  int64_t best_score = 0;
  const bool by_reuse = policy_ == "reuse";
  if (by_reuse && reuse == nullptr) throw std::logic_error("the reuse eviction has no history");
  for (const auto& [key, s] : slots_) {
    if (!s.ready || s.pins != 0 || protect.count(key)) continue;
    if (by_reuse) {  // max (score, -last_use, key)
      const int64_t sc = reuse->score(key, now, predicted);
      int64_t neg = -s.last_use, bneg = best ? -best->last_use : 0;
      if (!best || std::tie(sc, neg, s.key) > std::tie(best_score, bneg, best->key)) {
        best = &s;
        best_score = sc;
      }
    } else if (policy_ == "lru") {  // min (last_use, key)
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
  if (watch != nullptr) apply_target(now, protect);
  while (static_cast<int64_t>(slots_.size()) >= capacity_) {  // more than once only after a shrink
    Key v;
    if (!victim(now, protect, v)) {
      // a shrink never fails a demand read: with every slot pinned (a prefill group sized by the
      // capacity before it), the slot is taken over the target, within the arena; later
      // reserves and touches evict back down to it
      if (!prefetch && static_cast<int64_t>(slots_.size()) < std::min(start_capacity_, arena_slots_)) {
        over_target += 1;
        break;
      }
      return nullptr;
    }
    if (keep && keep(v)) return nullptr;
    evict(v, &key);
  }
  if ((static_cast<int64_t>(slots_.size()) + 1) * slot_bytes_ > budget_bytes_ ||
      (free_touched_.empty() && free_clean_.empty()))
    throw std::logic_error("pool over budget");
  Slot s;
  s.key = key;
  s.prefetched = prefetch;
  auto& from = free_touched_.empty() ? free_clean_ : free_touched_;  // reuse resident pages first
  s.index = from.back();
  from.pop_back();
  if (!touched_[static_cast<size_t>(s.index)]) {
    touched_[static_cast<size_t>(s.index)] = 1;
    ++touched_count_;
    if (watch != nullptr) watch->publish_resident(resident_bytes());
  }
  Slot& ref = slots_.emplace(key, s).first->second;
  peak_bytes = std::max(peak_bytes, used_bytes());
  return &ref;
}

int64_t ExpertPool::unused_prefetches() const {
  int64_t n = 0;
  for (const auto& kv : slots_) n += kv.second.prefetched ? 1 : 0;
  return n;
}

bool ExpertPool::preload(Key key) {
  Slot* s = reserve(key, -1, false, {});
  if (s == nullptr) return false;
  s->ready = s->demand = true;
  return true;
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
  free_touched_.push_back(it->second.index);
  slots_.erase(it);
  if (touched_count_ > capacity_) trim();
  evictions += 1;
  if (unused) wasted_prefetches += 1;
  if (events != nullptr) {
    std::string extra;
    if (for_key != nullptr) extra += " for=" + EventLog::key(*for_key);
    extra += std::string(" prefetched_unused=") + (unused ? "1" : "0");
    events->emit("evict", key, extra);
  }
}

ExpertPool::NextUse belady_next_use(const std::vector<std::vector<int>>& future, int L, int k, const std::vector<int>& units) {
  std::vector<int64_t> first;
  for (int T : units)
    for (int t = 0; t < T; ++t) first.push_back(static_cast<int64_t>(first.size()) - t);
  auto uses = std::make_shared<std::map<Key, std::vector<int64_t>>>();
  for (size_t pos = 0; pos < future.size(); ++pos)
    for (int li = 0; li < L; ++li)
      for (int j = 0; j < k; ++j) {
        auto& steps = (*uses)[{li, future[pos][static_cast<size_t>(li) * k + j]}];
        const int64_t p = pos < first.size() ? first[pos] : static_cast<int64_t>(pos);
        const int64_t st = p * L + li;
        if (steps.empty() || steps.back() != st) steps.push_back(st);
      }
  return [uses](Key key, int64_t now) {
    auto it = uses->find(key);
    if (it == uses->end()) return ExpertPool::kNever;
    auto nxt = std::upper_bound(it->second.begin(), it->second.end(), now);
    return nxt == it->second.end() ? ExpertPool::kNever : static_cast<double>(*nxt);
  };
}


}  // namespace spx
