#include "routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace spx {

void softmax(float* x, int n) {
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) m = std::max(m, x[i]);
  float s = 0.0f;
  for (int i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  for (int i = 0; i < n; ++i) x[i] = x[i] / s;
}

static float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

static std::vector<float> scores_of(const float* logits, const RoutingSpec& r) {
  std::vector<float> s(logits, logits + r.num_experts);
  if (r.score_func == "sigmoid") {
    for (auto& v : s) v = sigmoid(v);
  } else {
    softmax(s.data(), r.num_experts);
  }
  return s;
}

std::vector<int> topk(const std::vector<float>& v, int k) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  k = std::min<int>(k, static_cast<int>(v.size()));
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  });
  idx.resize(k);
  return idx;
}

std::vector<float> selection_scores(const float* logits, const RoutingSpec& r, const float* bias) {
  if (r.topk_before_softmax) return std::vector<float>(logits, logits + r.num_experts);
  std::vector<float> choice = scores_of(logits, r);
  if (r.score_bias && bias != nullptr)
    for (int e = 0; e < r.num_experts; ++e) choice[e] = choice[e] + bias[e];
  if (r.n_group > 1 && r.topk_group > 0) {
    const int per = r.num_experts / r.n_group;
    std::vector<float> gscore(r.n_group);
    for (int g = 0; g < r.n_group; ++g) {
      std::vector<float> grp(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      if (r.group_score == "top2sum") {
        auto t = topk(grp, 2);
        gscore[g] = grp[t[0]] + (t.size() > 1 ? grp[t[1]] : 0.0f);
      } else {
        gscore[g] = *std::max_element(grp.begin(), grp.end());
      }
    }
    // unselected groups after the selected ones, whose scores stay exact (see base.py)
    std::vector<char> selected(r.n_group, 0);
    for (int g : topk(gscore, r.topk_group)) selected[g] = 1;
    for (int g = 0; g < r.n_group; ++g)
      if (!selected[g])
        for (int e = g * per; e < (g + 1) * per; ++e) choice[e] = choice[e] - 1e4f;
  }
  return choice;
}

std::vector<float> expert_weights(const float* logits, const std::vector<int>& ids, const RoutingSpec& r) {
  const int k = static_cast<int>(ids.size());
  std::vector<float> w(k);
  if (r.topk_before_softmax) {
    for (int j = 0; j < k; ++j) w[j] = logits[ids[j]];
    softmax(w.data(), k);
    return w;
  }
  std::vector<float> s = scores_of(logits, r);
  for (int j = 0; j < k; ++j) w[j] = s[ids[j]];
  if (r.norm_topk_prob) {
    float sum = 0.0f;
    for (float v : w) sum += v;
    for (auto& v : w) v = v / (sum + 1e-20f);
  }
  for (auto& v : w) v = v * r.routed_scaling_factor;
  return w;
}

void select_experts(const float* logits, const RoutingSpec& r, const float* bias, std::vector<int>& ids,
                    std::vector<float>& weights) {
  ids = topk(selection_scores(logits, r, bias), r.top_k);
  weights = expert_weights(logits, ids, r);
}

}  // namespace spx
