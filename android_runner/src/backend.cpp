// ExecuTorch's Module as the runner's Backend (backend.h): executorch bundles.
#include "backend.h"

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <map>
#include <mutex>
#include <numeric>
#include <set>

#include "bundle.h"
#include "common.h"

#include "et_threadpool.h"

namespace spx {

using executorch::aten::ScalarType;
using executorch::extension::from_blob;
using executorch::extension::Module;
using executorch::runtime::Program;
using EtError = executorch::runtime::Error;
using executorch::runtime::EValue;

namespace {

std::string err_name(EtError e) { return "ExecuTorch error " + std::to_string(static_cast<int>(e)); }

}  // namespace

// -- a crash inside ExecuTorch is a one-line error naming the program ------------------------
//
// ExecuTorch verifies a program's flatbuffer but not what it means: an operator, value or memory
// plan index one bit off passes the verifier and then faults (or trips an ET_CHECK abort) while a
// method loads or runs. The bundle's sha256 check (made even with --no-verify-hashes) keeps such a
// program out unless its manifest was rewritten to match; for that case, while the runner is
// inside ExecuTorch (and only then) SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT print the refusal
// line, "specprefetch-runner: error: PROGRAM: ExecuTorch crashed (SIGSEGV) running method 'X':
// ...", and exit 1, as every refusal does. Outside ExecuTorch they keep their default action.

struct FaultLine {
  std::string head, tail;  // "...crashed (" and ") running method 'x': ...\n"
};

struct Faults {
  std::map<std::string, FaultLine> by_method;  // "running method 'x'" lines
};

namespace {

std::atomic<const FaultLine*> g_inside{nullptr};

void write_all(const char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::write(2, p, n);
    if (r <= 0) return;
    p += r, n -= size_t(r);
  }
}

extern "C" void on_fault(int sig) {
  const FaultLine* line = g_inside.load(std::memory_order_acquire);
  if (line == nullptr) {  // not ExecuTorch's: the default action, as without this handler
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  const char* name = sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : sig == SIGILL ? "SIGILL"
                     : sig == SIGFPE ? "SIGFPE" : "SIGABRT";
  write_all(line->head.data(), line->head.size());
  write_all(name, std::strlen(name));
  write_all(line->tail.data(), line->tail.size());
  ::_exit(1);
}

void install_fault_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    // SPX_DEFAULT_FAULTS=1 keeps the default action (a core dump, an Android tombstone) for debugging
    const char* keep = std::getenv("SPX_DEFAULT_FAULTS");
    if (keep != nullptr && keep[0] == '1') return;
    static char alt[1 << 16];  // a stack overflow in ExecuTorch still reaches the handler
    stack_t ss{};
    ss.ss_sp = alt;
    ss.ss_size = sizeof alt;
    ::sigaltstack(&ss, nullptr);
    struct sigaction sa{};
    sa.sa_handler = on_fault;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_ONSTACK;
    for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) ::sigaction(sig, &sa, nullptr);
  });
}

FaultLine fault_line(const std::string& program, const std::string& doing) {
  return {"specprefetch-runner: error: " + program + ": ExecuTorch crashed (",
          ") " + doing + ": a damaged or crafted program, not what the export wrote (or a bug: "
                              "SPX_DEFAULT_FAULTS=1 keeps the default crash)\n"};
}

// Marks the scope as inside ExecuTorch (nested scopes restore the outer one).
class Inside {
 public:
  explicit Inside(const FaultLine& line) : prev_(g_inside.exchange(&line, std::memory_order_acq_rel)) {}
  ~Inside() { g_inside.store(prev_, std::memory_order_release); }
  Inside(const Inside&) = delete;
  Inside& operator=(const Inside&) = delete;

 private:
  const FaultLine* prev_;
};

void copy_out(const EValue& v, std::vector<float>& dst, const std::string& what) {
  if (!v.isTensor()) throw spx::Error(what + ": output is not a tensor");
  const auto& t = v.toTensor();
  if (t.scalar_type() != ScalarType::Float) throw spx::Error(what + ": output is not float32");
  dst.assign(t.const_data_ptr<float>(), t.const_data_ptr<float>() + t.numel());
  // NaN or inf would poison the routing and the scheduler's orderings: refuse them here
  for (float f : dst)
    if (!std::isfinite(f)) throw spx::Error(what + ": output is not finite (a damaged or badly quantized program?)");
}

