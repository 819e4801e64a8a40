// The family's expert selection on the host (toolkit/models/families/base.py: select_experts,
// expert_weights, selection_scores), in float32 as the reference computes it.
#pragma once

#include <string>
#include <vector>

namespace spx {

struct RoutingSpec {
  int num_experts = 0;
  int top_k = 0;
  std::string score_func = "softmax";  // softmax | sigmoid
  bool topk_before_softmax = false;    // GPT-OSS: top-k on logits, softmax over the k
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  int n_group = 0;                     // group-limited top-k (DeepSeek); 0: not used
  int topk_group = 0;
  std::string group_score = "max";     // max (V2) | top2sum (V3)
  bool score_bias = false;             // DeepSeek-V3 selection bias

  // A plain softmax router: the window's probabilities are one softmax of the logits.
  bool softmax_router() const {
    return !score_bias && n_group <= 1 && !topk_before_softmax && score_func == "softmax";
  }
};

// In-place float32 softmax of n values (max subtracted first).
void softmax(float* x, int n);

// Scores whose descending order is the family's selection order (bias, groups applied).
// bias: the layer's selection bias [E] or nullptr.
std::vector<float> selection_scores(const float* logits, const RoutingSpec& r, const float* bias);

// Indices of the k largest values, descending; ties go to the lower index (torch.topk on CPU).
std::vector<int> topk(const std::vector<float>& v, int k);

// The family's top-k: ids (descending selection score) and their combination weights.
void select_experts(const float* logits, const RoutingSpec& r, const float* bias, std::vector<int>& ids,
                    std::vector<float>& weights);

// Combination weights of `ids` given the router logits (expert_weights in the reference).
std::vector<float> expert_weights(const float* logits, const std::vector<int>& ids, const RoutingSpec& r);

}  // namespace spx
