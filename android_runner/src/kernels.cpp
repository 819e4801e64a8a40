// Expert compute kernels: ISA dispatch, layout binding, the expert forward pass and the portable
// (plain C++) matrix-vector kernels. The AVX2 and NEON kernels are in kernels_avx2.cpp and
// kernels_neon.cpp. Numerics (float32 throughout, weights dequantised in registers, activations
// never quantised) are explained in kernels.h.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>

#include "kernels_impl.h"
#include "parallel.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace spx {

using detail::BoundMatrix;
using detail::ceil_group;
using detail::f16_to_f32;
using detail::kGroup;
using detail::load_u16;
using detail::kernels_for;

// ---------------------------------------------------------------------------------------------
// Portable kernels: plain C++, any CPU. Four partial sums per row so the compiler can overlap them.

namespace {

void portable_f16(const uint8_t* w, const uint8_t*, int64_t out, int64_t in, const float* x, float* y) {
  for (int64_t r = 0; r < out; ++r) {
    const uint8_t* row = w + static_cast<size_t>(r * in) * 2;
    float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    int64_t c = 0;
    for (; c + 4 <= in; c += 4) {
      a0 += f16_to_f32(load_u16(row + 2 * c)) * x[c];
      a1 += f16_to_f32(load_u16(row + 2 * c + 2)) * x[c + 1];
      a2 += f16_to_f32(load_u16(row + 2 * c + 4)) * x[c + 2];
      a3 += f16_to_f32(load_u16(row + 2 * c + 6)) * x[c + 3];
    }
    for (; c < in; ++c) a0 += f16_to_f32(load_u16(row + 2 * c)) * x[c];
    y[r] = (a0 + a1) + (a2 + a3);
  }
}

void portable_i8(const uint8_t* w, const uint8_t* s, int64_t out, int64_t in, const float* x, float* y) {
  for (int64_t r = 0; r < out; ++r) {
    const int8_t* row = reinterpret_cast<const int8_t*>(w) + r * in;
    float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    int64_t c = 0;
    for (; c + 4 <= in; c += 4) {
      a0 += static_cast<float>(row[c]) * x[c];
      a1 += static_cast<float>(row[c + 1]) * x[c + 1];
      a2 += static_cast<float>(row[c + 2]) * x[c + 2];
      a3 += static_cast<float>(row[c + 3]) * x[c + 3];
    }
    for (; c < in; ++c) a0 += static_cast<float>(row[c]) * x[c];
    y[r] = ((a0 + a1) + (a2 + a3)) * f16_to_f32(load_u16(s + 2 * r));
  }
}

// byte -> (value of its low nibble, value of its high nibble), each a signed 4-bit integer
struct NibblePairs {
  float v[256][2];
  constexpr NibblePairs() : v{} {
    for (int b = 0; b < 256; ++b) {
      v[b][0] = static_cast<float>((b & 0xF) - ((b & 0x8) << 1));
      v[b][1] = static_cast<float>((b >> 4) - ((b & 0x80) >> 3));
    }
  }
};
constexpr NibblePairs kNibbles;  // built at compile time

void portable_i4(const uint8_t* w, const uint8_t* s, int64_t out, int64_t in, const float* x, float* y) {
  const int64_t groups = ceil_group(in) / kGroup;
  for (int64_t r = 0; r < out; ++r) {
    const uint8_t* row = w + r * groups * (kGroup / 2);
    const uint8_t* sc = s + r * groups * 2;
    float acc = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* b = row + g * (kGroup / 2);
      const float* xg = x + g * kGroup;
      float a0 = 0, a1 = 0;
      for (int j = 0; j < kGroup / 2; ++j) {  // byte j: column 2j in the low nibble, 2j+1 in the high
        const float* q = kNibbles.v[b[j]];
        a0 += q[0] * xg[2 * j];
        a1 += q[1] * xg[2 * j + 1];
      }
      acc += (a0 + a1) * f16_to_f32(load_u16(sc + 2 * g));
    }
    y[r] = acc;
  }
}

