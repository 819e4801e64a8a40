#include "predictors.h"

#include <algorithm>

namespace spx {

std::vector<float> router_logits(const HostRouters& host, int E, int H, const float* x, int j) {
  std::vector<float> out(E);
  const float* w = host.weight.data() + static_cast<size_t>(j) * E * H;
  for (int e = 0; e < E; ++e) {
    const float* row = w + static_cast<size_t>(e) * H;
    float acc = 0.0f;
    for (int i = 0; i < H; ++i) acc += row[i] * x[i];
    out[e] = acc + (host.bias.empty() ? 0.0f : host.bias[static_cast<size_t>(j) * E + e]);
  }
  return out;
}

void add_ranks(std::vector<float>& s, const int* ids, int k) {
  for (int r = 0; r < k; ++r) s[ids[r]] = std::max(s[ids[r]], static_cast<float>(k - r));
}

void break_ties(std::vector<float>& s) {
  const float step_e = static_cast<float>(0.5 / static_cast<double>(s.size()));
  for (size_t e = 0; e < s.size(); ++e)
    if (s[e] > 0) s[e] = s[e] - static_cast<float>(e) * step_e;
}

std::vector<float> previous_token_scores(std::vector<float> s, int k) {
  const float step_e = static_cast<float>(0.5 / static_cast<double>(s.size()));
  for (size_t e = 0; e < s.size(); ++e)
    if (s[e] > 0) s[e] = (s[e] - static_cast<float>(e) * step_e) / static_cast<float>(k);
  return s;
}

}  // namespace spx
