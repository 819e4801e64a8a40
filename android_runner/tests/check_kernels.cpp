// check_kernels: runs the native expert kernels on blobs written by the Python toolkit, for the
// kernel tests (tests/test_native_kernels.py) and for timing them.
//
//   check_kernels [--threads N] [--mode forward|batch|many | --matvec ROLE] ISA LAYOUT.json BLOB.bin X.bin Y_OUT.bin
//       forward (default): ExpertExecutor::forward for each of the layout's `count` blobs (BLOB.bin
//       holds them back to back, `stride` bytes apart) on the matching float32 vector of X.bin
//       ([count, H]), writing the float32 outputs ([count, H]) to Y_OUT.bin.
//       batch: forward_batch of blob 0 on all `count` rows of X.bin at once.
//       many: forward_many of all `count` blobs on row 0 of X.bin (output row i: blob i).
//       --matvec ROLE: spx::matvec of that matrix of each blob on its row of X.bin ([count, in]),
//       writing [count, out].
//       --threads N: the parallel_for pool's size (the std::thread fallback; default 1).
//   check_kernels --bench [--iters N] ISA|all LAYOUT.json BLOB.bin X.bin
//       Times forward per ISA (every supported one for "all"): "hot" repeats blob 0 (cache
//       resident), "cycle" walks all `count` blobs. Prints nanoseconds per expert.
//   check_kernels --quantize ISA N X.bin OUT.bin
//       The ISA's activation quantisation of each N-float row of X.bin (run_quantize has the format).
//   check_kernels --silu ISA G.bin U.bin OUT.bin
//       The ISA's SwiGLU h = silu(g) * u, element by element (float32 files of one length).
//   check_kernels --f16-table OUT.bin
//       Writes the portable half -> float conversion of all 65536 bit patterns (float32, in order).
//
// ISA: portable, avx2, neon or best. LAYOUT.json: {"sections": [{role, kind, dtype, shape, offset,
// nbytes}], "matrices": [{role, shape}], "family", "hidden_act", "swiglu_limit", "count", "stride"}.
// Exit status: 0 ok, 1 error (message on stderr), 2 the ISA is not available on this CPU/build,
// 64 usage.
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "kernels.h"
#include "kernels_impl.h"
#include "parallel.h"

namespace {

using spx::Error;
using spx::Isa;

struct Layout {
  std::vector<spx::Section> sections;
  std::vector<spx::Matrix> matrices;
  std::string family, hidden_act;
  float swiglu_limit = 7.0f;
  size_t count = 1, stride = 0;
};

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error("cannot open " + path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

Layout parse_layout(const std::string& path) {
  Layout l;
  try {
    auto j = nlohmann::json::parse(read_file(path));
    for (const auto& s : j.at("sections")) {
      spx::Section sec;
      sec.role = s.at("role").get<std::string>();
      sec.kind = s.at("kind").get<std::string>();
      sec.dtype = s.at("dtype").get<std::string>();
      sec.shape = s.at("shape").get<std::vector<int64_t>>();
      sec.offset = s.at("offset").get<size_t>();
      sec.nbytes = s.at("nbytes").get<size_t>();
      l.sections.push_back(sec);
    }
    for (const auto& m : j.at("matrices")) l.matrices.push_back({m.at("role"), m.at("shape")});
    l.family = j.value("family", std::string("qwen3_moe"));
    l.hidden_act = j.value("hidden_act", std::string("silu"));
    l.swiglu_limit = j.value("swiglu_limit", 7.0f);
    l.count = j.value("count", size_t(1));
    l.stride = j.value("stride", size_t(0));
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": bad layout JSON (" + e.what() + ")");
  }
  return l;
}

// 64-byte aligned copy of a file's bytes (blobs are 4 KiB aligned in the pool).
struct Aligned {
  std::unique_ptr<uint8_t, void (*)(void*)> p{nullptr, std::free};
  size_t n = 0;
};

Aligned read_aligned(const std::string& path) {
  std::string raw = read_file(path);
  Aligned a;
  a.n = raw.size();
  a.p.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (raw.size() + 63) / 64 * 64 + 64)));
  if (!a.p) throw Error("out of memory reading " + path);
  std::memcpy(a.p.get(), raw.data(), raw.size());
  return a;
}