class EtBackend final : public Backend {
 public:
  EtBackend(const std::string& program, const std::vector<std::string>& methods, int hidden, int vocab, int threads,
            bool mrope);
  void reset() override;
  void embed(int64_t token, std::vector<float>& h) override;
  void layer(int index, const std::vector<float>& h, int64_t pos, bool moe, LayerOut& out) override;
  using Backend::layer_chunk;
  void layer_chunk(int index, const float* h, int T, int64_t pos, bool moe, LayerOut& out) override;
  void head(const std::vector<float>& h, std::vector<float>& logits) override;
  void vision(const std::string& method, const std::vector<float>& pixels, int64_t rows, int64_t cols,
              std::vector<float>& embeds, std::vector<float>& deepstack) override;
  const char* kind() const override { return "executorch"; }

 private:
  // a layer method on T positions from pos: (hidden, positions[, M-RoPE positions [3, T]])
  void run_positions(const std::string& name, const float* h, int T, int64_t pos, bool moe, LayerOut& out);
  std::unique_ptr<Module> module_;
  std::unique_ptr<Faults> faults_;
  bool mrope_ = false;                 // the layer methods take M-RoPE positions (kv.rope == "mrope")
  std::vector<int64_t> pos_, rope_;    // the positions' buffers, reused call to call
};

}  // namespace

EtBackend::EtBackend(const std::string& program, const std::vector<std::string>& methods, int hidden, int vocab,
                     int threads, bool mrope) {
  where_ = program, hidden_ = hidden, vocab_ = vocab, mrope_ = mrope;
  auto t0 = std::chrono::steady_clock::now();
  install_fault_handlers();
  faults_ = std::make_unique<Faults>();
  // before any method loads: XNNPACK keeps the pool it was given when a method is initialised
  auto* pool = executorch::extension::threadpool::get_threadpool();
  if (pool != nullptr) {
    if (threads > 0) pool->_unsafe_reset_threadpool(static_cast<uint32_t>(threads));
    this->threads = static_cast<int>(pool->get_thread_count());
  }
  // shared arenas: the layer methods and `reset` address the same mutable KV buffers
  module_ = std::make_unique<Module>(program, Module::LoadMode::Mmap, nullptr, nullptr, nullptr, true);
  // the whole flatbuffer checked before use: a damaged .pte is refused, not read out of bounds
  const FaultLine loading = fault_line(program, "loading the program");
  EtError e;
  {
    Inside guard(loading);
    e = module_->load(Program::Verification::InternalConsistency);
  }
  if (e != EtError::Ok) throw spx::Error(program + ": not a loadable ExecuTorch program (" + err_name(e) + ")");
  for (const auto& m : methods) {
    faults_->by_method[m] = fault_line(program, "running method '" + m + "'");
    const FaultLine load_line = fault_line(program, "loading method '" + m + "'");
    Inside guard(load_line);
    e = module_->load_method(m);
    if (e != EtError::Ok) throw spx::Error(program + ": method '" + m + "' does not load (" + err_name(e) + ")");
  }
  load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  find_prefill_chunks(methods);
}

namespace {

// module.execute(method, inputs) marked as inside ExecuTorch, with the method's fault line.
executorch::runtime::Result<std::vector<EValue>> run(Module& module, Faults& faults, const std::string& path,
                                                     const std::string& method, const std::vector<EValue>& inputs) {
  auto it = faults.by_method.find(method);
  if (it == faults.by_method.end())
    it = faults.by_method.emplace(method, fault_line(path, "running method '" + method + "'")).first;
  Inside guard(it->second);
  return module.execute(method, inputs);
}

}  // namespace

void EtBackend::reset() {
  float zero = 0.0f;
  auto t = from_blob(&zero, {1}, ScalarType::Float);
  auto r = run(*module_, *faults_, where_, "reset", {EValue(t)});
  if (!r.ok()) throw spx::Error(where_ + ": method 'reset' failed (" + err_name(r.error()) + ")");
}

void EtBackend::embed(int64_t token, std::vector<float>& h) {
  int64_t tok = token;
  auto t = from_blob(&tok, {1, 1}, ScalarType::Long);
  auto r = run(*module_, *faults_, where_, "embed", {EValue(t)});
  if (!r.ok()) throw spx::Error(where_ + ": method 'embed' failed (" + err_name(r.error()) + ")");
  copy_out(r.get()[0], h, where_ + ": embed");
  if (static_cast<int>(h.size()) != hidden_) throw spx::Error(where_ + ": embed returned the wrong width");
}

