// libFuzzer target: ExecuTorch's program loading as the runner does it (backend.cpp:
// Program::Verification::InternalConsistency, then every method loaded), on bit flips of a real
// bundle's model.pte. A corrupted program must be refused with an error code, never crash, leak,
// hang or hit UB inside the runtime. Anything else (a sanitizer report, a trap, a timeout) is a bug.
//
// The input is not the program: its first byte picks one of the real model.pte files named by
// SPX_FUZZ_PTE (colon-separated, read once; e.g. an fp32 and an 8da8w bundle's), and the rest is a
// list of edits applied to it, 4 bytes each: a 24-bit little-endian offset into the program's
// flatbuffer head (the bytes before the first segment; taken modulo its size) and one op byte
// (bits 7..6: 0 or 1 flip bit (op & 7), 2 set the byte to 0xff, 3 set it to 0x00). So every
// mutation is a few damaged bytes of a real, valid program, which is what a flipped bit on flash
// gives, and many get past the flatbuffer verifier to the checks behind it.
//
// What differs from the runner: the program is read through BufferDataLoader (the runner's Module
// uses MmapDataLoader; Program::load and Method::load are the same code over either), and no
// kernels or XNNPACK are linked in. A stand-in backend registered as "XnnpackBackend" accepts every
// delegate blob without reading it, so method loading goes on past the delegates to the values,
// the execution plan's chains and the operator lookups (which then fail: nothing is registered).
// The ExecuTorch runtime is compiled from source with the same sanitizers and coverage
// instrumentation: the wheel ships it only as uninstrumented shared libraries, where ASan
// would not see an out-of-bounds read and libFuzzer would get no coverage (docs/runner.md).
//
// Build and run (from the repo root; `make fuzz` does this, see the Makefile's fuzz section for the
// ExecuTorch sources it compiles with it):
//   SPX_FUZZ_PTE=B1/graphs/model.pte:B2/graphs/model.pte runs/fuzz/fuzz_program -max_len=257 -timeout=30 CORPUS
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <executorch/extension/data_loader/buffer_data_loader.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/core/hierarchical_allocator.h>
#include <executorch/runtime/executor/memory_manager.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/platform.h>
#include <executorch/runtime/platform/runtime.h>
#include <executorch/schema/extended_header.h>

namespace {

using executorch::extension::BufferDataLoader;
using executorch::extension::MallocMemoryAllocator;
using executorch::runtime::ArrayRef;
using executorch::runtime::BackendExecutionContext;
using executorch::runtime::BackendInitContext;
using executorch::runtime::BackendInterface;
using executorch::runtime::CompileSpec;
using executorch::runtime::DelegateHandle;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::ExtendedHeader;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::HierarchicalAllocator;
using executorch::runtime::MemoryManager;
using executorch::runtime::Program;
using executorch::runtime::Result;
using executorch::runtime::Span;

// The most planned memory one input may ask for: a flipped size field can ask for terabytes. That is
// a failed allocation, not a memory-safety bug in the loader, and it is not fuzzed here: Module
// allocates the planned buffers the method asks for, so the runner relies on the manifest's sha256
// of the program, checked before the program is loaded, to never see such a size.
constexpr int64_t kMaxPlanned = int64_t(1) << 30;

class StandInBackend final : public BackendInterface {
 public:
  bool is_available() const override { return true; }
  Result<DelegateHandle*> init(BackendInitContext&, FreeableBuffer* processed, ArrayRef<CompileSpec>) const override {
    if (processed != nullptr) processed->Free();
    static int handle;
    return &handle;
  }
  Error execute(BackendExecutionContext&, DelegateHandle*, Span<EValue*>) const override { return Error::NotSupported; }
};

struct Seed {
  std::unique_ptr<uint8_t, decltype(&std::free)> bytes{nullptr, &std::free};
  uint8_t* data = nullptr;  // the real program (bytes), 64-byte aligned as a loader's buffer must be
  size_t size = 0;
  size_t head = 0;          // the flatbuffer head: [0, first segment)
};

Seed load_seed(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (!f.eof() && !f.good()) {
    std::fprintf(stderr, "fuzz_program: cannot read %s\n", path.c_str());
    std::exit(2);
  }
  Seed s;
  s.size = bytes.size();
  s.bytes.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (s.size + 63) / 64 * 64)));
  s.data = s.bytes.get();
  std::memcpy(s.data, bytes.data(), s.size);
  auto eh = ExtendedHeader::Parse(s.data, s.size);
  s.head = eh.ok() && eh->segment_base_offset > 0 && eh->segment_base_offset <= s.size ? eh->segment_base_offset
                                                                                       : s.size;
  // the seed must be a program the runtime loads: otherwise every input would stop at the first check
  BufferDataLoader loader(s.data, s.size);
  auto p = Program::load(&loader, Program::Verification::InternalConsistency);
  if (!p.ok() || s.head == 0) {
    std::fprintf(stderr, "fuzz_program: %s does not load (error %d)\n", path.c_str(), static_cast<int>(p.error()));
    std::exit(2);
  }
  std::fprintf(stderr, "fuzz_program: %s, %zu bytes, flatbuffer head %zu bytes, %zu methods\n", path.c_str(), s.size,
               s.head, p->num_methods());
  return s;
}

