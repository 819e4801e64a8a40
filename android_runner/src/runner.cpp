#include "runner.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>

#include "events.h"
#include "executor.h"
#include "expert_store.h"
#include "kernels.h"
#include "pool.h"
#include "reader.h"
#include "scheduler.h"
#include "stats.h"

namespace spx {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The Reader's pread lanes as the scheduler's IOBackend.
class ReaderIO : public IOBackend {
 public:
  explicit ReaderIO(Reader& r) : r_(r) {}
  void submit(Key key, void* dst, bool demand) override { r_.submit(key, dst, demand); }
  bool landed(Key key) override { return r_.landed(key); }
  void wait(Key key) override { r_.wait(key); }
  void release(Key key) override { r_.forget(key); }

 private:
  Reader& r_;
};

// next_use(key, now): the step of the key's next real use after `now` (Belady's rule).
ExpertPool::NextUse belady(const std::vector<std::vector<int>>& future, int L, int k) {
  auto uses = std::make_shared<std::map<Key, std::vector<int64_t>>>();
  for (size_t pos = 0; pos < future.size(); ++pos)
    for (int li = 0; li < L; ++li)
      for (int j = 0; j < k; ++j)
        (*uses)[{li, future[pos][static_cast<size_t>(li) * k + j]}].push_back(static_cast<int64_t>(pos) * L + li);
  return [uses](Key key, int64_t now) {
    auto it = uses->find(key);
    if (it == uses->end()) return ExpertPool::kNever;
    auto nxt = std::upper_bound(it->second.begin(), it->second.end(), now);
    return nxt == it->second.end() ? ExpertPool::kNever : static_cast<double>(*nxt);
  };
}

}  // namespace

Runner::Runner(const ModelInfo& model, Executor& exec, const ExpertStore& store, const ExpertKernel& kernel,
               const HostRouters* host)
    : m_(model), exec_(exec), store_(store), kernel_(kernel), host_(host) {
  cfg_.predictor = "on-demand";  // always available; the caller configures its policy
  cfg_.eviction = "lru";
  if (store.num_layers != m_.L() || store.num_experts != m_.routing.num_experts)
    throw Error(store.path + ": " + std::to_string(store.num_layers) + " layers x " +
                std::to_string(store.num_experts) + " experts, the model has " + std::to_string(m_.L()) + " x " +
                std::to_string(m_.routing.num_experts));
  configure(cfg_);
}

std::vector<std::string> Runner::predictors() const {
  std::vector<std::string> out{"on-demand", "oracle"};
  if (!m_.preds_rows.empty() && !m_.graph_predictor.empty()) out.push_back(m_.graph_predictor);
  if (host_ != nullptr && !host_->weight.empty()) {
    if (m_.graph_predictor != "next-gate") out.push_back("next-gate");
    out.push_back("fate");
  }
  return out;
}

Source Runner::source_of(const std::string& p) const {
  if (p == "on-demand") return Source::none;
  if (p == "oracle") return Source::oracle;
  if (!m_.preds_rows.empty() && p == m_.graph_predictor) return Source::graph;
  if (host_ != nullptr && !host_->weight.empty()) {
    if (p == "next-gate") return Source::next_gate;
    if (p == "fate") return Source::fate;
  }
  std::string have;
  for (const auto& n : predictors()) have += (have.empty() ? "" : ", ") + n;
  throw Error("--policy " + cfg_.name() + ": predictor '" + p + "' is not available for this bundle (available: " +
              have + ")");
}

void Runner::configure(const RunConfig& cfg) {
  RunConfig saved = cfg_;
  cfg_ = cfg;
  try {
    source_of(cfg.predictor);
    if (!(cfg.pool_mib > 0 && cfg.pool_mib < 1e12)) throw Error("--pool-mib: must be a positive number");
    if (cfg.window < 1 || cfg.window > m_.L())
      throw Error("--window " + std::to_string(cfg.window) + ": must be 1.." + std::to_string(m_.L()) +
                  " (the MoE layers of one token)");
    if (cfg.queue_depth < 1) throw Error("--queue-depth " + std::to_string(cfg.queue_depth) + ": must be >= 1");
    const int64_t capacity = cfg.budget_bytes() / static_cast<int64_t>(store_.slot_bytes);
    if (capacity < m_.routing.top_k) {
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "--pool-mib %g: holds %lld expert slots of %.0f KiB, but one layer needs %d at once; use at "
                    "least %.2f",
                    cfg.pool_mib, static_cast<long long>(capacity), store_.slot_bytes / 1024.0, m_.routing.top_k,
                    m_.routing.top_k * static_cast<double>(store_.slot_bytes) / 1048576.0);
      throw Error(buf);
    }
    if (cfg.step_budget_kib >= 0 && cfg.step_budget_kib * 1024 < static_cast<int64_t>(store_.slot_bytes))
      throw Error("--step-budget-kib " + std::to_string(cfg.step_budget_kib) +
                  ": below one expert slot, so nothing could ever be prefetched");
  } catch (...) {
    cfg_ = saved;
    throw;
  }
}

