// Expert compute kernels: one routed expert's forward pass straight from its blob bytes
// (docs/expert-store.md, toolkit/models/expert_layout.py for the byte layout).
//
// Numerics: every kernel computes in float32. Quantised weights (fp16, int8 with one fp16 scale per
// output row, int4 with one fp16 scale per group of 32 inputs) are dequantised in registers and
// multiplied with float32 activations using float32 FMA accumulation. Activations are never
// quantised (no int8 dot products such as sdot / vpmaddubsw): that would be faster but would change
// the outputs versus the toolkit's Python reference (weights dequantised to float32, float32
// matmuls), which the runner must match token for token. The only difference from the reference is
// the order of the float32 additions (and, for int8/int4, the scale being applied to a row's or a
// group's partial sum instead of to every weight), i.e. rounding-level differences.
//
// Instruction sets are chosen at run time (best_isa()); ISA-specific code is compiled with
// function-level target attributes, so every source file builds with the compiler's default flags.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace spx {

enum class Isa { portable, avx2, neon };

// "portable", "avx2", "neon".
const char* isa_name(Isa isa);
// The Isa named `name` ("portable", "avx2", "neon", or "best" for best_isa()); throws Error otherwise.
Isa isa_from_name(const std::string& name);
// Whether this build on this CPU can run `isa`: portable always; avx2 on x86-64 with AVX2, FMA and
// F16C (checked at run time); neon on aarch64.
bool isa_supported(Isa isa);
// The fastest supported Isa: avx2, neon or portable.
Isa best_isa();

// y[out] = W x for one weight matrix of a blob. `w` is the matrix's weight section (dtype f16, i8 or
// u8 = packed int4), `scale` its scale section (i8, u8) or nullptr (f16); [out, in] is the matrix's
// true shape (int4 rows are padded to whole groups of 32 in the blob). Reads x[0..in) only.
// Throws Error if the sections do not match the shape or `isa` is not supported.
void matvec(Isa isa, const Section& w, const Section* scale, int64_t out, int64_t in, const uint8_t* blob,
            const float* x, float* y);

namespace detail {
// One weight matrix bound to its blob sections and the kernel that runs it (internal).
struct BoundMatrix {
  size_t w_off = 0;  // weight section offset in the blob
  size_t s_off = 0;  // scale section offset (int8 / int4)
  bool has_scale = false;
  bool pads_input = false;  // int4 with in % 32 != 0: the kernel reads x zero-padded to whole groups
  int64_t out = 0, in = 0;
  void (*fn)(const uint8_t* w, const uint8_t* s, int64_t out, int64_t in, const float* x, float* y) = nullptr;
};
}  // namespace detail

// One routed expert of a model, bound to a blob layout; forward() runs it on any blob of that layout.
class ExpertKernel {
 public:
  // sections: the blob layout (store order); matrices: role + true shape; family: "gpt_oss" selects
  // the GPT-OSS form (clamped GLU with biases), anything else the SwiGLU-style default;
  // hidden_act: the config's hidden_act (silu / swish, gelu, gelu_pytorch_tanh / gelu_new; unused by
  // GPT-OSS); swiglu_limit: GPT-OSS's clamp limit. Throws Error on a layout it cannot run (missing
  // gate/up/down, shape mismatch, unknown activation, unsupported isa) naming what is wrong.
  ExpertKernel(const std::vector<Section>& sections, const std::vector<Matrix>& matrices, const std::string& family,
               const std::string& hidden_act, float swiglu_limit, Isa isa = best_isa());

  // y[H] = the expert's unweighted output for x[H]; blob points at the expert's bytes (at least
  // blob_bytes() of them). Uses internal scratch: not thread-safe per object (one per thread).
  void forward(const uint8_t* blob, const float* x, float* y) const;

  int hidden() const { return static_cast<int>(h_); }
  int intermediate() const { return static_cast<int>(i_); }
  Isa isa() const { return isa_; }
  // Bytes of a blob this kernel reads: the end of its last section.
  size_t blob_bytes() const { return blob_bytes_; }

 private:
  enum class Act { silu, gelu, gelu_tanh };
  Isa isa_;
  bool gpt_oss_ = false;
  Act act_ = Act::silu;
  float limit_ = 7.0f;
  int64_t h_ = 0, i_ = 0;
  size_t blob_bytes_ = 0;
  detail::BoundMatrix gate_, up_, down_;
  size_t bias_gate_ = 0, bias_up_ = 0, bias_down_ = 0;  // f16 bias offsets (GPT-OSS)
  // scratch: x and the GLU output zero-padded to whole groups of 32 (int4 kernels read whole groups)
  mutable std::vector<float> xpad_, g_, u_, hpad_;
};

}  // namespace spx
