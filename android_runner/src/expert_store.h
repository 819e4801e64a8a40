// The expert store (docs/expert-store.md, toolkit/runtime/expert_store.py), format version 2: one
// file of 4 KiB-aligned expert blobs behind a 128-byte header (with its own CRC-32 over every
// field), an index of L*E 32-byte entries, and a JSON metadata block (covered by the index CRC),
// validated at open as the Python ExpertStore does. Older versions are refused (re-export).
//
// I/O: open() keeps ONE buffered file descriptor for the life of the store (plus, when the
// O_DIRECT self-test passes, a second O_DIRECT descriptor of the same inode, opened through
// /proc/self/fd so it cannot be another file); the path is never opened again, so a store file
// replaced on disk mid-run does not affect a running store. Buffered reads are followed by
// posix_fadvise(DONTNEED) on the range read, so the page cache does not keep the experts and a
// later run starts cold too (the expert pool, not the kernel, decides what stays resident).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common.h"

namespace spx {

class ExpertStore {
 public:
  static constexpr uint32_t kAlign = 4096;
  static constexpr size_t kHeaderSize = 128;
  static constexpr size_t kEntrySize = 32;

  struct Entry {
    uint64_t offset = 0;  // bytes from the start of the file, a multiple of 4096
    uint32_t size = 0;    // blob bytes (== blob_size); the slot on flash is slot_bytes
    uint32_t crc32 = 0;   // zlib CRC-32 of the blob's `size` bytes
  };

  // Everything the header, index and metadata say, validated against `file_size`.
  struct Index {
    std::string dtype;  // "fp16", "int8", "int4"
    int num_layers = 0, num_experts = 0, hidden_size = 0, intermediate_size = 0;
    int group_size = 0;     // 32 for int4, else 0
    bool has_bias = false;  // header flags bit 0 (GPT-OSS)
    uint64_t index_offset = 0, data_offset = 0;
    uint32_t blob_size = 0;
    uint32_t slot_bytes = 0;  // blob_size rounded up to 4096
    std::string family, config_hash;
    std::string source_digest;  // metadata.source.digest: sha256 over the source weight shards
    std::vector<int> moe_layers;
    std::vector<Section> sections;
    std::vector<Matrix> matrices;
    std::vector<Entry> entries;  // layer-major: entries[layer * num_experts + expert]
  };

  // Header only: checks magic, version, dtype, alignment and sizes, and returns how many bytes
  // from the start of the file parse_index needs (the end of the metadata block).
  static uint64_t index_bytes(const uint8_t* data, size_t n, uint64_t file_size, const std::string& where);
  // A pure parse of the first bytes of a store file (header + index + metadata; `n` may be more)
  // of a file of `file_size` bytes. Errors are spx::Error naming `where`.
  static Index parse_index(const uint8_t* data, size_t n, uint64_t file_size, const std::string& where);

  // Opens and validates the store, then (when `try_direct`) runs the O_DIRECT self-test (see
  // direct()); try_direct = false reads buffered (io_note says so).
  static std::unique_ptr<ExpertStore> open(const std::string& path, bool try_direct = true);
  ~ExpertStore();
  ExpertStore(const ExpertStore&) = delete;
  ExpertStore& operator=(const ExpertStore&) = delete;

  std::string path;
  std::string dtype;
  int num_layers = 0, num_experts = 0, hidden_size = 0, intermediate_size = 0;
  int group_size = 0;
  bool has_bias = false;
  uint32_t blob_size = 0;
  uint32_t slot_bytes = 0;
  uint64_t file_size = 0;
  std::vector<Section> sections;
  std::vector<Matrix> matrices;
  std::vector<int> moe_layers;
  std::string family, config_hash;
  std::string source_digest;

  // (layer position 0..L-1, expert); out of range throws Error naming the store.
  const Entry& entry(int layer, int expert) const;
  // Whether `blob` (at least entry.size bytes) matches the entry's CRC-32.
  bool check(int layer, int expert, const void* blob) const;

  // True when reads go through O_DIRECT: the self-test at open read the first expert's slot
  // with O_DIRECT and buffered and got the same bytes. Otherwise reads are buffered (followed by
  // posix_fadvise DONTNEED) and io_note() says why.
  bool direct() const { return direct_; }
  std::string io_note() const { return io_note_; }

  // posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) on the whole file: a cold start without root
  // (clean pages of the store leave the page cache). Best effort; never throws.
  void drop_cache() const;

  // Reads the expert's whole slot (slot_bytes, the blob then zero padding) into `dst`, which
  // must hold slot_bytes and be 4096-aligned for an O_DIRECT read (a misaligned dst is read
  // buffered). pread loops over short reads and EINTR; an I/O error or end of file throws Error
  // naming the store. Thread-safe (pread on shared descriptors). Does not check the CRC.
  void read(int layer, int expert, void* dst) const;

 private:
  ExpertStore() = default;
  void self_test();
  int fd_ = -1;         // buffered
  int direct_fd_ = -1;  // O_DIRECT, when direct_
  bool direct_ = false;
  std::string io_note_;
  std::vector<Entry> entries_;
};

// A 4096-aligned heap buffer (for O_DIRECT reads); throws std::bad_alloc.
struct AlignedBuffer {
  explicit AlignedBuffer(size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& o) noexcept : ptr(o.ptr), size(o.size) { o.ptr = nullptr; o.size = 0; }
  uint8_t* ptr = nullptr;
  size_t size = 0;
};

}  // namespace spx
