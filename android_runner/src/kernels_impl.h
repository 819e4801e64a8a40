// Internal to the expert kernels (kernels.cpp, kernels_avx2.cpp, kernels_neon.cpp): the per-ISA
// matrix-vector kernels behind spx::matvec and spx::ExpertExecutor.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace spx {
enum class Isa;  // kernels.h
namespace detail {

constexpr int64_t kGroup = 32;  // int4: inputs per fp16 scale

inline int64_t ceil_group(int64_t n) { return (n + kGroup - 1) / kGroup * kGroup; }

// y[out] = W x, W [out, in] in one weight format. w: the weight section's bytes; s: the scale
// section's bytes (nullptr for f16). Unaligned pointers are fine.
//  f16: w = f16 [out, in] row-major.
//  i8:  w = i8 [out, in], s = f16 [out]: W[r][c] = w[r][c] * s[r].
//  i4:  w = u8 [out, ceil32(in)/2] (low nibble = even column, signed -8..7), s = f16 [out, ceil32(in)/32]:
//       W[r][c] = q[r][c] * s[r][c/32]. The kernel reads x[0..ceil32(in)): the caller must make
//       x[in..ceil32(in)) readable and zero.
using MatvecFn = void (*)(const uint8_t* w, const uint8_t* s, int64_t out, int64_t in, const float* x, float* y);

// -- integer-dot kernels (int8 / int4 stores) --------------------------------------------------
//
// Activations quantised per block of 32 (quantize_act): q[b*32 + j] int8 in -127..127, d[b] the
// block's float32 scale (amax / 127), sx[b] = sum of the block's q (for the unsigned-offset tricks of
// x86's vpmaddubsw / vpdpbusd). Blocks past the row's end are zero. For int4 matrices each block is
// stored permuted, its 16 even columns first and its 16 odd columns after them (kPermuted), so the
// low nibbles of a weight block's 16 bytes (columns 0, 2, .., 30) meet q[0..16) and the high
// nibbles q[16..32) without shuffling the weights; int8 matrices take blocks in column order.
struct QAct {
  const int8_t* q = nullptr;    // [T][K * 32]
  const float* d = nullptr;     // [T][K]
  const int32_t* sx = nullptr;  // [T][K]
  int64_t K = 0;                // blocks per token row
  int64_t T = 1;                // token rows
};

// One int8 / int4 weight matrix as the integer kernels read it.
struct QMat {
  const uint8_t* w = nullptr;  // i8 [rows, in] or packed int4 [rows, K * 16]
  const uint8_t* s = nullptr;  // f16 scales: [rows] (int8) or [rows, K] (int4)
  int64_t in = 0;              // true columns (int8 rows are `in` bytes, not padded)
};

// Rows [r0, r1) of y = W q(x) for every token row of x, written to ya[t * ldy + r]; with `b` (a
// second matrix of the same shape, e.g. up beside gate) also yb[t * ldy + r] = B q(x) in the same pass
// over x. Every ISA computes, per row r and token t, exactly:
//   int4: acc = 0; for b in 0..K: acc = acc + float(sumi[r][b]) * (ws[r][b] * d[b]);  y = acc
//   int8: acc = 0; for b in 0..K: acc = acc + float(sumi[r][b]) * d[b];                y = acc * ws[r]
// with sumi the exact int32 dot product of the block's integers, float32 multiplies and adds (no
// FMA) in block order: outputs are bitwise identical across ISAs, thread counts and row ranges.
using QMatFn = void (*)(const QMat& a, const QMat* b, int64_t r0, int64_t r1, const QAct& x, float* ya, float* yb,
                        int64_t ldy);

// quantize_act's signature: every ISA's version writes exactly its bytes.
using QuantFn = void (*)(const float* x, int64_t n, bool permuted, int8_t* q, float* d, int32_t* sx);
// h[j] = silu(g[j]) * u[j] for j in [0, n), computed with e = exp_poly(-|g|) (at most 1, so it cannot
// overflow) as (g / (1 + e)) * u for g >= 0 (and NaN) and ((g * e) / (1 + e)) * u for g < 0: every
// ISA's version gives silu_mul's bits exactly (only an invalid operation's NaN, as -inf * 0, differs
// between x86 and ARM builds: negative on x86, ARM's default NaN positive).
using SiluMulFn = void (*)(const float* g, const float* u, int64_t n, float* h);

struct KernelSet {
  MatvecFn f16 = nullptr, i8 = nullptr, i4 = nullptr;
  QMatFn q8 = nullptr, q4 = nullptr;  // integer-dot int8 / int4 kernels
  QuantFn quant = nullptr;            // activation quantisation (quantize_act's rule)
  SiluMulFn silu_mul = nullptr;       // the SwiGLU between the matrices
};

constexpr int64_t kQBlock = 32;  // activation quantisation block (= the int4 group)

// Quantises n floats (one token row) into ceil(n/32) blocks: q [K*32], d [K], sx [K]. Per block:
// amax = max |x| (NaN if any x is NaN), d = amax / 127, id = 1 / d; when d is finite and positive
// and id is finite, q = clamp(rint(x * id), -127, 127) (round to nearest even), else (an all-zero or
// tiny block, or one holding inf / NaN) q = 0 and d is kept as computed, so inf / NaN still reach
// the output through d. permuted: the int4 order described at QAct. The portable version; the
// AVX2 and NEON ones (KernelSet::quant) vectorise whole blocks and call this for a row's tail.
void quantize_act(const float* x, int64_t n, bool permuted, int8_t* q, float* d, int32_t* sx);

// exp(x) in float32 with one fixed sequence of IEEE operations, so that the scalar code below and the
// AVX2 / NEON silu_mul give the same bits (a C library's expf differs between libraries and is not
// vectorised): Cephes' expf. x is clamped to [-104, 89] (exp(-104) rounds to 0, exp(89) overflows to
// inf), n = rint(x * log2(e)), r = x - n * ln2 (in two parts), exp(r) by a degree-7 polynomial
// (Horner, separate multiplies and adds), times 2^n as two exact power-of-two factors 2^(n >> 1) and
// 2^(n - (n >> 1)) (so that subnormal results round once and 2^128 overflows to inf). NaN returns x.
// Within 1 ulp of exp for normal results (0.99 ulp the worst case measured).
namespace expc {
constexpr float kLo = -104.0f, kHi = 89.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace expc

inline float pow2i(int32_t n) {  // 2^n for n in [-126, 127], exactly
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float exp_poly(float x) {
  using namespace expc;
  if (x != x) return x;
  x = x < kLo ? kLo : (x > kHi ? kHi : x);
  const float fx = std::nearbyint(x * kLog2e);
  float r = x - fx * kLn2Hi;
  r = r - fx * kLn2Lo;
  const float z = r * r;
  float y = kP0;
  y = y * r + kP1;
  y = y * r + kP2;
  y = y * r + kP3;
  y = y * r + kP4;
  y = y * r + kP5;
  y = y * z + r;
  y = y + 1.0f;
  const int32_t n = static_cast<int32_t>(fx), n1 = n >> 1;
  return y * pow2i(n1) * pow2i(n - n1);
}

// The portable silu_mul (SiluMulFn).
void silu_mul(const float* g, const float* u, int64_t n, float* h);

// The kernels of `isa` (kernels.cpp); throws Error if this build on this CPU cannot run it.
KernelSet kernels_for(Isa isa);

KernelSet portable_kernels();
KernelSet avx2_kernels();        // all null unless built for x86-64
KernelSet avxvnni_kernels();     // integer kernels with AVX-VNNI (VEX vpdpbusd); f16/i8/i4 = AVX2's
KernelSet avx512vnni_kernels();  // integer kernels with AVX512-VNNI (EVEX vpdpbusd, 256-bit)
KernelSet neon_kernels();        // all null unless built for aarch64
KernelSet dotprod_kernels();     // integer kernels with sdot (FEAT_DotProd); float kernels = NEON's
KernelSet i8mm_kernels();        // integer kernels with smmla (FEAT_I8MM) for token pairs, sdot else

// IEEE half -> float, exact for every input (subnormals, infinities, NaN payloads). Branch-light:
// move exponent and mantissa into place and rebias; infinities/NaNs get the rest of the exponent;
// subnormals are renormalised by one exact float subtraction (F. Giesen's half_to_float).
inline float f16_to_f32(uint16_t h) {
  constexpr uint32_t shifted_exp = 0x7c00u << 13;  // the half exponent mask, in float position
  uint32_t o = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = shifted_exp & o;
  o += (127u - 15u) << 23;
  if (exp == shifted_exp) {
    o += (128u - 16u) << 23;  // inf / NaN: exponent all ones, payload kept
  } else if (exp == 0) {      // zero / subnormal: 2^-14 * 0.m computed exactly in float
    o += 1u << 23;
    float f, magic;
    const uint32_t magic_bits = 113u << 23;  // 2^-14
    std::memcpy(&f, &o, sizeof f);
    std::memcpy(&magic, &magic_bits, sizeof magic);
    f -= magic;
    std::memcpy(&o, &f, sizeof o);
  }
  o |= static_cast<uint32_t>(h & 0x8000u) << 16;
  float out;
  std::memcpy(&out, &o, sizeof out);
  return out;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace detail
}  // namespace spx
