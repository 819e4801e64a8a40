// Expert compute kernels: one routed expert's forward pass straight from its blob bytes
// (docs/expert-store.md, toolkit/models/expert_layout.py for the byte layout).
//
// Numerics.
//  fp16 stores: float32 throughout. Weights are dequantised in registers and multiplied with the
//   float32 activations using float32 FMA accumulation; the only difference from the toolkit's
//   Python reference (float32 matmuls) is the order of the float32 additions.
//  int8 and int4 stores: integer dot products on quantised activations, as llama.cpp's Q8_0 x Q4_0 /
//   Q8_0 kernels do. The matrix input (x for gate and up, the GLU output for down) is quantised per
//   block of 32 values to int8 with one float32 scale per block: d = amax / 127, q = rint(x / d)
//   computed as x * (1 / d), round to nearest even (detail::quantize_act has the exact rule, also for
//   zero, tiny and non-finite blocks). Each block's dot product with the weights is computed exactly
//   in int32 and then scaled in float32, blocks in order, with separate multiplies and adds (no FMA):
//     int4 (one fp16 scale per row and group of 32): acc = acc + float(sumi) * (w_scale * x_scale)
//     int8 (one fp16 scale per row):                  acc = acc + float(sumi) * x_scale; y = acc * w_scale
//   Every ISA (portable, AVX2, AVX-VNNI, AVX512-VNNI, NEON, NEON dotprod, NEON i8mm) therefore gives
//   BITWISE identical results for int8 / int4 matrices, at any thread count, for forward,
//   forward_batch and forward_many alike (the SwiGLU between the matrices is vectorised with the
//   runner's own exp, exp_poly, the same bits on every ISA and C library but for the sign of an
//   invalid operation's NaN, negative on x86 and positive on ARM; the GELU forms and GPT-OSS's
//   GLU are scalar code whose erf / tanh / exp may round differently on another C library). The Python
//   reference (toolkit/runtime/experts.py) computes the same quantisation and block sums in torch.
//   Builds must not contract a * b + c into FMA (-ffp-contract=off, as CMakeLists.txt sets).
//
// Threads: forward, forward_batch and forward_many split their work over output rows (and experts)
// with spx::parallel_for (parallel.h: ExecuTorch's pool in the runner, sized by --threads); every
// output element is computed by one thread in a fixed order, so results never depend on the thread
// count. int8 / int4 experts only: fp16 experts run single-threaded.
//
// Instruction sets are chosen at run time (best_isa()); ISA-specific code is compiled with
// function-level target attributes, so every source file builds with the compiler's default flags.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace spx {

enum class Isa { portable, avx2, avx_vnni, avx512_vnni, neon, neon_dotprod, neon_i8mm };

// "portable", "avx2", "avx_vnni", "avx512_vnni", "neon", "neon_dotprod", "neon_i8mm".
const char* isa_name(Isa isa);
// The Isa named `name` (one of isa_name's, or "best" for best_isa()); throws Error otherwise.
Isa isa_from_name(const std::string& name);
// Whether this build on this CPU can run `isa` (checked at run time): portable always; avx2 on x86-64
// with AVX2, FMA and F16C; avx_vnni with AVX-VNNI as well; avx512_vnni with AVX512 F/VL/BW/VNNI as
// well; neon on aarch64; neon_dotprod with FEAT_DotProd (HWCAP_ASIMDDP); neon_i8mm with FEAT_I8MM too
// (HWCAP2_I8MM). The VNNI / dotprod / i8mm ISAs differ from avx2 / neon in the int8 / int4 kernels
// only (fp16 matrices run the avx2 / neon float kernels).
bool isa_supported(Isa isa);
// The fastest supported Isa: avx_vnni, avx512_vnni, avx2, neon_i8mm, neon_dotprod, neon or portable.
Isa best_isa();
// Every Isa isa_supported() accepts, in enum order.
std::vector<Isa> supported_isas();

// y[out] = W x for one weight matrix of a blob. `w` is the matrix's weight section (dtype f16, i8 or
// u8 = packed int4), `scale` its scale section (i8, u8) or nullptr (f16); [out, in] is the matrix's
// true shape (int4 rows are padded to whole groups of 32 in the blob). Reads x[0..in) only. fp16:
// float32 arithmetic; int8 / int4: x is quantised per block of 32 and the integer kernels run (as in
// ExpertExecutor). Single-threaded. Throws Error if the sections do not match the shape or `isa` is
// not supported.
void matvec(Isa isa, const Section& w, const Section* scale, int64_t out, int64_t in, const uint8_t* blob,
            const float* x, float* y);

