// The x86 integer-dot kernels (kernels_impl.h's QMatFn), stamped out by kernels_avx2.cpp once per
// instruction set: included with SPX_QNS (namespace), SPX_QTGT (target attribute) and SPX_QVNNI
// (0: AVX2 vpmaddubsw + vpmaddwd, 1: AVX-VNNI vpdpbusd, 2: AVX512-VNNI vpdpbusd on 256-bit vectors).
//
// One block of 32 inputs is one 256-bit vector of quantised x. int4: the 16 weight bytes are split into
// low nibbles (columns 0, 2, .., 30) and high nibbles (1, 3, .., 31), which meet x's permuted block
// (even columns first); each nibble n is taken as the unsigned n ^ 8 = q + 8 and the dot product
// corrected by 8 * sum(x). int8: AVX2 uses llama.cpp's sign trick, |w| (unsigned) times x with w's
// sign (|w| * x <= 128 * 127, so vpmaddubsw cannot saturate); VNNI takes w + 128 (unsigned) and
// corrects by 128 * sum(x). Four rows' int32 sums are reduced together (vphaddd), then scaled in
// float32 lane by lane exactly as the portable kernel does (mul, mul, add; no FMA).
// Rows come in tiles of 8 (two groups of 4: gate rows and up rows for the fused pass, or 8
// consecutive rows), then 4, then 1; tokens in groups of 4, then 1. The arithmetic per (row, token)
// is the same in every path, so results never depend on the tiling.