struct Inputs {
  Layout layout;
  Aligned blobs;
  std::vector<float> x;
};

Inputs load(const std::string& layout_path, const std::string& blob_path, const std::string& x_path, int64_t hidden,
            size_t blob_bytes, size_t x_rows = 0) {
  Inputs in;
  in.layout = parse_layout(layout_path);
  Layout& l = in.layout;
  if (l.stride == 0) l.stride = blob_bytes;
  if (l.stride < blob_bytes) throw Error(layout_path + ": stride " + std::to_string(l.stride) + " < blob size " +
                                         std::to_string(blob_bytes));
  in.blobs = read_aligned(blob_path);
  if (in.blobs.n < (l.count - 1) * l.stride + blob_bytes)
    throw Error(blob_path + ": " + std::to_string(in.blobs.n) + " bytes, too short for " + std::to_string(l.count) +
                " blobs of stride " + std::to_string(l.stride));
  std::string xs = read_file(x_path);
  if (x_rows == 0) x_rows = l.count;
  if (xs.size() != x_rows * static_cast<size_t>(hidden) * sizeof(float))
    throw Error(x_path + ": " + std::to_string(xs.size()) + " bytes, expected " + std::to_string(x_rows) + " x " +
                std::to_string(hidden) + " float32");
  in.x.resize(xs.size() / sizeof(float));
  std::memcpy(in.x.data(), xs.data(), xs.size());
  return in;
}

int usage() {
  std::cerr << "usage: check_kernels [--threads N] [--mode forward|batch|many | --matvec ROLE] ISA LAYOUT.json "
               "BLOB.bin X.bin Y_OUT.bin\n"
               "       check_kernels --bench [--iters N] ISA|all LAYOUT.json BLOB.bin X.bin\n"
               "       check_kernels --quantize ISA N X.bin OUT.bin | --silu ISA G.bin U.bin OUT.bin\n"
               "ISA: portable, avx2, avx_vnni, avx512_vnni, neon, neon_dotprod, neon_i8mm, best\n";
  return 64;
}

Isa require_isa(const std::string& name) {
  Isa isa = spx::isa_from_name(name);
  if (!spx::isa_supported(isa)) {
    std::cerr << "check_kernels: ISA '" << name << "' is not available on this CPU/build\n";
    std::exit(2);
  }
  return isa;
}

std::string dtype_name(const Layout& l) {
  for (const auto& s : l.sections)
    if (s.role == "gate" && s.kind == "weight")
      return s.dtype == "f16" ? "fp16" : s.dtype == "i8" ? "int8" : s.dtype == "u8" ? "int4" : s.dtype;
  return "?";
}

void write_floats(const std::string& path, const std::vector<float>& y) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(y.data()), static_cast<std::streamsize>(y.size() * sizeof(float)));
  if (!f) throw Error("cannot write " + path);
}

