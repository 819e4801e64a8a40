// A C ABI over the runner's scheduler, pool and reuse eviction (scheduler.h, pool.h), for a host loop in
// Python: the GPU tier's (toolkit/runtime/native_sched.py loads it with ctypes and builds it with the
// system's C++ compiler). The decisions are the runner's, which are the Python reference's; reads go through
// one callback into the caller (its copy IO), so the caller keeps its streams, slots and buffers, or, under the
// CUDA driver's calls, through the copy IO of cuda_copy_io.h (spx_cio_*: toolkit/runtime/native_io.py), which the
// Python scheduler can drive too.
//
// Every function returns 0 on success and -1 on failure (a C++ exception, or a failed callback), with the
// message in spx_sched_error(); a callback reports failure by returning -1 (the caller keeps its own error).
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <memory>
#include <string>
#include <vector>

#include "cuda_copy_io.h"
#include "pool.h"
#include "scheduler.h"

// built with -fvisibility=hidden and a version script (native_sched.py): only these entry points are exported,
// the libstdc++ linked in statically stays private to the library
#define SPX_API __attribute__((visibility("default")))

namespace {

using spx::Key;

// op: what the scheduler asks of the caller's IO, one callback for all (ctypes: one function type)
enum IoOp { kSubmitPrefetch = 0, kSubmitDemand = 1, kLanded = 2, kWait = 3, kRelease = 4, kTake = 5 };
using IoFn = int (*)(int op, int layer, int expert);

thread_local std::string g_error;

struct CallbackFailed : std::runtime_error {
  CallbackFailed() : std::runtime_error("the IO callback failed") {}
};

class CallbackIO : public spx::IOBackend {
 public:
  CallbackIO(IoFn fn, bool orders_reuse) : fn_(fn), orders_reuse_(orders_reuse) {}
  void submit(Key key, void*, bool demand) override { call(demand ? kSubmitDemand : kSubmitPrefetch, key); }
  bool landed(Key key) override { return call(kLanded, key) != 0; }
  void wait(Key key) override { call(kWait, key); }
  // (the caller's IO raises where a read is issued or waited for: a landed read has nothing to rethrow, and a
  // wait on it would cost the GPU tier's IO a stream wait and two events)
  void check(Key) override {}
  void release(Key key) override { call(kRelease, key); }
  void take(Key key) override { call(kTake, key); }
  bool orders_reuse() const override { return orders_reuse_; }

 private:
  int call(int op, Key key) {
    const int r = fn_(op, key.first, key.second);
    if (r < 0) throw CallbackFailed();
    return r;
  }
  IoFn fn_;
  bool orders_reuse_;
};

// a copy IO (spx_cio_new), shared by the caller and any scheduler it is given to
struct IoHandle {
  std::shared_ptr<spx::CudaCopyIO> io;
};

spx::CudaCopyIO& IO(void* h) { return *static_cast<IoHandle*>(h)->io; }

struct Handle {
  std::shared_ptr<spx::IOBackend> io;
  std::unique_ptr<spx::ReuseHistory> reuse;
  std::unique_ptr<spx::ExpertPool> pool;
  std::unique_ptr<spx::WindowScheduler> sched;
  int E = 0;
  int L = 0;
};

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
  } catch (...) {
    g_error = "an unknown C++ exception";
  }
  return -1;
}

Handle* H(void* h) { return static_cast<Handle*>(h); }

void check_key(const Handle* h, int layer, int expert) {
  if (layer < 0 || layer >= h->L || expert < 0 || expert >= h->E)
    throw spx::Error("expert (" + std::to_string(layer) + ", " + std::to_string(expert) + ") is outside the model's " +
                     std::to_string(h->L) + " MoE layers x " + std::to_string(h->E) + " experts");
}

// the key, which the pool must hold (data, landed, release read its slot)
Key held(Handle* h, int layer, int expert) {
  check_key(h, layer, expert);
  if (h->pool->get({layer, expert}) == nullptr)
    throw spx::Error("expert (" + std::to_string(layer) + ", " + std::to_string(expert) + ") has no slot in the pool");
  return {layer, expert};
}

