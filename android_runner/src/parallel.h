// One process-wide parallel-for for the expert kernels. In the runner it is backed by ExecuTorch's
// own thread pool (parallel_executorch.cpp registers it at start-up), so the kernels and XNNPACK share
// one pool sized by --threads instead of two pools fighting over the same cores. Without ExecuTorch
// (check_kernels, the other checks, the fuzz targets) a small std::thread pool is used: its workers
// sleep on a condition variable between jobs (no spinning), and it has one thread (the caller) until
// set_fallback_threads() asks for more.
//
// parallel_for(n, fn) calls fn(i) once for every i in [0, n), possibly concurrently, and returns when
// all calls have finished; the calling thread takes part. Callers make results independent of the
// thread count by having every output element computed by exactly one call.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

namespace spx {

// A non-owning reference to a callable (like ExecuTorch's FunctionRef): cheap to pass by value, valid
// while the referenced callable lives.
template <class Fn>
class FunctionRef;

template <class Ret, class... Args>
class FunctionRef<Ret(Args...)> {
 public:
  template <class F, class = std::enable_if_t<!std::is_same<std::decay_t<F>, FunctionRef>::value>>
  FunctionRef(F&& f) noexcept  // NOLINT: implicit, as a function parameter type
      : obj_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o, Args... a) -> Ret { return (*static_cast<std::remove_reference_t<F>*>(o))(std::forward<Args>(a)...); }) {}
  Ret operator()(Args... a) const { return call_(obj_, std::forward<Args>(a)...); }

 private:
  void* obj_;
  Ret (*call_)(void*, Args...);
};

// Runs fn(0) .. fn(n-1) on the process-wide pool (inline when n <= 1 or the pool has one thread).
// Not reentrant: fn must not call parallel_for.
void parallel_for(size_t n, FunctionRef<void(size_t)> fn);

// Threads parallel_for uses (the caller included): ExecuTorch's pool size in the runner.
size_t parallel_threads();

// The pool behind parallel_for (internal: set once at start-up, before any parallel_for).
struct ParallelBackend {
  size_t (*threads)() = nullptr;
  void (*run)(size_t n, FunctionRef<void(size_t)> fn) = nullptr;
};
void set_parallel_backend(const ParallelBackend& b);

// The std::thread fallback's size (the caller included; at least 1). No effect while another backend
// (ExecuTorch's pool) is installed. Not to be called while a parallel_for runs.
void set_fallback_threads(size_t n);

}  // namespace spx