namespace SPX_QNS {

SPX_QTGT inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if SPX_QVNNI == 1
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif SPX_QVNNI == 2
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// [sum(p0), sum(p1), sum(p2), sum(p3)] (int32, exact)
SPX_QTGT inline __m128i hsum4i(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

SPX_QTGT inline int32_t hsum1i(__m256i p) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// int4: a weight block as 32 unsigned bytes q + 8 (low nibbles in the low half)
SPX_QTGT inline __m256i load_w4(const uint8_t* p) {
  const __m128i v = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), _mm_set1_epi8(char(0x88)));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// int8: a weight block (the row's last, partial block zero-padded through a copy: rows are not padded)
SPX_QTGT inline __m256i load_w8(const uint8_t* p, int64_t n) {
  if (n >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint8_t t[32] = {};
  std::memcpy(t, p, static_cast<size_t>(n));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
}

// the prepared weight of one row block: int4 -> q + 8; int8 -> w (AVX2: kept signed for the sign
// trick; VNNI: w + 128)
template <bool I4>
SPX_QTGT inline __m256i prep(const uint8_t* p, int64_t n) {
  if (I4) return load_w4(p);
#if SPX_QVNNI
  return _mm256_xor_si256(load_w8(p, n), _mm256_set1_epi8(char(0x80)));
#else
  return load_w8(p, n);
#endif
}

// the raw int32 lanes of one row block times x (before the offset correction)
template <bool I4>
SPX_QTGT inline __m256i rowdot(__m256i w, __m256i x) {
#if SPX_QVNNI
  return dot_u8s8(w, x);
#else
  if (I4) return dot_u8s8(w, x);
  return dot_u8s8(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
#endif
}

// what the raw sums are off by: 8 * sum(x) (int4), 128 * sum(x) (int8 with VNNI), 0 (int8 AVX2)
template <bool I4>
constexpr int32_t offset_mul() {
#if SPX_QVNNI
  return I4 ? 8 : 128;
#else
  return I4 ? 8 : 0;
#endif
}

SPX_QTGT inline __m128 ld_scales4(const uint8_t* s, size_t stride) {
  return _mm_cvtph_ps(_mm_setr_epi16(static_cast<short>(load_u16(s)), static_cast<short>(load_u16(s + stride)),
                                     static_cast<short>(load_u16(s + 2 * stride)),
                                     static_cast<short>(load_u16(s + 3 * stride)), 0, 0, 0, 0));
}

struct Geo {
  size_t rb, sb;      // weight / scale bytes per row
  int64_t K, in;      // blocks per row, true columns
};

inline Geo geo(bool i4, const QMat& m, int64_t K) {
  return i4 ? Geo{static_cast<size_t>(K) * 16, static_cast<size_t>(K) * 2, K, m.in}
            : Geo{static_cast<size_t>(m.in), 2, K, m.in};
}

// G groups of 4 rows (wa/sa: the first group's first row, wb/sb the second's) x TB tokens from t0.
template <bool I4, int G, int TB>
SPX_QTGT void tile(const Geo& gm, const uint8_t* wa, const uint8_t* sa, const uint8_t* wb, const uint8_t* sbp,
                   const QAct& x, int64_t t0, float* ya, float* yb, int64_t ldy) {
  const int64_t K = gm.K;
  const size_t rb = gm.rb;
  __m128 acc[G][TB];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < TB; ++t) acc[g][t] = _mm_setzero_ps();
  for (int64_t b = 0; b < K; ++b) {
    const int64_t n = gm.in - b * 32;
    const size_t wo = I4 ? static_cast<size_t>(b) * 16 : static_cast<size_t>(b) * 32;
    __m256i w[G][4];
    for (int k = 0; k < 4; ++k) {
      w[0][k] = prep<I4>(wa + k * rb + wo, n);
      if (G == 2) w[G - 1][k] = prep<I4>(wb + k * rb + wo, n);
    }
    __m128 sc[G];
    if (I4) {
      sc[0] = ld_scales4(sa + 2 * b, gm.sb);
      if (G == 2) sc[G - 1] = ld_scales4(sbp + 2 * b, gm.sb);
    }
    for (int t = 0; t < TB; ++t) {
      const int64_t tt = t0 + t;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (tt * K + b) * 32));
      const float d = x.d[tt * K + b];
      const __m128i off = _mm_set1_epi32(offset_mul<I4>() * x.sx[tt * K + b]);
      for (int g = 0; g < G; ++g) {
        __m128i si = hsum4i(rowdot<I4>(w[g][0], xv), rowdot<I4>(w[g][1], xv), rowdot<I4>(w[g][2], xv),
                            rowdot<I4>(w[g][3], xv));
        if (offset_mul<I4>() != 0) si = _mm_sub_epi32(si, off);
        const __m128 f = _mm_cvtepi32_ps(si);
        const __m128 m = I4 ? _mm_mul_ps(sc[g], _mm_set1_ps(d)) : _mm_set1_ps(d);
        acc[g][t] = _mm_add_ps(acc[g][t], _mm_mul_ps(f, m));
      }
    }
  }
  for (int t = 0; t < TB; ++t) {
    const int64_t tt = t0 + t;
    for (int g = 0; g < G; ++g) {
      __m128 v = acc[g][t];
      if (!I4) v = _mm_mul_ps(v, ld_scales4(g ? sbp : sa, 2));  // int8: times the row scales at the end
      _mm_storeu_ps((g ? yb : ya) + tt * ldy, v);
    }
  }
}