std::vector<Key> keys_of(const Handle* h, const int32_t* kv, int n) {
  std::vector<Key> keys(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    check_key(h, kv[2 * i], kv[2 * i + 1]);
    keys[static_cast<size_t>(i)] = {kv[2 * i], kv[2 * i + 1]};
  }
  return keys;
}

std::vector<std::vector<float>> rows_of(const float* v, int W, int E) {
  std::vector<std::vector<float>> rows(static_cast<size_t>(W));
  for (int w = 0; w < W; ++w) rows[static_cast<size_t>(w)].assign(v + static_cast<size_t>(w) * E, v + static_cast<size_t>(w + 1) * E);
  return rows;
}

}  // namespace

extern "C" {

SPX_API const char* spx_sched_error() { return g_error.c_str(); }

// One sequence's pool and scheduler. cfg_i: candidates, queue_depth, step_budget_bytes, read_budget_bytes,
// prefetch (0/1), orders_reuse (0/1); cfg_d: min_confidence, candidate_threshold. Reuse table (policy
// "reuse"; its array sizes checked by the caller): bits, visits16 [2^bits], classes [L*E] or null, n_classes,
// class_visits16 [n_classes * 2^bits]. Belady (policy "belady"): future [P * L * k] expert ids of P positions
// (P < 0: none), the prompt one unit (the GPU tier's prefill is one pass). The pool maps no arena: the caller's IO holds
// the bytes. Reads: through `native_io` (an spx_cio_new handle, kept alive by the scheduler too) where it is given,
// else through the callback `io`.
SPX_API int spx_sched_new(void** out, int64_t budget_bytes, int64_t slot_bytes, const char* policy, int L, int E, int k,
                          const int64_t* cfg_i, const double* cfg_d, int bits, const int64_t* visits16,
                          const int32_t* classes, int n_classes, const int64_t* class_visits16, const int32_t* future,
                          int P, IoFn io, void* native_io) {
  return guarded([&] {
    if (L < 1 || E < 1 || k < 1 || k > E) throw spx::Error("a model of L >= 1 MoE layers, E >= 1 experts, 1 <= k <= E");
    auto h = std::make_unique<Handle>();
    h->E = E;
    h->L = L;
    spx::SchedulerConfig cfg;
    cfg.candidates = static_cast<int>(cfg_i[0]);
    cfg.queue_depth = static_cast<int>(cfg_i[1]);
    cfg.step_budget_bytes = cfg_i[2];
    cfg.read_budget_bytes = cfg_i[3];
    cfg.prefetch = cfg_i[4] != 0;
    cfg.min_confidence = cfg_d[0];
    cfg.candidate_threshold = cfg_d[1];
    if (native_io != nullptr)
      h->io = static_cast<IoHandle*>(native_io)->io;
    else
      h->io = std::make_shared<CallbackIO>(io, cfg_i[5] != 0);
    const std::string pol(policy);
    spx::ExpertPool::NextUse next_use;
    if (pol == "belady") {
      if (P < 0) throw spx::Error("belady eviction needs the run's recorded routing (its future)");
      std::vector<std::vector<int>> fut(static_cast<size_t>(P));
      for (int p = 0; p < P; ++p) {
        fut[static_cast<size_t>(p)].assign(future + static_cast<size_t>(p) * L * k, future + static_cast<size_t>(p + 1) * L * k);
        for (int e : fut[static_cast<size_t>(p)]) check_key(h.get(), 0, e);
      }
      next_use = spx::belady_next_use(fut, L, k, {});
    }
    if (pol == "reuse") {
      if (visits16 == nullptr || bits < 1 || bits > 20) throw spx::Error("the reuse eviction needs a reuse table");
      spx::ReuseTable t;
      t.bits = bits;
      t.visits16.assign(visits16, visits16 + (size_t{1} << bits));
      if (classes != nullptr) {
        for (int li = 0; li < L; ++li) {
          t.classes.emplace_back(classes + static_cast<size_t>(li) * E, classes + static_cast<size_t>(li + 1) * E);
          for (int c : t.classes.back())
            if (c < 0 || c >= n_classes) throw spx::Error("a reuse class id outside the table's classes");
        }
        for (int c = 0; c < n_classes; ++c)
          t.class_visits16.emplace_back(class_visits16 + (static_cast<size_t>(c) << bits),
                                        class_visits16 + (static_cast<size_t>(c + 1) << bits));
      }
      h->reuse = std::make_unique<spx::ReuseHistory>(t, L);
    }
    h->pool = std::make_unique<spx::ExpertPool>(budget_bytes, slot_bytes, pol, k, L * E, next_use, false);
    h->sched = std::make_unique<spx::WindowScheduler>(*h->pool, *h->io, cfg, L, k, nullptr, h->reuse.get());
    *out = h.release();
  });
}

SPX_API void spx_sched_free(void* h) { delete H(h); }

SPX_API int spx_acquire(void* h, int64_t step, const int32_t* keys, int n) {
  return guarded([&] { H(h)->sched->acquire(step, keys_of(H(h), keys, n)); });
}

// A MoE layer's experts made resident, pinned and read: acquire with the pool's residents first (each group in the
// given order), then data() of each key in the given order (one crossing for the GPU tier's graph decode)
SPX_API int spx_acquire_read(void* h, int64_t step, const int32_t* keys, int n) {
  return guarded([&] { H(h)->sched->acquire_read(step, keys_of(H(h), keys, n)); });
}

// *out = 1 when every key has a slot in the pool: data() of each in the given order and nothing else (the acquire's
// bookkeeping follows: the GPU tier's graph decode enqueues the layer's replay between them); 0: nothing done
SPX_API int spx_read_resident(void* h, const int32_t* keys, int n, int* out) {
  *out = 0;
  return guarded([&] {
    std::vector<Key> ks = keys_of(H(h), keys, n);
    for (const Key& key : ks)
      if (H(h)->pool->get(key) == nullptr) return;
    for (const Key& key : ks) H(h)->sched->data(key);
    *out = 1;
  });
}

SPX_API int spx_release(void* h, int64_t step, const int32_t* keys, int n, int pump) {
  return guarded([&] {
    std::vector<Key> ks = keys_of(H(h), keys, n);
    for (const Key& key : ks) {
      const spx::Slot* s = H(h)->pool->get(key);
      if (s == nullptr || s->pins < 1) throw spx::Error("releasing an expert that is not acquired");
    }
    H(h)->sched->release(step, ks, pump != 0);
  });
}

SPX_API int spx_data(void* h, int layer, int expert) {
  return guarded([&] { H(h)->sched->data(held(H(h), layer, expert)); });
}

// *out: 1 when the slot's bytes are in memory (data() would not wait)
SPX_API int spx_landed(void* h, int layer, int expert, int* out) {
  return guarded([&] { *out = H(h)->sched->landed(held(H(h), layer, expert)) ? 1 : 0; });
}

// probs: W rows of E probabilities, row w for the step targets[w]
SPX_API int spx_plan_probs(void* h, int64_t step, const int64_t* targets, int W, const float* probs) {
  return guarded([&] {
    H(h)->sched->plan_probs(step, std::vector<int64_t>(targets, targets + W), rows_of(probs, W, H(h)->E));
  });
}

// confs / ids: W rows of m candidates each (a confidence of 0: no candidate)
SPX_API int spx_plan_ranked(void* h, int64_t step, const int64_t* targets, int W, int m, const double* confs,
                            const int32_t* ids) {
  return guarded([&] {
    std::vector<std::vector<double>> c(static_cast<size_t>(W));
    std::vector<std::vector<int>> e(static_cast<size_t>(W));
    for (int w = 0; w < W; ++w) {
      c[static_cast<size_t>(w)].assign(confs + static_cast<size_t>(w) * m, confs + static_cast<size_t>(w + 1) * m);
      e[static_cast<size_t>(w)].assign(ids + static_cast<size_t>(w) * m, ids + static_cast<size_t>(w + 1) * m);
      for (int x : e[static_cast<size_t>(w)]) check_key(H(h), 0, x);
    }
    H(h)->sched->plan_ranked(step, std::vector<int64_t>(targets, targets + W), c, e);
  });
}

// sizes[j] experts of visit j (target + j * L), one after another in `experts`
SPX_API int spx_set_next_visits(void* h, int layer, int64_t target, const int32_t* experts, const int32_t* sizes,
                                int visits) {
  return guarded([&] {
    auto* r = H(h)->sched->reuse();
    if (r == nullptr) throw spx::Error("set_next_visits: the pool does not evict by reuse");
    check_key(H(h), layer, 0);
    if (visits < 0 || visits > spx::kMaxNextVisits)
      throw spx::Error("set_next_visits: " + std::to_string(visits) + " visits, not 0.." +
                       std::to_string(spx::kMaxNextVisits));
    for (int j = 0; j < visits; ++j)
      if (sizes[j] < 0) throw spx::Error("set_next_visits: a set of " + std::to_string(sizes[j]) + " experts");
    std::vector<std::vector<int>> sets;
    for (int j = 0, at = 0; j < visits; at += sizes[j++]) {
      for (int i = 0; i < sizes[j]; ++i) check_key(H(h), layer, experts[at + i]);
      sets.emplace_back(experts + at, experts + at + sizes[j]);
    }
    r->set_next_visits(layer, target, std::move(sets));
  });
}

// Preload: a slot for the key (ready, read on demand), its read left to the caller.
SPX_API int spx_preload(void* h, int layer, int expert) {
  return guarded([&] {
    check_key(H(h), layer, expert);
    if (H(h)->pool->get({layer, expert}) != nullptr) throw spx::Error("preload: the expert already has a slot");
    if (!H(h)->pool->preload({layer, expert})) throw spx::Error("preload: the pool is full");
  });
}

// *out: 1 when the pool holds the key (ready or loading)
SPX_API int spx_has(void* h, int layer, int expert, int* out) {
  return guarded([&] {
    check_key(H(h), layer, expert);
    *out = H(h)->pool->get({layer, expert}) != nullptr ? 1 : 0;
  });
}

SPX_API int spx_settle(void* h) {
  return guarded([&] { H(h)->pool->settle(); });
}

// out[0..10]: requests, hits, prefetch_hits, late, misses, prefetch_issued, dropped_stale,
// dropped_low_conf, dropped_no_slot, dropped_late, bytes_read; *wait_s
SPX_API int spx_stats(void* h, int64_t* out, double* wait_s) {
  return guarded([&] {
    const spx::SchedulerStats& s = H(h)->sched->stats;
    const int64_t v[11] = {s.requests, s.hits, s.prefetch_hits, s.late, s.misses, s.prefetch_issued,
                           s.dropped_stale, s.dropped_low_conf, s.dropped_no_slot, s.dropped_late, s.bytes_read};
    std::memcpy(out, v, sizeof v);
    *wait_s = s.wait_s;
  });
}

// out[0..5]: evictions, wasted_prefetches, peak_bytes, prefetches in flight, the scheduler's step, capacity (slots)
SPX_API int spx_pool_info(void* h, int64_t* out) {
  return guarded([&] {
    auto* x = H(h);
    const int64_t v[6] = {x->pool->evictions, x->pool->wasted_prefetches, x->pool->peak_bytes,
                          static_cast<int64_t>(x->sched->in_flight()), x->sched->step(), x->pool->capacity()};
    std::memcpy(out, v, sizeof v);
  });
}

// *out: slots a prefetch filled that no step has used yet (a walk over the slots: the run's figures only)
SPX_API int spx_unused_prefetches(void* h, int64_t* out) {
  return guarded([&] { *out = H(h)->pool->unused_prefetches(); });
}

// The read budget from `step` on (bytes a step; -1: none): WindowScheduler::set_read_budget (the GPU tier sets a
// fixed one at spx_sched_new; tests/test_native_sched.py drives this against the Python scheduler's)
SPX_API int spx_set_read_budget(void* h, int64_t step, int64_t bytes) {
  return guarded([&] { H(h)->sched->set_read_budget(step, bytes); });
}

// ReadBudgetMeter over n MoE steps (spans[i], now_s[i], wait_s[i]): out[i] the budget in bytes from step i on
// (-1: none yet), as the runner sets it: for tests/test_native_sched.py, which holds the Python ReadBudgetMeter
// to the same rule
SPX_API int spx_budget_meter(double read_bytes_per_s, int64_t slot_bytes, int n, const int32_t* spans,
                             const double* now_s, const double* wait_s, int64_t* out) {
  return guarded([&] {
    spx::ReadBudgetMeter m(read_bytes_per_s, slot_bytes);
    for (int i = 0; i < n; ++i) out[i] = m.at(spans[i], now_s[i], wait_s[i]);
  });
}

// -- the copy IO through the CUDA driver (cuda_copy_io.h) --------------------------------------------------
// addr: the slot arena's device address, the pinned host buffer's; dims: capacity, slot stride, blob stride, bytes a
// copy, L, E; streams: copy, demand, compute (handles; 0: the legacy default stream)
SPX_API int spx_cio_new(void** out, const char* library, const uint64_t* addr, const int64_t* dims,
                        const uint64_t* streams) {
  return guarded([&] {
    spx::CudaCopyIO::Layout lay;
    lay.slots = addr[0];
    lay.host = addr[1];
    lay.capacity = static_cast<int>(dims[0]);
    lay.slot_stride = dims[1];
    lay.blob_stride = dims[2];
    lay.nbytes = dims[3];
    lay.L = static_cast<int>(dims[4]);
    lay.E = static_cast<int>(dims[5]);
    auto h = std::make_unique<IoHandle>();
    h->io = std::make_shared<spx::CudaCopyIO>(library, lay, streams[0], streams[1], streams[2]);
    *out = h.release();
  });
}

SPX_API void spx_cio_free(void* h) { delete static_cast<IoHandle*>(h); }

SPX_API int spx_cio_submit(void* h, int layer, int expert, int demand) {
  return guarded([&] { IO(h).submit({layer, expert}, nullptr, demand != 0); });
}

SPX_API int spx_cio_landed(void* h, int layer, int expert, int* out) {
  return guarded([&] { *out = IO(h).landed({layer, expert}) ? 1 : 0; });
}

SPX_API int spx_cio_wait(void* h, int layer, int expert) {
  return guarded([&] { IO(h).wait({layer, expert}); });
}

// *slot: the expert's slot, the compute stream ordered after its copy
SPX_API int spx_cio_take(void* h, int layer, int expert, int* slot) {
  return guarded([&] {
    IO(h).take({layer, expert});
    *slot = IO(h).slot({layer, expert});
  });
}

SPX_API int spx_cio_release(void* h, int layer, int expert) {
  return guarded([&] { IO(h).release({layer, expert}); });
}

// what 0: the compute stream (a handle); 1: fenced (0/1)
SPX_API int spx_cio_set(void* h, int what, uint64_t value) {
  return guarded([&] {
    if (what == 0)
      IO(h).set_compute(value);
    else if (what == 1)
      IO(h).set_fenced(value != 0);
    else
      throw spx::Error("spx_cio_set: no setting " + std::to_string(what));
  });
}

// out[i]: the slot of key i (layer, expert pairs), -1 for none
SPX_API int spx_cio_slots(void* h, const int32_t* keys, int n, int64_t* out) {
  return guarded([&] {
    for (int i = 0; i < n; ++i) out[i] = IO(h).slot({keys[2 * i], keys[2 * i + 1]});
  });
}

// out[0..3]: copies, stalls, bytes copied, events made
SPX_API int spx_cio_counts(void* h, int64_t* out) {
  return guarded([&] {
    const int64_t v[4] = {IO(h).copies(), IO(h).stalls(), IO(h).copied_bytes(), IO(h).events_made()};
    std::memcpy(out, v, sizeof v);
  });
}

// *out: milliseconds summed over the copies (which 0) or the stalls (1) from index `since` on
SPX_API int spx_cio_ms(void* h, int which, int64_t since, double* out) {
  return guarded([&] { *out = IO(h).ms(which == 0, since); });
}

}  // extern "C"
