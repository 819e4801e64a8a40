// The aarch64 integer-dot kernels (kernels_impl.h's QMatFn), stamped out by kernels_neon.cpp once per
// instruction set: included with SPX_QNS (namespace), SPX_QTGT (target attribute) and SPX_QARM
// (0: plain NEON, vmull_s8 / vpadalq_s16; 1: FEAT_DotProd sdot; 2: sdot, and FEAT_I8MM smmla for
// pairs of tokens, each smmla giving two rows x two tokens).
//
// Weights are taken signed as they are (int4 nibbles sign-extended by shifts; low nibbles = columns
// 0, 2, .., 30 meet x's permuted block q[0..16), high nibbles q[16..32)), so no offset correction.
// Four rows' int32 sums are reduced together (vpaddq), then scaled in float32 lane by lane exactly as
// the portable kernel does (mul, mul, add; no FMA). Tiles as in kernels_x86_body.h.

namespace SPX_QNS {

struct WB {  // one row's prepared weight block: 32 int8 values in the order x's block holds them
  int8x16_t a, b;
};

template <bool I4>
SPX_QTGT inline WB prep(const uint8_t* p, int64_t n) {
  if (I4) {
    const int8x16_t v = vreinterpretq_s8_u8(vld1q_u8(p));
    return {vshrq_n_s8(vshlq_n_s8(v, 4), 4), vshrq_n_s8(v, 4)};
  }
  if (n >= 32) return {vld1q_s8(reinterpret_cast<const int8_t*>(p)), vld1q_s8(reinterpret_cast<const int8_t*>(p) + 16)};
  alignas(16) int8_t t[32] = {};
  std::memcpy(t, p, static_cast<size_t>(n));  // int8 rows are not padded: the partial last block
  return {vld1q_s8(t), vld1q_s8(t + 16)};
}

SPX_QTGT inline int32x4_t rowdot(const WB& w, int8x16_t x0, int8x16_t x1) {
#if SPX_QARM >= 1
  return vdotq_s32(vdotq_s32(vdupq_n_s32(0), w.a, x0), w.b, x1);
#else
  int16x8_t p0 = vmull_s8(vget_low_s8(w.a), vget_low_s8(x0));
  p0 = vmlal_high_s8(p0, w.a, x0);  // two products of at most 128 * 127: no int16 overflow
  int16x8_t p1 = vmull_s8(vget_low_s8(w.b), vget_low_s8(x1));
  p1 = vmlal_high_s8(p1, w.b, x1);
  return vpadalq_s16(vpaddlq_s16(p0), p1);
#endif
}

SPX_QTGT inline int32x4_t hsum4i(int32x4_t p0, int32x4_t p1, int32x4_t p2, int32x4_t p3) {
  return vpaddq_s32(vpaddq_s32(p0, p1), vpaddq_s32(p2, p3));
}

SPX_QTGT inline float32x4_t ld_scales4(const uint8_t* s, size_t stride) {
  uint16x4_t v = vdup_n_u16(load_u16(s));
  v = vset_lane_u16(load_u16(s + stride), v, 1);
  v = vset_lane_u16(load_u16(s + 2 * stride), v, 2);
  v = vset_lane_u16(load_u16(s + 3 * stride), v, 3);
  return vcvt_f32_f16(vreinterpret_f16_u16(v));
}

SPX_QTGT inline float ld_scale(const uint8_t* s) {
  return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(load_u16(s)))), 0);
}

struct Geo {
  size_t rb, sb;  // weight / scale bytes per row
  int64_t K, in;  // blocks per row, true columns
};

inline Geo geo(bool i4, const QMat& m, int64_t K) {
  return i4 ? Geo{static_cast<size_t>(K) * 16, static_cast<size_t>(K) * 2, K, m.in}
            : Geo{static_cast<size_t>(m.in), 2, K, m.in};
}

// acc += float(si) * (scale * d) lane by lane (int4) or acc += float(si) * d (int8)
template <bool I4>
SPX_QTGT inline float32x4_t scale_add(float32x4_t acc, int32x4_t si, float32x4_t sc, float d) {
  const float32x4_t m = I4 ? vmulq_f32(sc, vdupq_n_f32(d)) : vdupq_n_f32(d);
  return vaddq_f32(acc, vmulq_f32(vcvtq_f32_s32(si), m));
}

