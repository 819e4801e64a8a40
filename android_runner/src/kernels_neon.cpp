// NEON expert kernels (aarch64, where NEON, fp16 <-> fp32 conversion and FMA are always present):
// 4-wide float32 FMA, weights dequantised in registers (fp16 via vcvt_f32_f16, int8 and int4 via
// integer widening and vcvtq_f32_s32), four output rows at a time with two accumulators each so
// every x load serves four rows and eight independent chains hide FMA latency. The integer-dot kernels
// of int8 / int4 stores (NEON, dotprod, i8mm) are kernels_neon_body.h, included below.
#include "kernels_impl.h"

#if defined(__aarch64__)

#include <arm_neon.h>

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

KernelSet neon_kernels() { return {neon_f16, neon_i8, neon_i4, q_neon::q8, q_neon::q4}; }
#if SPX_ARM_EXT
KernelSet dotprod_kernels() { return {neon_f16, neon_i8, neon_i4, q_dotprod::q8, q_dotprod::q4}; }
KernelSet i8mm_kernels() { return {neon_f16, neon_i8, neon_i4, q_i8mm::q8, q_i8mm::q4}; }
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
