// bench_kernels: per-expert time of the expert kernels at one shape (toolkit/peers/kernel_bench.py
// drives it and compares with llama.cpp's ggml kernels).
//
//   bench_kernels [--hidden H] [--ffn I] [--experts N] [--batch T] [--many M] [--threads 1,2]
//                 [--isa NAME|best] [--min-seconds S]
//
// Builds N random experts of each integer dtype (int4: packed nibbles with fp16 group scales; int8:
// fp16 row scales), laid out as the store does, and times, walking the N blobs (so weights come
// from memory, not cache, as in a decode step over a layer's experts):
//   float    the previous float32 kernels (weights dequantised in registers, fp32 FMA): gate, up, GLU,
//            down; one thread
//   forward  ExpertExecutor::forward (integer dot products), per thread count
//   many     forward_many over M experts at once (one decode layer's resident experts), per expert
//   batch    forward_batch over T token rows, per expert per token
// One JSON object per line on stdout: {"dtype", "isa", "kernel", "threads", "H", "I", "tokens",
// "us_per_expert", "us_per_expert_token", "gmacs"}.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <tuple>
#include <string>
#include <vector>

#include "kernels.h"
#include "kernels_impl.h"
#include "parallel.h"

namespace {

using spx::Section;

uint16_t f32_to_f16(float f) {  // round to nearest even; inputs here are normal and in range
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  int32_t e = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t m = x & 0x7fffffu;
  if (e <= 0) return static_cast<uint16_t>(sign);
  uint32_t h = (static_cast<uint32_t>(e) << 10) | (m >> 13);
  const uint32_t rest = m & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

struct Layout {
  std::vector<Section> sections;
  std::vector<spx::Matrix> matrices;
  size_t blob = 0;
};

Layout layout(const std::string& dtype, int64_t H, int64_t I) {
  Layout l;
  size_t off = 0;
  auto add = [&](const std::string& role, const std::string& kind, const std::string& dt, std::vector<int64_t> shape,
                 size_t item) {
    size_t n = item;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    l.sections.push_back({role, kind, dt, shape, off, n});
    off = (off + n + 63) / 64 * 64;
  };
  for (auto [role, o, i] : {std::make_tuple("gate", I, H), std::make_tuple("up", I, H), std::make_tuple("down", H, I)}) {
    l.matrices.push_back({role, {o, i}});
    if (dtype == "int4") {
      const int64_t ip = (i + 31) / 32 * 32;
      add(role, "weight", "u8", {o, ip / 2}, 1);
      add(role, "scale", "f16", {o, ip / 32}, 2);
    } else {
      add(role, "weight", "i8", {o, i}, 1);
      add(role, "scale", "f16", {o}, 2);
    }
  }
  l.blob = (off + 4095) / 4096 * 4096;
  return l;
}

std::vector<uint8_t> random_blobs(const Layout& l, size_t n, std::mt19937& rng) {
  std::vector<uint8_t> b(l.blob * n);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.002f, 0.02f);
  for (size_t e = 0; e < n; ++e)
    for (const Section& s : l.sections) {
      uint8_t* p = b.data() + e * l.blob + s.offset;
      if (s.kind == "scale") {
        for (size_t k = 0; k < s.nbytes / 2; ++k) {
          uint16_t h = f32_to_f16(sc(rng));
          std::memcpy(p + 2 * k, &h, 2);
        }
      } else {
        for (size_t k = 0; k < s.nbytes; ++k) p[k] = static_cast<uint8_t>(byte(rng) == 0 ? 0x80 : byte(rng));
      }
    }
  return b;
}

template <class F>
double time_per_call(F&& f, double min_seconds) {
  using clock = std::chrono::steady_clock;
  f();  // warm up
  long reps = 1;
  for (;;) {
    auto t0 = clock::now();
    for (long r = 0; r < reps; ++r) f();
    double s = std::chrono::duration<double>(clock::now() - t0).count();
    if (s >= min_seconds / 3) {
      double best = s / reps;
      for (int k = 0; k < 2; ++k) {
        t0 = clock::now();
        for (long r = 0; r < reps; ++r) f();
        best = std::min(best, std::chrono::duration<double>(clock::now() - t0).count() / reps);
      }
      return best;
    }
    reps *= 2;
  }
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',')) v.push_back(std::atoi(tok.c_str()));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t H = 256, I = 2048, T = 64;
  size_t N = 32, M = 8;
  std::vector<int> threads = {1, 2};
  std::string isa_name = "best";
  double min_s = 0.3;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string o = argv[i], v = argv[i + 1];
    if (o == "--hidden") H = std::atol(v.c_str());
    else if (o == "--ffn") I = std::atol(v.c_str());
    else if (o == "--experts") N = static_cast<size_t>(std::atol(v.c_str()));
    else if (o == "--batch") T = std::atol(v.c_str());
    else if (o == "--many") M = static_cast<size_t>(std::atol(v.c_str()));
    else if (o == "--threads") threads = parse_list(v);
    else if (o == "--isa") isa_name = v;
    else if (o == "--min-seconds") min_s = std::atof(v.c_str());
    else {
      std::fprintf(stderr, "bench_kernels: unknown option %s\n", o.c_str());
      return 64;
    }
  }
  if (H <= 0 || I <= 0 || T <= 0 || N == 0 || M == 0 || M > N || threads.empty()) {
    std::fprintf(stderr, "bench_kernels: bad sizes (need --experts >= --many >= 1)\n");
    return 64;
  }
  try {
    const spx::Isa isa = spx::isa_from_name(isa_name);
    if (!spx::isa_supported(isa)) {
      std::fprintf(stderr, "bench_kernels: ISA '%s' is not available on this CPU/build\n", isa_name.c_str());
      return 2;
    }
    std::mt19937 rng(1234);
    std::vector<float> x(static_cast<size_t>(T * H));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& v : x) v = nd(rng);
    const double macs = 3.0 * static_cast<double>(H) * static_cast<double>(I);
    auto emit = [&](const char* dtype, const char* kernel, int th, int64_t tokens, double sec_per_expert_token) {
      std::printf("{\"dtype\": \"%s\", \"isa\": \"%s\", \"kernel\": \"%s\", \"threads\": %d, \"H\": %lld, \"I\": %lld, "
                  "\"tokens\": %lld, \"us_per_expert_token\": %.3f, \"gmacs\": %.2f}\n",
                  dtype, spx::isa_name(isa), kernel, th, static_cast<long long>(H), static_cast<long long>(I),
                  static_cast<long long>(tokens), sec_per_expert_token * 1e6, macs / sec_per_expert_token / 1e9);
      std::fflush(stdout);
    };
    for (const char* dtype : {"int4", "int8"}) {
      const Layout l = layout(dtype, H, I);
      const std::vector<uint8_t> blobs = random_blobs(l, N, rng);
      spx::ExpertExecutor k(l.sections, l.matrices, "qwen3_moe", "silu", 7.0f, isa);
      std::vector<float> y(static_cast<size_t>(T * H) * M);
      size_t e = 0;
      auto blob = [&]() { const uint8_t* p = blobs.data() + (e % N) * l.blob; ++e; return p; };
      {  // the previous float kernels, one thread
        const spx::detail::KernelSet ks = spx::isa_supported(spx::Isa::avx2) ? spx::detail::avx2_kernels()
                                          : spx::isa_supported(spx::Isa::neon) ? spx::detail::neon_kernels()
                                                                                : spx::detail::portable_kernels();
        const spx::detail::MatvecFn fn = std::string(dtype) == "int4" ? ks.i4 : ks.i8;
        const Section *w[3], *s[3];
        for (int m = 0; m < 3; ++m) {
          w[m] = &l.sections[2 * m];
          s[m] = &l.sections[2 * m + 1];
        }
        std::vector<float> g(I), u(I), h((I + 31) / 32 * 32, 0.0f);
        double t = time_per_call([&] {
          const uint8_t* b = blob();
          fn(b + w[0]->offset, b + s[0]->offset, I, H, x.data(), g.data());
          fn(b + w[1]->offset, b + s[1]->offset, I, H, x.data(), u.data());
          for (int64_t j = 0; j < I; ++j) h[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
          fn(b + w[2]->offset, b + s[2]->offset, H, I, h.data(), y.data());
        }, min_s);
        emit(dtype, "float", 1, 1, t);
      }
      for (int th : threads) {
        spx::set_fallback_threads(static_cast<size_t>(std::max(1, th)));
        double t = time_per_call([&] { k.forward(blob(), x.data(), y.data()); }, min_s);
        emit(dtype, "forward", th, 1, t);
        std::vector<const uint8_t*> bl(M);
        std::vector<float*> outs(M);
        for (size_t m = 0; m < M; ++m) outs[m] = y.data() + m * static_cast<size_t>(H);
        t = time_per_call([&] {
          for (size_t m = 0; m < M; ++m) bl[m] = blob();
          k.forward_many(bl.data(), static_cast<int>(M), x.data(), outs.data());
        }, min_s);
        emit(dtype, "many", th, 1, t / static_cast<double>(M));
        t = time_per_call([&] { k.forward_batch(blob(), x.data(), T, y.data()); }, min_s);
        emit(dtype, "batch", th, T, t / static_cast<double>(T));
      }
      spx::set_fallback_threads(1);
    }
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "bench_kernels: error: %s\n", ex.what());
    return 1;
  }
  return 0;
}