namespace detail {
// One weight matrix bound to its blob sections and the kernel that runs it (internal).
struct BoundMatrix {
  size_t w_off = 0;  // weight section offset in the blob
  size_t s_off = 0;  // scale section offset (int8 / int4)
  bool has_scale = false;
  bool pads_input = false;  // int4 with in % 32 != 0: the float kernel reads x zero-padded to whole groups
  bool int4 = false, int8 = false;
  int64_t out = 0, in = 0;
  void (*fn)(const uint8_t* w, const uint8_t* s, int64_t out, int64_t in, const float* x, float* y) = nullptr;
  // integer-dot kernel (int8 / int4): kernels_impl.h's QMatFn
  void* qfn = nullptr;
};
struct QScratch;  // per-call buffers of the integer path (kernels.cpp)
}  // namespace detail

// One routed expert of a model, bound to a blob layout; forward() runs it on any blob of that layout.
class ExpertExecutor {
 public:
  // sections: the blob layout (store order); matrices: role + true shape; family: "gpt_oss" selects
  // the GPT-OSS form (clamped GLU with biases), anything else the SwiGLU-style default;
  // hidden_act: the config's hidden_act (silu / swish, gelu, gelu_pytorch_tanh / gelu_new; unused by
  // GPT-OSS); swiglu_limit: GPT-OSS's clamp limit. Throws Error on a layout it cannot run (missing
  // gate/up/down, shape mismatch, gate / up / down of different dtypes, unknown activation,
  // unsupported isa) naming what is wrong.
  ExpertExecutor(const std::vector<Section>& sections, const std::vector<Matrix>& matrices, const std::string& family,
               const std::string& hidden_act, float swiglu_limit, Isa isa = best_isa());
  ~ExpertExecutor();
  ExpertExecutor(const ExpertExecutor&) = delete;
  ExpertExecutor& operator=(const ExpertExecutor&) = delete;

  // y[H] = the expert's unweighted output for x[H]; blob points at the expert's bytes (at least
  // blob_bytes() of them). int8 / int4: rows split over parallel_for's threads. Uses internal
  // scratch: one call at a time per object (the methods below included).
  void forward(const uint8_t* blob, const float* x, float* y) const;

  // x [T, H] (rows contiguous) -> y [T, H]: row r of y is bitwise equal to forward(blob, x + r*H, .),
  // whatever T (chunked prefill relies on it). Each weight block is read once for all T rows.
  void forward_batch(const uint8_t* blob, const float* x, int64_t T, float* y) const;

  // n experts (blobs[i], each of this layout) on the same x [H]: outs[i][H] is bitwise equal to
  // forward(blobs[i], x, outs[i]). x is quantised once; two parallel_for dispatches in all (gate/up
  // + GLU over experts x row blocks, then down).
  void forward_many(const uint8_t* const* blobs, int n, const float* x, float* const* outs) const;

  int hidden_size() const { return static_cast<int>(h_); }
  int intermediate() const { return static_cast<int>(i_); }
  Isa isa() const { return isa_; }
  // Whether the integer-dot path runs (int8 / int4 stores).
  bool quantized() const { return quant_; }
  // Bytes of a blob this kernel reads: the end of its last section.
  size_t blob_bytes() const { return blob_bytes_; }

 private:
  enum class Act { silu, gelu, gelu_tanh };
  void forward_float(const uint8_t* blob, const float* x, float* y) const;
  // the integer path: n experts x T token rows (forward: 1 x 1, forward_batch: 1 x T, forward_many: n x 1)
  void run_quantized(const uint8_t* const* blobs, int n, const float* x, int64_t T, float* const* outs) const;
  // h[j] = GLU(g[j], u[j]) for j in [j0, j1) (biases from the blob for GPT-OSS)
  void glu(const uint8_t* blob, const float* g, const float* u, int64_t j0, int64_t j1, float* h) const;

  Isa isa_;
  bool gpt_oss_ = false;
  bool quant_ = false;
  Act act_ = Act::silu;
  float limit_ = 7.0f;
  int64_t h_ = 0, i_ = 0;
  size_t blob_bytes_ = 0;
  detail::BoundMatrix gate_, up_, down_;
  size_t bias_gate_ = 0, bias_up_ = 0, bias_down_ = 0;  // f16 bias offsets (GPT-OSS)
  // scratch: x and the GLU output zero-padded to whole groups of 32 (int4 kernels read whole groups)
  mutable std::vector<float> xpad_, g_, u_, hpad_;
  detail::QScratch* qs_ = nullptr;  // owned
  // the ISA's activation quantisation and SwiGLU (kernels_impl.h's QuantFn, SiluMulFn)
  void (*quant_fn_)(const float* x, int64_t n, bool permuted, int8_t* q, float* d, int32_t* sx) = nullptr;
  void (*silu_mul_)(const float* g, const float* u, int64_t n, float* h) = nullptr;
};

}  // namespace spx