#if SPX_QARM == 2
// the four int32 dot products rows {r0, r1} x tokens {t0, t1} of one block: [r0t0, r0t1, r1t0, r1t1]
SPX_QTGT inline int32x4_t mm2x2(const WB& r0, const WB& r1, const int8x16_t x[2][2]) {
  const int64x2_t a0 = vreinterpretq_s64_s8(r0.a), a1 = vreinterpretq_s64_s8(r1.a);
  const int64x2_t b0 = vreinterpretq_s64_s8(r0.b), b1 = vreinterpretq_s64_s8(r1.b);
  const int64x2_t x00 = vreinterpretq_s64_s8(x[0][0]), x10 = vreinterpretq_s64_s8(x[1][0]);
  const int64x2_t x01 = vreinterpretq_s64_s8(x[0][1]), x11 = vreinterpretq_s64_s8(x[1][1]);
  int32x4_t acc = vdupq_n_s32(0);
  acc = vmmlaq_s32(acc, vreinterpretq_s8_s64(vzip1q_s64(a0, a1)), vreinterpretq_s8_s64(vzip1q_s64(x00, x10)));
  acc = vmmlaq_s32(acc, vreinterpretq_s8_s64(vzip2q_s64(a0, a1)), vreinterpretq_s8_s64(vzip2q_s64(x00, x10)));
  acc = vmmlaq_s32(acc, vreinterpretq_s8_s64(vzip1q_s64(b0, b1)), vreinterpretq_s8_s64(vzip1q_s64(x01, x11)));
  acc = vmmlaq_s32(acc, vreinterpretq_s8_s64(vzip2q_s64(b0, b1)), vreinterpretq_s8_s64(vzip2q_s64(x01, x11)));
  return acc;
}
#endif

// G groups of 4 rows x TB tokens from t0 (see kernels_x86_body.h)
template <bool I4, int G, int TB>
SPX_QTGT void tile(const Geo& gm, const uint8_t* wa, const uint8_t* sa, const uint8_t* wb, const uint8_t* sbp,
                   const QAct& x, int64_t t0, float* ya, float* yb, int64_t ldy) {
  const int64_t K = gm.K;
  const size_t rb = gm.rb;
  float32x4_t acc[G][TB];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < TB; ++t) acc[g][t] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < K; ++b) {
    const int64_t n = gm.in - b * 32;
    const size_t wo = I4 ? static_cast<size_t>(b) * 16 : static_cast<size_t>(b) * 32;
    WB w[G][4];
    for (int k = 0; k < 4; ++k) {
      w[0][k] = prep<I4>(wa + k * rb + wo, n);
      if (G == 2) w[G - 1][k] = prep<I4>(wb + k * rb + wo, n);
    }
    float32x4_t sc[G];
    for (int g = 0; g < G; ++g) sc[g] = I4 ? ld_scales4((g ? sbp : sa) + 2 * b, gm.sb) : vdupq_n_f32(0.0f);
#if SPX_QARM == 2
    if (TB % 2 == 0) {
      for (int t = 0; t < TB; t += 2) {
        int8x16_t xv[2][2];
        for (int u = 0; u < 2; ++u) {
          const int8_t* q = x.q + ((t0 + t + u) * K + b) * 32;
          xv[u][0] = vld1q_s8(q);
          xv[u][1] = vld1q_s8(q + 16);
        }
        const float d0 = x.d[(t0 + t) * K + b], d1 = x.d[(t0 + t + 1) * K + b];
        for (int g = 0; g < G; ++g) {
          const int32x4_t m01 = mm2x2(w[g][0], w[g][1], xv), m23 = mm2x2(w[g][2], w[g][3], xv);
          acc[g][t] = scale_add<I4>(acc[g][t], vuzp1q_s32(m01, m23), sc[g], d0);
          acc[g][t + 1] = scale_add<I4>(acc[g][t + 1], vuzp2q_s32(m01, m23), sc[g], d1);
        }
      }
      continue;
    }
#endif
    for (int t = 0; t < TB; ++t) {
      const int8_t* q = x.q + ((t0 + t) * K + b) * 32;
      const int8x16_t x0 = vld1q_s8(q), x1 = vld1q_s8(q + 16);
      const float d = x.d[(t0 + t) * K + b];
      for (int g = 0; g < G; ++g) {
        const int32x4_t si = hsum4i(rowdot(w[g][0], x0, x1), rowdot(w[g][1], x0, x1), rowdot(w[g][2], x0, x1),
                                    rowdot(w[g][3], x0, x1));
        acc[g][t] = scale_add<I4>(acc[g][t], si, sc[g], d);
      }
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int g = 0; g < G; ++g) {
      float32x4_t v = acc[g][t];
      if (!I4) v = vmulq_f32(v, ld_scales4(g ? sbp : sa, 2));  // int8: times the row scales at the end
      vst1q_f32((g ? yb : ya) + (t0 + t) * ldy, v);
    }
}

