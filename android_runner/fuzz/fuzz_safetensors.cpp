// libFuzzer target: spx::parse_safetensors on arbitrary bytes (host.safetensors). Refusals are
// spx::Error; anything else is a bug.
//
// Build and run (from the repo root; clang 14):
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I android_runner/src \
//     android_runner/fuzz/fuzz_safetensors.cpp android_runner/src/safetensors.cpp -o /tmp/fuzz_safetensors
//   /tmp/fuzz_safetensors -max_total_time=60 -max_len=4096 /tmp/corpus-safetensors
#include <cstddef>
#include <cstdint>

#include "common.h"
#include "safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto t = spx::parse_safetensors(data, size, "fuzz/host.safetensors");
    for (const auto& kv : t) {
      size_t n = 1;
      for (int64_t d : kv.second.shape) n *= size_t(d);
      if (n != kv.second.data.size()) __builtin_trap();
    }
  } catch (const spx::Error&) {
  }
  return 0;
}
