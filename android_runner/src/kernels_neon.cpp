// NEON expert kernels (aarch64, where NEON, fp16 <-> fp32 conversion and FMA are always present):
// 4-wide float32 FMA, weights dequantised in registers (fp16 via vcvt_f32_f16, int8 and int4 via
// integer widening and vcvtq_f32_s32), four output rows at a time with two accumulators each so
// every x load serves four rows and eight independent chains hide FMA latency. The integer-dot kernels
// of int8 / int4 stores (NEON, dotprod, i8mm) are kernels_neon_body.h, included below.
#include "kernels_impl.h"

#if defined(__aarch64__)

#include <arm_neon.h>

#include <cmath>
#include <limits>

namespace spx {
namespace detail {
namespace {

struct F8 {  // 8 floats
  float32x4_t lo, hi;
};

inline F8 ld_f16(const uint8_t* p) {
  float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(reinterpret_cast<const uint16_t*>(p)));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}

inline F8 cvt_s16(int16x8_t v) {
  return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(v))), vcvtq_f32_s32(vmovl_high_s16(v))};
}

inline F8 ld_i8(const uint8_t* p) { return cvt_s16(vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(p)))); }

// Four consecutive chunks of 8 with the same x: acc.lo += w.lo * x.lo, acc.hi += w.hi * x.hi.
inline void fma8(F8& acc, const F8& w, float32x4_t xl, float32x4_t xh) {
  acc.lo = vfmaq_f32(acc.lo, w.lo, xl);
  acc.hi = vfmaq_f32(acc.hi, w.hi, xh);
}

inline float sum8(const F8& a) { return vaddvq_f32(vaddq_f32(a.lo, a.hi)); }

template <F8 (*LD)(const uint8_t*), int ITEM>
inline void rows4(const uint8_t* p0, size_t rb, int64_t in8, const float* x, float t[4]) {
  const uint8_t* p1 = p0 + rb;
  const uint8_t* p2 = p1 + rb;
  const uint8_t* p3 = p2 + rb;
  const float32x4_t z = vdupq_n_f32(0.0f);
  F8 a0{z, z}, a1{z, z}, a2{z, z}, a3{z, z};
  for (int64_t c = 0; c < in8; c += 8) {
    float32x4_t xl = vld1q_f32(x + c), xh = vld1q_f32(x + c + 4);
    fma8(a0, LD(p0 + ITEM * c), xl, xh);
    fma8(a1, LD(p1 + ITEM * c), xl, xh);
    fma8(a2, LD(p2 + ITEM * c), xl, xh);
    fma8(a3, LD(p3 + ITEM * c), xl, xh);
  }
  t[0] = sum8(a0), t[1] = sum8(a1), t[2] = sum8(a2), t[3] = sum8(a3);
}

template <F8 (*LD)(const uint8_t*), int ITEM>
inline float row1(const uint8_t* p, int64_t in8, const float* x) {
  const float32x4_t z = vdupq_n_f32(0.0f);
  F8 a{z, z};
  for (int64_t c = 0; c < in8; c += 8) fma8(a, LD(p + ITEM * c), vld1q_f32(x + c), vld1q_f32(x + c + 4));
  return sum8(a);
}

void neon_f16(const uint8_t* w, const uint8_t*, int64_t out, int64_t in, const float* x, float* y) {
  const int64_t in8 = in & ~int64_t(7);
  const size_t rb = static_cast<size_t>(in) * 2;
  int64_t r = 0;
  for (; r + 4 <= out; r += 4) {
    const uint8_t* p = w + static_cast<size_t>(r) * rb;
    float t[4];
    rows4<ld_f16, 2>(p, rb, in8, x, t);
    for (int k = 0; k < 4; ++k) {
      const uint8_t* pk = p + k * rb;
      for (int64_t c = in8; c < in; ++c) t[k] += f16_to_f32(load_u16(pk + 2 * c)) * x[c];
      y[r + k] = t[k];
    }
  }
  for (; r < out; ++r) {
    const uint8_t* p = w + static_cast<size_t>(r) * rb;
    float t = row1<ld_f16, 2>(p, in8, x);
    for (int64_t c = in8; c < in; ++c) t += f16_to_f32(load_u16(p + 2 * c)) * x[c];
    y[r] = t;
  }
}

