#include "scheduler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>

#include "events.h"
#include "routing.h"

namespace spx {

using Clock = std::chrono::steady_clock;

SchedulerStats SchedulerStats::minus(const SchedulerStats& o) const {
  SchedulerStats r;
  r.requests = requests - o.requests;
  r.hits = hits - o.hits;
  r.prefetch_hits = prefetch_hits - o.prefetch_hits;
  r.late = late - o.late;
  r.misses = misses - o.misses;
  r.prefetch_issued = prefetch_issued - o.prefetch_issued;
  r.dropped_stale = dropped_stale - o.dropped_stale;
  r.dropped_low_conf = dropped_low_conf - o.dropped_low_conf;
  r.dropped_no_slot = dropped_no_slot - o.dropped_no_slot;
  r.dropped_late = dropped_late - o.dropped_late;
  r.bytes_read = bytes_read - o.bytes_read;
  r.wait_s = wait_s - o.wait_s;
  return r;
}

WindowScheduler::WindowScheduler(ExpertPool& pool, IOBackend& io, const SchedulerConfig& cfg, int num_layers,
                                 int top_k, EventLog* events, ReuseHistory* reuse)
    : pool_(pool), io_(io), cfg_(cfg), L_(num_layers), k_(top_k), events_(events), reuse_(reuse) {
  if (pool.policy() == "prediction" || pool.policy() == "reuse") pool.predicted = &predicted_next_;
  if (pool.policy() == "reuse" && reuse == nullptr) throw std::logic_error("the reuse eviction needs a ReuseHistory");
  pool.reuse = reuse;
  pool.on_evict = [this](Key key) { evicting(key); };
  pool.events = events;
}

void WindowScheduler::emit(const char* kind, Key key, const std::string& extra) {
  if (events_ != nullptr) events_->emit(kind, key, extra);
}

bool WindowScheduler::loading_has(Key key) const {
  for (const auto& kv : loading_)
    if (kv.first == key) return true;
  return false;
}

void WindowScheduler::loading_erase(Key key) {
  for (auto it = loading_.begin(); it != loading_.end(); ++it)
    if (it->first == key) {
      loading_.erase(it);
      return;
    }
}

double WindowScheduler::next_predicted_use(Key key, int64_t now) const {
  auto it = predicted_next_.find(key);
  return (it != predicted_next_.end() && it->second >= now) ? static_cast<double>(it->second)
                                                             : ExpertPool::kNever;
}

void WindowScheduler::retire(int64_t step) {
  std::vector<std::pair<Key, int64_t>> keep;
  for (const auto& kv : loading_) {
    if (kv.second < step) {
      pool_.get(kv.first)->ready = true;
      emit("ready", kv.first);
    } else {
      keep.push_back(kv);
    }
  }
  loading_.swap(keep);
}

void WindowScheduler::wait(Key key) {
  auto t0 = Clock::now();
  io_.wait(key);
  stats.wait_s += std::chrono::duration<double>(Clock::now() - t0).count();
}

namespace {
// A failed read's error, saying which kind of read it was (a demand miss or a prefetch).
template <typename F>
void naming_the_read(bool demand, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + (demand ? " (a demand read)" : " (a prefetched read)"));
  }
}
}  // namespace

void WindowScheduler::evicting(Key key) {
  Slot* s = pool_.get(key);
  // an evicted slot whose bytes have not landed is an unused prefetch (every acquired slot is read
  // through data() before its release, so it has landed by then): one
  // still queued is cancelled before it reaches the disk, rather than waited for (which would promote
  // a useless read ahead of the others); the decision is the same either way, only the reads differ
  if (!s->landed && io_.cancel(key)) {
    io_.release(key);
    return;
  }
  if (!s->landed && !io_.orders_reuse()) {  // its bytes must land before the slot is reused; a failed read fails the run
    naming_the_read(s->demand, [&] {
      if (!io_.landed(key))
        wait(key);
      else
        io_.check(key);  // rethrows the read's error, whenever it finished
    });
  }
  io_.release(key);
}

const uint8_t* WindowScheduler::data(Key key) {
  Slot* s = pool_.get(key);
  if (!s->landed) {
    naming_the_read(s->demand, [&] {
      if (!io_.landed(key)) {
        if (!s->demand) stats.late += 1;  // a hit whose read is still on its way
        wait(key);
      } else {
        io_.check(key);  // rethrows the read's error (I/O, checksum) if it failed
      }
    });
    io_.take(key);
    s->landed = true;
  }
  return pool_.data(*s);
}

bool WindowScheduler::landed(Key key) {
  Slot* s = pool_.get(key);
  return s->landed || io_.landed(key);
}