// int4, G groups of 4 rows x TB tokens: two rows per 256-bit vector ([row k | row k+1], 16 weight bytes
// each), nibbles masked in place and met by x's even / odd halves broadcast to both lanes. The eight
// (or four) rows' sums come out of the vphaddd tree in lane order [0 2 4 6 | 1 3 5 7] (G = 2; rows 0-3
// from wa, 4-7 from wb) or [0 2 . . | 1 3 . .] (G = 1): the float lanes are kept in that order (the
// scales are loaded so) and put back in row order when stored.
//
// The weights of one block come from a source: I4Rows unpacks them from the matrix rows (and gathers the
// block's scales) each time, I4Packed reads what I4Rows produced for the whole tile once (tile_tokens
// does that when the tile meets several groups of tokens, so the unpacking and the scale gathers are not
// repeated per group). Both hand tile_i4 the same registers, so the arithmetic is the same.
template <int G>
struct I4Rows {
  static constexpr int P = 2 * G;  // row pairs
  const uint8_t* row[8];
  const uint8_t* srow[8];
  SPX_QTGT I4Rows(const Geo& gm, const uint8_t* wa, const uint8_t* sa, const uint8_t* wb, const uint8_t* sbp) {
    for (int k = 0; k < 4; ++k) {
      row[k] = wa + k * gm.rb;
      srow[k] = sa + k * gm.sb;
      row[4 + k] = G == 2 ? wb + k * gm.rb : row[k];
      srow[4 + k] = G == 2 ? sbp + k * gm.sb : srow[k];
    }
  }
  SPX_QTGT inline void block(int64_t b, __m256i* lo, __m256i* hi, __m256& sc) const {
    const __m256i m0f = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x88));
    const size_t wo = static_cast<size_t>(b) * 16;
    for (int j = 0; j < P; ++j) {  // pair j: rows (2j, 2j+1) of the lane order's source rows
      const int ra = G == 2 ? (j < 2 ? 2 * j : 4 + 2 * (j - 2)) : 2 * j;
      __m256i v = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row[ra] + wo))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[ra + 1] + wo)), 1);
      v = _mm256_xor_si256(v, flip);  // nibble n -> n ^ 8 = q + 8
      lo[j] = _mm256_and_si256(v, m0f);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
    }
    // scales in lane order: [r0 r2 r4 r6 | r1 r3 r5 r7] (G = 2), [r0 r2 - - | r1 r3 - -] (G = 1)
    const uint8_t* const* S = srow;
    const size_t so = static_cast<size_t>(b) * 2;
    if (G == 2) {
      sc = _mm256_cvtph_ps(_mm_setr_epi16(
          static_cast<short>(load_u16(S[0] + so)), static_cast<short>(load_u16(S[2] + so)),
          static_cast<short>(load_u16(S[4] + so)), static_cast<short>(load_u16(S[6] + so)),
          static_cast<short>(load_u16(S[1] + so)), static_cast<short>(load_u16(S[3] + so)),
          static_cast<short>(load_u16(S[5] + so)), static_cast<short>(load_u16(S[7] + so))));
    } else {
      const short s0 = static_cast<short>(load_u16(S[0] + so)), s2 = static_cast<short>(load_u16(S[2] + so));
      const short s1 = static_cast<short>(load_u16(S[1] + so)), s3 = static_cast<short>(load_u16(S[3] + so));
      sc = _mm256_cvtph_ps(_mm_setr_epi16(s0, s2, s0, s2, s1, s3, s1, s3));
    }
  }
};

// A tile's unpacked blocks (I4Rows::block for every block), at most kPackBlocks of them.
constexpr int64_t kPackBlocks = 128;  // rows of up to 4096 inputs; longer rows unpack per token group
template <int G>
struct I4Packed {
  static constexpr int P = 2 * G;
  alignas(32) __m256i w[kPackBlocks][2 * P];
  alignas(32) __m256 s[kPackBlocks];
  SPX_QTGT void fill(const I4Rows<G>& rows, int64_t K) {
    for (int64_t b = 0; b < K; ++b) rows.block(b, w[b], w[b] + P, s[b]);
  }
  SPX_QTGT inline void block(int64_t b, __m256i* lo, __m256i* hi, __m256& sc) const {
    for (int j = 0; j < P; ++j) {
      lo[j] = _mm256_load_si256(&w[b][j]);
      hi[j] = _mm256_load_si256(&w[b][P + j]);
    }
    sc = _mm256_load_ps(reinterpret_cast<const float*>(&s[b]));
  }
};

template <int G, int TB, class Src>
SPX_QTGT void tile_i4(const Geo& gm, const Src& src, const QAct& x, int64_t t0, float* ya, float* yb, int64_t ldy) {
  const int64_t K = gm.K;
  constexpr int P = 2 * G;  // row pairs
  __m256 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K; ++b) {
    __m256i lo[P], hi[P];
    __m256 sc;
    src.block(b, lo, hi, sc);
    for (int t = 0; t < TB; ++t) {
      const int64_t tt = t0 + t;
      const int8_t* q = x.q + (tt * K + b) * 32;
      const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
      __m256i d[P];
      for (int j = 0; j < P; ++j) {
#if SPX_QVNNI == 1
        d[j] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo[j], xlo), hi[j], xhi);
#elif SPX_QVNNI == 2
        d[j] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo[j], xlo), hi[j], xhi);