template <bool I4>
SPX_QTGT float row1(const Geo& gm, const uint8_t* w, const uint8_t* s, const QAct& x, int64_t t) {
  const int64_t K = gm.K;
  float acc = 0.0f;
  for (int64_t b = 0; b < K; ++b) {
    const WB wv = prep<I4>(w + (I4 ? b * 16 : b * 32), gm.in - b * 32);
    const int8_t* q = x.q + (t * K + b) * 32;
    const int32_t sumi = vaddvq_s32(rowdot(wv, vld1q_s8(q), vld1q_s8(q + 16)));
    const float d = x.d[t * K + b];
    const float m = I4 ? ld_scale(s + 2 * b) * d : d;
    acc = acc + static_cast<float>(sumi) * m;
  }
  return I4 ? acc : acc * ld_scale(s);
}

template <bool I4, int G>
SPX_QTGT void tile_tokens(const Geo& gm, const uint8_t* wa, const uint8_t* sa, const uint8_t* wb, const uint8_t* sb,
                          const QAct& x, float* ya, float* yb, int64_t ldy) {
  int64_t t = 0;
  for (; t + 4 <= x.T; t += 4) tile<I4, G, 4>(gm, wa, sa, wb, sb, x, t, ya, yb, ldy);
  for (; t < x.T; ++t) tile<I4, G, 1>(gm, wa, sa, wb, sb, x, t, ya, yb, ldy);
}

template <bool I4>
SPX_QTGT void qmat(const QMat& a, const QMat* b, int64_t r0, int64_t r1, const QAct& x, float* ya, float* yb,
                   int64_t ldy) {
  const Geo gm = geo(I4, a, x.K);
  auto W = [&](const QMat& m, int64_t r) { return m.w + static_cast<size_t>(r) * gm.rb; };
  auto S = [&](const QMat& m, int64_t r) { return m.s + static_cast<size_t>(r) * (I4 ? gm.sb : 2); };
  int64_t r = r0;
  if (b) {
    for (; r + 4 <= r1; r += 4)
      tile_tokens<I4, 2>(gm, W(a, r), S(a, r), W(*b, r), S(*b, r), x, ya + r, yb + r, ldy);
  } else {
    for (; r + 8 <= r1; r += 8)
      tile_tokens<I4, 2>(gm, W(a, r), S(a, r), W(a, r + 4), S(a, r + 4), x, ya + r, ya + r + 4, ldy);
    for (; r + 4 <= r1; r += 4) tile_tokens<I4, 1>(gm, W(a, r), S(a, r), nullptr, nullptr, x, ya + r, nullptr, ldy);
  }
  for (; r < r1; ++r)
    for (int64_t t = 0; t < x.T; ++t) {
      ya[t * ldy + r] = row1<I4>(gm, W(a, r), S(a, r), x, t);
      if (b) yb[t * ldy + r] = row1<I4>(gm, W(*b, r), S(*b, r), x, t);
    }
}

SPX_QTGT void q4(const QMat& a, const QMat* b, int64_t r0, int64_t r1, const QAct& x, float* ya, float* yb,
                 int64_t ldy) {
  qmat<true>(a, b, r0, r1, x, ya, yb, ldy);
}

SPX_QTGT void q8(const QMat& a, const QMat* b, int64_t r0, int64_t r1, const QAct& x, float* ya, float* yb,
                 int64_t ldy) {
  qmat<false>(a, b, r0, r1, x, ya, yb, ldy);
}

}  // namespace SPX_QNS