void neon_i8(const uint8_t* w, const uint8_t* s, int64_t out, int64_t in, const float* x, float* y) {
  const int64_t in8 = in & ~int64_t(7);
  const size_t rb = static_cast<size_t>(in);
  int64_t r = 0;
  for (; r + 4 <= out; r += 4) {
    const uint8_t* p = w + static_cast<size_t>(r) * rb;
    float t[4];
    rows4<ld_i8, 1>(p, rb, in8, x, t);
    for (int k = 0; k < 4; ++k) {
      const int8_t* pk = reinterpret_cast<const int8_t*>(p + k * rb);
      for (int64_t c = in8; c < in; ++c) t[k] += static_cast<float>(pk[c]) * x[c];
      y[r + k] = t[k] * f16_to_f32(load_u16(s + 2 * (r + k)));
    }
  }
  for (; r < out; ++r) {
    const uint8_t* p = w + static_cast<size_t>(r) * rb;
    float t = row1<ld_i8, 1>(p, in8, x);
    const int8_t* q = reinterpret_cast<const int8_t*>(p);
    for (int64_t c = in8; c < in; ++c) t += static_cast<float>(q[c]) * x[c];
    y[r] = t * f16_to_f32(load_u16(s + 2 * r));
  }
}

// One group of 32 int4 values of one row (16 bytes, low nibble = even column) times x[0..32):
// the unscaled dot product as a 4-lane vector. The low nibble is sign-extended by shifting it to
// the top of the byte and back (arithmetic), the high nibble by the arithmetic shift alone; a zip
// restores column order.
inline float32x4_t group_dot(const uint8_t* b, const float32x4_t xv[8]) {
  int8x16_t v = vreinterpretq_s8_u8(vld1q_u8(b));
  int8x16_t lo = vshrq_n_s8(vshlq_n_s8(v, 4), 4);
  int8x16_t hi = vshrq_n_s8(v, 4);
  int8x16_t c0 = vzip1q_s8(lo, hi);  // columns 0..15
  int8x16_t c1 = vzip2q_s8(lo, hi);  // columns 16..31
  F8 q0 = cvt_s16(vmovl_s8(vget_low_s8(c0)));
  F8 q1 = cvt_s16(vmovl_high_s8(c0));
  F8 q2 = cvt_s16(vmovl_s8(vget_low_s8(c1)));
  F8 q3 = cvt_s16(vmovl_high_s8(c1));
  float32x4_t t0 = vmulq_f32(q0.lo, xv[0]);
  float32x4_t t1 = vmulq_f32(q0.hi, xv[1]);
  t0 = vfmaq_f32(t0, q1.lo, xv[2]);
  t1 = vfmaq_f32(t1, q1.hi, xv[3]);
  t0 = vfmaq_f32(t0, q2.lo, xv[4]);
  t1 = vfmaq_f32(t1, q2.hi, xv[5]);
  t0 = vfmaq_f32(t0, q3.lo, xv[6]);
  t1 = vfmaq_f32(t1, q3.hi, xv[7]);
  return vaddq_f32(t0, t1);
}

inline float scale_at(const uint8_t* p) {
  return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(load_u16(p)))), 0);
}

void neon_i4(const uint8_t* w, const uint8_t* s, int64_t out, int64_t in, const float* x, float* y) {
  const int64_t groups = ceil_group(in) / kGroup;
  const size_t rb = static_cast<size_t>(groups) * (kGroup / 2);
  const size_t sb = static_cast<size_t>(groups) * 2;
  int64_t r = 0;
  for (; r + 4 <= out; r += 4) {
    const uint8_t* p0 = w + static_cast<size_t>(r) * rb;
    const uint8_t* s0 = s + static_cast<size_t>(r) * sb;
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t g = 0; g < groups; ++g) {
      float32x4_t xv[8];
      for (int k = 0; k < 8; ++k) xv[k] = vld1q_f32(x + g * kGroup + 4 * k);
      const uint8_t* b = p0 + g * (kGroup / 2);
      const uint8_t* sc = s0 + 2 * g;
      a0 = vfmaq_n_f32(a0, group_dot(b, xv), scale_at(sc));
      a1 = vfmaq_n_f32(a1, group_dot(b + rb, xv), scale_at(sc + sb));
      a2 = vfmaq_n_f32(a2, group_dot(b + 2 * rb, xv), scale_at(sc + 2 * sb));
      a3 = vfmaq_n_f32(a3, group_dot(b + 3 * rb, xv), scale_at(sc + 3 * sb));
    }
    y[r] = vaddvq_f32(a0), y[r + 1] = vaddvq_f32(a1), y[r + 2] = vaddvq_f32(a2), y[r + 3] = vaddvq_f32(a3);
  }
  for (; r < out; ++r) {
    const uint8_t* p = w + static_cast<size_t>(r) * rb;
    const uint8_t* sc = s + static_cast<size_t>(r) * sb;
    float32x4_t a = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      float32x4_t xv[8];
      for (int k = 0; k < 8; ++k) xv[k] = vld1q_f32(x + g * kGroup + 4 * k);
      a = vfmaq_n_f32(a, group_dot(p + g * (kGroup / 2), xv), scale_at(sc + 2 * g));
    }
    y[r] = vaddvq_f32(a);
  }
}

