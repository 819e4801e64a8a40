#include "planner.h"

#include <algorithm>

#include "common.h"
#include "scheduler.h"

namespace spx {

void RoutingState::record(int li, const float* x, const std::vector<int>& chosen) {
  std::copy(x, x + H, hidden.begin() + static_cast<size_t>(li) * H);
  std::copy(chosen.begin(), chosen.end(), ids.begin() + static_cast<size_t>(li) * k);
}

void ChunkState::record(int li, const float* x, const std::vector<int>& chosen) {
  for (int t = 0; t < T; ++t) {
    std::copy(x + static_cast<size_t>(t) * H, x + static_cast<size_t>(t + 1) * H,
              hidden.begin() + (static_cast<size_t>(t) * L + li) * H);
    std::copy(chosen.begin() + static_cast<size_t>(t) * k, chosen.begin() + static_cast<size_t>(t + 1) * k,
              ids.begin() + (static_cast<size_t>(t) * L + li) * k);
  }
}

PrefetchPlanner::PrefetchPlanner(Source source, int num_layers, int window, const RoutingSpec& routing, const HostRouters* host,
                 const std::map<int, std::vector<int>>& preds_rows, int hidden, int next_visits)
    : source_(source), L_(num_layers), W_(window), H_(hidden), E_(routing.num_experts), routing_(routing),
      host_(host), rows_(preds_rows) {
  if (next_visits > 0 && source == Source::graph)
    for (const auto& [li, hs] : rows_) {
      std::vector<int> rows;
      for (int j = 1; j <= next_visits; ++j) {
        auto r = std::find(hs.begin(), hs.end(), j * L_);
        if (r == hs.end())
          throw Error("the bundle's preds rows of MoE layer " + std::to_string(li) + " lack horizon " +
                      std::to_string(j * L_) + " (its next visits' rows)");
        rows.push_back(static_cast<int>(r - hs.begin()));
      }
      nv_rows_[li] = std::move(rows);
    }
  if ((source == Source::next_gate || source == Source::fate) && (host == nullptr || host->weight.empty()))
    throw Error("host next-gate / fate prediction needs the bundle's router weights (host.safetensors)");
}


const float* PrefetchPlanner::score_bias(int j) const {
  if (host_ == nullptr || host_->score_bias.empty()) return nullptr;
  return host_->score_bias.data() + static_cast<size_t>(j) * E_;
}

std::vector<float> PrefetchPlanner::host_logits(int src, int j, const RoutingState& state) const {
  return router_logits(*host_, E_, H_, state.hidden.data() + static_cast<size_t>(src) * H_, j);
}

void PrefetchPlanner::note_next_visits(WindowScheduler& sched, int li, int64_t target, const float* base) const {
  const std::vector<int>& rows = nv_rows_.at(li);
  std::vector<std::vector<int>> sets;
  const int n = next_visit_size(routing_.top_k, E_, sched.pool().capacity(), L_);  // every visit's set size
  for (size_t j = 0; j < rows.size(); ++j) {
    const float* row = base + static_cast<size_t>(rows[j]) * E_;
    std::vector<int> order(static_cast<size_t>(E_));
    for (int e = 0; e < E_; ++e) order[static_cast<size_t>(e)] = e;
    std::partial_sort(order.begin(), order.begin() + n, order.end(),
                      [row](int a, int b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    order.resize(static_cast<size_t>(n));
    sets.push_back(std::move(order));
  }
  sched.reuse()->set_next_visits(li, target, std::move(sets));
}

void PrefetchPlanner::plan(WindowScheduler& sched, int li, int64_t step, const RoutingState& state,
                   const std::vector<float>& preds, int64_t end) const {
  if (nv_rows_.count(li) != 0 && sched.reuse() != nullptr && preds.size() == rows_.at(li).size() * static_cast<size_t>(E_))
    note_next_visits(sched, li, step + L_, preds.data());
  const int W = static_cast<int>(std::min<int64_t>(W_, end - 1 - step));
  if (source_ == Source::none || W < 1) {
    sched.plan_probs(step, {}, {});
    return;
  }
  std::vector<int64_t> targets;
  std::vector<std::vector<float>> rows;
  if (source_ == Source::graph) {
    auto it = rows_.find(li);
    if (it == rows_.end() || it->second.empty()) {  // no heads for this layer: nothing to plan
      sched.plan_probs(step, {}, {});
      return;
    }
    const auto& hs = it->second;
    if (preds.size() != hs.size() * static_cast<size_t>(E_))
      throw Error("MoE layer " + std::to_string(li) + ": the layer graph returned " + std::to_string(preds.size()) +
                  " prediction values, expected " + std::to_string(hs.size() * E_));
    for (int h = 1; h <= W; ++h) {
      auto r = std::find(hs.begin(), hs.end(), h);
      if (r == hs.end()) continue;
      const float* logits = preds.data() + static_cast<size_t>(r - hs.begin()) * E_;
      targets.push_back(step + h);
      if (routing_.softmax_router()) {
        rows.emplace_back(logits, logits + E_);
        softmax(rows.back().data(), E_);
      } else {
        rows.push_back(selection_scores(logits, routing_, score_bias((li + h) % L_)));
      }
    }
    if (routing_.softmax_router())
      sched.plan_probs(step, targets, rows);
    else
      sched.plan(step, targets, rows);
    return;
  }
  if (source_ == Source::next_gate || source_ == Source::fate) {
    const int src = source_ == Source::fate ? std::max(0, li - 1) : li;
    for (int h = 1; h <= W; ++h) {
      const int j = (li + h) % L_;
      auto logits = host_logits(src, j, state);
      targets.push_back(step + h);
      if (routing_.softmax_router()) {
        softmax(logits.data(), E_);
        rows.push_back(std::move(logits));
      } else {
        rows.push_back(selection_scores(logits.data(), routing_, score_bias(j)));
      }
    }
    if (routing_.softmax_router())
      sched.plan_probs(step, targets, rows);
    else
      sched.plan(step, targets, rows);
    return;
  }
  if (source_ == Source::previous_token) {
    // the most recent routing of each target layer (planner.py's PreviousToken): layer j > li of
    // this position is still the previous position's in state.ids, a layer past the last (the next
    // position's j - L) this position's own; the first position has no previous one
    for (int h = 1; h <= W; ++h) {
      const int j = li + h;
      std::vector<float> s(E_, 0.0f);
      if (j >= L_ || state.pos > 0) add_ranks(s, state.ids.data() + static_cast<size_t>(j % L_) * state.k, state.k);
      targets.push_back(step + h);
      rows.push_back(previous_token_scores(std::move(s), state.k));
    }
    sched.plan(step, targets, rows);
    return;
  }
  // oracle: the recorded routing of this position and the next; rank k..1 in the router's order
  const auto* fut = state.future;
  const int k = state.k;
  std::vector<int> cur = state.ids, next(static_cast<size_t>(L_) * k, 0);
  if (fut != nullptr && state.pos < static_cast<int>(fut->size())) cur = (*fut)[state.pos];
  if (fut != nullptr && state.pos + 1 < static_cast<int>(fut->size())) next = (*fut)[state.pos + 1];
  for (int h = 1; h <= W; ++h) {
    const int j = li + h;
    const int* ids = j < L_ ? cur.data() + static_cast<size_t>(j) * k : next.data() + static_cast<size_t>(j - L_) * k;
    std::vector<float> s(E_, 0.0f);
    add_ranks(s, ids, k);
    targets.push_back(step + h);
    rows.push_back(std::move(s));
  }
  sched.plan(step, targets, rows);
}

namespace {
void max_into(std::vector<float>& acc, const std::vector<float>& row) {
  if (acc.empty()) {
    acc = row;
    return;
  }
  for (size_t e = 0; e < acc.size(); ++e) acc[e] = std::max(acc[e], row[e]);
}
}  // namespace

void PrefetchPlanner::plan_chunk(WindowScheduler& sched, int li, int64_t step, int T, int T_next, const ChunkState& chunk,
                         const RoutingState& state, const std::vector<float>& preds, int64_t end) const {
  auto target = [&](int h) { return step + h + (li + h >= L_ ? static_cast<int64_t>(T - 1) * L_ : 0); };
  if (nv_rows_.count(li) != 0 && sched.reuse() != nullptr) {  // its last position's rows
    const size_t P = rows_.at(li).size();
    if (preds.size() == static_cast<size_t>(T) * P * E_)
      note_next_visits(sched, li, target(L_), preds.data() + (static_cast<size_t>(T) - 1) * P * E_);
  }
  std::vector<int> hs;
  for (int h = 1; h <= W_; ++h)
    if (target(h) < end) hs.push_back(h);
  if (source_ == Source::none || hs.empty()) {
    sched.plan_probs(step, {}, {});
    return;
  }
  std::vector<int64_t> targets;
  std::vector<std::vector<float>> rows;
  const bool softmax_router = routing_.softmax_router();
  if (source_ == Source::oracle) {
    const auto* fut = state.future;
    const int k = state.k, p0 = state.pos;
    for (int h : hs) {
      const int j = li + h;
      const int lo = j < L_ ? p0 : p0 + T, n = j < L_ ? T : T_next, jj = j < L_ ? j : j - L_;
      std::vector<float> s(E_, 0.0f);
      for (int p = lo; p < lo + n; ++p) {
        const int* ids = nullptr;
        // only a recorded future says what a later layer routes to (the chunk's own layers past li
        // have not run yet), as planner.py does
        if (fut != nullptr && p < static_cast<int>(fut->size()))
          ids = (*fut)[p].data() + static_cast<size_t>(jj) * k;
        else
          continue;
        add_ranks(s, ids, k);
      }
      break_ties(s);  // many experts share the best rank: ascending id first, as planner.py does
      targets.push_back(target(h));
      rows.push_back(std::move(s));
    }
    sched.plan(step, targets, rows);
    return;
  }
  if (source_ == Source::previous_token) {
    // a layer of this span: the position before it (the span's own positions have not run that
    // layer yet); the next unit's layer j - L: every span position's choice there
    const int k = state.k;
    for (int h : hs) {
      const int j = li + h;
      std::vector<float> s(E_, 0.0f);
      if (j < L_) {
        if (state.pos > 0)  // state.ids past li: still the position before the span
          add_ranks(s, state.ids.data() + static_cast<size_t>(j) * k, k);
      } else {
        for (int t = 0; t < T; ++t) add_ranks(s, chunk.ids.data() + (static_cast<size_t>(t) * L_ + (j - L_)) * k, k);
      }
      targets.push_back(target(h));
      rows.push_back(previous_token_scores(std::move(s), k));
    }
    sched.plan(step, targets, rows);
    return;
  }
  if (source_ == Source::graph) {
    auto it = rows_.find(li);
    if (it == rows_.end() || it->second.empty()) {
      sched.plan_probs(step, {}, {});
      return;
    }
    const auto& rs = it->second;
    const size_t P = rs.size();
    if (preds.size() != static_cast<size_t>(T) * P * E_)
      throw Error("MoE layer " + std::to_string(li) + ": the chunk's layer graph returned " +
                  std::to_string(preds.size()) + " prediction values, expected " +
                  std::to_string(static_cast<size_t>(T) * P * E_));
    for (int h : hs) {
      auto r = std::find(rs.begin(), rs.end(), h);
      if (r == rs.end()) continue;
      std::vector<float> acc;
      for (int t = 0; t < T; ++t) {
        const float* logits = preds.data() + (static_cast<size_t>(t) * P + static_cast<size_t>(r - rs.begin())) * E_;
        std::vector<float> row;
        if (softmax_router) {
          row.assign(logits, logits + E_);
          softmax(row.data(), E_);
        } else {
          row = selection_scores(logits, routing_, score_bias((li + h) % L_));
        }
        max_into(acc, row);
      }
      targets.push_back(target(h));
      rows.push_back(std::move(acc));
    }
  } else {  // host next-gate / fate: each token's router input
    const int src = source_ == Source::fate ? std::max(0, li - 1) : li;
    for (int h : hs) {
      const int j = (li + h) % L_;
      std::vector<float> acc;
      RoutingState one(L_, H_, state.k);
      for (int t = 0; t < T; ++t) {
        std::copy(chunk.hidden.begin() + (static_cast<size_t>(t) * L_ + src) * H_,
                  chunk.hidden.begin() + (static_cast<size_t>(t) * L_ + src + 1) * H_,
                  one.hidden.begin() + static_cast<size_t>(src) * H_);
        auto logits = host_logits(src, j, one);
        if (softmax_router) {
          softmax(logits.data(), E_);
          max_into(acc, logits);
        } else {
          max_into(acc, selection_scores(logits.data(), routing_, score_bias(j)));
        }
      }
      targets.push_back(target(h));
      rows.push_back(std::move(acc));
    }
  }
  if (targets.empty()) {
    sched.plan_probs(step, {}, {});
    return;
  }
  if (softmax_router)
    sched.plan_probs(step, targets, rows);
  else
    sched.plan(step, targets, rows);
}

}  // namespace spx