Generation Runner::run(const std::vector<int>& prompt, int max_new, EventLog* events,
                       const std::vector<std::vector<int>>* recorded) {
  if (!cfg_.needs_future()) return generate(prompt, max_new, nullptr, events);
  if (recorded != nullptr) return generate(prompt, max_new, recorded, events);
  RunConfig cfg = cfg_;
  RunConfig od = cfg_;
  od.predictor = "on-demand";
  od.eviction = "lru";
  cfg_ = od;
  Generation rec;
  try {
    rec = generate(prompt, max_new, nullptr, nullptr);
  } catch (...) {
    cfg_ = cfg;
    throw;
  }
  cfg_ = cfg;
  return generate(prompt, max_new, &rec.routing, events);
}

Generation Runner::generate(const std::vector<int>& prompt, int max_new,
                            const std::vector<std::vector<int>>* future, EventLog* events) {
  const RunConfig& cfg = cfg_;
  if (prompt.empty()) throw Error("the prompt is empty");
  if (max_new < 1) throw Error("--max-new-tokens " + std::to_string(max_new) + ": must be >= 1");
  for (int t : prompt)
    if (t < 0 || t >= m_.vocab)
      throw Error("prompt token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                  std::to_string(m_.vocab - 1) + ")");
  if (m_.max_seq > 0 && static_cast<int>(prompt.size()) + max_new - 1 > m_.max_seq)
    throw Error("prompt (" + std::to_string(prompt.size()) + " tokens) + --max-new-tokens " + std::to_string(max_new) +
                " exceeds the graphs' KV cache of " + std::to_string(m_.max_seq) + " positions");
  if (cfg.needs_future() && future == nullptr)
    throw Error("--policy " + cfg.name() + ": needs a recorded first pass");
  const int L = m_.L(), k = m_.routing.top_k, H = m_.hidden;
  const Source source = source_of(cfg.predictor);
  Planner planner(source, L, cfg.window, m_.routing, host_, m_.preds_rows, H);
  RoutingState state(L, H, k);
  state.future = future;

  const int total = L * m_.routing.num_experts;
  // the pool's arena outlives the reader, whose destructor waits for reads still in flight into it
  ExpertPool pool(cfg.budget_bytes(), static_cast<int64_t>(store_.slot_bytes), cfg.eviction, k, total,
                  cfg.eviction == "belady" ? belady(*future, L, k) : nullptr);
  Reader reader(store_, cfg.lanes > 0 ? cfg.lanes : std::min(cfg.queue_depth + 1, 64), cfg.verify);
  ReaderIO io(reader);
  SchedulerConfig scfg;
  scfg.queue_depth = cfg.queue_depth;
  scfg.min_confidence = cfg.min_confidence;
  scfg.floor = cfg.floor;
  scfg.prefetch = planner.active();
  scfg.step_budget_bytes = cfg.step_budget_kib >= 0 ? cfg.step_budget_kib * 1024 : -1;
  WindowScheduler sched(pool, io, scfg, L, k, events);
  if (events != nullptr) {
    events->header(cfg.name(), cfg.budget_bytes(), static_cast<int64_t>(store_.slot_bytes), pool.capacity(),
                   cfg.window, cfg.queue_depth, cfg.min_confidence, L, k);
    events->sequence(static_cast<int>(prompt.size()));
  }

  Generation g;
  if (cfg.preload) {  // every expert resident before the run: no read is left for the decode
    if (pool.capacity() < total)
      throw Error("--preload: the pool holds " + std::to_string(pool.capacity()) + " of the " + std::to_string(total) +
                  " experts; give --pool-mib " + std::to_string(total * static_cast<double>(store_.slot_bytes) / 1048576.0));
    const auto tp = Clock::now();
    for (int li = 0; li < L; ++li)
      for (int e = 0; e < m_.routing.num_experts; ++e) {
        Slot* s = pool.reserve({li, e}, -1, false, {});
        io.submit({li, e}, pool.data(*s), true);
      }
    for (int li = 0; li < L; ++li)
      for (int e = 0; e < m_.routing.num_experts; ++e) {
        Slot* s = pool.get({li, e});
        io.wait({li, e});
        s->ready = s->landed = true;
      }
    g.preload_ms = seconds_since(tp) * 1e3;
  }
  std::vector<int> moe_index(m_.num_layers, -1);
  for (int li = 0; li < L; ++li) moe_index[m_.moe_layers[li]] = li;
  const int n_prompt = static_cast<int>(prompt.size());
  const int64_t end = static_cast<int64_t>(n_prompt + max_new - 1) * L;
  std::vector<int> seq = prompt;
  std::vector<double> times;
  DecodeAccount account;
  std::vector<float> h, y(H), e_out(H), logits;
  std::vector<int> ids;
  std::vector<float> w;
  std::vector<Key> keys;
  LayerOut out;
  double last_wait = 0;
  int64_t last_bytes = 0;

  double plan_s = 0, expert_s = 0;
  int64_t expert_calls = 0;
  exec_.reset();
  const auto t0 = Clock::now();
  int pos = 0;
  while (true) {
    exec_.embed(seq[pos], h);
    for (int layer = 0; layer < m_.num_layers; ++layer) {
      const int li = moe_index[layer];
      exec_.layer(layer, h, pos, li >= 0, out);
      if (li < 0) {
        h.swap(out.h);
        continue;
      }
      const int64_t step = static_cast<int64_t>(pos) * L + li;
      if (static_cast<int>(out.x.size()) != H || static_cast<int>(out.logits.size()) != m_.routing.num_experts)
        throw Error("layer_" + std::to_string(layer) + ": router outputs of the wrong size");
      const float* sb = (host_ != nullptr && !host_->score_bias.empty())
                            ? host_->score_bias.data() + static_cast<size_t>(li) * m_.routing.num_experts
                            : nullptr;
      select_experts(out.logits.data(), m_.routing, sb, ids, w);
      state.record(li, out.x.data(), ids);
      keys.clear();
      for (int e : ids) keys.emplace_back(li, e);
      if (events != nullptr) events->at(step, pos, li);
      sched.acquire(step, keys);  // demand reads go out first
      auto tp = Clock::now();
      planner.plan(sched, li, step, state, out.preds, end);
      plan_s += seconds_since(tp);
      std::fill(y.begin(), y.end(), 0.0f);
      for (size_t j = 0; j < keys.size(); ++j) {
        const uint8_t* blob = sched.data(keys[j]);  // waits for the read (the stall), outside the kernel time
        auto tk = Clock::now();
        kernel_.forward(blob, out.x.data(), e_out.data());
        expert_s += seconds_since(tk);
        ++expert_calls;
        const float wj = w[j];
        for (int i = 0; i < H; ++i) y[i] = y[i] + wj * e_out[i];
      }
      sched.release(step, keys);
      h.swap(out.h);
      for (int i = 0; i < H; ++i) h[i] = h[i] + y[i];
    }
    g.routing.push_back(state.ids);
    state.next_position();
    if (pos < n_prompt - 1) {  // still the prompt: its next token is given
      ++pos;
      continue;
    }
    if (g.tokens.empty()) g.prefill_ms = seconds_since(t0) * 1e3;
    exec_.head(h, logits);
    const int nxt = static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    g.tokens.push_back(nxt);
    times.push_back(seconds_since(t0));
    if (events != nullptr)
      events->token(static_cast<int>(g.tokens.size()) - 1, pos + 1, nxt, times.back() * 1e3);
    if (g.tokens.size() == 1) {  // decode figures are counted from here
      account.start(sched, pool);
      g.first_token_ms = times.back() * 1e3;
    } else {
      g.stall_ms.push_back((sched.stats.wait_s - last_wait) * 1e3);
      g.bytes_read.push_back(sched.stats.bytes_read - last_bytes);
    }
    last_wait = sched.stats.wait_s;
    last_bytes = sched.stats.bytes_read;
    const bool eos = std::find(m_.eos_token_ids.begin(), m_.eos_token_ids.end(), nxt) != m_.eos_token_ids.end();
    if (static_cast<int>(g.tokens.size()) >= max_new || eos) break;
    seq.push_back(nxt);
    ++pos;
  }
  g.stats = account.finish(cfg.name(), sched, pool, times, times.front());
  g.expert_ms_per_call = expert_calls ? expert_s / static_cast<double>(expert_calls) * 1e3 : 0.0;
  g.plan_ms_per_layer = g.routing.empty() ? 0.0 : plan_s / static_cast<double>(g.routing.size() * L) * 1e3;
  if (events != nullptr) events->end(static_cast<int>(g.tokens.size()), seconds_since(t0) * 1e3);
  return g;
}

}  // namespace spx
