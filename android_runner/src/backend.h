// The dense part of a bundle's step graphs, behind one interface with two implementations chosen
// by the build (`specprefetch runner build`): ExecuTorch's Module for executorch bundles
// (backend.cpp: every method loaded once at start, KV caches as the program's own mutable
// buffers, zeroed by `reset`), or ONNX Runtime with Qualcomm's QNN execution provider for qnn and
// qai-hub bundles (backend_ort.cpp: one session per EPContext graph on the HTP, the KV cache held
// here and passed in and out, as the graphs of those bundles hold no state). The routed experts
// are never in either: they are computed by the runner's kernels from pool slots.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace spx {

struct LayerOut {
  std::vector<float> h;       // dense layer: the new hidden; MoE layer: the residual (h_res)
  std::vector<float> x;       // MoE: the router input [H]
  std::vector<float> logits;  // MoE: router logits [E]
  std::vector<float> preds;   // MoE: predicted-router rows [P * E] (empty when the graph has none)
};

struct Bundle;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual void reset() = 0;                                       // zero every layer's KV cache
  virtual void embed(int64_t token, std::vector<float>& h) = 0;   // [H]
  virtual void layer(int index, const std::vector<float>& h, int64_t pos, bool moe, LayerOut& out) = 0;
  // Decoder layer `index` over T prompt positions pos .. pos+T-1 at once (method prefill_T_layer_N):
  // h [T * H] in; out.h [T * H], and for a MoE layer x [T * H], logits [T * E], preds [T * P * E].
  // Writes the same KV cache as `layer`.
  void layer_chunk(int index, const std::vector<float>& h, int T, int64_t pos, bool moe, LayerOut& out);
  // The same on T * hidden floats at h (a span's chunk, in place in the span's hidden states).
  virtual void layer_chunk(int index, const float* h, int T, int64_t pos, bool moe, LayerOut& out) = 0;
  // The prefill chunk sizes T > 1 whose prefill_T_layer_N graphs were loaded for every layer
  // (ascending; empty for a bundle exported without prefill chunks).
  const std::vector<int>& prefill_chunks() const { return chunks_; }
  virtual void head(const std::vector<float>& h, std::vector<float>& logits) = 0;  // [V]
  // A vision-language bundle's vision method (graphs.vision.method) on one image's pixel_values
  // [rows, cols]: image_embeds [tokens * H] and the DeepStack features [taps * tokens * H]. A backend
  // without one throws.
  virtual void vision(const std::string& method, const std::vector<float>& pixels, int64_t rows, int64_t cols,
                      std::vector<float>& embeds, std::vector<float>& deepstack);
  // M-RoPE bundles (kv.rope mrope): this sequence's rotary positions, `rows` [3 * n] for positions 0..n-1
  // and p + delta on every axis after them; empty rows: the cache position itself (text).
  void set_rope(std::vector<int64_t> rows, int64_t delta) { rope_rows_ = std::move(rows), rope_delta_ = delta; }
  // What runs the graphs ("executorch", "onnxruntime-qnn") and how many graph calls crossed to an
  // accelerator since the start (0 for ExecuTorch on the CPU): the run's JSON reports both.
  virtual const char* kind() const = 0;
  virtual int64_t accelerator_calls() const { return 0; }

  double load_ms = 0;  // program / sessions load
  int threads = 0;     // the expert kernels' threads: ExecuTorch's thread pool, or parallel.cpp's (ONNX Runtime)

 protected:
  // prefill chunk sizes from method names: T for every prefill_T_layer_N present for every layer_N
  void find_prefill_chunks(const std::vector<std::string>& methods);
  // the rotary positions [3 * T] of cache positions pos .. pos+T-1 (set_rope) into out
  void rope_positions(int64_t pos, int T, std::vector<int64_t>& out) const;
  std::vector<int64_t> rope_rows_;
  int64_t rope_delta_ = 0;
  std::string where_;  // the program or graphs directory, as errors name it
  int hidden_ = 0, vocab_ = 0;
  std::vector<int> chunks_;
};

// The backend this build runs the bundle with (every method in `methods` loaded; errors name the
// program or graph file). `threads`: the compute threads (0: one per core): ExecuTorch's pool, which
// runs the layer graphs and the expert kernels; with ONNX Runtime, whose graphs run on the HTP, the
// expert kernels' own pool.
std::unique_ptr<Backend> open_backend(const Bundle& b, const std::vector<std::string>& methods, int threads);

// The bundle targets this build's backend runs ("executorch", or "qnn" and "qai-hub").
bool backend_runs_target(const std::string& target);

}  // namespace spx
