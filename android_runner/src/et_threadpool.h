// ExecuTorch's thread pool (the one XNNPACK uses). An ExecuTorch built from source (the Android NDK
// build) installs its header; the pip wheel does not, so there the members the runner uses are
// declared as ExecuTorch 1.5 defines them in libexecutorch_threadpool (linked as executorch::threadpool).
#pragma once

#include <executorch/runtime/core/function_ref.h>

#include <cstddef>
#include <cstdint>

#if __has_include(<executorch/extension/threadpool/threadpool.h>)
#include <executorch/extension/threadpool/threadpool.h>
#else
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t num_threads);
  void run(executorch::runtime::FunctionRef<void(size_t)> fn, size_t range);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool
#endif