// quantize_act (kernels_impl.h) for whole blocks of 32, as avx2_quantize_act does: vrndnq is rint's
// round-to-nearest-even, the int4 order by vuzp; the row's partial last block goes to the portable code.
void neon_quantize_act(const float* x, int64_t n, bool permuted, int8_t* q, float* d, int32_t* sx) {
  const int64_t full = n / kQBlock;
  for (int64_t b = 0; b < full; ++b) {
    const float* xb = x + b * kQBlock;
    float32x4_t v[8];
    for (int k = 0; k < 8; ++k) v[k] = vld1q_f32(xb + 4 * k);
    float32x4_t a = vabsq_f32(v[0]);
    uint32x4_t ordered = vceqq_f32(v[0], v[0]);
    for (int k = 1; k < 8; ++k) {
      a = vmaxq_f32(a, vabsq_f32(v[k]));
      ordered = vandq_u32(ordered, vceqq_f32(v[k], v[k]));
    }
    const float amax = vminvq_u32(ordered) == 0 ? std::numeric_limits<float>::quiet_NaN() : vmaxvq_f32(a);
    const float db = amax / 127.0f;
    const float id = 1.0f / db;
    d[b] = db;
    int8_t* qb = q + b * kQBlock;
    if (!(db > 0.0f && std::isfinite(db) && std::isfinite(id))) {
      std::memset(qb, 0, kQBlock);
      sx[b] = 0;
      continue;
    }
    const float32x4_t hi = vdupq_n_f32(127.0f), lo = vdupq_n_f32(-127.0f);
    int32x4_t iv[8];
    int32x4_t s = vdupq_n_s32(0);
    for (int k = 0; k < 8; ++k) {
      const float32x4_t r = vrndnq_f32(vmulq_n_f32(v[k], id));
      iv[k] = vcvtq_s32_f32(vminq_f32(vmaxq_f32(r, lo), hi));
      s = vaddq_s32(s, iv[k]);
    }
    sx[b] = vaddvq_s32(s);
    int8x16_t p[2];
    for (int h = 0; h < 2; ++h) {
      const int16x8_t a0 = vcombine_s16(vmovn_s32(iv[4 * h]), vmovn_s32(iv[4 * h + 1]));
      const int16x8_t a1 = vcombine_s16(vmovn_s32(iv[4 * h + 2]), vmovn_s32(iv[4 * h + 3]));
      p[h] = vcombine_s8(vmovn_s16(a0), vmovn_s16(a1));
    }
    if (permuted) {
      const int8x16_t even = vuzp1q_s8(p[0], p[1]), odd = vuzp2q_s8(p[0], p[1]);
      p[0] = even;
      p[1] = odd;
    }
    vst1q_s8(qb, p[0]);
    vst1q_s8(qb + 16, p[1]);
  }
  if (full * kQBlock < n)
    quantize_act(x + full * kQBlock, n - full * kQBlock, permuted, q + full * kQBlock, d + full, sx + full);
}