// Integer-dot kernels (kernels_impl.h, QMatFn): the same integers and float operations as every
// SIMD kernel, one row and one block at a time.
void portable_q4(const detail::QMat& a, const detail::QMat* b, int64_t r0, int64_t r1, const detail::QAct& x,
                 float* ya, float* yb, int64_t ldy) {
  const int64_t K = x.K;
  const size_t rb = static_cast<size_t>(K) * 16, sb = static_cast<size_t>(K) * 2;
  for (int m = 0; m < (b ? 2 : 1); ++m) {
    const detail::QMat& mat = m ? *b : a;
    float* y = m ? yb : ya;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = mat.w + static_cast<size_t>(r) * rb;
      const uint8_t* sc = mat.s + static_cast<size_t>(r) * sb;
      for (int64_t t = 0; t < x.T; ++t) {
        const int8_t* q = x.q + t * K * kGroup;
        const float* d = x.d + t * K;
        float acc = 0.0f;
        for (int64_t g = 0; g < K; ++g) {
          const uint8_t* wb = row + g * 16;
          const int8_t* qb = q + g * kGroup;
          int32_t sumi = 0;
          for (int j = 0; j < 16; ++j) {  // low nibble: column 2j (q[j]), high: column 2j+1 (q[16+j])
            const int lo = (wb[j] & 0xF) - ((wb[j] & 0x8) << 1);
            const int hi = (wb[j] >> 4) - ((wb[j] & 0x80) >> 3);
            sumi += lo * qb[j] + hi * qb[16 + j];
          }
          acc = acc + static_cast<float>(sumi) * (f16_to_f32(load_u16(sc + 2 * g)) * d[g]);
        }
        y[t * ldy + r] = acc;
      }
    }
  }
}

void portable_q8(const detail::QMat& a, const detail::QMat* b, int64_t r0, int64_t r1, const detail::QAct& x,
                 float* ya, float* yb, int64_t ldy) {
  const int64_t K = x.K, in = a.in;
  for (int m = 0; m < (b ? 2 : 1); ++m) {
    const detail::QMat& mat = m ? *b : a;
    float* y = m ? yb : ya;
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* row = reinterpret_cast<const int8_t*>(mat.w) + r * in;
      const float ws = f16_to_f32(load_u16(mat.s + 2 * r));
      for (int64_t t = 0; t < x.T; ++t) {
        const int8_t* q = x.q + t * K * kGroup;
        const float* d = x.d + t * K;
        float acc = 0.0f;
        for (int64_t g = 0; g < K; ++g) {
          const int64_t c0 = g * kGroup, c1 = std::min(in, c0 + kGroup);
          int32_t sumi = 0;
          for (int64_t c = c0; c < c1; ++c) sumi += row[c] * q[c];
          acc = acc + static_cast<float>(sumi) * d[g];
        }
        y[t * ldy + r] = acc * ws;
      }
    }
  }
}

}  // namespace

