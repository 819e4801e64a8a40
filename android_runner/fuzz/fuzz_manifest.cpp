// libFuzzer target: spx::parse_manifest (and parse_model_config on the same bytes) must refuse
// any input with an spx::Error, never crash, leak, hang or hit UB. Anything else escaping (another
// exception type, a sanitizer report) is a bug.
//
// Build and run (from the repo root; clang 14):
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I android_runner/src \
//     android_runner/fuzz/fuzz_manifest.cpp android_runner/src/bundle.cpp android_runner/src/sha256.cpp \
//     -o /tmp/fuzz_manifest
//   mkdir -p /tmp/corpus-manifest && cp BUNDLE/manifest.json /tmp/corpus-manifest/
//   /tmp/fuzz_manifest -max_total_time=60 -max_len=16384 /tmp/corpus-manifest
#include <cstddef>
#include <cstdint>
#include <string>

#include "bundle.h"
#include "common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  try {
    spx::Bundle b = spx::parse_manifest(text, "fuzz/manifest.json");
    // invariants the runner relies on after a successful parse
    if ((b.target != "executorch" && b.target != "qnn" && b.target != "qai-hub") || b.moe_layers.empty() || b.top_k < 1 || b.top_k > b.num_experts ||
        !(b.pool_mib > 0) || b.scheduler.window < 1 || b.scheduler.queue_depth < 1)
      __builtin_trap();
    for (int l : b.moe_layers)
      if (l < 0 || l >= b.num_layers) __builtin_trap();
    for (const auto& kv : b.preds_rows)
      if (kv.first < 0 || size_t(kv.first) >= b.moe_layers.size()) __builtin_trap();
    if ((b.target == "executorch" ? !b.files.count(b.program_file) : b.graph_files.empty()) ||
        !b.files.count(b.store_file) || !b.files.count(b.config_file) || b.methods.empty())
      __builtin_trap();
    for (const auto& [name, rel] : b.graph_files)
      if (!b.files.count(rel) || !b.files.count(b.graph_binaries.at(name))) __builtin_trap();
    // a qnn bundle embeds with its table or its embed graph; the table is a listed file
    if (b.target != "executorch" && (b.embedding_file.empty() ? !b.graph_files.count("embed")
                                                              : !b.files.count(b.embedding_file)))
      __builtin_trap();
  } catch (const spx::Error&) {
  }
  try {
    spx::Bundle b;
    b.family = size && (data[0] & 1) ? "qwen3_vl_moe" : "qwen3_moe";
    spx::parse_model_config(b, text, "fuzz/config.json");
  } catch (const spx::Error&) {
  }
  return 0;
}
