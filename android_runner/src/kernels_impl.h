// Internal to the expert kernels (kernels.cpp, kernels_avx2.cpp, kernels_neon.cpp): the per-ISA
// matrix-vector kernels behind spx::matvec and spx::ExpertKernel.
#pragma once

#include <cstdint>
#include <cstring>

namespace spx {
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

struct KernelSet {
  MatvecFn f16 = nullptr, i8 = nullptr, i4 = nullptr;
};

KernelSet portable_kernels();
KernelSet avx2_kernels();  // all null unless built for x86-64
KernelSet neon_kernels();  // all null unless built for aarch64

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
