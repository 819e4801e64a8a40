// The bundle's ExecuTorch program through extension/module's Module: every method loaded once at
// start, KV caches as the program's own mutable buffers (shared arenas, zeroed by `reset`). The
// program holds the dense work (embed, per-layer attention + router + adapter heads, head); the
// routed experts are never in it: they are computed by the runner's kernels from pool slots.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace executorch::extension::module {
class Module;
}  // namespace executorch::extension::module

namespace spx {

struct LayerOut {
  std::vector<float> h;       // dense layer: the new hidden; MoE layer: the residual (h_res)
  std::vector<float> x;       // MoE: the router input [H]
  std::vector<float> logits;  // MoE: router logits [E]
  std::vector<float> preds;   // MoE: predicted-router rows [P * E] (empty when the graph has none)
};

class Backend {
 public:
  // Loads the program and every method in `methods`; errors name the program file. A crash inside
  // ExecuTorch while it loads or runs the program (a program crafted past its flatbuffer
  // verification) prints one refusal line naming the program and the method and exits 1. `threads`:
  // ExecuTorch's thread pool size for the layer graphs (XNNPACK, optimized kernels); 0 leaves
  // ExecuTorch's default (one thread per core).
  Backend(const std::string& program, const std::vector<std::string>& methods, int hidden, int vocab,
           int threads = 0);
  ~Backend();

  void reset();                                        // zero every layer's KV cache
  void embed(int64_t token, std::vector<float>& h);   // [H]
  void layer(int index, const std::vector<float>& h, int64_t pos, bool moe, LayerOut& out);
  // Decoder layer `index` over T prompt positions pos .. pos+T-1 at once (method prefill_T_layer_N):
  // h [T * H] in; out.h [T * H], and for a MoE layer x [T * H], logits [T * E], preds [T * P * E].
  // Writes the same KV cache as `layer`.
  void layer_chunk(int index, const std::vector<float>& h, int T, int64_t pos, bool moe, LayerOut& out);
  // The same on T * hidden floats at h (a span's chunk, in place in the span's hidden states).
  void layer_chunk(int index, const float* h, int T, int64_t pos, bool moe, LayerOut& out);
  // The prefill chunk sizes T > 1 whose prefill_T_layer_N methods were loaded for every layer
  // (ascending; empty for a bundle exported before prefill chunks).
  const std::vector<int>& prefill_chunks() const { return chunks_; }
  void head(const std::vector<float>& h, std::vector<float>& logits);  // [V]

  double load_ms = 0;  // program load + every method's load
  int threads = 0;     // the thread pool's size

  struct Faults;  // what a crash inside ExecuTorch prints (backend.cpp)

 private:
  std::string path_;
  int hidden_, vocab_;
  std::unique_ptr<executorch::extension::module::Module> module_;
  std::unique_ptr<Faults> faults_;
  std::vector<int> chunks_;
};

}  // namespace spx