#else  // each vpmaddubsw lane <= 2 * 15 * 127: the two add up without int16 overflow
        d[j] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[j], xlo), _mm256_maddubs_epi16(hi[j], xhi)),
                                 _mm256_set1_epi16(1));
#endif
      }
      __m256i si;
      if (G == 2) {
        si = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
      } else {
        const __m256i h = _mm256_hadd_epi32(d[0], d[1]);
        si = _mm256_hadd_epi32(h, h);
      }
      si = _mm256_sub_epi32(si, _mm256_set1_epi32(8 * x.sx[tt * K + b]));
      const __m256 m = _mm256_mul_ps(sc, _mm256_set1_ps(x.d[tt * K + b]));
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(si), m));
    }
  }
  for (int t = 0; t < TB; ++t) {
    const int64_t tt = t0 + t;
    if (G == 2) {  // lanes [0 2 4 6 1 3 5 7] -> rows 0..7
      const __m256 v = _mm256_permutevar8x32_ps(acc[t], _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm_storeu_ps(ya + tt * ldy, _mm256_castps256_ps128(v));
      _mm_storeu_ps(yb + tt * ldy, _mm256_extractf128_ps(v, 1));
    } else {  // lanes [0 2 0 2 1 3 1 3] -> rows 0..3
      const __m256 v = _mm256_permutevar8x32_ps(acc[t], _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
      _mm_storeu_ps(ya + tt * ldy, _mm256_castps256_ps128(v));
    }
  }
}

// one row x one token (the tails), the same arithmetic as a tile lane
template <bool I4>
SPX_QTGT float row1(const Geo& gm, const uint8_t* w, const uint8_t* s, const QAct& x, int64_t t) {
  const int64_t K = gm.K;
  float acc = 0.0f;
  for (int64_t b = 0; b < K; ++b) {
    const int64_t n = gm.in - b * 32;
    const __m256i wv = prep<I4>(w + (I4 ? b * 16 : b * 32), n);
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (t * K + b) * 32));
    const int32_t sumi = hsum1i(rowdot<I4>(wv, xv)) - offset_mul<I4>() * x.sx[t * K + b];
    const float d = x.d[t * K + b];
    const float m = I4 ? _cvtsh_ss(load_u16(s + 2 * b)) * d : d;
    acc = acc + static_cast<float>(sumi) * m;
  }
  return I4 ? acc : acc * _cvtsh_ss(load_u16(s));
}

template <bool I4, int G>
SPX_QTGT void tile_tokens(const Geo& gm, const uint8_t* wa, const uint8_t* sa, const uint8_t* wb, const uint8_t* sb,
                          const QAct& x, float* ya, float* yb, int64_t ldy) {
  int64_t t = 0;
  if (I4) {
    const I4Rows<G> rows(gm, wa, sa, wb, sb);
    // several token groups: unpack the tile once, into a buffer of 36 KiB (G = 2) per thread made on
    // first use (if that allocation fails, the tile unpacks per group: this runs on a pool worker,
    // where an exception would end the process)
    thread_local std::unique_ptr<I4Packed<G>> buf;
    if (x.T >= 8 && gm.K <= kPackBlocks && !buf) buf.reset(new (std::nothrow) I4Packed<G>);
    if (x.T >= 8 && gm.K <= kPackBlocks && buf) {
      I4Packed<G>& packed = *buf;
      packed.fill(rows, gm.K);
      for (; t + 4 <= x.T; t += 4) tile_i4<G, 4>(gm, packed, x, t, ya, yb, ldy);
      for (; t < x.T; ++t) tile_i4<G, 1>(gm, packed, x, t, ya, yb, ldy);
      return;
    }
    for (; t + 4 <= x.T; t += 4) tile_i4<G, 4>(gm, rows, x, t, ya, yb, ldy);
    for (; t < x.T; ++t) tile_i4<G, 1>(gm, rows, x, t, ya, yb, ldy);
    return;
  }
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
  if (b) {  // fused: 4 rows of a and the same 4 rows of b share every x load
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