namespace detail {
KernelSet portable_kernels() {
  return {portable_f16, portable_i8, portable_i4, portable_q8, portable_q4, quantize_act, silu_mul};
}

void silu_mul(const float* g, const float* u, int64_t n, float* h) {
  for (int64_t j = 0; j < n; ++j) {
    const float v = g[j], e = exp_poly(-std::fabs(v));  // e <= 1: no overflow for very negative v
    h[j] = (v < 0.0f ? (v * e) / (1.0f + e) : v / (1.0f + e)) * u[j];
  }
}

void quantize_act(const float* x, int64_t n, bool permuted, int8_t* q, float* d, int32_t* sx) {
  const int64_t K = (n + kQBlock - 1) / kQBlock;
  for (int64_t b = 0; b < K; ++b) {
    const int64_t c0 = b * kQBlock, m = std::min<int64_t>(kQBlock, n - c0);
    const float* xb = x + c0;
    float amax = 0.0f;
    bool nan = false;
    for (int64_t j = 0; j < m; ++j) {
      const float a = std::fabs(xb[j]);
      nan |= a != a;
      amax = a > amax ? a : amax;
    }
    if (nan) amax = std::numeric_limits<float>::quiet_NaN();
    const float db = amax / 127.0f;
    const float id = 1.0f / db;
    const bool ok = db > 0.0f && std::isfinite(db) && std::isfinite(id);
    int8_t* qb = q + c0;
    int32_t s = 0;
    for (int64_t j = 0; j < kQBlock; ++j) {
      int v = 0;
      if (ok && j < m) {
        float r = std::nearbyint(xb[j] * id);
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        v = static_cast<int>(r);
      }
      s += v;
      qb[permuted ? ((j & 1) ? 16 + j / 2 : j / 2) : j] = static_cast<int8_t>(v);
    }
    d[b] = db;
    sx[b] = s;
  }
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// ISA selection

namespace {
struct IsaInfo {
  Isa isa;
  const char* name;
};
constexpr IsaInfo kIsas[] = {{Isa::portable, "portable"},       {Isa::avx2, "avx2"},
                             {Isa::avx_vnni, "avx_vnni"},       {Isa::avx512_vnni, "avx512_vnni"},
                             {Isa::neon, "neon"},               {Isa::neon_dotprod, "neon_dotprod"},
                             {Isa::neon_i8mm, "neon_i8mm"}};

#if defined(__x86_64__)
bool x86_avx2() {
  static const bool ok = [] {
    // AVX2 and FMA (the checks include the OS saving the YMM state); F16C from CPUID leaf 1
    unsigned a = 0, b = 0, c = 0, d = 0;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c &&
           detail::avx2_kernels().f16 != nullptr;
  }();
  return ok;
}
bool x86_avx_vnni() {  // CPUID.(EAX=7, ECX=1):EAX bit 4
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return x86_avx2() && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4));
  }();
  return ok;
}
bool x86_avx512_vnni() {
  static const bool ok = x86_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  return ok;
}
#endif

#if defined(__aarch64__) && defined(__linux__)
bool arm_hwcap(int which, unsigned long bit) { return (getauxval(which) & bit) != 0; }
#endif
}  // namespace

const char* isa_name(Isa isa) {
  for (const IsaInfo& i : kIsas)
    if (i.isa == isa) return i.name;
  return "?";
}

Isa isa_from_name(const std::string& name) {
  for (const IsaInfo& i : kIsas)
    if (name == i.name) return i.isa;
  if (name == "best") return best_isa();
  std::string all;
  for (const IsaInfo& i : kIsas) all += std::string(i.name) + ", ";
  throw Error("unknown kernel ISA '" + name + "' (choose " + all + "or best)");
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::portable: return true;
#if defined(__x86_64__)
    case Isa::avx2: return x86_avx2();
    case Isa::avx_vnni: return x86_avx_vnni() && detail::avxvnni_kernels().q4 != nullptr;
    case Isa::avx512_vnni: return x86_avx512_vnni() && detail::avx512vnni_kernels().q4 != nullptr;
#endif
#if defined(__aarch64__)
    case Isa::neon: return detail::neon_kernels().f16 != nullptr;
#if defined(__linux__)
    case Isa::neon_dotprod:  // HWCAP_ASIMDDP = 1 << 20, HWCAP2_I8MM = 1 << 13 (Linux and Android)
      return arm_hwcap(AT_HWCAP, 1ul << 20) && detail::dotprod_kernels().q4 != nullptr;
    case Isa::neon_i8mm:
      return arm_hwcap(AT_HWCAP, 1ul << 20) && arm_hwcap(AT_HWCAP2, 1ul << 13) && detail::i8mm_kernels().q4 != nullptr;
#endif
#endif
    default: return false;
  }
}

