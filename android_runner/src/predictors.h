// The host predictors' scores, one function each, as toolkit/predictors/base.py computes them:
// next-gate / FATE (a later layer's router on an earlier layer's router input), previous-token (the
// phone engines' temporal baseline: the most recent routing of the target layer, by router rank) and
// the oracle's ranks. The planner (planner.h) decides which rows they score and where the reads go.
#pragma once

#include <vector>

namespace spx {

struct HostRouters {      // from host.safetensors
  std::vector<float> weight;      // [L, E, H]
  std::vector<float> bias;        // [L, E] logit bias, or empty
  std::vector<float> score_bias;  // [L, E] selection bias, or empty
};

// next-gate / FATE: layer j's router logits on the router input x [H] (NextGate, FateStyle).
std::vector<float> router_logits(const HostRouters& host, int E, int H, const float* x, int j);

// ids [k] in router order get ranks k..1 in s, keeping the larger where s already has one.
void add_ranks(std::vector<float>& s, const int* ids, int k);

// Ranked experts less a tie-break by ascending id (0.5 / E of a rank), as the oracle's chunk rows.
void break_ties(std::vector<float>& s);

// previous-token's scores from ranks: the tie-break, then over k (PreviousToken).
std::vector<float> previous_token_scores(std::vector<float> ranks, int k);

}  // namespace spx
