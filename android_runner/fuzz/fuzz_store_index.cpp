// libFuzzer target: spx::ExpertStore::parse_index on arbitrary bytes. The first 8 bytes of the
// input are the file size the parser checks offsets against (u64 little-endian), the rest is the
// start of a store file (header, index, metadata). Refusals are spx::Error; anything else is a bug.
//
// Build and run (from the repo root; clang 14):
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I android_runner/src \
//     android_runner/fuzz/fuzz_store_index.cpp android_runner/src/expert_store.cpp android_runner/src/crc32.cpp \
//     -o /tmp/fuzz_store_index
//   seed: python3 -c "import struct,sys; d=open('BUNDLE/experts.spx','rb').read(); \
//     o=struct.unpack_from('<Q',d,56)[0]; sys.stdout.buffer.write(struct.pack('<Q',len(d))+d[:o])" \
//     > /tmp/corpus-store/seed
//   /tmp/fuzz_store_index -max_total_time=60 -max_len=65536 /tmp/corpus-store
// The index and header CRCs would stop almost every mutation early, so the custom mutator below
// rewrites them after most mutations: the metadata and entry checks behind them get fuzzed too.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "common.h"
#include "crc32.h"
#include "expert_store.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// Mutate, then (most of the time) rewrite the header's index CRC so mutations of the index and
// metadata get past the checksum and exercise the parser behind it.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  size = LLVMFuzzerMutate(data, size, max_size);
  if (size < 8 + 128 || seed % 8 == 0) return size;
  uint8_t* d = data + 8;
  size_t n = size - 8;
  uint64_t index_offset = 0;
  uint32_t L, E, meta_len;
  std::memcpy(&index_offset, d + 48, 8);
  std::memcpy(&L, d + 16, 4);
  std::memcpy(&E, d + 20, 4);
  std::memcpy(&meta_len, d + 44, 4);
  uint64_t body = uint64_t(L) * E * 32 + meta_len;
  if (index_offset >= 128 && index_offset <= n && body <= n - index_offset) {
    uint32_t crc = spx::crc32(d + index_offset, size_t(body));
    std::memcpy(d + 64, &crc, 4);
  }
  uint32_t head = spx::crc32(d, 124);  // format 2: the header's own CRC covers every field
  std::memcpy(d + 124, &head, 4);
  return size;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t file_size = 0;
  std::memcpy(&file_size, data, 8);
  try {
    auto ix = spx::ExpertStore::parse_index(data + 8, size - 8, file_size, "fuzz/experts.spx");
    // invariants the reader relies on after a successful parse
    if (ix.entries.size() != size_t(ix.num_layers) * size_t(ix.num_experts) || ix.slot_bytes % 4096 ||
        ix.slot_bytes < ix.blob_size)
      __builtin_trap();
    for (const auto& e : ix.entries)
      if (e.offset % 4096 || e.offset > file_size || ix.slot_bytes > file_size - e.offset || e.size != ix.blob_size)
        __builtin_trap();
    for (const auto& s : ix.sections)
      if (s.offset + s.nbytes > ix.blob_size) __builtin_trap();
  } catch (const spx::Error&) {
  }
  return 0;
}