Isa best_isa() {
  for (Isa i : {Isa::avx_vnni, Isa::avx512_vnni, Isa::avx2, Isa::neon_i8mm, Isa::neon_dotprod, Isa::neon})
    if (isa_supported(i)) return i;
  return Isa::portable;
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> v;
  for (const IsaInfo& i : kIsas)
    if (isa_supported(i.isa)) v.push_back(i.isa);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Layout binding

detail::KernelSet detail::kernels_for(Isa isa) {
  if (!isa_supported(isa))
    throw Error(std::string("kernel ISA '") + isa_name(isa) + "' is not supported by this build on this CPU");
  switch (isa) {
    case Isa::avx2: return detail::avx2_kernels();
    case Isa::avx_vnni: return detail::avxvnni_kernels();
    case Isa::avx512_vnni: return detail::avx512vnni_kernels();
    case Isa::neon: return detail::neon_kernels();
    case Isa::neon_dotprod: return detail::dotprod_kernels();
    case Isa::neon_i8mm: return detail::i8mm_kernels();
    default: return detail::portable_kernels();
  }
}

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

void expect_section(const Section& s, const char* dtype, const std::vector<int64_t>& shape, size_t itemsize,
                    const std::string& what) {
  if (s.dtype != dtype)
    throw Error("expert layout: " + what + " section '" + s.role + "' (" + s.kind + ") has dtype '" + s.dtype +
                "', expected '" + dtype + "'");
  if (s.shape != shape)
    throw Error("expert layout: " + what + " section '" + s.role + "' (" + s.kind + ") has shape " +
                shape_str(s.shape) + ", expected " + shape_str(shape));
  size_t n = itemsize;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  if (s.nbytes != n)
    throw Error("expert layout: section '" + s.role + "' (" + s.kind + ") has " + std::to_string(s.nbytes) +
                " bytes, its shape " + shape_str(shape) + " needs " + std::to_string(n));
}


// Checks a weight matrix's sections against its true shape [out, in] and picks its kernel.
BoundMatrix bind_matrix(const Section& w, const Section* scale, int64_t out, int64_t in, Isa isa) {
  if (out <= 0 || in <= 0)
    throw Error("expert layout: matrix '" + w.role + "' has an empty shape [" + std::to_string(out) + ", " +
                std::to_string(in) + "]");
  const detail::KernelSet ks = kernels_for(isa);
  BoundMatrix m;
  m.out = out;
  m.in = in;
  m.w_off = w.offset;
  if (w.kind != "weight") throw Error("expert layout: section '" + w.role + "' is a " + w.kind + ", not a weight");
  if (w.dtype == "f16") {
    expect_section(w, "f16", {out, in}, 2, "weight");
    m.fn = ks.f16;
  } else if (w.dtype == "i8") {
    expect_section(w, "i8", {out, in}, 1, "weight");
    if (!scale) throw Error("expert layout: int8 matrix '" + w.role + "' has no scale section");
    expect_section(*scale, "f16", {out}, 2, "scale");
    m.fn = ks.i8;
    m.int8 = true;
    m.qfn = reinterpret_cast<void*>(ks.q8);
  } else if (w.dtype == "u8") {
    const int64_t ip = ceil_group(in);
    expect_section(w, "u8", {out, ip / 2}, 1, "weight");
    if (!scale) throw Error("expert layout: int4 matrix '" + w.role + "' has no scale section");
    expect_section(*scale, "f16", {out, ip / kGroup}, 2, "scale");
    m.fn = ks.i4;
    m.int4 = true;
    m.qfn = reinterpret_cast<void*>(ks.q4);
    m.pads_input = (in % kGroup) != 0;
  } else {
    throw Error("expert layout: weight section '" + w.role + "' has dtype '" + w.dtype +
                "' (the kernels run f16, i8 and u8 = int4)");
  }
  if (scale) {
    if (w.dtype == "f16") throw Error("expert layout: fp16 matrix '" + w.role + "' has a scale section");
    m.has_scale = true;
    m.s_off = scale->offset;
  }
  return m;
}

void run(const BoundMatrix& m, const uint8_t* blob, const float* x, float* y) {
  m.fn(blob + m.w_off, m.has_scale ? blob + m.s_off : nullptr, m.out, m.in, x, y);
}

inline float gelu(float v) { return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f)); }
inline float gelu_tanh(float v) {
  const float k = 0.79788456080286536f;  // sqrt(2 / pi)
  return 0.5f * v * (1.0f + std::tanh(k * (v + 0.044715f * v * v * v)));
}

