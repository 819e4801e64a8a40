// The GPU tier's copy IO through the CUDA driver (cuda_copy_io.h).
#include "cuda_copy_io.h"

#include <dlfcn.h>

#include <string>
#include <utility>

#include "common.h"

namespace spx {

namespace {
constexpr int kNotReady = 600;             // CUDA_ERROR_NOT_READY
constexpr unsigned kDisableTiming = 2;     // CU_EVENT_DISABLE_TIMING: an event only waited on
constexpr size_t kSweepEvery = 64;         // spans pushed between reads of every completed one
}  // namespace

// the driver's entry points the IO calls, with the signatures of cuda.h (handles as pointers, addresses as
// 64-bit integers: CUdeviceptr)
struct CudaApi {
  void* lib = nullptr;
  int (*memcpy_async)(uint64_t, uint64_t, size_t, void*) = nullptr;
  int (*stream_wait)(void*, void*, unsigned) = nullptr;
  int (*event_create)(void**, unsigned) = nullptr;
  int (*event_destroy)(void*) = nullptr;
  int (*event_record)(void*, void*) = nullptr;
  int (*event_query)(void*) = nullptr;
  int (*event_elapsed)(float*, void*, void*) = nullptr;
  int (*error_name)(int, const char**) = nullptr;
};

namespace {
template <typename F>
void resolve(CudaApi& api, const std::string& library, F& fn, const char* name) {
  void* p = dlsym(api.lib, name);
  if (p == nullptr) throw Error("launch=driver: the CUDA driver (" + library + ") has no " + name);
  fn = reinterpret_cast<F>(p);
}

void* stream_of(uint64_t handle) { return reinterpret_cast<void*>(static_cast<uintptr_t>(handle)); }
}  // namespace

CudaCopyIO::CudaCopyIO(const std::string& library, const Layout& layout, uint64_t copy_stream,
                       uint64_t demand_stream, uint64_t compute_stream)
    : api_(std::make_unique<CudaApi>()), lay_(layout), copy_stream_(copy_stream), demand_stream_(demand_stream),
      compute_(compute_stream) {
  if (lay_.capacity < 1 || lay_.L < 1 || lay_.E < 1 || lay_.nbytes < 1 || lay_.slot_stride < lay_.nbytes ||
      lay_.blob_stride < lay_.nbytes)
    throw Error("internal: a copy IO of " + std::to_string(lay_.capacity) + " slots of " +
                std::to_string(lay_.slot_stride) + " bytes for blobs of " + std::to_string(lay_.nbytes));
  api_->lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (api_->lib == nullptr) {
    const char* why = dlerror();
    throw Error("launch=driver: cannot load the CUDA driver (" + library + ": " + (why ? why : "dlopen failed") + ")");
  }
  try {
    resolve(*api_, library, api_->memcpy_async, "cuMemcpyAsync");
    resolve(*api_, library, api_->stream_wait, "cuStreamWaitEvent");
    resolve(*api_, library, api_->event_create, "cuEventCreate");
    resolve(*api_, library, api_->event_destroy, "cuEventDestroy_v2");
    resolve(*api_, library, api_->event_record, "cuEventRecord");
    resolve(*api_, library, api_->event_query, "cuEventQuery");
    resolve(*api_, library, api_->event_elapsed, "cuEventElapsedTime");
    resolve(*api_, library, api_->error_name, "cuGetErrorName");
  } catch (...) {
    dlclose(api_->lib);
    throw;
  }
  for (int i = lay_.capacity - 1; i >= 0; --i) free_.push_back(i);   // slot 0 handed out first
  const size_t keys = static_cast<size_t>(lay_.L) * static_cast<size_t>(lay_.E);
  where_.assign(keys, -1);
  done_.assign(keys, nullptr);
  last_use_.resize(static_cast<size_t>(lay_.capacity));
}

CudaCopyIO::~CudaCopyIO() {
  for (auto& e : events_)   // (an event still recorded on a stream is released once it completes)
    if (e->h != nullptr) api_->event_destroy(e->h);
  dlclose(api_->lib);
}

void CudaCopyIO::fail(int rc, const char* call) const {
  const char* name = nullptr;
  const std::string what = api_->error_name(rc, &name) == 0 && name != nullptr ? name : "error " + std::to_string(rc);
  throw Error(std::string("launch=driver: ") + call + " failed: " + what);
}

int CudaCopyIO::index(Key key) const {
  if (key.first < 0 || key.first >= lay_.L || key.second < 0 || key.second >= lay_.E)
    throw Error("expert (" + std::to_string(key.first) + ", " + std::to_string(key.second) +
                ") is outside the copy IO's " + std::to_string(lay_.L) + " MoE layers x " + std::to_string(lay_.E) +
                " experts");
  return key.first * lay_.E + key.second;
}

int CudaCopyIO::slot(Key key) const { return where_[static_cast<size_t>(index(key))]; }

CudaCopyIO::Event* CudaCopyIO::event(bool timing) {
  auto& pool = pool_[timing ? 1 : 0];
  Event* e;
  if (!pool.empty()) {
    e = pool.back();
    pool.pop_back();
  } else {
    void* h = nullptr;
    const int rc = api_->event_create(&h, timing ? 0u : kDisableTiming);
    if (rc != 0) fail(rc, "cuEventCreate");
    events_.push_back(std::make_unique<Event>());
    e = events_.back().get();
    e->h = h;
    e->timing = timing;
  }
  e->refs = 1;
  return e;
}

CudaCopyIO::Event* CudaCopyIO::recorded(bool timing, uint64_t stream) {
  Event* e = event(timing);
  const int rc = api_->event_record(e->h, stream_of(stream));
  if (rc != 0) {
    drop(e);
    fail(rc, "cuEventRecord");
  }
  return e;
}

void CudaCopyIO::drop(Event* e) {
  if (e != nullptr && --e->refs == 0) pool_[e->timing ? 1 : 0].push_back(e);
}

bool CudaCopyIO::complete(Event* e) {
  const int rc = api_->event_query(e->h);
  if (rc == kNotReady) return false;
  if (rc != 0) fail(rc, "cuEventQuery");
  return true;
}

void CudaCopyIO::stream_wait(uint64_t stream, Event* e) {
  const int rc = api_->stream_wait(stream_of(stream), e->h, 0);
  if (rc != 0) fail(rc, "cuStreamWaitEvent");
}

bool CudaCopyIO::read(Span& s, bool must) {
  if (s.a == nullptr) return true;
  float ms = 0.0f;
  const int rc = api_->event_elapsed(&ms, s.a->h, s.b->h);
  if (rc == kNotReady && !must) return false;
  if (rc != 0) fail(rc, "cuEventElapsedTime");
  s.ms = ms;
  drop(s.a);
  drop(s.b);
  s.a = s.b = nullptr;
  return true;
}

void CudaCopyIO::sweep(std::vector<Span>& spans, size_t& from) noexcept {
  // the oldest spans while they have completed (one call where the device is behind), and every 64 spans all of
  // them (the copy and demand streams' copies complete out of order); a span the driver cannot time is left to
  // ms(), which raises its error (the copy or wait that pushed it has been made)
  const bool all = spans.size() % kSweepEvery == 0;
  for (size_t i = from; i < spans.size(); ++i) {
    bool done = false;
    try {
      done = read(spans[i], false);
    } catch (...) {
    }
    if (!done && !all) break;
  }
  while (from < spans.size() && spans[from].a == nullptr) ++from;
}

void CudaCopyIO::submit(Key key, void*, bool demand) {
  const int i = index(key);
  if (where_[static_cast<size_t>(i)] >= 0)
    throw Error("internal: expert (" + std::to_string(key.first) + ", " + std::to_string(key.second) +
                ") copied while it has a slot");
  if (free_.empty()) throw Error("internal: a copy with every slot of the arena taken");
  const int idx = free_.back();
  const uint64_t cs = demand ? demand_stream_ : copy_stream_;
  auto& last = last_use_[static_cast<size_t>(idx)];
  for (Event* e : last)   // the slot's last readers and its old copy
    if (e != nullptr && !complete(e)) stream_wait(cs, e);
  Span s;
  s.a = recorded(true, cs);
  const int rc = api_->memcpy_async(lay_.slots + static_cast<uint64_t>(idx) * static_cast<uint64_t>(lay_.slot_stride),
                                    lay_.host + static_cast<uint64_t>(i) * static_cast<uint64_t>(lay_.blob_stride),
                                    static_cast<size_t>(lay_.nbytes), stream_of(cs));
  if (rc != 0) {
    drop(s.a);
    fail(rc, "cuMemcpyAsync");
  }
  try {
    s.b = recorded(true, cs);
  } catch (...) {   // the copy is queued with no event to order the slot's next copy after it: the slot stays out
    drop(s.a);       // of use (taken from the free slots, given to no expert)
    for (Event* e : last) drop(e);
    last.clear();
    free_.pop_back();
    throw;
  }
  // (the IO's state changes only once every call has succeeded)
  for (Event* e : last) drop(e);
  last.clear();
  free_.pop_back();
  where_[static_cast<size_t>(i)] = idx;
  ++s.b->refs;   // also the copy's completion, until it has landed or the slot is released
  done_[static_cast<size_t>(i)] = s.b;
  copies_.push_back(s);
  copied_bytes_ += lay_.nbytes;
  sweep(copies_, copies_read_);
}

bool CudaCopyIO::landed(Key key) {
  Event*& ev = done_[static_cast<size_t>(index(key))];
  if (ev == nullptr) return true;
  if (!complete(ev)) return false;
  drop(ev);   // (nothing waits for a completed copy again)
  ev = nullptr;
  return true;
}

void CudaCopyIO::wait(Key key) {
  Event* ev = done_[static_cast<size_t>(index(key))];
  if (ev == nullptr) return;
  Span s;
  s.a = recorded(true, compute_);
  try {
    stream_wait(compute_, ev);
    s.b = recorded(true, compute_);
  } catch (...) {
    drop(s.a);
    throw;
  }
  stalls_.push_back(s);
  sweep(stalls_, stalls_read_);
}

void CudaCopyIO::take(Key key) {
  const int i = index(key);
  if (where_[static_cast<size_t>(i)] < 0)
    throw Error("internal: expert (" + std::to_string(key.first) + ", " + std::to_string(key.second) +
                ") read with no slot");
  Event* ev = done_[static_cast<size_t>(i)];
  if (ev != nullptr) stream_wait(compute_, ev);   // ordered after the copy, whether or not it was waited for
}

void CudaCopyIO::release(Key key) {
  const int i = index(key);
  const int idx = where_[static_cast<size_t>(i)];
  if (idx < 0)
    throw Error("internal: expert (" + std::to_string(key.first) + ", " + std::to_string(key.second) +
                ") released with no slot");
  Event* used = fenced_ ? nullptr : recorded(false, compute_);   // the kernels enqueued so far that may read the slot
  auto& last = last_use_[static_cast<size_t>(idx)];
  for (Event* e : last) drop(e);
  last.clear();
  if (used != nullptr) last.push_back(used);
  if (done_[static_cast<size_t>(i)] != nullptr) last.push_back(done_[static_cast<size_t>(i)]);   // its copy's ref
  done_[static_cast<size_t>(i)] = nullptr;
  where_[static_cast<size_t>(i)] = -1;
  free_.push_back(idx);
}

double CudaCopyIO::ms(bool copies, int64_t since) {
  auto& spans = copies ? copies_ : stalls_;
  double sum = 0.0;
  for (size_t i = static_cast<size_t>(since < 0 ? 0 : since); i < spans.size(); ++i) {
    read(spans[i], true);
    sum += spans[i].ms;
  }
  sweep(spans, copies ? copies_read_ : stalls_read_);
  return sum;
}

}  // namespace spx
