// AVX2 expert kernels (x86-64 with AVX2, FMA, F16C). fp16 / float paths: 8-wide float32 FMA, weights dequantised in
// registers (fp16 via F16C, int8 and int4 via integer -> float conversion), four output rows at a
// time so every x load serves four rows and four independent accumulator chains hide FMA latency.
// Compiled with function-level target attributes: this file builds with default flags, and the
// kernels only run where isa_supported(Isa::avx2) found the instructions at run time. The integer-dot
// kernels of int8 / int4 stores (AVX2, AVX-VNNI, AVX512-VNNI) are kernels_x86_body.h, included below.
#include "kernels_impl.h"

#if defined(__x86_64__)

#include <immintrin.h>

#include <cmath>
#include <limits>
#include <memory>
#include <new>

#define SPX_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace spx {
namespace detail {
namespace {

// [sum(a0), sum(a1), sum(a2), sum(a3)]
SPX_AVX2 inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 s01 = _mm256_hadd_ps(a0, a1);
  __m256 s23 = _mm256_hadd_ps(a2, a3);
  __m256 s = _mm256_hadd_ps(s01, s23);
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

SPX_AVX2 inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

SPX_AVX2 inline __m256 ld_f16(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

SPX_AVX2 inline __m256 ld_i8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 8 int4 values (4 bytes, low nibble first) -> 8 exact floats: broadcast the 32-bit word, shift
// nibble k down to the bottom of lane k, keep it (n); n ^ 8 = q + 8 in 0..15 for the signed value q.
// Or'ed into the mantissa of 2^23 (bits 0x4B000000) that is the float 2^23 + q + 8, so subtracting
// 2^23 + 8 gives q exactly. This keeps the integer work off the FMA ports (and, xor) where a
// shift-left / arithmetic-shift-right / convert sequence would load them with three operations.
SPX_AVX2 inline __m256 ld_i4(const uint8_t* p, __m256i shifts) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  __m256i n = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(v), shifts), _mm256_set1_epi32(0xF));
  __m256i f = _mm256_xor_si256(n, _mm256_set1_epi32(0x4B000008));
  return _mm256_sub_ps(_mm256_castsi256_ps(f), _mm256_set1_ps(8388616.0f));
}

// Row-wise weight formats for dot_rows: bytes per weight, 8 weights as floats, one weight as a float.
struct F16Weights {
  static constexpr size_t kBytes = 2;
  SPX_AVX2 static inline __m256 load8(const uint8_t* p) { return ld_f16(p); }
  static inline float one(const uint8_t* p) { return f16_to_f32(load_u16(p)); }
};
struct I8Weights {
  static constexpr size_t kBytes = 1;
  SPX_AVX2 static inline __m256 load8(const uint8_t* p) { return ld_i8(p); }
  static inline float one(const uint8_t* p) { return static_cast<float>(static_cast<int8_t>(*p)); }
};

// y[out] = W x (unscaled) for row-major weights of format T: four rows at a time, two accumulator
// chains per row, the scalar tail (in % 8) added after the horizontal sum.
template <class T>
SPX_AVX2 void dot_rows(const uint8_t* w, int64_t out, int64_t in, const float* x, float* y) {
  constexpr size_t B = T::kBytes;
  const int64_t in8 = in & ~int64_t(7);
  const size_t rb = static_cast<size_t>(in) * B;  // row bytes
  int64_t r = 0;
  for (; r + 4 <= out; r += 4) {
    const uint8_t* p0 = w + static_cast<size_t>(r) * rb;
    const uint8_t* p1 = p0 + rb;
    const uint8_t* p2 = p1 + rb;
    const uint8_t* p3 = p2 + rb;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= in8; c += 16) {
      __m256 xv = _mm256_loadu_ps(x + c), xw = _mm256_loadu_ps(x + c + 8);
      a0 = _mm256_fmadd_ps(T::load8(p0 + B * c), xv, a0);
      a1 = _mm256_fmadd_ps(T::load8(p1 + B * c), xv, a1);
      a2 = _mm256_fmadd_ps(T::load8(p2 + B * c), xv, a2);
      a3 = _mm256_fmadd_ps(T::load8(p3 + B * c), xv, a3);
      b0 = _mm256_fmadd_ps(T::load8(p0 + B * (c + 8)), xw, b0);
      b1 = _mm256_fmadd_ps(T::load8(p1 + B * (c + 8)), xw, b1);
      b2 = _mm256_fmadd_ps(T::load8(p2 + B * (c + 8)), xw, b2);
      b3 = _mm256_fmadd_ps(T::load8(p3 + B * (c + 8)), xw, b3);
    }
    if (c < in8) {
      __m256 xv = _mm256_loadu_ps(x + c);
      a0 = _mm256_fmadd_ps(T::load8(p0 + B * c), xv, a0);
      a1 = _mm256_fmadd_ps(T::load8(p1 + B * c), xv, a1);
      a2 = _mm256_fmadd_ps(T::load8(p2 + B * c), xv, a2);
      a3 = _mm256_fmadd_ps(T::load8(p3 + B * c), xv, a3);
    }
    alignas(16) float t[4];
    _mm_store_ps(t, hsum4(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1), _mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3)));
    for (int64_t c = in8; c < in; ++c) {
      t[0] += T::one(p0 + B * c) * x[c];
      t[1] += T::one(p1 + B * c) * x[c];
      t[2] += T::one(p2 + B * c) * x[c];
      t[3] += T::one(p3 + B * c) * x[c];
    }
    y[r] = t[0], y[r + 1] = t[1], y[r + 2] = t[2], y[r + 3] = t[3];
  }
  for (; r < out; ++r) {
    const uint8_t* p = w + static_cast<size_t>(r) * rb;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= in8; c += 16) {
      a0 = _mm256_fmadd_ps(T::load8(p + B * c), _mm256_loadu_ps(x + c), a0);
      a1 = _mm256_fmadd_ps(T::load8(p + B * (c + 8)), _mm256_loadu_ps(x + c + 8), a1);
    }
    for (; c < in8; c += 8) a0 = _mm256_fmadd_ps(T::load8(p + B * c), _mm256_loadu_ps(x + c), a0);
    float t = hsum(_mm256_add_ps(a0, a1));
    for (; c < in; ++c) t += T::one(p + B * c) * x[c];
    y[r] = t;
  }
}

