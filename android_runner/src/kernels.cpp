// Expert compute kernels: ISA dispatch, layout binding, the expert forward pass and the portable
// (plain C++) matrix-vector kernels. The AVX2 and NEON kernels are in kernels_avx2.cpp and
// kernels_neon.cpp. Numerics (float32 throughout, weights dequantised in registers, activations
// never quantised) are explained in kernels.h.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>

#include "kernels_impl.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace spx {

using detail::BoundMatrix;
using detail::ceil_group;
using detail::f16_to_f32;
using detail::kGroup;
using detail::load_u16;

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

}  // namespace

namespace detail {
KernelSet portable_kernels() { return {portable_f16, portable_i8, portable_i4}; }
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// ISA selection

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::portable: return "portable";
    case Isa::avx2: return "avx2";
    case Isa::neon: return "neon";
  }
  return "?";
}

Isa isa_from_name(const std::string& name) {
  if (name == "portable") return Isa::portable;
  if (name == "avx2") return Isa::avx2;
  if (name == "neon") return Isa::neon;
  if (name == "best") return best_isa();
  throw Error("unknown kernel ISA '" + name + "' (choose portable, avx2, neon or best)");
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::portable: return true;
    case Isa::avx2: {
#if defined(__x86_64__)
      static const bool ok = [] {
        // AVX2 and FMA (the checks include the OS saving the YMM state); F16C from CPUID leaf 1
        unsigned a = 0, b = 0, c = 0, d = 0;
        bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c &&
               detail::avx2_kernels().f16 != nullptr;
      }();
      return ok;
#else
      return false;
#endif
    }
    case Isa::neon:
#if defined(__aarch64__)
      return detail::neon_kernels().f16 != nullptr;
#else
      return false;
#endif
  }
  return false;
}

Isa best_isa() {
  if (isa_supported(Isa::avx2)) return Isa::avx2;
  if (isa_supported(Isa::neon)) return Isa::neon;
  return Isa::portable;
}

// ---------------------------------------------------------------------------------------------
// Layout binding

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

detail::KernelSet kernels_for(Isa isa) {
  if (!isa_supported(isa))
    throw Error(std::string("kernel ISA '") + isa_name(isa) + "' is not supported by this build on this CPU");
  switch (isa) {
    case Isa::avx2: return detail::avx2_kernels();
    case Isa::neon: return detail::neon_kernels();
    default: return detail::portable_kernels();
  }
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
  } else if (w.dtype == "u8") {
    const int64_t ip = ceil_group(in);
    expect_section(w, "u8", {out, ip / 2}, 1, "weight");
    if (!scale) throw Error("expert layout: int4 matrix '" + w.role + "' has no scale section");
    expect_section(*scale, "f16", {out, ip / kGroup}, 2, "scale");
    m.fn = ks.i4;
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

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }
inline float gelu(float v) { return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f)); }
inline float gelu_tanh(float v) {
  const float k = 0.79788456080286536f;  // sqrt(2 / pi)
  return 0.5f * v * (1.0f + std::tanh(k * (v + 0.044715f * v * v * v)));
}

}  // namespace

void matvec(Isa isa, const Section& w, const Section* scale, int64_t out, int64_t in, const uint8_t* blob,
            const float* x, float* y) {
  BoundMatrix m = bind_matrix(w, scale, out, in, isa);
  if (m.pads_input) {
    std::vector<float> xp(static_cast<size_t>(ceil_group(in)), 0.0f);
    std::copy(x, x + in, xp.begin());
    run(m, blob, xp.data(), y);
  } else {
    run(m, blob, x, y);
  }
}

ExpertKernel::ExpertKernel(const std::vector<Section>& sections, const std::vector<Matrix>& matrices,
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

  xpad_.assign(static_cast<size_t>(ceil_group(h_)), 0.0f);
  g_.assign(static_cast<size_t>(i_), 0.0f);
  u_.assign(static_cast<size_t>(i_), 0.0f);
  hpad_.assign(static_cast<size_t>(ceil_group(i_)), 0.0f);
}

void ExpertKernel::forward(const uint8_t* blob, const float* x, float* y) const {
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
  const int64_t n = i_;
  if (gpt_oss_) {
    const uint8_t* bg = blob + bias_gate_;
    const uint8_t* bu = blob + bias_up_;
    const float lim = limit_;
    for (int64_t j = 0; j < n; ++j) {
      float gv = g[j] + f16_to_f32(load_u16(bg + 2 * j));
      float uv = u[j] + f16_to_f32(load_u16(bu + 2 * j));
      gv = gv > lim ? lim : gv;  // clamp(max=limit); NaN passes through as in torch
      uv = uv > lim ? lim : (uv < -lim ? -lim : uv);
      float glu = gv * (1.0f / (1.0f + std::exp(-(gv * 1.702f))));
      h[j] = (uv + 1.0f) * glu;
    }
  } else {
    switch (act_) {
      case Act::silu:
        for (int64_t j = 0; j < n; ++j) h[j] = silu(g[j]) * u[j];
        break;
      case Act::gelu:
        for (int64_t j = 0; j < n; ++j) h[j] = gelu(g[j]) * u[j];
        break;
      case Act::gelu_tanh:
        for (int64_t j = 0; j < n; ++j) h[j] = gelu_tanh(g[j]) * u[j];
        break;
    }
  }
  run(down_, blob, h, y);
  if (gpt_oss_) {
    const uint8_t* bd = blob + bias_down_;
    for (int64_t j = 0; j < h_; ++j) y[j] += f16_to_f32(load_u16(bd + 2 * j));
  }
}

}  // namespace spx
