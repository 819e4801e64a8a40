// ONNX Runtime with Qualcomm's QNN execution provider as the runner's Backend (backend.h): qnn and
// qai-hub bundles, whose graphs are EPContext models (a QNN context binary beside each) compiled
// for one Snapdragon SoC by `specprefetch export --target qnn`.
//
// The QNN EP is a plugin library of ONNX Runtime (onnxruntime-qnn 2.x): registered with
// RegisterExecutionProviderLibrary, its HTP device picked from GetEpDevices and appended with
// SessionOptionsAppendExecutionProvider_V2, CPU fallback disabled (every node on the HTP). On
// x86-64 the same library runs the HTP simulator. The token embedding is a table the runner reads
// rows of on the CPU (EmbeddingTable; an older bundle's embed graph otherwise). The graphs hold no
// state ("io" KV mode): each
// layer takes the past K/V of its layer, a one-hot of the position and the additive mask (and, last,
// a one-hot of each rotary axis' position for an M-RoPE bundle), and returns the current position's
// K/V, which this backend writes into its own cache. A vision-language bundle's vision graph runs here
// too (`vision`).
//
// Where the libraries come from: SPX_QNN_EP_LIB names the QNN EP library
// (libonnxruntime_providers_qnn.so, which finds libQnnHtp.so and the HTP skel beside itself);
// unset, the one beside the runner (lib/ of its build) is used. SPX_QNN_PROVIDER_OPTIONS adds QNN
// provider options, "key=value;key=value" (e.g. htp_performance_mode=burst on a phone).
// the API asked for at run time (kOrtApiVersion below), not the headers' own version
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT
#include <onnxruntime_session_options_config_keys.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backend.h"
#include "bundle.h"
#include "common.h"
#include "json_checked.h"
#include "kernels_impl.h"
#include "parallel.h"

