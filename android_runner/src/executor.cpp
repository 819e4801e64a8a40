#include "executor.h"

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "common.h"

// ExecuTorch's thread pool. An ExecuTorch built from source (the Android NDK build) installs its
// header; the pip wheel does not, so there the two members used here are declared as ExecuTorch
// 1.5 defines them in libexecutorch_threadpool (linked as executorch::threadpool).
#if __has_include(<executorch/extension/threadpool/threadpool.h>)
#include <executorch/extension/threadpool/threadpool.h>
#else
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool
#endif

namespace spx {

using executorch::aten::ScalarType;
using executorch::extension::from_blob;
using executorch::extension::Module;
using executorch::runtime::Program;
using EtError = executorch::runtime::Error;
using executorch::runtime::EValue;

namespace {

std::string err_name(EtError e) { return "ExecuTorch error " + std::to_string(static_cast<int>(e)); }

void copy_out(const EValue& v, std::vector<float>& dst, const std::string& what) {
  if (!v.isTensor()) throw spx::Error(what + ": output is not a tensor");
  const auto& t = v.toTensor();
  if (t.scalar_type() != ScalarType::Float) throw spx::Error(what + ": output is not float32");
  dst.assign(t.const_data_ptr<float>(), t.const_data_ptr<float>() + t.numel());
  // NaN or inf would poison the routing and the scheduler's orderings: refuse them here
  for (float f : dst)
    if (!std::isfinite(f)) throw spx::Error(what + ": output is not finite (a damaged or badly quantized program?)");
}

}  // namespace

Executor::Executor(const std::string& program, const std::vector<std::string>& methods, int hidden, int vocab,
                   int threads)
    : path_(program), hidden_(hidden), vocab_(vocab) {
  auto t0 = std::chrono::steady_clock::now();
  // before any method loads: XNNPACK keeps the pool it was given when a method is initialised
  auto* pool = executorch::extension::threadpool::get_threadpool();
  if (pool != nullptr) {
    if (threads > 0) pool->_unsafe_reset_threadpool(static_cast<uint32_t>(threads));
    this->threads = static_cast<int>(pool->get_thread_count());
  }
  // shared arenas: the layer methods and `reset` address the same mutable KV buffers
  module_ = std::make_unique<Module>(program, Module::LoadMode::Mmap, nullptr, nullptr, nullptr, true);
  // the whole flatbuffer checked before use: a damaged .pte is refused, not read out of bounds
  EtError e = module_->load(Program::Verification::InternalConsistency);
  if (e != EtError::Ok) throw spx::Error(program + ": not a loadable ExecuTorch program (" + err_name(e) + ")");
  for (const auto& m : methods) {
    e = module_->load_method(m);
    if (e != EtError::Ok) throw spx::Error(program + ": method '" + m + "' does not load (" + err_name(e) + ")");
  }
  load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

Executor::~Executor() = default;

void Executor::reset() {
  float zero = 0.0f;
  auto t = from_blob(&zero, {1}, ScalarType::Float);
  auto r = module_->execute("reset", {EValue(t)});
  if (!r.ok()) throw spx::Error(path_ + ": method 'reset' failed (" + err_name(r.error()) + ")");
}

void Executor::embed(int64_t token, std::vector<float>& h) {
  int64_t tok = token;
  auto t = from_blob(&tok, {1, 1}, ScalarType::Long);
  auto r = module_->execute("embed", {EValue(t)});
  if (!r.ok()) throw spx::Error(path_ + ": method 'embed' failed (" + err_name(r.error()) + ")");
  copy_out(r.get()[0], h, path_ + ": embed");
  if (static_cast<int>(h.size()) != hidden_) throw spx::Error(path_ + ": embed returned the wrong width");
}

void Executor::layer(int index, const std::vector<float>& h, int64_t pos, bool moe, LayerOut& out) {
  const std::string name = "layer_" + std::to_string(index);
  int64_t p = pos;
  auto th = from_blob(const_cast<float*>(h.data()), {1, 1, hidden_}, ScalarType::Float);
  auto tp = from_blob(&p, {1}, ScalarType::Long);
  auto r = module_->execute(name, {EValue(th), EValue(tp)});
  if (!r.ok()) throw spx::Error(path_ + ": method '" + name + "' failed (" + err_name(r.error()) + ")");
  const auto& outs = r.get();
  const size_t want = moe ? 3 : 1;
  if (outs.size() < want) throw spx::Error(path_ + ": method '" + name + "' returned too few outputs");
  copy_out(outs[0], out.h, path_ + ": " + name);
  if (static_cast<int>(out.h.size()) != hidden_)
    throw spx::Error(path_ + ": method '" + name + "' returned a hidden state of the wrong width");
  if (!moe) return;
  copy_out(outs[1], out.x, path_ + ": " + name);
  copy_out(outs[2], out.logits, path_ + ": " + name);
  if (outs.size() > 3)
    copy_out(outs[3], out.preds, path_ + ": " + name);
  else
    out.preds.clear();
}

void Executor::head(const std::vector<float>& h, std::vector<float>& logits) {
  auto th = from_blob(const_cast<float*>(h.data()), {1, 1, hidden_}, ScalarType::Float);
  auto r = module_->execute("head", {EValue(th)});
  if (!r.ok()) throw spx::Error(path_ + ": method 'head' failed (" + err_name(r.error()) + ")");
  copy_out(r.get()[0], logits, path_ + ": head");
  if (static_cast<int>(logits.size()) != vocab_) throw spx::Error(path_ + ": head returned the wrong width");
}

}  // namespace spx