detail::QMat qmat(const BoundMatrix& m, const uint8_t* blob) {
  detail::QMat q;
  q.w = blob + m.w_off;
  q.s = blob + m.s_off;
  q.in = m.in;
  return q;
}

inline detail::QMatFn qfn(const BoundMatrix& m) { return reinterpret_cast<detail::QMatFn>(m.qfn); }

int64_t blocks(int64_t n) { return (n + detail::kQBlock - 1) / detail::kQBlock; }

}  // namespace

void matvec(Isa isa, const Section& w, const Section* scale, int64_t out, int64_t in, const uint8_t* blob,
            const float* x, float* y) {
  BoundMatrix m = bind_matrix(w, scale, out, in, isa);
  if (m.int4 || m.int8) {
    const int64_t K = blocks(in);
    std::vector<int8_t> q(static_cast<size_t>(K * detail::kQBlock));
    std::vector<float> d(static_cast<size_t>(K));
    std::vector<int32_t> sx(static_cast<size_t>(K));
    kernels_for(isa).quant(x, in, m.int4, q.data(), d.data(), sx.data());
    detail::QAct qa{q.data(), d.data(), sx.data(), K, 1};
    qfn(m)(qmat(m, blob), nullptr, 0, out, qa, y, nullptr, out);
  } else if (m.pads_input) {
    std::vector<float> xp(static_cast<size_t>(ceil_group(in)), 0.0f);
    std::copy(x, x + in, xp.begin());
    run(m, blob, xp.data(), y);
  } else {
    run(m, blob, x, y);
  }
}

namespace detail {
// Buffers of the integer path, grown on demand: x quantised ([T][Kh] blocks), and per expert e and
// token t the gate / up outputs, the GLU output and its quantised blocks.
struct QScratch {
  std::vector<int8_t> qx, qh;
  std::vector<float> dx, dh, g, u, h;
  std::vector<int32_t> sxx, sxh;
  void size(int n, int64_t T, int64_t Kh, int64_t Ki, int64_t I) {
    auto grow = [](auto& v, int64_t k) {
      if (v.size() < static_cast<size_t>(k)) v.resize(static_cast<size_t>(k));
    };
    grow(qx, T * Kh * kQBlock);
    grow(dx, T * Kh);
    grow(sxx, T * Kh);
    grow(g, n * T * I);
    grow(u, n * T * I);
    grow(h, n * T * I);
    grow(qh, n * T * Ki * kQBlock);
    grow(dh, n * T * Ki);
    grow(sxh, n * T * Ki);
  }
};
}  // namespace detail

