// The process-wide parallel-for (parallel.h): the installed backend (ExecuTorch's thread pool in the
// runner) or a std::thread fallback whose workers sleep on a condition variable between jobs.
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace spx {

namespace {

ParallelBackend g_backend;  // constant-initialised: safe to set from another file's static initialiser

// Workers take indices from a shared counter; the job's caller takes part too and waits until every
// index has finished. Sleeping (not spinning) between jobs keeps idle workers off the cores that the
// reader lanes and ExecuTorch use.
class FallbackPool {
 public:
  ~FallbackPool() { resize(1); }

  size_t threads() const { return workers_.size() + 1; }

  void resize(size_t n) {
    n = std::max<size_t>(n, 1);
    if (n == threads()) return;
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    std::lock_guard<std::mutex> g(m_);
    stop_ = false;
    for (size_t i = 1; i < n; ++i) workers_.emplace_back([this, gen = generation_] { work(gen); });
  }

  void run(size_t n, FunctionRef<void(size_t)> fn) {
    std::unique_lock<std::mutex> g(m_);
    fn_ = &fn;
    n_ = n;
    next_.store(0);
    done_ = 0;
    ++generation_;
    g.unlock();
    cv_.notify_all();
    drain();
    g.lock();
    done_cv_.wait(g, [&] { return done_ == n_ && busy_ == 0; });
    fn_ = nullptr;
    if (error_) {
      std::exception_ptr e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  // Runs indices until none are left; counts them as done.
  void drain() {
    size_t mine = 0;
    for (;;) {
      size_t i = next_.fetch_add(1);
      if (i >= n_) break;
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> g(m_);
        if (!error_) error_ = std::current_exception();
      }
      ++mine;
    }
    if (mine) {
      std::lock_guard<std::mutex> g(m_);
      done_ += mine;
      if (done_ == n_) done_cv_.notify_all();
    }
  }

  // seen: the generation when the worker was made (a job posted before the thread first runs is
  // still picked up; stop_ is checked whatever the generation)
  void work(uint64_t seen) {
    std::unique_lock<std::mutex> g(m_);
    for (;;) {
      cv_.wait(g, [&] { return stop_ || generation_ != seen; });
      seen = generation_;
      if (stop_) return;
      if (fn_ == nullptr) continue;
      ++busy_;
      g.unlock();
      drain();
      g.lock();
      if (--busy_ == 0) done_cv_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const FunctionRef<void(size_t)>* fn_ = nullptr;
  size_t n_ = 0, done_ = 0, busy_ = 0;
  std::atomic<size_t> next_{0};
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

FallbackPool& fallback() {
  static FallbackPool pool;
  return pool;
}

std::mutex g_run_mutex;  // one job at a time on the fallback pool

}  // namespace

void set_parallel_backend(const ParallelBackend& b) { g_backend = b; }

size_t parallel_threads() {
  if (g_backend.threads) return std::max<size_t>(g_backend.threads(), 1);
  return fallback().threads();
}

void set_fallback_threads(size_t n) {
  std::lock_guard<std::mutex> g(g_run_mutex);
  fallback().resize(n);
}

void parallel_for(size_t n, FunctionRef<void(size_t)> fn) {
  if (n == 0) return;
  if (n == 1 || parallel_threads() <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  if (g_backend.run) {
    g_backend.run(n, fn);
    return;
  }
  std::lock_guard<std::mutex> g(g_run_mutex);
  fallback().run(n, fn);
}

}  // namespace spx
