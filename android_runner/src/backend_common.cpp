// What both backends (backend.cpp: ExecuTorch; backend_ort.cpp: ONNX Runtime + QNN) share.
#include <cstdio>
#include <map>
#include <set>

#include "backend.h"
#include "common.h"

namespace spx {

void Backend::layer_chunk(int index, const std::vector<float>& h, int T, int64_t pos, bool moe, LayerOut& out) {
  if (static_cast<int64_t>(h.size()) != static_cast<int64_t>(T) * hidden_)
    throw Error(where_ + ": method 'prefill_" + std::to_string(T) + "_layer_" + std::to_string(index) +
                "': hidden input of the wrong size");
  layer_chunk(index, h.data(), T, pos, moe, out);
}

void Backend::find_prefill_chunks(const std::vector<std::string>& methods) {
  std::set<int> layers;
  std::map<int, std::set<int>> by_chunk;
  for (const auto& m : methods) {
    int a = 0, b = 0, n = 0;
    if (std::sscanf(m.c_str(), "layer_%d%n", &a, &n) == 1 && n == static_cast<int>(m.size())) layers.insert(a);
    else if (std::sscanf(m.c_str(), "prefill_%d_layer_%d%n", &a, &b, &n) == 2 && n == static_cast<int>(m.size()) && a > 1)
      by_chunk[a].insert(b);
  }
  chunks_.clear();
  for (const auto& [T, ls] : by_chunk)
    if (!layers.empty() && ls == layers) chunks_.push_back(T);
}

void Backend::vision(const std::string& method, const std::vector<float>&, int64_t, int64_t, std::vector<float>&,
                     std::vector<float>&) {
  throw Error(where_ + ": this backend runs no vision method ('" + method + "')");
}

void Backend::rope_positions(int64_t pos, int T, std::vector<int64_t>& out) const {
  out.resize(3 * static_cast<size_t>(T));
  const int64_t n = static_cast<int64_t>(rope_rows_.size() / 3);
  for (int a = 0; a < 3; ++a)
    for (int t = 0; t < T; ++t) {
      const int64_t p = pos + t;
      out[static_cast<size_t>(a) * T + t] = p < n ? rope_rows_[static_cast<size_t>(a * n + p)] : p + rope_delta_;
    }
}

}  // namespace spx