ExpertExecutor::ExpertExecutor(const std::vector<Section>& sections, const std::vector<Matrix>& matrices,
                           const std::string& family, const std::string& hidden_act, float swiglu_limit, Isa isa)
    : isa_(isa) {
  gpt_oss_ = family == "gpt_oss";
  if (gpt_oss_) {
    if (!(swiglu_limit > 0.0f))
      throw Error("gpt_oss expert: swiglu_limit must be a positive number, got " + std::to_string(swiglu_limit));
    limit_ = swiglu_limit;
  } else if (hidden_act == "silu" || hidden_act == "swish") {
    act_ = Act::silu;
  } else if (hidden_act == "gelu") {
    act_ = Act::gelu;
  } else if (hidden_act == "gelu_pytorch_tanh" || hidden_act == "gelu_new") {
    act_ = Act::gelu_tanh;
  } else {
    throw Error("expert activation '" + hidden_act + "' of family '" + family +
                "' is not supported by the native kernels (silu, swish, gelu, gelu_pytorch_tanh, gelu_new)");
  }
  kernels_for(isa);  // refuse an unsupported ISA before looking at the layout

  std::map<std::string, std::vector<int64_t>> shapes;
  for (const Matrix& m : matrices) {
    if (!shapes.emplace(m.role, m.shape).second) throw Error("expert layout: matrix '" + m.role + "' listed twice");
  }
  std::map<std::pair<std::string, std::string>, const Section*> secs;
  for (const Section& s : sections) {
    if (!secs.emplace(std::make_pair(s.role, s.kind), &s).second)
      throw Error("expert layout: section '" + s.role + "' (" + s.kind + ") listed twice");
    if (!shapes.count(s.role)) throw Error("expert layout: section '" + s.role + "' belongs to no expert matrix");
    if (s.offset + s.nbytes < s.offset) throw Error("expert layout: section '" + s.role + "' overflows");
    blob_bytes_ = std::max(blob_bytes_, s.offset + s.nbytes);
  }
  auto mat_shape = [&](const std::string& role) -> const std::vector<int64_t>& {
    auto it = shapes.find(role);
    if (it == shapes.end()) throw Error("expert layout: no '" + role + "' matrix (an expert needs gate, up and down)");
    if (it->second.size() != 2)
      throw Error("expert layout: matrix '" + role + "' has shape " + shape_str(it->second) + ", expected [out, in]");
    return it->second;
  };
  auto section = [&](const std::string& role, const char* kind) -> const Section* {
    auto it = secs.find({role, kind});
    return it == secs.end() ? nullptr : it->second;
  };
  const auto& gs = mat_shape("gate");
  const auto& us = mat_shape("up");
  const auto& ds = mat_shape("down");
  i_ = gs[0];
  h_ = gs[1];
  if (us != gs)
    throw Error("expert layout: up matrix " + shape_str(us) + " does not match gate " + shape_str(gs));
  if (ds != std::vector<int64_t>{h_, i_})
    throw Error("expert layout: down matrix " + shape_str(ds) + " is not [hidden, intermediate] = " +
                shape_str({h_, i_}) + " of gate " + shape_str(gs));
  auto bind = [&](const std::string& role) {
    const Section* w = section(role, "weight");
    if (!w) throw Error("expert layout: no weight section for matrix '" + role + "'");
    const auto& sh = shapes[role];
    return bind_matrix(*w, section(role, "scale"), sh[0], sh[1], isa);
  };
  const detail::KernelSet ks = kernels_for(isa);
  quant_fn_ = ks.quant;
  silu_mul_ = ks.silu_mul;
  gate_ = bind("gate");
  up_ = bind("up");
  down_ = bind("down");

  const char* bias_roles[] = {"bias_gate", "bias_up", "bias_down"};
  if (gpt_oss_) {
    size_t* offs[] = {&bias_gate_, &bias_up_, &bias_down_};
    const int64_t lens[] = {i_, i_, h_};
    for (int k = 0; k < 3; ++k) {
      auto it = shapes.find(bias_roles[k]);
      if (it == shapes.end()) throw Error(std::string("gpt_oss expert layout: no '") + bias_roles[k] + "' bias");
      if (it->second != std::vector<int64_t>{lens[k]})
        throw Error(std::string("gpt_oss expert layout: '") + bias_roles[k] + "' has shape " +
                    shape_str(it->second) + ", expected " + shape_str({lens[k]}));
      const Section* s = section(bias_roles[k], "bias");
      if (!s) throw Error(std::string("gpt_oss expert layout: no bias section for '") + bias_roles[k] + "'");
      expect_section(*s, "f16", {lens[k]}, 2, "bias");
      *offs[k] = s->offset;
    }
  }
  for (const auto& kv : shapes) {
    const std::string& r = kv.first;
    bool known = r == "gate" || r == "up" || r == "down" ||
                 (gpt_oss_ && (r == bias_roles[0] || r == bias_roles[1] || r == bias_roles[2]));
    if (!known)
      throw Error("expert layout: matrix '" + r + "' is not part of a '" + family + "' expert" +
                  (gpt_oss_ ? "" : " (only gpt_oss experts carry biases)"));
  }
  for (const Section& s : sections) {
    const bool core = s.role == "gate" || s.role == "up" || s.role == "down";
    const bool ok = (core && (s.kind == "weight" || s.kind == "scale")) || (!core && s.kind == "bias");
    if (!ok) throw Error("expert layout: section '" + s.role + "' of kind '" + s.kind + "' is not understood");
  }

  quant_ = gate_.int4 || gate_.int8;
  if (quant_ || up_.qfn || down_.qfn) {
    if (!(gate_.int4 == up_.int4 && up_.int4 == down_.int4 && gate_.int8 == up_.int8 && up_.int8 == down_.int8))
      throw Error("expert layout: gate, up and down must share one dtype (an expert store has one)");
    if (!gate_.qfn || !up_.qfn || !down_.qfn)
      throw Error(std::string("kernel ISA '") + isa_name(isa) + "' has no integer kernels");
    qs_ = new detail::QScratch;
  }
  xpad_.assign(static_cast<size_t>(ceil_group(h_)), 0.0f);
  g_.assign(static_cast<size_t>(i_), 0.0f);
  u_.assign(static_cast<size_t>(i_), 0.0f);
  hpad_.assign(static_cast<size_t>(ceil_group(i_)), 0.0f);
}