int run_check(std::vector<std::string> a) {
  std::string mode = "forward", role;
  while (a.size() >= 2 && a[0].rfind("--", 0) == 0) {
    if (a[0] == "--threads") {
      spx::set_fallback_threads(static_cast<size_t>(std::max(1L, std::atol(a[1].c_str()))));
    } else if (a[0] == "--mode") {
      mode = a[1];
      if (mode != "forward" && mode != "batch" && mode != "many") return usage();
    } else if (a[0] == "--matvec") {
      role = a[1];
    } else {
      return usage();
    }
    a.erase(a.begin(), a.begin() + 2);
  }
  if (a.size() != 5) return usage();
  Isa isa = require_isa(a[0]);
  Layout l = parse_layout(a[1]);
  if (!role.empty()) {  // one matrix of each blob
    const spx::Section *w = nullptr, *sc = nullptr;
    std::vector<int64_t> shape;
    for (const auto& s : l.sections) {
      if (s.role == role && s.kind == "weight") w = &s;
      if (s.role == role && s.kind == "scale") sc = &s;
    }
    for (const auto& m : l.matrices)
      if (m.role == role) shape = m.shape;
    if (!w || shape.size() != 2) throw Error(a[1] + ": no matrix '" + role + "'");
    size_t bytes = 0;
    for (const auto& s : l.sections) bytes = std::max(bytes, s.offset + s.nbytes);
    Inputs in = load(a[1], a[2], a[3], shape[1], bytes);
    std::vector<float> y(in.layout.count * static_cast<size_t>(shape[0]));
    for (size_t i = 0; i < in.layout.count; ++i)
      spx::matvec(isa, *w, sc, shape[0], shape[1], in.blobs.p.get() + i * in.layout.stride,
                  in.x.data() + i * static_cast<size_t>(shape[1]), y.data() + i * static_cast<size_t>(shape[0]));
    write_floats(a[4], y);
    return 0;
  }
  spx::ExpertExecutor k(l.sections, l.matrices, l.family, l.hidden_act, l.swiglu_limit, isa);
  Inputs in = load(a[1], a[2], a[3], k.hidden_size(), k.blob_bytes());
  const size_t H = static_cast<size_t>(k.hidden_size()), n = in.layout.count;
  std::vector<float> y(n * H);
  if (mode == "batch") {
    k.forward_batch(in.blobs.p.get(), in.x.data(), static_cast<int64_t>(n), y.data());
  } else if (mode == "many") {
    std::vector<const uint8_t*> blobs(n);
    std::vector<float*> outs(n);
    for (size_t i = 0; i < n; ++i) {
      blobs[i] = in.blobs.p.get() + i * in.layout.stride;
      outs[i] = y.data() + i * H;
    }
    k.forward_many(blobs.data(), static_cast<int>(n), in.x.data(), outs.data());
  } else {
    for (size_t i = 0; i < n; ++i)
      k.forward(in.blobs.p.get() + i * in.layout.stride, in.x.data() + i * H, y.data() + i * H);
  }
  write_floats(a[4], y);
  return 0;
}

std::vector<float> read_floats(const std::string& path) {
  const std::string raw = read_file(path);
  if (raw.size() % sizeof(float)) throw Error(path + ": not a whole number of float32 values");
  std::vector<float> v(raw.size() / sizeof(float));
  std::memcpy(v.data(), raw.data(), raw.size());
  return v;
}

// --quantize ISA N X.bin OUT.bin: each row of N floats of X.bin quantised by the ISA's KernelSet::quant,
// in column order and in the int4 order; OUT.bin holds per row q [K*32] int8, q permuted [K*32] int8,
// d [K] float32 and sx [K] int32 (both orders give the same d and sx: the second pair is checked here).
int run_quantize(const std::vector<std::string>& a) {
  if (a.size() != 4) return usage();
  const Isa isa = require_isa(a[0]);
  const int64_t n = std::atol(a[1].c_str());
  const std::vector<float> x = read_floats(a[2]);
  if (n <= 0 || x.size() % static_cast<size_t>(n)) throw Error(a[2] + ": not rows of " + a[1] + " floats");
  const spx::detail::QuantFn quant = spx::detail::kernels_for(isa).quant;
  const int64_t K = (n + 31) / 32, rows = static_cast<int64_t>(x.size()) / n;
  std::string out;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int8_t> q(static_cast<size_t>(K * 32)), qp(q.size());
    std::vector<float> d(static_cast<size_t>(K)), dp(d.size());
    std::vector<int32_t> sx(static_cast<size_t>(K)), sxp(sx.size());
    quant(x.data() + r * n, n, false, q.data(), d.data(), sx.data());
    quant(x.data() + r * n, n, true, qp.data(), dp.data(), sxp.data());
    if (std::memcmp(d.data(), dp.data(), d.size() * sizeof(float)) || sx != sxp)
      throw Error("row " + std::to_string(r) + ": the int4 order changed d or sx");
    out.append(reinterpret_cast<const char*>(q.data()), q.size());
    out.append(reinterpret_cast<const char*>(qp.data()), qp.size());
    out.append(reinterpret_cast<const char*>(d.data()), d.size() * sizeof(float));
    out.append(reinterpret_cast<const char*>(sx.data()), sx.size() * sizeof(int32_t));
  }
  std::ofstream f(a[3], std::ios::binary);
  f.write(out.data(), static_cast<std::streamsize>(out.size()));
  if (!f) throw Error("cannot write " + a[3]);
  return 0;
}