namespace {

// A layer method (layer_N or prefill_T_layer_N) on (hidden, positions), its outputs unpacked into `out`;
// h_size: the hidden state's element count (`what` names it in the error: width, size).
void run_layer(Module& module, Faults& faults, const std::string& where_, const std::string& name,
               const std::vector<EValue>& inputs, int64_t h_size, const char* what, bool moe, LayerOut& out) {
  auto r = run(module, faults, where_, name, inputs);
  if (!r.ok()) throw spx::Error(where_ + ": method '" + name + "' failed (" + err_name(r.error()) + ")");
  const auto& outs = r.get();
  const size_t want = moe ? 3 : 1;
  if (outs.size() < want) throw spx::Error(where_ + ": method '" + name + "' returned too few outputs");
  copy_out(outs[0], out.h, where_ + ": " + name);
  if (static_cast<int64_t>(out.h.size()) != h_size)
    throw spx::Error(where_ + ": method '" + name + "' returned a hidden state of the wrong " + what);
  if (!moe) return;
  copy_out(outs[1], out.x, where_ + ": " + name);
  copy_out(outs[2], out.logits, where_ + ": " + name);
  if (outs.size() > 3)
    copy_out(outs[3], out.preds, where_ + ": " + name);
  else
    out.preds.clear();
}

}  // namespace

void EtBackend::run_positions(const std::string& name, const float* h, int T, int64_t pos, bool moe, LayerOut& out) {
  pos_.resize(static_cast<size_t>(T));
  std::iota(pos_.begin(), pos_.end(), pos);
  auto th = from_blob(const_cast<float*>(h), {1, T, hidden_}, ScalarType::Float);
  auto tp = from_blob(pos_.data(), {T}, ScalarType::Long);
  std::vector<EValue> inputs{EValue(th), EValue(tp)};
  executorch::extension::TensorPtr tr;
  if (mrope_) {  // the sequence's M-RoPE positions (set_rope; text: the cache position on all three axes)
    rope_positions(pos, T, rope_);
    tr = from_blob(rope_.data(), {3, T}, ScalarType::Long);
    inputs.emplace_back(tr);
  }
  run_layer(*module_, *faults_, where_, name, inputs, static_cast<int64_t>(T) * hidden_, T == 1 ? "width" : "size",
            moe, out);
}

void EtBackend::layer(int index, const std::vector<float>& h, int64_t pos, bool moe, LayerOut& out) {
  run_positions("layer_" + std::to_string(index), h.data(), 1, pos, moe, out);
}

void EtBackend::layer_chunk(int index, const float* h, int T, int64_t pos, bool moe, LayerOut& out) {
  run_positions("prefill_" + std::to_string(T) + "_layer_" + std::to_string(index), h, T, pos, moe, out);
}

void EtBackend::vision(const std::string& method, const std::vector<float>& pixels, int64_t rows, int64_t cols,
                       std::vector<float>& embeds, std::vector<float>& deepstack) {
  if (static_cast<int64_t>(pixels.size()) != rows * cols) throw spx::Error(where_ + ": " + method + ": pixel size");
  auto t = from_blob(const_cast<float*>(pixels.data()), {static_cast<int>(rows), static_cast<int>(cols)},
                     ScalarType::Float);
  auto r = run(*module_, *faults_, where_, method, {EValue(t)});
  if (!r.ok()) throw spx::Error(where_ + ": method '" + method + "' failed (" + err_name(r.error()) + ")");
  if (r.get().size() < 2) throw spx::Error(where_ + ": method '" + method + "' returned too few outputs");
  copy_out(r.get()[0], embeds, where_ + ": " + method);
  copy_out(r.get()[1], deepstack, where_ + ": " + method);
}

void EtBackend::head(const std::vector<float>& h, std::vector<float>& logits) {
  auto th = from_blob(const_cast<float*>(h.data()), {1, 1, hidden_}, ScalarType::Float);
  auto r = run(*module_, *faults_, where_, "head", {EValue(th)});
  if (!r.ok()) throw spx::Error(where_ + ": method 'head' failed (" + err_name(r.error()) + ")");
  copy_out(r.get()[0], logits, where_ + ": head");
  if (static_cast<int>(logits.size()) != vocab_) throw spx::Error(where_ + ": head returned the wrong width");
}

std::unique_ptr<Backend> open_backend(const Bundle& b, const std::vector<std::string>& methods, int threads) {
  return std::make_unique<EtBackend>(b.program_path, methods, b.hidden_size, b.vocab_size, threads, b.mrope);
}

bool backend_runs_target(const std::string& target) { return target == "executorch"; }

}  // namespace spx