ExpertExecutor::~ExpertExecutor() { delete qs_; }

void ExpertExecutor::glu(const uint8_t* blob, const float* g, const float* u, int64_t j0, int64_t j1, float* h) const {
  if (gpt_oss_) {
    const uint8_t* bg = blob + bias_gate_;
    const uint8_t* bu = blob + bias_up_;
    const float lim = limit_;
    for (int64_t j = j0; j < j1; ++j) {
      float gv = g[j] + f16_to_f32(load_u16(bg + 2 * j));
      float uv = u[j] + f16_to_f32(load_u16(bu + 2 * j));
      gv = gv > lim ? lim : gv;  // clamp(max=limit); NaN passes through as in torch
      uv = uv > lim ? lim : (uv < -lim ? -lim : uv);
      float glu = gv * (1.0f / (1.0f + std::exp(-(gv * 1.702f))));
      h[j] = (uv + 1.0f) * glu;
    }
    return;
  }
  switch (act_) {
    case Act::silu:
      silu_mul_(g + j0, u + j0, j1 - j0, h + j0);
      break;
    case Act::gelu:
      for (int64_t j = j0; j < j1; ++j) h[j] = gelu(g[j]) * u[j];
      break;
    case Act::gelu_tanh:
      for (int64_t j = j0; j < j1; ++j) h[j] = gelu_tanh(g[j]) * u[j];
      break;
  }
}

void ExpertExecutor::forward(const uint8_t* blob, const float* x, float* y) const {
  if (quant_) {
    run_quantized(&blob, 1, x, 1, &y);
  } else {
    forward_float(blob, x, y);
  }
}

void ExpertExecutor::forward_batch(const uint8_t* blob, const float* x, int64_t T, float* y) const {
  if (T <= 0) return;
  if (quant_) {
    run_quantized(&blob, 1, x, T, &y);
    return;
  }
  for (int64_t t = 0; t < T; ++t) forward_float(blob, x + t * h_, y + t * h_);
}

void ExpertExecutor::forward_many(const uint8_t* const* blobs, int n, const float* x, float* const* outs) const {
  if (n <= 0) return;
  if (quant_) {
    run_quantized(blobs, n, x, 1, outs);
    return;
  }
  for (int i = 0; i < n; ++i) forward_float(blobs[i], x, outs[i]);
}