// exp_poly (kernels_impl.h) on 4 lanes: the same operations in the same order (no FMA).
inline float32x4_t exp4(float32x4_t x) {
  using namespace expc;
  const uint32x4_t ordered = vceqq_f32(x, x);
  const float32x4_t xc = vminq_f32(vmaxq_f32(x, vdupq_n_f32(kLo)), vdupq_n_f32(kHi));
  const float32x4_t fx = vrndnq_f32(vmulq_n_f32(xc, kLog2e));
  float32x4_t r = vsubq_f32(xc, vmulq_n_f32(fx, kLn2Hi));
  r = vsubq_f32(r, vmulq_n_f32(fx, kLn2Lo));
  const float32x4_t z = vmulq_f32(r, r);
  float32x4_t y = vdupq_n_f32(kP0);
  y = vaddq_f32(vmulq_f32(y, r), vdupq_n_f32(kP1));
  y = vaddq_f32(vmulq_f32(y, r), vdupq_n_f32(kP2));
  y = vaddq_f32(vmulq_f32(y, r), vdupq_n_f32(kP3));
  y = vaddq_f32(vmulq_f32(y, r), vdupq_n_f32(kP4));
  y = vaddq_f32(vmulq_f32(y, r), vdupq_n_f32(kP5));
  y = vaddq_f32(vmulq_f32(y, z), r);
  y = vaddq_f32(y, vdupq_n_f32(1.0f));
  const int32x4_t n = vcvtq_s32_f32(fx), n1 = vshrq_n_s32(n, 1), n2 = vsubq_s32(n, n1);
  const int32x4_t bias = vdupq_n_s32(127);
  const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, bias), 23));
  const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, bias), 23));
  return vbslq_f32(ordered, vmulq_f32(vmulq_f32(y, s1), s2), x);
}

void neon_silu_mul(const float* g, const float* u, int64_t n, float* h) {
  const float32x4_t one = vdupq_n_f32(1.0f);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float32x4_t v = vld1q_f32(g + j);
    const float32x4_t e = exp4(vnegq_f32(vabsq_f32(v)));  // exp(-|v|)
    const float32x4_t den = vaddq_f32(one, e);
    const uint32x4_t neg = vcltq_f32(v, vdupq_n_f32(0.0f));
    const float32x4_t s = vbslq_f32(neg, vdivq_f32(vmulq_f32(v, e), den), vdivq_f32(v, den));
    vst1q_f32(h + j, vmulq_f32(s, vld1q_f32(u + j)));
  }
  if (j < n) silu_mul(g + j, u + j, n - j, h + j);
}

}  // namespace

// The integer-dot kernels, once per instruction set (kernels_neon_body.h). dotprod / i8mm code needs a
// compiler whose arm_neon.h offers those intrinsics to functions with a target attribute: GCC, or
// clang 16 and newer (the NDK r26's is 17); an older clang builds plain NEON only.
#if defined(__clang__) && __clang_major__ < 16 && !(defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_FEATURE_MATMUL_INT8))
#define SPX_ARM_EXT 0
#else
#define SPX_ARM_EXT 1
#endif
#if defined(__clang__)
#define SPX_TGT_DOTPROD __attribute__((target("dotprod")))
#define SPX_TGT_I8MM __attribute__((target("dotprod,i8mm")))
#else
#define SPX_TGT_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define SPX_TGT_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#endif
#define SPX_QNS q_neon
#define SPX_QTGT
#define SPX_QARM 0
#include "kernels_neon_body.h"
#undef SPX_QNS
#undef SPX_QTGT
#undef SPX_QARM
#if SPX_ARM_EXT
#define SPX_QNS q_dotprod
#define SPX_QTGT SPX_TGT_DOTPROD
#define SPX_QARM 1
#include "kernels_neon_body.h"
#undef SPX_QNS
#undef SPX_QTGT
#undef SPX_QARM
#define SPX_QNS q_i8mm
#define SPX_QTGT SPX_TGT_I8MM
#define SPX_QARM 2
#include "kernels_neon_body.h"
#undef SPX_QNS
#undef SPX_QTGT
#undef SPX_QARM
#endif

KernelSet neon_kernels() {
  return {neon_f16, neon_i8, neon_i4, q_neon::q8, q_neon::q4, neon_quantize_act, neon_silu_mul};
}
#if SPX_ARM_EXT
KernelSet dotprod_kernels() {
  return {neon_f16, neon_i8, neon_i4, q_dotprod::q8, q_dotprod::q4, neon_quantize_act, neon_silu_mul};
}
KernelSet i8mm_kernels() {
  return {neon_f16, neon_i8, neon_i4, q_i8mm::q8, q_i8mm::q4, neon_quantize_act, neon_silu_mul};
}
#else
KernelSet dotprod_kernels() { return {}; }
KernelSet i8mm_kernels() { return {}; }
#endif

}  // namespace detail
}  // namespace spx

#else  // not aarch64

namespace spx {
namespace detail {
KernelSet neon_kernels() { return {}; }
KernelSet dotprod_kernels() { return {}; }
KernelSet i8mm_kernels() { return {}; }
}  // namespace detail
}  // namespace spx

#endif