namespace spx {
namespace {

// The ORT API version this backend asks for: the plugin-EP functions it calls exist from 1.22 on.
constexpr uint32_t kOrtApiVersion = 22;
constexpr const char* kQnnEp = "QNNExecutionProvider";

std::string exe_dir() {
  std::vector<char> buf(4096);
  ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return ".";
  std::string p(buf.data(), static_cast<size_t>(n));
  auto slash = p.rfind('/');
  return slash == std::string::npos ? "." : p.substr(0, slash);
}

bool is_file(const std::string& p) { return ::access(p.c_str(), R_OK) == 0; }

// An ONNX Runtime / QNN message as part of a one-line refusal.
std::string one_line(const char* what) { return jsonc::one_line(what, 300); }

// SPX_QNN_EP_LIB, else the library this build was made against where it exists (a host build: the
// onnxruntime-qnn wheel's, which finds the HTP simulator beside itself), else the one in lib/ beside
// the runner (a phone build, shipped with it).
std::string qnn_ep_library() {
  const char* env = std::getenv("SPX_QNN_EP_LIB");
  std::string p = exe_dir() + "/../lib/libonnxruntime_providers_qnn.so";
#ifdef SPX_QNN_EP_DEFAULT
  if (is_file(SPX_QNN_EP_DEFAULT)) p = SPX_QNN_EP_DEFAULT;
#endif
  if (env != nullptr && env[0] != '\0') p = env;
  if (!is_file(p))
    throw Error(std::string(env != nullptr && env[0] != '\0' ? "SPX_QNN_EP_LIB " : "") + p +
                ": the QNN execution provider library is missing (libonnxruntime_providers_qnn.so: from the "
                "onnxruntime-qnn wheel here, from com.qualcomm.qti:onnxruntime-android-qnn on a phone; docs/runner.md)");
  return p;
}

std::unordered_map<std::string, std::string> provider_options() {
  std::unordered_map<std::string, std::string> opts{{"backend_type", "htp"}};
  const char* env = std::getenv("SPX_QNN_PROVIDER_OPTIONS");
  if (env == nullptr) return opts;
  std::string s(env);
  size_t a = 0;
  while (a <= s.size()) {
    size_t b = s.find(';', a);
    if (b == std::string::npos) b = s.size();
    std::string kv = s.substr(a, b - a);
    if (!kv.empty()) {
      auto eq = kv.find('=');
      if (eq == std::string::npos || eq == 0)
        throw Error("SPX_QNN_PROVIDER_OPTIONS: " + kv + " is not key=value");
      opts[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    a = b + 1;
  }
  return opts;
}

// The bundle's token embedding table (graphs.embedding: a float16 [vocab, hidden] `weight` in a
// safetensors file), looked up on the CPU instead of an HTP graph call a position: its header is
// checked once, and each token's row is read with pread (only the rows a prompt touches are read).
class EmbeddingTable {
 public:
  EmbeddingTable(const std::string& path, int vocab, int hidden);
  ~EmbeddingTable() {
    if (fd_ >= 0) ::close(fd_);
  }
  EmbeddingTable(const EmbeddingTable&) = delete;
  EmbeddingTable& operator=(const EmbeddingTable&) = delete;
  void row(int64_t token, std::vector<float>& h);

 private:
  void load_header();
  std::string path_;
  int fd_ = -1;
  int vocab_ = 0, hidden_ = 0;
  uint64_t data_ = 0;  // the file offset of row 0
  std::vector<uint16_t> half_;
};

EmbeddingTable::EmbeddingTable(const std::string& path, int vocab, int hidden)
    : path_(path), vocab_(vocab), hidden_(hidden), half_(static_cast<size_t>(hidden)) {
  // O_NONBLOCK: a FIFO put in its place is refused below (not a regular file), not waited on
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) throw Error(path + ": cannot open the embedding table (" + std::strerror(errno) + ")");
  try {
    load_header();
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

void EmbeddingTable::load_header() {
  const std::string& path = path_;
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw Error(path + ": cannot stat the embedding table (" + std::strerror(errno) + ")");
  if (!S_ISREG(st.st_mode)) throw Error(path + ": the embedding table is not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint8_t len[8];
  if (size < 8 || ::pread(fd_, len, 8, 0) != 8) jsonc::fail(path, "truncated safetensors file (no header length)");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | len[i];
  if (hlen < 2 || hlen > (100ull << 20) || hlen > size - 8)
    jsonc::fail(path, "safetensors header length " + std::to_string(hlen) + " does not fit the file");
  std::string text(static_cast<size_t>(hlen), '\0');
  if (::pread(fd_, text.data(), text.size(), 8) != static_cast<ssize_t>(hlen)) jsonc::fail(path, "truncated safetensors header");
  const jsonc::json h = jsonc::parse(text, path, "safetensors header");
  jsonc::need_object(h, path, "");
  const jsonc::json& w = jsonc::field(h, "weight", path, "");
  const std::string dtype = jsonc::as_str(jsonc::field(w, "dtype", path, "weight"), path, "weight.dtype");
  const auto shape = jsonc::as_int_list(jsonc::field(w, "shape", path, "weight"), path, "weight.shape", 0, INT64_MAX);
  if (dtype != "F16" || shape.size() != 2 || shape[0] != vocab_ || shape[1] != hidden_) {
    std::string dims;
    for (int64_t d : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    jsonc::fail(path, "weight is " + dtype + " [" + dims + "]; a float16 table [" + std::to_string(vocab_) + ", " +
                          std::to_string(hidden_) + "] (the model's vocabulary and hidden size) expected");
  }
  const jsonc::json& offs = jsonc::as_list(jsonc::field(w, "data_offsets", path, "weight"), path, "weight.data_offsets");
  if (offs.size() != 2) jsonc::fail(path, "weight.data_offsets must be [begin, end]");
  const uint64_t b = jsonc::as_u64(offs[0], path, "weight.data_offsets[0]");
  const uint64_t e = jsonc::as_u64(offs[1], path, "weight.data_offsets[1]");
  const uint64_t want = static_cast<uint64_t>(vocab_) * static_cast<uint64_t>(hidden_) * 2;
  const uint64_t dlen = size - 8 - hlen;  // the data after the header (no overflow: hlen <= size - 8)
  if (b > e || e > dlen || e - b != want)
    jsonc::fail(path, "weight's data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + "] do not hold " +
                          std::to_string(want) + " bytes inside the file's " + std::to_string(dlen) + " bytes of data");
  data_ = 8 + hlen + b;
}

void EmbeddingTable::row(int64_t token, std::vector<float>& h) {
  if (token < 0 || token >= vocab_)
    throw Error(path_ + ": token id " + std::to_string(token) + " outside 0.." + std::to_string(vocab_ - 1));
  const size_t n = half_.size() * sizeof(uint16_t);
  const off_t at = static_cast<off_t>(data_ + static_cast<uint64_t>(token) * n);
  const ssize_t got = ::pread(fd_, half_.data(), n, at);
  if (got != static_cast<ssize_t>(n))
    throw Error(path_ + ": cannot read row " + std::to_string(token) + " of the embedding table (" +
                (got < 0 ? std::string(std::strerror(errno)) : "short read") + ")");
  h.resize(half_.size());
  for (size_t i = 0; i < half_.size(); ++i) h[i] = detail::f16_to_f32(half_[i]);
}

// One EPContext graph: its session and its input / output names, in the model's order.
struct Graph {
  std::unique_ptr<Ort::Session> session;
  std::vector<std::string> in_names, out_names;
  std::vector<const char*> in_ptrs, out_ptrs;
  std::string path;
};

class OrtBackend final : public Backend {
 public:
  OrtBackend(const Bundle& b, const std::vector<std::string>& methods, int threads);
  void reset() override;
  void embed(int64_t token, std::vector<float>& h) override;
  void layer(int index, const std::vector<float>& h, int64_t pos, bool moe, LayerOut& out) override;
  using Backend::layer_chunk;
  void layer_chunk(int index, const float* h, int T, int64_t pos, bool moe, LayerOut& out) override;
  void head(const std::vector<float>& h, std::vector<float>& logits) override;
  void vision(const std::string& method, const std::vector<float>& pixels, int64_t rows, int64_t cols,
              std::vector<float>& embeds, std::vector<float>& deepstack) override;
  const char* kind() const override { return "onnxruntime-qnn"; }
  int64_t accelerator_calls() const override { return calls_; }

 private:
  std::vector<Ort::Value> run(const std::string& name, std::vector<Ort::Value>& inputs);
  void run_layer(const std::string& name, int index, const float* h, int T, int64_t pos, bool moe, LayerOut& out);
  Graph& graph(const std::string& name);
  Ort::Value floats(float* data, const std::vector<int64_t>& shape) const;
  void copy_out(const Ort::Value& v, std::vector<float>& dst, const std::string& what) const;

  std::unique_ptr<Ort::Env> env_;
  Ort::MemoryInfo mem_{nullptr};
  std::map<std::string, Graph> graphs_;
  // the host's KV cache: per layer K and V of the shapes in kv.layers, [.., .., max_seq, ..]
  std::vector<std::vector<float>> k_, v_;
  std::vector<KvLayer> kv_;
  int max_seq_ = 0;
  float mask_value_ = -100.0f;
  bool mrope_ = false;  // kv.rope mrope: the layer graphs also take rope_onehot, a one-hot per rotary axis
  // the host's inputs of the call in progress: the cache positions' one-hot [T, S] and mask [1, 1, T, S];
  // M-RoPE: rope_onehot [3, T, S], row (a, t) one-hot at axis a's (t, h, w) rotary position of cache
  // position pos+t
  std::vector<float> onehot_, mask_, rope_onehot_;
  std::vector<int64_t> rope_;  // M-RoPE: the call's rotary positions [3 * T] (rope_positions)
  int64_t calls_ = 0;
  std::unique_ptr<EmbeddingTable> embedding_;  // null: the bundle's embed graph
};

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

OrtBackend::OrtBackend(const Bundle& b, const std::vector<std::string>& methods, int threads) {
  const auto t0 = std::chrono::steady_clock::now();
  // the expert kernels' threads (parallel.cpp's own pool: no ExecuTorch here); the graphs run on the HTP
  this->threads = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  set_fallback_threads(static_cast<size_t>(this->threads));
  where_ = b.dir + "/graphs";  // as errors name the graphs; each graph's own errors name its file
  hidden_ = b.hidden_size, vocab_ = b.vocab_size;
  const OrtApi* api = OrtGetApiBase()->GetApi(kOrtApiVersion);
  if (api == nullptr)
    throw Error(std::string("libonnxruntime ") + OrtGetApiBase()->GetVersionString() +
                " is too old: the QNN plugin execution provider needs ONNX Runtime 1.22 or newer");
  Ort::InitApi(api);
  if (b.kv_mode != "io") throw Error(b.manifest_path + ": kv.mode " + b.kv_mode + ": QNN graphs take their KV cache as inputs ('io')");
  max_seq_ = b.max_seq;
  mrope_ = b.mrope;
  mask_value_ = static_cast<float>(b.kv_mask_value);
  if (!b.embedding_path.empty()) embedding_ = std::make_unique<EmbeddingTable>(b.embedding_path, vocab_, hidden_);
  kv_ = b.kv_layers;
  for (size_t l = 0; l < kv_.size(); ++l) {
    const auto& L = kv_[l];
    if (L.k.size() != 4 || L.v.size() != 4 || L.k[2] != max_seq_ || L.v[2] != max_seq_)
      throw Error(b.manifest_path + ": kv.layers[" + std::to_string(l) + "]: caches of rank 4 with kv.max_seq positions on axis 2 expected");
    k_.emplace_back(static_cast<size_t>(numel(L.k)), 0.0f);
    v_.emplace_back(static_cast<size_t>(numel(L.v)), 0.0f);
  }
  try {
    env_ = std::make_unique<Ort::Env>(ORT_LOGGING_LEVEL_FATAL, "specprefetch-runner");  // errors come back as exceptions
    const std::string lib = qnn_ep_library();
    try {
      env_->RegisterExecutionProviderLibrary(kQnnEp, lib);
    } catch (const Ort::Exception& e) {
      throw Error(lib + ": ONNX Runtime " + OrtGetApiBase()->GetVersionString() + " could not register it (" +
                  one_line(e.what()) + "; onnxruntime-qnn 2.7 needs ONNX Runtime 1.24.2 or newer)");
    }
    std::vector<Ort::ConstEpDevice> devices;
    for (const auto& d : env_->GetEpDevices())
      if (std::string(d.EpName()) == kQnnEp) devices.push_back(d);
    if (devices.empty())
      throw Error(lib + ": the QNN execution provider found no device (the HTP backend library libQnnHtp.so "
                        "must lie beside it; docs/runner.md)");
    const auto opts = provider_options();
    mem_ = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    for (const auto& m : methods) {
      auto it = b.graph_paths.find(m);
      if (it == b.graph_paths.end()) throw Error(b.manifest_path + ": no graph file for " + m);
      Ort::SessionOptions so;
      so.SetLogSeverityLevel(4);
      so.SetIntraOpNumThreads(1);  // every node runs on the HTP: no CPU thread pool per session
      so.SetInterOpNumThreads(1);
      so.AddConfigEntry(kOrtSessionOptionsDisableCPUEPFallback, "1");
      so.AppendExecutionProvider_V2(*env_, devices, opts);
      Graph g;
      g.path = it->second;
      try {
        g.session = std::make_unique<Ort::Session>(*env_, g.path.c_str(), so);
      } catch (const Ort::Exception& e) {
        throw Error(g.path + ": QNN could not load it (" + one_line(e.what()) + ")");
      }
      Ort::AllocatorWithDefaultOptions alloc;
      for (size_t i = 0; i < g.session->GetInputCount(); ++i)
        g.in_names.emplace_back(g.session->GetInputNameAllocated(i, alloc).get());
      for (size_t i = 0; i < g.session->GetOutputCount(); ++i)
        g.out_names.emplace_back(g.session->GetOutputNameAllocated(i, alloc).get());
      for (const auto& n : g.in_names) g.in_ptrs.push_back(n.c_str());
      for (const auto& n : g.out_names) g.out_ptrs.push_back(n.c_str());
      graphs_.emplace(m, std::move(g));
    }
  } catch (const Ort::Exception& e) {
    throw Error(where_ + ": ONNX Runtime: " + one_line(e.what()));
  }
  find_prefill_chunks(methods);  // prefill_T_layer_N graphs: T prompt positions per HTP call
  load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

Graph& OrtBackend::graph(const std::string& name) {
  auto it = graphs_.find(name);
  if (it == graphs_.end()) throw Error(where_ + ": graph '" + name + "' was not loaded");
  return it->second;
}

Ort::Value OrtBackend::floats(float* data, const std::vector<int64_t>& shape) const {
  return Ort::Value::CreateTensor<float>(mem_, data, static_cast<size_t>(numel(shape)), shape.data(), shape.size());
}

std::vector<Ort::Value> OrtBackend::run(const std::string& name, std::vector<Ort::Value>& inputs) {
  Graph& g = graph(name);
  if (inputs.size() != g.in_names.size())
    throw Error(g.path + ": takes " + std::to_string(g.in_names.size()) + " inputs, the runner passes " +
                std::to_string(inputs.size()));
  try {
    ++calls_;
    return g.session->Run(Ort::RunOptions{nullptr}, g.in_ptrs.data(), inputs.data(), inputs.size(),
                          g.out_ptrs.data(), g.out_ptrs.size());
  } catch (const Ort::Exception& e) {
    throw Error(g.path + ": run failed (" + one_line(e.what()) + ")");
  }
}

void OrtBackend::copy_out(const Ort::Value& v, std::vector<float>& dst, const std::string& what) const {
  auto info = v.GetTensorTypeAndShapeInfo();
  if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) throw Error(what + ": output is not float32");
  const float* p = v.GetTensorData<float>();
  dst.assign(p, p + info.GetElementCount());
  for (float f : dst)
    if (!std::isfinite(f)) throw Error(what + ": output is not finite (a damaged or badly quantized graph?)");
}

void OrtBackend::reset() {
  for (auto& k : k_) std::fill(k.begin(), k.end(), 0.0f);
  for (auto& v : v_) std::fill(v.begin(), v.end(), 0.0f);
}

void OrtBackend::embed(int64_t token, std::vector<float>& h) {
  if (embedding_) return embedding_->row(token, h);  // on the CPU: no crossing to the HTP
  int64_t tok = token;
  const std::vector<int64_t> shape{1, 1};
  std::vector<Ort::Value> in;
  in.push_back(Ort::Value::CreateTensor<int64_t>(mem_, &tok, 1, shape.data(), shape.size()));
  auto out = run("embed", in);
  copy_out(out.at(0), h, where_ + ": embed");
  if (static_cast<int>(h.size()) != hidden_) throw Error(where_ + ": embed returned the wrong width");
}

void OrtBackend::layer(int index, const std::vector<float>& h, int64_t pos, bool moe, LayerOut& out) {
  if (static_cast<int>(h.size()) != hidden_) throw Error(where_ + ": layer_" + std::to_string(index) + ": hidden input of the wrong size");
  run_layer("layer_" + std::to_string(index), index, h.data(), 1, pos, moe, out);
}

void OrtBackend::layer_chunk(int index, const float* h, int T, int64_t pos, bool moe, LayerOut& out) {
  run_layer("prefill_" + std::to_string(T) + "_layer_" + std::to_string(index), index, h, T, pos, moe, out);
}

// Decoder layer `index` over the T positions pos .. pos+T-1 (T = 1: the decode graph layer_N; else the
// prefill graph prefill_T_layer_N): the host's one-hot [T, S] of the cache positions, additive mask
// [1, 1, T, S] (rows as toolkit/runtime/backend.py host_mask), the layer's cache and, an M-RoPE bundle's
// graphs, rope_onehot [3, T, S] last (row (a, t) one-hot at the rotary position of axis a (t, h, w) of
// cache position pos+t, as set_rope gave them) in; the positions' K and V back into the cache.
void OrtBackend::run_layer(const std::string& name, int index, const float* h, int T, int64_t pos, bool moe,
                           LayerOut& out) {
  if (index < 0 || static_cast<size_t>(index) >= kv_.size()) throw Error(where_ + ": no KV cache for " + name);
  if (pos < 0 || T < 1 || pos + T > max_seq_) throw Error(where_ + ": positions " + std::to_string(pos) + ".." +
                                                          std::to_string(pos + T - 1) + " past the KV cache");
  const KvLayer& L = kv_[static_cast<size_t>(index)];
  const size_t S = static_cast<size_t>(max_seq_);
  onehot_.assign(static_cast<size_t>(T) * S, 0.0f);
  mask_.resize(static_cast<size_t>(T) * S);
  if (mrope_) {
    rope_positions(pos, T, rope_);  // [3 * T], axis-major: row a * T + t
    rope_onehot_.assign(rope_.size() * S, 0.0f);
    for (size_t r = 0; r < rope_.size(); ++r) {
      const int64_t p = rope_[r];
      if (p < 0 || p >= max_seq_)
        throw Error(where_ + ": " + name + ": rotary position " + std::to_string(p) + " (axis " +
                    std::to_string(r / static_cast<size_t>(T)) + ", cache position " +
                    std::to_string(pos + static_cast<int64_t>(r % static_cast<size_t>(T))) + ") outside 0.." +
                    std::to_string(max_seq_ - 1) + ", the one-hot's width (kv.max_seq)");
      rope_onehot_[r * S + static_cast<size_t>(p)] = 1.0f;
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t q = pos + t;
    onehot_[static_cast<size_t>(t) * S + static_cast<size_t>(q)] = 1.0f;
    for (int64_t j = 0; j < max_seq_; ++j) {
      const bool allowed = j <= q && (L.window == 0 || j > q - L.window);
      mask_[static_cast<size_t>(t) * S + static_cast<size_t>(j)] = allowed ? 0.0f : mask_value_;
    }
  }
  std::vector<Ort::Value> in;  // inputs are read, never written, by ONNX Runtime
  in.push_back(floats(const_cast<float*>(h), {1, T, hidden_}));
  in.push_back(floats(onehot_.data(), {T, max_seq_}));
  in.push_back(floats(mask_.data(), {1, 1, T, max_seq_}));
  in.push_back(floats(k_[static_cast<size_t>(index)].data(), L.k));
  in.push_back(floats(v_[static_cast<size_t>(index)].data(), L.v));
  if (mrope_) in.push_back(floats(rope_onehot_.data(), {3, T, max_seq_}));
  auto outs = run(name, in);
  const size_t want = (moe ? 3 : 1) + 2;
  if (outs.size() < want) throw Error(where_ + ": graph '" + name + "' returned too few outputs");
  copy_out(outs[0], out.h, where_ + ": " + name);
  if (static_cast<int64_t>(out.h.size()) != static_cast<int64_t>(T) * hidden_)
    throw Error(where_ + ": graph '" + name + "' returned a hidden state of the wrong size");
  if (moe) {
    copy_out(outs[1], out.x, where_ + ": " + name);
    copy_out(outs[2], out.logits, where_ + ": " + name);
    if (outs.size() > 5) copy_out(outs[3], out.preds, where_ + ": " + name);
    else out.preds.clear();
  }
  // the positions' K and V ([a, b, T, d]) into the cache ([a, b, max_seq, d]) at pos .. pos+T-1
  auto write = [&](const Ort::Value& src, std::vector<float>& dst, const std::vector<int64_t>& shape, const char* what) {
    auto info = src.GetTensorTypeAndShapeInfo();
    const int64_t rows = shape[0] * shape[1], d = shape[3];
    if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || static_cast<int64_t>(info.GetElementCount()) != rows * T * d)
      throw Error(where_ + ": graph '" + name + "' returned a " + what + " of the wrong size");
    const float* p = src.GetTensorData<float>();
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(dst.data() + (r * max_seq_ + pos) * d, p + r * T * d, static_cast<size_t>(T * d) * sizeof(float));
  };
  write(outs[outs.size() - 2], k_[static_cast<size_t>(index)], L.k, "k_new");
  write(outs[outs.size() - 1], v_[static_cast<size_t>(index)], L.v, "v_new");
}

void OrtBackend::head(const std::vector<float>& h, std::vector<float>& logits) {
  std::vector<Ort::Value> in;
  in.push_back(floats(const_cast<float*>(h.data()), {1, 1, hidden_}));
  auto out = run("head", in);
  copy_out(out.at(0), logits, where_ + ": head");
  if (static_cast<int>(logits.size()) != vocab_) throw Error(where_ + ": head returned the wrong width");
}

// A vision-language bundle's vision graph (`method`) on one image's pixel_values [rows, cols]: output 0
// the image embeddings, output 1 the DeepStack features (main.cpp checks their sizes).
void OrtBackend::vision(const std::string& method, const std::vector<float>& pixels, int64_t rows, int64_t cols,
                        std::vector<float>& embeds, std::vector<float>& deepstack) {
  const Graph& g = graph(method);
  if (rows < 1 || cols < 1 || static_cast<int64_t>(pixels.size()) != rows * cols)
    throw Error(g.path + ": " + std::to_string(pixels.size()) + " pixel values for pixel_values [" + std::to_string(rows) +
                ", " + std::to_string(cols) + "]");
  std::vector<Ort::Value> in;  // read, never written, by ONNX Runtime
  in.push_back(floats(const_cast<float*>(pixels.data()), {rows, cols}));
  auto outs = run(method, in);
  if (outs.size() < 2)
    throw Error(g.path + ": returned " + std::to_string(outs.size()) + " outputs; image_embeds and the DeepStack features expected");
  copy_out(outs[0], embeds, g.path + ": image_embeds");
  copy_out(outs[1], deepstack, g.path + ": deepstack");
}

}  // namespace

std::unique_ptr<Backend> open_backend(const Bundle& b, const std::vector<std::string>& methods, int threads) {
  return std::make_unique<OrtBackend>(b, methods, threads);
}

bool backend_runs_target(const std::string& target) { return target == "qnn" || target == "qai-hub"; }

}  // namespace spx
