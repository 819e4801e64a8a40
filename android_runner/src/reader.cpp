// Reader: pread lanes with a demand queue ahead of the prefetch queue (see reader.h).
#include "reader.h"

#include <system_error>

namespace spx {

Reader::Reader(const ExpertStore& store, int lanes, bool verify) : store_(store), verify_(verify) {
  if (lanes < 1 || lanes > 64) throw Error("reader: " + std::to_string(lanes) + " lanes; choose 1..64");
  try {
    for (int i = 0; i < lanes; ++i) threads_.emplace_back([this] { lane(); });
  } catch (const std::system_error& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
    throw Error(std::string("reader: cannot start its threads (") + e.what() + ")");
  }
}

Reader::~Reader() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

std::string Reader::name(Key key) const {
  return "expert (" + std::to_string(key.first) + ", " + std::to_string(key.second) + ")";
}

void Reader::submit(Key key, void* dst, bool demand) {
  store_.entry(key.first, key.second);  // range check (throws Error)
  if (!dst) throw Error(store_.path + ": " + name(key) + " submitted without a buffer");
  std::lock_guard<std::mutex> lk(mu_);
  auto it = reqs_.find(key);
  if (it != reqs_.end()) {
    Req& r = it->second;
    if (r.dst != dst)
      throw Error(store_.path + ": " + name(key) + " submitted into another buffer while its read is tracked (forget it first)");
    if (demand && !r.demand && r.state == State::queued) {
      r.demand = true;
      demand_q_.emplace_back(key, r.id);
      work_cv_.notify_one();
    }
    return;
  }
  Req r;
  r.dst = dst;
  r.demand = demand;
  r.id = ++next_id_;
  (demand ? demand_q_ : prefetch_q_).emplace_back(key, r.id);
  reqs_.emplace(key, std::move(r));
  work_cv_.notify_one();
}

bool Reader::landed(Key key) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = reqs_.find(key);
  return it != reqs_.end() && it->second.state == State::done;
}

void Reader::wait(Key key) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = reqs_.find(key);
  if (it == reqs_.end()) throw Error(store_.path + ": " + name(key) + " was waited for but never submitted");
  if (it->second.state == State::queued && !it->second.demand) {
    it->second.demand = true;
    demand_q_.emplace_back(key, it->second.id);
    work_cv_.notify_one();
  }
  const uint64_t id = it->second.id;
  done_cv_.wait(lk, [&] {
    auto j = reqs_.find(key);
    return j == reqs_.end() || j->second.id != id || j->second.state == State::done;
  });
  it = reqs_.find(key);
  if (it == reqs_.end() || it->second.id != id)
    throw Error(store_.path + ": " + name(key) + " was forgotten while being waited for");
  if (it->second.failed) throw Error(it->second.error);
}

void Reader::forget(Key key) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = reqs_.find(key);
  if (it == reqs_.end()) return;
  if (it->second.state == State::reading)
    throw Error(store_.path + ": " + name(key) + " forgotten while its read is in flight (wait for it first)");
  reqs_.erase(it);  // a queued read is cancelled: its queue entry no longer matches a request
  done_cv_.notify_all();
}

void Reader::pause(bool on) {
  std::lock_guard<std::mutex> lk(mu_);
  paused_ = on;
  if (!on) work_cv_.notify_all();
}

bool Reader::cancel(Key key) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = reqs_.find(key);
  if (it == reqs_.end() || it->second.state != State::queued) return false;
  reqs_.erase(it);  // its queue entry no longer matches a request: the lanes skip it
  ++cancelled_;
  done_cv_.notify_all();
  return true;
}

void Reader::lane() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    work_cv_.wait(lk, [&] { return stop_ || (!paused_ && (!demand_q_.empty() || !prefetch_q_.empty())); });
    if (stop_) return;
    auto& q = demand_q_.empty() ? prefetch_q_ : demand_q_;
    const auto [key, id] = q.front();
    q.pop_front();
    auto it = reqs_.find(key);
    if (it == reqs_.end() || it->second.id != id || it->second.state != State::queued) continue;  // stale
    it->second.state = State::reading;
    void* dst = it->second.dst;
    lk.unlock();

    bool failed = false;
    std::string error;
    try {
      store_.read(key.first, key.second, dst);
      if (verify_ && !store_.check(key.first, key.second, dst)) {
        failed = true;
        error = store_.path + ": " + name(key) + " failed its checksum (corrupt blob)";
      }
    } catch (const std::exception& e) {
      failed = true;
      error = e.what();
    } catch (...) {
      failed = true;
      error = store_.path + ": " + name(key) + ": read failed (unknown error)";
    }
    bytes_ += store_.slot_bytes;
    ++reads_;
    if (store_.direct() && reinterpret_cast<uintptr_t>(dst) % ExpertStore::kAlign == 0) ++direct_reads_;

    lk.lock();
    // forget() refuses a request in flight, so it is still ours
    auto done = reqs_.find(key);
    if (done != reqs_.end() && done->second.id == id) {
      done->second.state = State::done;
      done->second.failed = failed;
      done->second.error = std::move(error);
    }
    done_cv_.notify_all();
  }
}

}  // namespace spx