void WindowScheduler::plan(int64_t step, const std::vector<int64_t>& targets,
                           std::vector<std::vector<float>> scores) {
  std::vector<int64_t> ts;
  std::vector<std::vector<float>> probs;
  for (size_t w = 0; w < scores.size(); ++w) {
    auto& s = scores[w];
    bool any = false, nonneg = true;
    float sum = 0.0f;
    for (float v : s) {
      any = any || v != 0.0f;
      nonneg = nonneg && v >= 0.0f;
      sum += v;
    }
    if (!any) continue;
    if (nonneg && sum > 0.0f) {
      float d = std::max(sum, 1e-20f);
      for (auto& v : s) v = v / d;
    } else {
      softmax(s.data(), static_cast<int>(s.size()));
    }
    ts.push_back(targets[w]);
    probs.push_back(std::move(s));
  }
  plan_probs(step, ts, probs);
}

void WindowScheduler::begin_plan(int64_t step) {
  step_ = step;
  step_bytes_ = 0;
  advance(step);
}

void WindowScheduler::queue_candidate(int64_t target, int e, double c) {
  if (c <= 0 || c < cfg_.candidate_threshold) return;
  const Key key{static_cast<int>(target % L_), e};
  auto pn = predicted_next_.find(key);
  if (pn == predicted_next_.end() || pn->second < step_ || target < pn->second) predicted_next_[key] = target;
  if (loading_has(key) || pool_.get(key) != nullptr) return;
  auto old = pending_.find(key);
  if (old != pending_.end() && std::make_pair(old->second.first, -old->second.second) <= std::make_pair(target, -c))
    return;
  pending_[key] = {target, c};
  queue_.emplace_back(target, -c, seq_++, key);
  std::push_heap(queue_.begin(), queue_.end(), std::greater<Item>());
}

void WindowScheduler::plan_probs(int64_t step, const std::vector<int64_t>& targets,
                                 const std::vector<std::vector<float>>& probs) {
  begin_plan(step);
  if (cfg_.prefetch && !probs.empty()) {
    const int m = cfg_.candidates > 0 ? cfg_.candidates : k_;
    for (size_t w = 0; w < targets.size(); ++w)
      for (int e : topk(probs[w], m)) queue_candidate(targets[w], e, probs[w][static_cast<size_t>(e)]);
  }
  pump();
}

void WindowScheduler::plan_ranked(int64_t step, const std::vector<int64_t>& targets,
                                  const std::vector<std::vector<double>>& confs, const std::vector<std::vector<int>>& ids) {
  begin_plan(step);
  if (cfg_.prefetch)
    for (size_t w = 0; w < targets.size(); ++w)
      for (size_t j = 0; j < confs[w].size(); ++j) queue_candidate(targets[w], ids[w][j], confs[w][j]);
  pump();
}

void WindowScheduler::pump(const std::set<Key>& protect) {
  while (!queue_.empty()) {
    const auto [deadline, negc, sq, key] = queue_.front();
    auto pend = pending_.find(key);
    if (pend == pending_.end() || pend->second != std::make_pair(deadline, -negc)) {
      std::pop_heap(queue_.begin(), queue_.end(), std::greater<Item>());
      queue_.pop_back();  // superseded entry
      continue;
    }
    if (deadline <= step_) {
      std::pop_heap(queue_.begin(), queue_.end(), std::greater<Item>());
      queue_.pop_back();
      pending_.erase(key);
      stats.dropped_stale += 1;
      if (events_ != nullptr) emit("drop", key, " reason=stale target=" + std::to_string(deadline));
      continue;
    }
    const bool budget_left = cfg_.step_budget_bytes < 0 || step_bytes_ + pool_.slot_bytes() <= cfg_.step_budget_bytes;
    if (static_cast<int>(loading_.size()) >= cfg_.queue_depth || !budget_left) {
      drop_weak();
      return;
    }
    std::pop_heap(queue_.begin(), queue_.end(), std::greater<Item>());
    queue_.pop_back();
    pending_.erase(key);
    if (loading_has(key) || pool_.get(key) != nullptr) continue;
    if (cfg_.read_budget_bytes >= 0 && backlog_ + pool_.slot_bytes() > cfg_.read_budget_bytes * (deadline - step_)) {
      stats.dropped_late += 1;  // it would land after its step: it only delays other reads
      if (events_ != nullptr) emit("drop", key, " reason=late target=" + std::to_string(deadline));
      continue;
    }
    const int64_t now = step_;
    const int64_t dl = deadline;
    // the veto: the victim is predicted to be needed by the deadline (the window's prediction; with
    // the reuse eviction, its score, history included)
    Slot* slot = pool_.reserve(key, now, true, protect, [this, now, dl](Key v) {
      return reuse_ != nullptr ? reuse_->score(v, now, &predicted_next_) <= dl * 16 : next_predicted_use(v, now) <= dl;
    });
    if (slot == nullptr) {
      stats.dropped_no_slot += 1;
      if (events_ != nullptr) emit("drop", key, " reason=no_slot target=" + std::to_string(deadline));
      continue;
    }
    loading_.emplace_back(key, step_);
    io_.submit(key, pool_.data(*slot), false);
    backlog_ += pool_.slot_bytes();
    stats.prefetch_issued += 1;
    stats.bytes_read += pool_.slot_bytes();
    step_bytes_ += pool_.slot_bytes();
    if (events_ != nullptr)   // (the strings built only where a log is kept: the GPU tier's host keeps none)
      emit("prefetch", key, " target=" + std::to_string(deadline) + " conf=" + EventLog::fixed(-negc, 4));
  }
}