std::vector<Seed>& seeds() {
  static std::vector<Seed> all = [] {
    const char* env = std::getenv("SPX_FUZZ_PTE");
    if (env == nullptr || *env == '\0') {
      std::fprintf(stderr, "fuzz_program: set SPX_FUZZ_PTE to a bundle's graphs/model.pte (several: "
                           "colon-separated)\n");
      std::exit(2);
    }
    std::vector<Seed> out;
    std::string list = env;
    for (size_t start = 0; start <= list.size();) {
      const size_t end = std::min(list.find(':', start), list.size());
      if (end > start) out.push_back(load_seed(list.substr(start, end - start)));
      start = end + 1;
    }
    return out;
  }();
  return all;
}

void load_methods(const Program& program) {
  for (size_t i = 0; i < program.num_methods(); ++i) {
    auto name = program.get_method_name(i);
    if (!name.ok()) continue;
    auto meta = program.method_meta(*name);
    if (!meta.ok()) continue;
    std::vector<std::vector<uint8_t>> planned;
    std::vector<Span<uint8_t>> spans;
    int64_t total = 0;
    bool too_large = false;
    for (size_t b = 0; b < meta->num_memory_planned_buffers(); ++b) {
      auto n = meta->memory_planned_buffer_size(b);
      if (!n.ok()) break;
      if (*n < 0 || *n > kMaxPlanned - total) {
        too_large = true;
        break;
      }
      total += *n;
      planned.emplace_back(static_cast<size_t>(*n));
    }
    if (too_large) continue;
    for (auto& p : planned) spans.emplace_back(p.data(), p.size());
    HierarchicalAllocator planned_memory({spans.data(), spans.size()});
    MallocMemoryAllocator method_allocator, temp_allocator;
    MemoryManager memory(&method_allocator, &planned_memory, &temp_allocator);
    auto method = program.load_method(*name, &memory);
    (void)method;  // loaded or refused: either is fine; only how it ends matters
  }
}

// ExecuTorch's log lines (every refusal logs why) formatted as usual but not printed, unless
// SPX_FUZZ_LOG is set: printing them would be most of the time per input.
void no_log(et_timestamp_t, et_pal_log_level_t, const char*, const char*, size_t, const char*, size_t) {}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  executorch::runtime::runtime_init();
  if (std::getenv("SPX_FUZZ_LOG") == nullptr)
    executorch::runtime::register_pal(executorch::runtime::PalImpl::create(no_log, __FILE__));
  static StandInBackend backend;
  (void)executorch::runtime::register_backend({"XnnpackBackend", &backend});
  seeds();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Seed& s = seeds()[size > 0 ? data[0] % seeds().size() : 0];
  if (size > 0) ++data, --size;
  struct Edit {
    size_t at;
    uint8_t old;
  };
  std::vector<Edit> edits;
  for (size_t i = 0; i + 4 <= size; i += 4) {
    const size_t at = (size_t(data[i]) | size_t(data[i + 1]) << 8 | size_t(data[i + 2]) << 16) % s.head;
    const uint8_t op = data[i + 3];
    edits.push_back({at, s.data[at]});
    switch (op >> 6) {
      case 0:
      case 1: s.data[at] ^= uint8_t(1u << (op & 7)); break;
      case 2: s.data[at] = 0xff; break;
      default: s.data[at] = 0x00; break;
    }
  }
  {
    BufferDataLoader loader(s.data, s.size);
    auto program = Program::load(&loader, Program::Verification::InternalConsistency);
    if (program.ok()) load_methods(*program);
  }
  for (auto it = edits.rbegin(); it != edits.rend(); ++it) s.data[it->at] = it->old;  // the seed again
  return 0;
}