SPX_AVX2 void avx2_f16(const uint8_t* w, const uint8_t*, int64_t out, int64_t in, const float* x, float* y) {
  dot_rows<F16Weights>(w, out, in, x, y);
}

SPX_AVX2 void avx2_i8(const uint8_t* w, const uint8_t* s, int64_t out, int64_t in, const float* x, float* y) {
  dot_rows<I8Weights>(w, out, in, x, y);
  for (int64_t r = 0; r < out; ++r) y[r] = y[r] * f16_to_f32(load_u16(s + 2 * r));  // one scale per row
}

// One group of 32 inputs of one row: the unscaled dot product as an 8-lane vector.
SPX_AVX2 inline __m256 group_dot(const uint8_t* b, __m256 x0, __m256 x1, __m256 x2, __m256 x3, __m256i sh) {
  __m256 t = _mm256_mul_ps(ld_i4(b, sh), x0);
  t = _mm256_fmadd_ps(ld_i4(b + 4, sh), x1, t);
  t = _mm256_fmadd_ps(ld_i4(b + 8, sh), x2, t);
  return _mm256_fmadd_ps(ld_i4(b + 12, sh), x3, t);
}

SPX_AVX2 void avx2_i4(const uint8_t* w, const uint8_t* s, int64_t out, int64_t in, const float* x, float* y) {
  const int64_t groups = ceil_group(in) / kGroup;
  const size_t rb = static_cast<size_t>(groups) * (kGroup / 2);  // row bytes
  const size_t sb = static_cast<size_t>(groups) * 2;             // scale bytes per row
  const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  int64_t r = 0;
  for (; r + 4 <= out; r += 4) {
    const uint8_t* p0 = w + static_cast<size_t>(r) * rb;
    const uint8_t* s0 = s + static_cast<size_t>(r) * sb;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + g * kGroup;
      __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8), x2 = _mm256_loadu_ps(xg + 16),
             x3 = _mm256_loadu_ps(xg + 24);
      const uint8_t* b = p0 + g * (kGroup / 2);
      const uint8_t* sc = s0 + 2 * g;
      a0 = _mm256_fmadd_ps(group_dot(b, x0, x1, x2, x3, sh), _mm256_set1_ps(_cvtsh_ss(load_u16(sc))), a0);
      a1 = _mm256_fmadd_ps(group_dot(b + rb, x0, x1, x2, x3, sh), _mm256_set1_ps(_cvtsh_ss(load_u16(sc + sb))), a1);
      a2 = _mm256_fmadd_ps(group_dot(b + 2 * rb, x0, x1, x2, x3, sh),
                           _mm256_set1_ps(_cvtsh_ss(load_u16(sc + 2 * sb))), a2);
      a3 = _mm256_fmadd_ps(group_dot(b + 3 * rb, x0, x1, x2, x3, sh),
                           _mm256_set1_ps(_cvtsh_ss(load_u16(sc + 3 * sb))), a3);
    }
    _mm_storeu_ps(y + r, hsum4(a0, a1, a2, a3));
  }
  for (; r < out; ++r) {
    const uint8_t* p = w + static_cast<size_t>(r) * rb;
    const uint8_t* sc = s + static_cast<size_t>(r) * sb;
    __m256 a = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + g * kGroup;
      __m256 t = group_dot(p + g * (kGroup / 2), _mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8),
                           _mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24), sh);
      a = _mm256_fmadd_ps(t, _mm256_set1_ps(_cvtsh_ss(load_u16(sc + 2 * g))), a);
    }
    y[r] = hsum(a);
  }
}