void WindowScheduler::drop_weak() {
  std::vector<Item> items = queue_;
  std::sort(items.begin(), items.end());
  std::vector<Item> keep;
  for (const auto& item : items) {
    const auto& [deadline, negc, sq, key] = item;
    auto pend = pending_.find(key);
    if (pend == pending_.end() || pend->second != std::make_pair(deadline, -negc)) continue;
    if (-negc < cfg_.min_confidence) {
      pending_.erase(pend);
      stats.dropped_low_conf += 1;
      if (events_ != nullptr) emit("drop", key, " reason=low_confidence target=" + std::to_string(deadline));
    } else {
      keep.push_back(item);
    }
  }
  std::make_heap(keep.begin(), keep.end(), std::greater<Item>());
  queue_.swap(keep);
}

void WindowScheduler::advance(int64_t step) {
  if (cfg_.read_budget_bytes >= 0 && step > backlog_step_) {
    backlog_ = std::max<int64_t>(0, backlog_ - cfg_.read_budget_bytes * (step - backlog_step_));
    backlog_step_ = step;
  }
}

ReadBudgetMeter::ReadBudgetMeter(double read_bytes_per_s, int64_t slot_bytes)
    : rate_(read_bytes_per_s), slot_kib_((slot_bytes + 1023) / 1024) {}

int64_t ReadBudgetMeter::at(int span, double now_s, double wait_s) {
  if (span == span_) {
    const double dt = std::max(0.0, (now_s - last_now_) - (wait_s - last_wait_));
    est_ = fresh_ ? dt : est_ + (dt - est_) / 8.0;
    fresh_ = false;
  } else {  // another span: its first step's time replaces the estimate
    span_ = span;
    fresh_ = true;
  }
  last_now_ = now_s, last_wait_ = wait_s;
  if (est_ <= 0) return -1;
  const auto kib = static_cast<int64_t>(std::min(rate_ * est_ / 1024.0, static_cast<double>(kMaxBudgetKib)));
  return std::min(std::max(kib, slot_kib_), kMaxBudgetKib) * 1024;
}

void WindowScheduler::set_read_budget(int64_t step, int64_t bytes) {
  if (cfg_.read_budget_bytes >= 0) {
    advance(step);
  } else {
    backlog_ = static_cast<int64_t>(loading_.size()) * pool_.slot_bytes();
    backlog_step_ = step;
  }
  cfg_.read_budget_bytes = bytes;
}

void WindowScheduler::acquire_read(int64_t step, const std::vector<Key>& keys) {
  std::vector<Key> order(keys);
  std::stable_partition(order.begin(), order.end(), [this](const Key& k) { return pool_.get(k) != nullptr; });
  acquire(step, order);
  for (const Key& key : keys) data(key);
}

void WindowScheduler::acquire(int64_t step, const std::vector<Key>& keys) {
  step_ = step;
  advance(step);
  retire(step);
  if (reuse_ != nullptr) reuse_->observe(step, keys);  // before any reservation (the evictions read it)
  const std::set<Key> need(keys.begin(), keys.end());
  for (const Key& key : keys) {
    stats.requests += 1;
    Slot* slot = pool_.get(key);
    if (slot != nullptr) {
      if (!slot->ready) {  // prefetched this very step
        loading_erase(key);
        slot->ready = true;
      }
      stats.hits += 1;
      stats.prefetch_hits += slot->prefetched ? 1 : 0;
      if (events_ != nullptr) emit("hit", key, std::string(" prefetched=") + (slot->prefetched ? "1" : "0"));
    } else {
      stats.misses += 1;
      pending_.erase(key);
      slot = pool_.reserve(key, step, false, need);
      if (slot == nullptr)
        throw std::logic_error("pool has no evictable slot for a demand read (every slot pinned)");
      slot->ready = true;
      slot->demand = true;
      io_.submit(key, pool_.data(*slot), true);
      // not in the read budget's backlog: the step waits for its demand reads, so it lasts as long as they
      // take and the prefetches' schedule (in steps) is not pushed back (the Python reference's rule)
      stats.bytes_read += pool_.slot_bytes();
      emit("miss", key);
    }
    slot->pins += 1;
  }
}

void WindowScheduler::release(int64_t step, const std::vector<Key>& keys, bool do_pump) {
  for (const Key& key : keys) {
    Slot* s = pool_.get(key);
    s->pins -= 1;
    pool_.touch(*s, step);
  }
  if (do_pump) pump();
}

}  // namespace spx
