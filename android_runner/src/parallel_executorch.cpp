// parallel.h's backend in the runner: ExecuTorch's own thread pool (the one XNNPACK uses, sized by
// the runner's --threads), installed by a static initialiser when this file is linked in. It is
// built into specprefetch-runner only (CMakeLists.txt), never into spx_core: the checks and fuzz
// targets, which have no ExecuTorch, keep the std::thread fallback.
#include <cstddef>
#include <cstdint>

#include "et_threadpool.h"
#include "parallel.h"

namespace {

namespace etp = executorch::extension::threadpool;

size_t et_threads() {
  etp::ThreadPool* p = etp::get_threadpool();
  return p ? p->get_thread_count() : 1;
}

void et_run(size_t n, spx::FunctionRef<void(size_t)> fn) {
  etp::ThreadPool* p = etp::get_threadpool();
  if (p == nullptr) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto call = [&fn](size_t i) { fn(i); };
  p->run(executorch::runtime::FunctionRef<void(size_t)>(call), n);
}

struct Install {
  Install() { spx::set_parallel_backend({et_threads, et_run}); }
} install;

}  // namespace