// quantize_act (kernels_impl.h) for whole blocks of 32: the same amax, d, id and ok per block (a max is
// exact in any order; vroundps with _MM_FROUND_TO_NEAREST_INT is rint's round-to-nearest-even), the
// clamp as min / max (q cannot be NaN where ok), packed as llama.cpp's quantize_row_q8_0 does, the int4
// order by a byte shuffle; the row's partial last block goes to the portable code.
SPX_AVX2 void avx2_quantize_act(const float* x, int64_t n, bool permuted, int8_t* q, float* d, int32_t* sx) {
  const int64_t full = n / kQBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // within each 128-bit lane: even bytes first, then odd; then qwords (0, 2, 1, 3)
  const __m256i deint = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                         14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t b = 0; b < full; ++b) {
    const float* xb = x + b * kQBlock;
    __m256 v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(xb + 8 * k);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const __m256 un = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q), _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)),
                                   _mm256_or_ps(_mm256_cmp_ps(v[2], v[2], _CMP_UNORD_Q), _mm256_cmp_ps(v[3], v[3], _CMP_UNORD_Q)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float amax = _mm256_movemask_ps(un) ? std::numeric_limits<float>::quiet_NaN() : _mm_cvtss_f32(m);
    const float db = amax / 127.0f;
    const float id = 1.0f / db;
    d[b] = db;
    int8_t* qb = q + b * kQBlock;
    if (!(db > 0.0f && std::isfinite(db) && std::isfinite(id))) {
      std::memset(qb, 0, kQBlock);
      sx[b] = 0;
      continue;
    }
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i iv[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      iv[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    sx[b] = _mm_cvtsi128_si32(s);
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (permuted) p = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(p, deint), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), p);
  }
  if (full * kQBlock < n)
    quantize_act(x + full * kQBlock, n - full * kQBlock, permuted, q + full * kQBlock, d + full, sx + full);
}

// exp_poly (kernels_impl.h) on 8 lanes: the same operations in the same order.
SPX_AVX2 inline __m256 exp8(__m256 x) {
  using namespace expc;
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLo)), _mm256_set1_ps(kHi));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(xc, _mm256_mul_ps(fx, _mm256_set1_ps(kLn2Hi)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fx, _mm256_set1_ps(kLn2Lo)));
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(kP1));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(kP2));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(kP3));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(kP4));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(kP5));
  y = _mm256_add_ps(_mm256_mul_ps(y, z), r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i n = _mm256_cvtps_epi32(fx), n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_blendv_ps(_mm256_mul_ps(_mm256_mul_ps(y, s1), s2), x, nan);
}

SPX_AVX2 void avx2_silu_mul(const float* g, const float* u, int64_t n, float* h) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(g + j);
    const __m256 e = exp8(_mm256_or_ps(v, sign));  // exp(-|v|)
    const __m256 den = _mm256_add_ps(one, e);
    const __m256 neg = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 s = _mm256_blendv_ps(_mm256_div_ps(v, den), _mm256_div_ps(_mm256_mul_ps(v, e), den), neg);
    _mm256_storeu_ps(h + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
  }
  if (j < n) silu_mul(g + j, u + j, n - j, h + j);
}

}  // namespace

// The integer-dot kernels, once per instruction set (kernels_x86_body.h).
#define SPX_QNS q_avx2
#define SPX_QTGT __attribute__((target("avx2,fma,f16c")))
#define SPX_QVNNI 0
#include "kernels_x86_body.h"
#undef SPX_QNS
#undef SPX_QTGT
#undef SPX_QVNNI
#define SPX_QNS q_avxvnni
#define SPX_QTGT __attribute__((target("avx2,fma,f16c,avxvnni")))
#define SPX_QVNNI 1
#include "kernels_x86_body.h"
#undef SPX_QNS
#undef SPX_QTGT
#undef SPX_QVNNI
#define SPX_QNS q_avx512vnni
#define SPX_QTGT __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define SPX_QVNNI 2
#include "kernels_x86_body.h"
#undef SPX_QNS
#undef SPX_QTGT
#undef SPX_QVNNI

KernelSet avx2_kernels() {
  return {avx2_f16, avx2_i8, avx2_i4, q_avx2::q8, q_avx2::q4, avx2_quantize_act, avx2_silu_mul};
}
KernelSet avxvnni_kernels() {
  return {avx2_f16, avx2_i8, avx2_i4, q_avxvnni::q8, q_avxvnni::q4, avx2_quantize_act, avx2_silu_mul};
}
KernelSet avx512vnni_kernels() {
  return {avx2_f16, avx2_i8, avx2_i4, q_avx512vnni::q8, q_avx512vnni::q4, avx2_quantize_act, avx2_silu_mul};
}

}  // namespace detail
}  // namespace spx

#else  // not x86-64

namespace spx {
namespace detail {
KernelSet avx2_kernels() { return {}; }
KernelSet avxvnni_kernels() { return {}; }
KernelSet avx512vnni_kernels() { return {}; }
}  // namespace detail
}  // namespace spx

#endif
