// The prefetch planner (toolkit/runtime/planner.py): a MoE layer's predictions turned into the
// scheduler's window of target steps. Sources: the layer graph's preds rows (the adapter's heads
// or next-gate heads exported into the program: what the phone runs), host next-gate / FATE
// (the routers of host.safetensors applied to a router input), the oracle (recorded routing), or
// none (on-demand). Every score goes through the family's selection rule.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "predictors.h"
#include "routing.h"

namespace spx {

class WindowScheduler;

// What host predictors may see: this position's router inputs and choices, the previous
// position's choices, and (the oracle only) the recorded future.
struct RoutingState {
  RoutingState(int num_layers, int hidden, int top_k)
      : L(num_layers), H(hidden), k(top_k), hidden(static_cast<size_t>(num_layers) * hidden),
        ids(static_cast<size_t>(num_layers) * top_k) {}
  void record(int li, const float* x, const std::vector<int>& chosen);
  void next_position() { ++pos; }
  int L, H, k;
  std::vector<float> hidden;  // [L, H]
  std::vector<int> ids;       // [L, k]
  int pos = 0;
  const std::vector<std::vector<int>>* future = nullptr;  // per position [L * k]
};

// A prefill chunk's router inputs [T, L, H] and choices [T, L, k] so far (planner.py's ChunkState).
struct ChunkState {
  ChunkState(int T_, int num_layers, int hidden, int top_k)
      : T(T_), L(num_layers), H(hidden), k(top_k), hidden(static_cast<size_t>(T_) * num_layers * hidden),
        ids(static_cast<size_t>(T_) * num_layers * top_k) {}
  void record(int li, const float* x, const std::vector<int>& chosen);  // x [T * H], chosen [T * k]
  int T, L, H, k;
  std::vector<float> hidden;
  std::vector<int> ids;
};

// previous_token: the phone engines' temporal baseline (the most recent routing of each target layer)
enum class Source { none, graph, next_gate, fate, previous_token, oracle };

class PrefetchPlanner {
 public:
  // preds_rows: MoE layer position -> the horizons of its preds rows, in row order.
  // next_visits: hand the reuse eviction each layer's predicted next N visits from its preds rows of
  // horizons L, 2L, ..., NL (the adapter's next-visit heads; graph source only; 0: none): planner.py's
  // next_visits.
  PrefetchPlanner(Source source, int num_layers, int window, const RoutingSpec& routing, const HostRouters* host,
          const std::map<int, std::vector<int>>& preds_rows, int hidden, int next_visits = 0);

  // Queue the window's reads after MoE layer li's graph ran; targets at or past `end` are not planned.
  void plan(WindowScheduler& sched, int li, int64_t step, const RoutingState& state, const std::vector<float>& preds,
            int64_t end) const;
  // The same after MoE layer li of a prefill chunk (step = p0 * L + li, state.pos = p0): T positions,
  // the next unit T_next; every token's window rows merged per expert by their maximum; preds
  // [T * P * E]. Horizons past the last MoE layer target the next unit (step + h + (T - 1) * L).
  void plan_chunk(WindowScheduler& sched, int li, int64_t step, int T, int T_next, const ChunkState& chunk,
                  const RoutingState& state, const std::vector<float>& preds, int64_t end) const;
  bool active() const { return source_ != Source::none; }

 private:
  std::vector<float> host_logits(int src_layer, int j, const RoutingState& state) const;
  // each visit's largest logits (next_visit_size of them at the pool's capacity; ties: the lower id first) of
  // layer li's rows of
  // horizons L, 2L, ... (nv_rows_), in the preds of one position starting at `base`
  void note_next_visits(WindowScheduler& sched, int li, int64_t target, const float* base) const;
  const float* score_bias(int j) const;

  Source source_;
  int L_, W_, H_, E_;
  RoutingSpec routing_;
  const HostRouters* host_;
  std::map<int, std::vector<int>> rows_;
  // MoE layer -> its preds rows of horizons L, 2L, ..., where the reuse eviction reads them
  std::map<int, std::vector<int>> nv_rows_;
};

}  // namespace spx
