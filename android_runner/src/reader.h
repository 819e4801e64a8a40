// Reader: a few pread "lanes" (std::thread workers) that read experts from the store into the
// pool's buffers. Not io_uring: Android's seccomp policy blocks it for apps; a handful of
// blocking preads in flight keeps UFS/NVMe queues busy enough for experts of tens of KiB to MiB.
//
// Demand reads (the step needs the expert now) go ahead of every queued prefetch; a prefetch
// that is waited for is promoted to demand, and one still queued can be cancel()led. Reads of one key
// are tracked from submit() until forget() or cancel(): landed() polls, wait() blocks and rethrows the read's error (I/O, or a failed CRC-32
// when `verify`). Thread-safe (one mutex, two condition variables).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "expert_store.h"

namespace spx {

class Reader {
 public:
  // `lanes` worker threads (1..64) reading from `store` (which must outlive the Reader); with
  // `verify`, every blob's CRC-32 is checked once it has landed.
  Reader(const ExpertStore& store, int lanes, bool verify);
  ~Reader();  // lets in-flight reads finish, drops queued ones, joins the lanes
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  // Queue a read of `key` into `dst` (store.slot_bytes bytes, 4096-aligned for O_DIRECT). `dst`
  // must stay valid until the key is forgotten or the Reader destroyed (a lane may be writing
  // it until then): declare buffers before the Reader that fills them.
  // `demand` reads go before queued prefetches. Submitting a key already tracked into the same
  // buffer is a no-op (or promotes a queued prefetch to demand); into another buffer it throws
  // Error (the caller must forget() it first). A key out of the store's range throws Error.
  void submit(Key key, void* dst, bool demand);
  // Non-blocking: the read of `key` has finished (successfully or not; wait() tells which).
  // False for a key not tracked.
  bool landed(Key key);
  // Blocks until the read of `key` has finished (promoting it to demand if still queued); throws
  // Error if it failed, e.g. "<store>: expert (l, e) failed its checksum (corrupt blob)", or if
  // the key was never submitted.
  void wait(Key key);
  // The pool dropped `key`: stop tracking it. A read still queued is cancelled (its buffer will
  // not be written); a read in flight throws Error (wait() for it first). Unknown keys: no-op.
  void forget(Key key);
  // Cancel the read of `key` if it is still queued (true: it never reaches the disk); false when
  // it is reading, done or unknown. Never blocks.
  bool cancel(Key key);
  // Tests: lanes start no new read while paused (reads in flight finish); resume with false.
  void pause(bool on);

  uint64_t bytes_read() const { return bytes_.load(); }  // slot bytes read so far
  uint64_t reads() const { return reads_.load(); }       // reads finished so far
  uint64_t cancelled() const { return cancelled_.load(); }  // queued reads cancelled before the disk
  uint64_t direct_reads() const { return direct_reads_.load(); }  // ... of which through O_DIRECT
  bool direct() const { return store_.direct(); }
  int lanes() const { return int(threads_.size()); }

 private:
  enum class State { queued, reading, done };
  struct Req {
    void* dst = nullptr;
    State state = State::queued;
    bool demand = false;
    bool failed = false;
    uint64_t id = 0;
    std::string error;
  };
  void lane();
  std::string name(Key key) const;

  const ExpertStore& store_;
  const bool verify_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::map<Key, Req> reqs_;
  std::deque<std::pair<Key, uint64_t>> demand_q_, prefetch_q_;  // (key, request id); stale ids skipped
  uint64_t next_id_ = 0;
  bool stop_ = false;
  bool paused_ = false;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> bytes_{0}, reads_{0}, direct_reads_{0}, cancelled_{0};
};

}  // namespace spx