void ExpertExecutor::run_quantized(const uint8_t* const* blobs, int n, const float* x, int64_t T,
                                 float* const* outs) const {
  detail::QScratch& s = *qs_;
  const bool p4 = gate_.int4;
  const int64_t H = h_, I = i_, Kh = blocks(H), Ki = blocks(I), B = detail::kQBlock;
  s.size(n, T, Kh, Ki, I);
  for (int64_t t = 0; t < T; ++t)
    quant_fn_(x + t * H, H, p4, s.qx.data() + t * Kh * B, s.dx.data() + t * Kh, s.sxx.data() + t * Kh);
  const detail::QAct xa{s.qx.data(), s.dx.data(), s.sxx.data(), Kh, T};
  const size_t threads = parallel_threads();
  // tasks: experts x row chunks; about 4 per thread so uneven chunks even out; gate/up chunks are whole
  // blocks of 32 rows (each chunk quantises the GLU blocks it produced), down chunks whole tiles of 8
  auto chunking = [&](int64_t units, int64_t unit) {
    int64_t per = units;
    if (threads > 1) {
      const int64_t want = std::max<int64_t>(1, (static_cast<int64_t>(threads) * 4 + n - 1) / n);
      per = (units + std::min(want, units) - 1) / std::min(want, units);
    }
    return std::make_pair(per * unit, (units + per - 1) / per);  // rows per chunk, chunks
  };
  const auto ca = chunking(Ki, B);
  const detail::QMatFn fgu = qfn(gate_), fd = qfn(down_);
  const size_t tI = static_cast<size_t>(T * I);
  parallel_for(static_cast<size_t>(n) * static_cast<size_t>(ca.second), [&](size_t task) {
    const size_t e = task / static_cast<size_t>(ca.second);
    const int64_t r0 = static_cast<int64_t>(task % static_cast<size_t>(ca.second)) * ca.first;
    const int64_t r1 = std::min(I, r0 + ca.first);
    const uint8_t* blob = blobs[e];
    float* g = s.g.data() + e * tI;
    float* u = s.u.data() + e * tI;
    float* h = s.h.data() + e * tI;
    const detail::QMat gm = qmat(gate_, blob), um = qmat(up_, blob);
    fgu(gm, &um, r0, r1, xa, g, u, I);
    for (int64_t t = 0; t < T; ++t) {
      glu(blob, g + t * I, u + t * I, r0, r1, h + t * I);
      const size_t qo = e * static_cast<size_t>(T * Ki) + static_cast<size_t>(t * Ki);
      quant_fn_(h + t * I + r0, r1 - r0, p4, s.qh.data() + qo * B + r0, s.dh.data() + qo + r0 / B,
                           s.sxh.data() + qo + r0 / B);
    }
  });
  const auto cb = chunking((H + 7) / 8, 8);
  parallel_for(static_cast<size_t>(n) * static_cast<size_t>(cb.second), [&](size_t task) {
    const size_t e = task / static_cast<size_t>(cb.second);
    const int64_t r0 = static_cast<int64_t>(task % static_cast<size_t>(cb.second)) * cb.first;
    const int64_t r1 = std::min(H, r0 + cb.first);
    const uint8_t* blob = blobs[e];
    const size_t qo = e * static_cast<size_t>(T * Ki);
    const detail::QAct ha{s.qh.data() + qo * B, s.dh.data() + qo, s.sxh.data() + qo, Ki, T};
    float* y = outs[e];
    fd(qmat(down_, blob), nullptr, r0, r1, ha, y, nullptr, H);
    if (gpt_oss_) {
      const uint8_t* bd = blob + bias_down_;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = r0; j < r1; ++j) y[t * H + j] += f16_to_f32(load_u16(bd + 2 * j));
    }
  });
}

void ExpertExecutor::forward_float(const uint8_t* blob, const float* x, float* y) const {
  const float* xin = x;
  if (gate_.pads_input || up_.pads_input) {  // int4 reads whole groups of 32: zero-padded copy
    std::memcpy(xpad_.data(), x, static_cast<size_t>(h_) * sizeof(float));
    xin = xpad_.data();
  }
  float* g = g_.data();
  float* u = u_.data();
  float* h = hpad_.data();  // the tail past i_ stays zero
  run(gate_, blob, xin, g);
  run(up_, blob, xin, u);
  glu(blob, g, u, 0, i_, h);
  run(down_, blob, h, y);
  if (gpt_oss_) {
    const uint8_t* bd = blob + bias_down_;
    for (int64_t j = 0; j < h_; ++j) y[j] += f16_to_f32(load_u16(bd + 2 * j));
  }
}

}  // namespace spx