// --silu ISA G.bin U.bin OUT.bin: h = silu(g) * u by the ISA's KernelSet::silu_mul.
int run_silu(const std::vector<std::string>& a) {
  if (a.size() != 4) return usage();
  const Isa isa = require_isa(a[0]);
  const std::vector<float> g = read_floats(a[1]), u = read_floats(a[2]);
  if (g.size() != u.size()) throw Error(a[2] + ": not as long as " + a[1]);
  std::vector<float> h(g.size());
  spx::detail::kernels_for(isa).silu_mul(g.data(), u.data(), static_cast<int64_t>(g.size()), h.data());
  write_floats(a[3], h);
  return 0;
}

int run_bench(std::vector<std::string> a) {
  long iters = 0;  // 0: auto (about 0.3 s per measurement)
  if (a.size() >= 2 && a[0] == "--iters") {
    iters = std::atol(a[1].c_str());
    a.erase(a.begin(), a.begin() + 2);
  }
  if (a.size() != 4) return usage();
  std::vector<Isa> isas;
  if (a[0] == "all") {
    isas = spx::supported_isas();
  } else {
    isas.push_back(require_isa(a[0]));
  }
  Layout l = parse_layout(a[1]);
  for (Isa isa : isas) {
    spx::ExpertExecutor k(l.sections, l.matrices, l.family, l.hidden_act, l.swiglu_limit, isa);
    Inputs in = load(a[1], a[2], a[3], k.hidden_size(), k.blob_bytes());
    const size_t H = static_cast<size_t>(k.hidden_size()), n = in.layout.count;
    std::vector<float> y(H);
    volatile float sink = 0;
    auto time = [&](bool cycle) {
      using clock = std::chrono::steady_clock;
      auto once = [&](long reps) {
        auto t0 = clock::now();
        for (long r = 0; r < reps; ++r) {
          size_t i = cycle ? static_cast<size_t>(r) % n : 0;
          k.forward(in.blobs.p.get() + i * in.layout.stride, in.x.data() + i * H, y.data());
          sink = sink + y[0];
        }
        return std::chrono::duration<double, std::nano>(clock::now() - t0).count();
      };
      long reps = iters;
      if (reps <= 0) {  // calibrate: grow until a run takes 50 ms, then aim at 0.3 s
        reps = 16;
        double ns = once(reps);
        while (ns < 5e7) {
          reps *= 4;
          ns = once(reps);
        }
        reps = static_cast<long>(reps * 3e8 / ns) + 1;
      } else {
        once(std::min(iters, 100L));  // warm up
      }
      double best = 1e300;
      for (int rep = 0; rep < 3; ++rep) best = std::min(best, once(reps) / static_cast<double>(reps));
      return best;
    };
    double hot = time(false), cyc = time(true);
    std::printf("bench isa=%s dtype=%s family=%s H=%d I=%d blob_bytes=%zu hot_ns=%.0f cycle_ns=%.0f cycle_blobs=%zu\n",
                spx::isa_name(isa), dtype_name(l).c_str(), l.family.c_str(), k.hidden_size(), k.intermediate(),
                k.blob_bytes(), hot, cyc, n);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  try {
    if (a.size() == 2 && a[0] == "--f16-table") {
      std::vector<float> t(65536);
      for (uint32_t h = 0; h < 65536; ++h) t[h] = spx::detail::f16_to_f32(static_cast<uint16_t>(h));
      std::ofstream f(a[1], std::ios::binary);
      f.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.size() * sizeof(float)));
      if (!f) throw Error("cannot write " + a[1]);
      return 0;
    }
    if (!a.empty() && a[0] == "--quantize") return run_quantize(std::vector<std::string>(a.begin() + 1, a.end()));
    if (!a.empty() && a[0] == "--silu") return run_silu(std::vector<std::string>(a.begin() + 1, a.end()));
    if (!a.empty() && a[0] == "--bench") return run_bench(std::vector<std::string>(a.begin() + 1, a.end()));
    return run_check(a);
  } catch (const std::exception& e) {
    std::cerr << "check_kernels: error: " << e.what() << "\n";
    return 1;
  }
}
