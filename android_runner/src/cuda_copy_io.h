// The GPU tier's copy IO in C++ (toolkit/runtime/native_io.py loads it): the scheduler's IOBackend whose reads are
// copies from pinned host memory into a slot arena on a CUDA device, made through the CUDA driver's C entry points
// (libcuda.so.1, opened with dlopen: no CUDA headers or toolkit at build time, so the library builds on any
// machine). It orders the copies, waits and events as the Python IO it replaced (toolkit/runtime/gpu.py's CudaCopyIO
// under launch=driver, before 2026-12-07), on the same streams, with fewer calls: a copy known to have landed is
// neither waited for again nor kept in its slot's last use, and its events come from a pool instead of being made and
// destroyed per copy; the scheduler's copies, waits and releases need no crossing into Python.
//
// - submit: a free slot (the last freed first), the compute stream's last use of the slot and the slot's old copy
//   waited for where they have not completed, then the copy on the copy stream (a prefetch) or the demand stream,
//   between two timed events (the copy's time; the second is the copy's completion);
// - landed: the copy's completion event has completed (a completed one is dropped: nothing waits for it again);
// - wait: the compute stream waits for the copy, between two timed events (a stall);
// - take: the compute stream is ordered after the copy (whether or not it was waited for);
// - release: the slot freed; a later copy into it waits for an event recorded on the compute stream now (unless
//   fenced: every kernel that read the slot has run) and for the old copy's completion (orders_reuse).
//
// A copy's and a stall's times are read from their event pairs as soon as they have completed (the oldest pairs at
// each copy and stall, all of them every 64) or when asked (ms), so their events go back to the pool. Every driver
// failure throws one line naming the call and the driver's error name, and leaves the IO as it was, except a copy
// queued whose end event then fails: its slot stays out of use.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "scheduler.h"

namespace spx {

struct CudaApi;   // the driver's entry points (cuda_copy_io.cpp)

class CudaCopyIO : public IOBackend {
 public:
  struct Layout {
    uint64_t slots = 0;        // the slot arena's device address
    int64_t slot_stride = 0;   // bytes from one slot to the next
    int capacity = 0;          // slots
    uint64_t host = 0;         // the pinned host buffer: blob (layer * E + expert) at host + that * blob_stride
    int64_t blob_stride = 0;
    int64_t nbytes = 0;        // bytes a copy moves (one blob)
    int L = 0;
    int E = 0;
  };
  // `library`: the driver's shared library (libcuda.so.1, or a stand-in with its entry points); streams by handle
  // (0: the legacy default stream)
  CudaCopyIO(const std::string& library, const Layout& layout, uint64_t copy_stream, uint64_t demand_stream,
             uint64_t compute_stream);
  ~CudaCopyIO() override;
  CudaCopyIO(const CudaCopyIO&) = delete;
  CudaCopyIO& operator=(const CudaCopyIO&) = delete;

  void submit(Key key, void* dst, bool demand) override;
  bool landed(Key key) override;
  void wait(Key key) override;
  void check(Key) override {}   // a copy fails where it is issued
  void release(Key key) override;
  bool orders_reuse() const override { return true; }
  void take(Key key) override;

  int slot(Key key) const;       // -1: no slot
  void set_compute(uint64_t stream) { compute_ = stream; }
  void set_fenced(bool fenced) { fenced_ = fenced; }
  int64_t copies() const { return static_cast<int64_t>(copies_.size()); }
  int64_t stalls() const { return static_cast<int64_t>(stalls_.size()); }
  int64_t copied_bytes() const { return copied_bytes_; }
  // milliseconds summed over the copies (or the stalls) from index `since` on; every event must have completed
  double ms(bool copies, int64_t since);
  int64_t events_made() const { return static_cast<int64_t>(events_.size()); }

 private:
  struct Event {
    void* h = nullptr;
    bool timing = false;
    int refs = 0;
  };
  struct Span {   // two timed events on one stream, or the milliseconds between them once read
    Event* a = nullptr;
    Event* b = nullptr;
    double ms = 0.0;
  };
  int index(Key key) const;
  Event* event(bool timing);
  Event* recorded(bool timing, uint64_t stream);
  void drop(Event* e);
  bool complete(Event* e);
  void stream_wait(uint64_t stream, Event* e);
  bool read(Span& s, bool must);
  void sweep(std::vector<Span>& spans, size_t& from) noexcept;
  [[noreturn]] void fail(int rc, const char* call) const;

  std::unique_ptr<CudaApi> api_;
  Layout lay_;
  uint64_t copy_stream_, demand_stream_, compute_;
  bool fenced_ = false;
  std::vector<int> free_;                  // free slots, the next one last
  std::vector<int> where_;                 // [L * E] slot, or -1
  std::vector<Event*> done_;               // [L * E] the copy's completion, held until landed or released
  std::vector<std::vector<Event*>> last_use_;   // per slot: what a copy into it waits for
  std::vector<Span> copies_, stalls_;
  size_t copies_read_ = 0, stalls_read_ = 0;    // every span before these has been read
  int64_t copied_bytes_ = 0;
  std::vector<std::unique_ptr<Event>> events_;  // every event made (destroyed with the IO)
  std::vector<Event*> pool_[2];                  // events free for reuse: [timing]
};

}  // namespace spx
