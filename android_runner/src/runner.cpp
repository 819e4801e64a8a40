#include "runner.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>

#include "events.h"
#include "backend.h"
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

double lower_median(std::vector<double> v) {  // the middle value, the lower one of an even count
  auto mid = v.begin() + static_cast<std::ptrdiff_t>((v.size() - 1) / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

// The Reader's pread lanes as the scheduler's IOBackend.
class ReaderIO : public IOBackend {
 public:
  explicit ReaderIO(Reader& r) : r_(r) {}
  void submit(Key key, void* dst, bool demand) override { r_.submit(key, dst, demand); }
  bool landed(Key key) override { return r_.landed(key); }
  void wait(Key key) override { r_.wait(key); }
  void release(Key key) override { r_.forget(key); }
  bool cancel(Key key) override { return r_.cancel(key); }

 private:
  Reader& r_;
};

// The order a MoE layer computes its acquired experts in (compute while loading): every expert
// whose bytes have landed first, in the given order, then each of the others as soon as its read
// lands (polling; when none has, waiting for the first of them). `compute(i, blob)` runs for each
// index of `keys`; the bytes of a not yet landed one are waited for in sched.data (the stall).
template <typename F>
void compute_landed_first(WindowScheduler& sched, const std::vector<Key>& keys, F&& compute) {
  std::vector<size_t> waiting;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (sched.landed(keys[i]))
      compute(i, sched.data(keys[i]));
    else
      waiting.push_back(i);
  }
  while (!waiting.empty()) {
    size_t pick = 0;
    for (size_t w = 0; w < waiting.size(); ++w)
      if (sched.landed(keys[waiting[w]])) {
        pick = w;
        break;
      }
    const size_t i = waiting[pick];
    waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(pick));
    compute(i, sched.data(keys[i]));  // waits for the first still missing when none has landed
  }
}

}  // namespace

std::vector<int> chunk_plan(int n, const std::vector<int>& chunks) {
  std::vector<int> sizes;
  for (int T : chunks)
    if (T > 1) sizes.push_back(T);
  std::sort(sizes.rbegin(), sizes.rend());
  std::vector<int> out;
  int left = n;
  for (int T : sizes)
    while (left >= T) {
      out.push_back(T);
      left -= T;
    }
  for (; left > 0; --left) out.push_back(1);
  return out;
}

std::vector<int> prefill_spans(const std::vector<int>& units, int cap) {
  std::vector<int> out;
  int run = 0;
  for (int T : units) {
    if (T > 1 && (run == 0 || run + T <= cap)) {
      run += T;
      continue;
    }
    if (run > 0) out.push_back(run);
    run = 0;
    if (T > 1)
      run = T;
    else
      out.push_back(1);
  }
  if (run > 0) out.push_back(run);
  return out;
}

std::vector<int> Runner::chunk_sizes() const {
  std::vector<int> out;
  if (cfg_.prefill_chunk == 0) return out;
  for (int T : exec_.prefill_chunks())
    if (cfg_.prefill_chunk < 0 || T <= cfg_.prefill_chunk) out.push_back(T);
  return out;
}

Runner::Runner(const ModelInfo& model, Backend& exec, const ExpertStore& store, const ExpertExecutor& kernel,
               const HostRouters* host)
    : m_(model), exec_(exec), store_(store), kernel_(kernel), host_(host) {
  cfg_.predictor = "on-demand";  // always available; the caller configures its policy
  cfg_.eviction = "lru";
  if (store.num_layers != m_.L() || store.num_experts != m_.routing.num_experts)
    throw Error(store.path + ": " + std::to_string(store.num_layers) + " layers x " +
                std::to_string(store.num_experts) + " experts, the model has " + std::to_string(m_.L()) + " x " +
                std::to_string(m_.routing.num_experts));
  // the caller configures the run's pool; this first check needs one that holds a layer's top-k, whatever
  // the slot size (RunConfig's default 8 MiB holds fewer than four 3 MiB experts)
  cfg_.pool_mib = std::max(cfg_.pool_mib, m_.routing.top_k * static_cast<double>(store.slot_bytes) / 1048576.0);
  configure(cfg_);
}

std::vector<std::string> Runner::predictors() const {
  std::vector<std::string> out{"on-demand", "previous-token", "oracle"};
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
  if (p == "previous-token") return Source::previous_token;
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
    if (cfg.prefill_chunk > 0) {
      const auto& have = exec_.prefill_chunks();
      if (std::find(have.begin(), have.end(), cfg.prefill_chunk) == have.end()) {
        std::string sizes;
        for (int T : have) sizes += (sizes.empty() ? "" : ", ") + std::to_string(T);
        throw Error("--prefill-chunk " + std::to_string(cfg.prefill_chunk) + ": the bundle's prefill chunk sizes are " +
                    (sizes.empty() ? std::string("none: the bundle predates prefill chunks") : sizes) +
                    "; give one of them or off");
      }
    }
    if (cfg.step_budget_kib >= 0 && cfg.step_budget_kib * 1024 < static_cast<int64_t>(store_.slot_bytes))
      throw Error("--step-budget-kib " + std::to_string(cfg.step_budget_kib) +
                  ": below one expert slot, so nothing could ever be prefetched");
    if (cfg.read_budget_kib >= 0 && cfg.read_budget_kib * 1024 < static_cast<int64_t>(store_.slot_bytes))
      throw Error("--read-budget-kib " + std::to_string(cfg.read_budget_kib) +
                  ": below one expert slot, so nothing could ever be prefetched");
  } catch (...) {
    cfg_ = saved;
    throw;
  }
}

void mrope_positions(int n, const std::vector<int>& starts, int gh, int gw, std::vector<int64_t>& rows,
                     int64_t& delta) {
  rows.assign(3 * static_cast<size_t>(n), 0);
  auto set = [&](int p, int64_t t, int64_t h, int64_t w) {
    rows[static_cast<size_t>(p)] = t, rows[static_cast<size_t>(n + p)] = h, rows[static_cast<size_t>(2 * n + p)] = w;
  };
  int64_t cur = 0, top = -1;
  int i = 0;
  for (int s : starts) {
    if (s < i || s + gh * gw > n) throw Error("an image's tokens do not fit the prompt");
    for (; i < s; ++i, ++cur) set(i, cur, cur, cur);
    for (int r = 0; r < gh; ++r)
      for (int c = 0; c < gw; ++c) set(s + r * gw + c, cur, cur + r, cur + c);
    top = std::max<int64_t>(top, cur + std::max(gh, gw) - 1);
    cur += std::max(gh, gw);
    i = s + gh * gw;
  }
  for (; i < n; ++i, ++cur) set(i, cur, cur, cur);
  top = std::max<int64_t>(top, cur - 1);
  delta = top + 1 - n;
}

std::pair<int, int> ImagePrompt::at(int p) const {
  for (size_t k = 0; k < starts.size(); ++k)
    if (p >= starts[k] && p < starts[k] + tokens) return {static_cast<int>(k), p - starts[k]};
  return {-1, -1};
}

void ImagePrompt::embed(int p, float* h) const {
  const auto [k, r] = at(p);
  if (k < 0) return;
  const float* src = embeds[static_cast<size_t>(k)].data() + static_cast<size_t>(r) * hidden;
  std::copy(src, src + hidden, h);
}

void ImagePrompt::add_deepstack(int p, int layer, float* h) const {
  if (layer >= taps) return;
  const auto [k, r] = at(p);
  if (k < 0) return;
  const float* f = deepstack[static_cast<size_t>(k)].data() + (static_cast<size_t>(layer) * tokens + r) * hidden;
  for (int i = 0; i < hidden; ++i) h[i] = h[i] + f[i];
}

const Runner::ReadProbe& Runner::read_probe(const ExpertPool& pool, int lanes) {
  const int64_t ring = std::min<int64_t>(pool.arena_slots(), 2LL * lanes);
  for (const ReadProbe& p : probes_)  // the same lanes, reads in flight and checking: the same measurement
    if (p.lanes == lanes && p.in_flight == std::min<int64_t>(lanes, ring) && p.verify == cfg_.verify) return p;
  // slot reads spread over the store: 64 MiB's worth, at least 16 and at most 64 reads (probe_reads in
  // toolkit/runtime/runner.py), each into its own scratch slot while in flight (at most two per lane), checked
  // as the run's reads are; through the Reader, as the run's (a buffered store's reads leave no page cached)
  const int64_t total = static_cast<int64_t>(m_.L()) * m_.routing.num_experts;
  const int64_t slot = static_cast<int64_t>(store_.slot_bytes);
  const int64_t n = std::min<int64_t>(total, std::clamp<int64_t>(((64LL << 20) + slot - 1) / slot, 16, 64));
  if (ring < 1 || pool.scratch(0) == nullptr) throw Error("--read-budget-kib auto: the pool has no slot to probe with");
  std::vector<Key> keys;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = j * total / n;
    keys.emplace_back(static_cast<int>(i / m_.routing.num_experts), static_cast<int>(i % m_.routing.num_experts));
  }
  const auto t = Clock::now();
  try {
    Reader reader(store_, lanes, cfg_.verify);
    for (int64_t j = 0; j < n; ++j) {
      if (j >= ring) {
        reader.wait(keys[static_cast<size_t>(j - ring)]);
        reader.forget(keys[static_cast<size_t>(j - ring)]);
      }
      reader.submit(keys[static_cast<size_t>(j)], pool.scratch(j % ring), true);
    }
    for (int64_t j = std::max<int64_t>(0, n - ring); j < n; ++j) reader.wait(keys[static_cast<size_t>(j)]);
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (read by --read-budget-kib auto's probe of the flash's rate)");
  }
  ReadProbe p;
  p.lanes = lanes, p.verify = cfg_.verify, p.reads = static_cast<int>(n);
  p.in_flight = static_cast<int>(std::min<int64_t>(lanes, ring));  // reads in flight at most (a small pool: fewer)
  p.bytes = n * slot;
  p.ms = seconds_since(t) * 1e3;
  p.mibs = static_cast<double>(n * slot) / 1048576.0 / std::max(p.ms * 1e-3, 1e-9);
  probes_.push_back(p);
  return probes_.back();
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
  const int L = m_.L(), k = m_.routing.top_k, H = m_.hidden_size;
  const Source source = source_of(cfg.predictor);
  PrefetchPlanner planner(source, L, cfg.window, m_.routing, host_, m_.preds_rows, H,
                          cfg.next_visit && cfg.eviction == "reuse"
                              ? (cfg.max_next_visits < 0 ? m_.next_visits : std::min(m_.next_visits, cfg.max_next_visits))
                              : 0);
  RoutingState state(L, H, k);
  state.future = future;

  const int total = L * m_.routing.num_experts;
  const std::vector<int> sizes = chunk_sizes();
  const std::vector<int> units = chunk_plan(static_cast<int>(prompt.size()), sizes);
  const std::vector<int> spans = prefill_spans(units);
  // the pool's arena outlives the reader, whose destructor waits for reads still in flight into it
  ExpertPool pool(cfg.budget_bytes(), static_cast<int64_t>(store_.slot_bytes), cfg.eviction, k, total,
                  cfg.eviction == "belady" ? belady_next_use(*future, L, k, spans) : nullptr);
  const int lanes = cfg.lanes > 0 ? cfg.lanes : std::min(cfg.queue_depth + 1, 64);
  Generation g;
  std::unique_ptr<ReadBudgetMeter> meter;  // --read-budget-kib auto
  std::vector<double> budget_kib, budget_step_ms;  // auto: each decode step's
  if (cfg.read_budget_auto && (!planner.active() || cfg.preload)) {
    // nothing prefetched (or every expert read before the run): nothing to budget, nothing probed
    g.read_budget.mode = "auto", g.read_budget.rate_from = "unused";
  } else if (cfg.read_budget_auto) {
    ReadBudgetReport& rb = g.read_budget;
    rb.mode = "auto";
    if (cfg.read_rate_mibs > 0) {
      rb.read_mibs = cfg.read_rate_mibs, rb.rate_from = "given";
    } else {
      const size_t had = probes_.size();
      const ReadProbe& pr = read_probe(pool, lanes);
      rb.read_mibs = pr.mibs;
      if (probes_.size() > had) {  // probed for this run (its reads, its time: the report's probe_*)
        rb.rate_from = "probe", rb.probe_reads = pr.reads, rb.probe_lanes = pr.in_flight;
        rb.probe_ms = pr.ms, rb.probe_bytes = pr.bytes;
      } else {
        rb.rate_from = "cached";  // an earlier run of this process probed it
      }
    }
    meter = std::make_unique<ReadBudgetMeter>(rb.read_mibs * 1048576.0, static_cast<int64_t>(store_.slot_bytes));
  } else if (cfg.read_budget_kib >= 0) {
    g.read_budget.mode = "fixed", g.read_budget.kib = cfg.read_budget_kib;
  }
  Reader reader(store_, lanes, cfg.verify);
  ReaderIO io(reader);
  SchedulerConfig scfg;
  scfg.queue_depth = cfg.queue_depth;
  scfg.min_confidence = cfg.min_confidence;
  scfg.candidate_threshold = cfg.candidate_threshold;
  scfg.prefetch = planner.active();
  scfg.step_budget_bytes = cfg.step_budget_kib >= 0 ? cfg.step_budget_kib * 1024 : -1;
  scfg.read_budget_bytes = cfg.read_budget_kib >= 0 ? cfg.read_budget_kib * 1024 : -1;
  std::unique_ptr<ReuseHistory> reuse;
  if (cfg.eviction == "reuse") {
    if (m_.reuse.empty()) throw Error("--policy " + cfg.name() + ": the bundle has no reuse table");
    reuse = std::make_unique<ReuseHistory>(cfg.reuse_classes ? m_.reuse : m_.reuse.whole(), L);
  }
  WindowScheduler sched(pool, io, scfg, L, k, events, reuse.get());
  // auto: the budget from this step on, by the compute time measured since the last MoE step
  auto meter_step = [&](int64_t step, int span, bool decode) {
    if (!meter) return;
    const int64_t b = meter->at(span, std::chrono::duration<double>(Clock::now().time_since_epoch()).count(),
                                sched.stats.wait_s);
    if (b != sched.read_budget()) {
      sched.set_read_budget(step, b);
      if (events != nullptr) events->budget(step, b < 0 ? -1 : b / 1024);
    }
    if (decode && b >= 0) budget_kib.push_back(static_cast<double>(b / 1024)), budget_step_ms.push_back(meter->step_s() * 1e3);
  };
  if (events != nullptr) {
    events->header(cfg.name(), cfg.budget_bytes(), static_cast<int64_t>(store_.slot_bytes), pool.capacity(),
                   cfg.window, cfg.queue_depth, cfg.min_confidence, L, k,
                   cfg.read_budget_auto ? "auto" : cfg.read_budget_kib >= 0 ? std::to_string(cfg.read_budget_kib) : "off");
    events->sequence(static_cast<int>(prompt.size()));
  }

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
  std::vector<float> h, y(H), e_outs, logits;
  std::vector<int> ids;
  std::vector<float> w;
  std::vector<Key> keys;
  LayerOut out;
  double last_wait = 0;
  int64_t last_bytes = 0;

  double plan_s = 0, expert_s = 0;
  int64_t expert_calls = 0;
  std::map<int, int> unit_at;  // a prompt span's first position -> its size
  {
    int p = 0;
    for (int T : spans) unit_at[p] = T, p += T;
  }
  g.prefill_chunks = units;

  // Prompt positions p0 .. p0+T-1 (a span: its chunks chunk_plan(T), run in order through each
  // layer's prefill_T' methods before the next layer) through every layer, as the reference
  // runner's Runner._chunk: at MoE layer i (step p0 * L + i) the union of the span's
  // experts is acquired in groups of at most the pool's capacity, resident ones first, then the
  // others, each part by ascending expert id; each expert computes every token routed to it in one
  // batch; a token sums its experts in its own top-k order. The window is planned after the last
  // group's acquire; earlier groups release without issuing prefetches. Leaves the chunk's hidden
  // states [T * H] in hc.
  std::vector<float> hc, xs, ys;
  LayerOut part;
  auto chunk = [&](int p0, int T, int T_next) {
    const std::vector<int> parts = chunk_plan(T, sizes);
    hc.assign(static_cast<size_t>(T) * H, 0.0f);
    for (int t = 0; t < T; ++t) {
      exec_.embed(seq[p0 + t], h);
      if (images_ != nullptr) images_->embed(p0 + t, h.data());
      std::copy(h.begin(), h.end(), hc.begin() + static_cast<size_t>(t) * H);
    }
    auto deepstack = [&](int layer) {
      if (images_ != nullptr)
        for (int t = 0; t < T; ++t) images_->add_deepstack(p0 + t, layer, hc.data() + static_cast<size_t>(t) * H);
    };
    ChunkState cs(T, L, H, k);
    std::vector<std::vector<int>> rt(static_cast<size_t>(T), std::vector<int>(static_cast<size_t>(L) * k));
    std::vector<int> ids_all(static_cast<size_t>(T) * k), row_ids;
    std::vector<float> w_all(static_cast<size_t>(T) * k), row_w;
    std::vector<float> outs_tj(static_cast<size_t>(T) * k * H);  // token t's j-th expert output
    for (int layer = 0; layer < m_.num_layers; ++layer) {
      const int li = moe_index[layer];
      if (parts.size() == 1) {
        exec_.layer_chunk(layer, hc, T, p0, li >= 0, out);
      } else {  // the span's chunks in order: each one's attention sees the KV the earlier ones wrote
        out.h.clear(), out.x.clear(), out.logits.clear(), out.preds.clear();
        int o = 0;
        for (int Tp : parts) {
          exec_.layer_chunk(layer, hc.data() + static_cast<size_t>(o) * H, Tp, p0 + o, li >= 0, part);
          out.h.insert(out.h.end(), part.h.begin(), part.h.end());
          out.x.insert(out.x.end(), part.x.begin(), part.x.end());
          out.logits.insert(out.logits.end(), part.logits.begin(), part.logits.end());
          out.preds.insert(out.preds.end(), part.preds.begin(), part.preds.end());
          o += Tp;
        }
      }
      if (li < 0) {
        hc.swap(out.h);
        deepstack(layer);
        continue;
      }
      const int64_t step = static_cast<int64_t>(p0) * L + li;
      const int E = m_.routing.num_experts;
      if (out.x.size() != static_cast<size_t>(T) * H || out.logits.size() != static_cast<size_t>(T) * E)
        throw Error("prefill_" + std::to_string(parts.front()) + "_layer_" + std::to_string(layer) +
                    ": router outputs of the wrong size (a span of " + std::to_string(T) + " positions)");
      const float* sb = (host_ != nullptr && !host_->score_bias.empty())
                            ? host_->score_bias.data() + static_cast<size_t>(li) * E
                            : nullptr;
      for (int t = 0; t < T; ++t) {
        select_experts(out.logits.data() + static_cast<size_t>(t) * E, m_.routing, sb, row_ids, row_w);
        std::copy(row_ids.begin(), row_ids.end(), ids_all.begin() + static_cast<size_t>(t) * k);
        std::copy(row_w.begin(), row_w.end(), w_all.begin() + static_cast<size_t>(t) * k);
        std::copy(row_ids.begin(), row_ids.end(), rt[t].begin() + static_cast<size_t>(li) * k);
      }
      cs.record(li, out.x.data(), ids_all);
      state.record(li, out.x.data() + static_cast<size_t>(T - 1) * H, row_ids);  // the last position's
      if (events != nullptr) events->at(step, p0, li);
      std::map<int, std::vector<int>> users;  // expert -> t * k + j of the tokens routed to it
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) users[ids_all[static_cast<size_t>(t) * k + j]].push_back(t * k + j);
      std::vector<int> order;
      for (const auto& kv : users)
        if (pool.get({li, kv.first}) != nullptr) order.push_back(kv.first);
      for (const auto& kv : users)
        if (pool.get({li, kv.first}) == nullptr) order.push_back(kv.first);
      meter_step(step, T, false);
      const size_t G = static_cast<size_t>(std::max<int64_t>(1, pool.capacity()));
      for (size_t a = 0; a < order.size(); a += G) {
        const bool last = a + G >= order.size();
        keys.clear();
        for (size_t b = a; b < std::min(order.size(), a + G); ++b) keys.emplace_back(li, order[b]);
        sched.acquire(step, keys);
        if (last) {
          auto tp = Clock::now();
          planner.plan_chunk(sched, li, step, T, T_next, cs, state, out.preds, end);
          plan_s += seconds_since(tp);
        }
        compute_landed_first(sched, keys, [&](size_t ki, const uint8_t* blob) {  // data() waited: the stall
          const Key& key = keys[ki];
          const auto& us = users[key.second];
          const int n = static_cast<int>(us.size());
          xs.resize(static_cast<size_t>(n) * H);
          ys.resize(static_cast<size_t>(n) * H);
          for (int u = 0; u < n; ++u)
            std::copy(out.x.begin() + static_cast<size_t>(us[u] / k) * H,
                      out.x.begin() + static_cast<size_t>(us[u] / k + 1) * H, xs.begin() + static_cast<size_t>(u) * H);
          auto tk = Clock::now();
          kernel_.forward_batch(blob, xs.data(), n, ys.data());  // one batched product
          expert_s += seconds_since(tk);
          expert_calls += n;
          for (int u = 0; u < n; ++u)
            std::copy(ys.begin() + static_cast<size_t>(u) * H, ys.begin() + static_cast<size_t>(u + 1) * H,
                      outs_tj.begin() + static_cast<size_t>(us[u]) * H);
        });
        sched.release(step, keys, last);
      }
      hc.swap(out.h);
      for (int t = 0; t < T; ++t) {
        std::fill(y.begin(), y.end(), 0.0f);
        for (int j = 0; j < k; ++j) {
          const float wj = w_all[static_cast<size_t>(t) * k + j];
          const float* eo = outs_tj.data() + (static_cast<size_t>(t) * k + j) * H;
          for (int i = 0; i < H; ++i) y[i] = y[i] + wj * eo[i];
        }
        float* ht = hc.data() + static_cast<size_t>(t) * H;
        for (int i = 0; i < H; ++i) ht[i] = ht[i] + y[i];
      }
      deepstack(layer);
    }
    for (auto& r : rt) g.routing.push_back(std::move(r));
  };

  exec_.reset();
  if (images_ != nullptr && images_->rope.size() != 3 * prompt.size())
    throw Error("the image prompt's positions are not the prompt's");
  exec_.set_rope(images_ != nullptr ? images_->rope : std::vector<int64_t>{}, images_ != nullptr ? images_->delta : 0);
  const auto t0 = Clock::now();
  const int64_t calls0 = exec_.accelerator_calls();
  int pos = 0;
  while (true) {
    auto u = unit_at.find(pos);
    const int T = u == unit_at.end() ? 1 : u->second;
    if (T > 1) {  // a prefill chunk
      auto un = unit_at.find(pos + T);
      chunk(pos, T, un == unit_at.end() ? 1 : un->second);
      for (int t = 0; t < T; ++t) state.next_position();
      const int last = pos + T - 1;
      if (last < n_prompt - 1) {
        pos += T;
        continue;
      }
      pos = last;
      h.assign(hc.begin() + static_cast<size_t>(T - 1) * H, hc.end());
    } else {
      exec_.embed(seq[pos], h);
      if (images_ != nullptr) images_->embed(pos, h.data());
      for (int layer = 0; layer < m_.num_layers; ++layer) {
        const int li = moe_index[layer];
        exec_.layer(layer, h, pos, li >= 0, out);
        if (li < 0) {
          h.swap(out.h);
          if (images_ != nullptr) images_->add_deepstack(pos, layer, h.data());
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
        meter_step(step, 1, !g.tokens.empty());
        sched.acquire(step, keys);  // demand reads go out first
        auto tp = Clock::now();
        planner.plan(sched, li, step, state, out.preds, end);
        plan_s += seconds_since(tp);
        // compute while loading: resident experts first (one forward_many), then each missing one
        // as its read lands; the outputs are summed in top-k order afterwards, so nothing changes
        e_outs.resize(keys.size() * static_cast<size_t>(H));
        {
          std::vector<const uint8_t*> now_blobs;
          std::vector<float*> now_outs;
          std::vector<size_t> later;
          for (size_t j = 0; j < keys.size(); ++j) {
            if (sched.landed(keys[j])) {
              now_blobs.push_back(sched.data(keys[j]));
              now_outs.push_back(e_outs.data() + j * H);
            } else {
              later.push_back(j);
            }
          }
          auto tk = Clock::now();
          if (!now_blobs.empty())
            kernel_.forward_many(now_blobs.data(), static_cast<int>(now_blobs.size()), out.x.data(), now_outs.data());
          expert_s += seconds_since(tk);
          std::vector<Key> later_keys;
          for (size_t j : later) later_keys.push_back(keys[j]);
          compute_landed_first(sched, later_keys, [&](size_t i, const uint8_t* blob) {  // data() waited: the stall
            auto tk2 = Clock::now();
            kernel_.forward(blob, out.x.data(), e_outs.data() + later[i] * H);
            expert_s += seconds_since(tk2);
          });
          expert_calls += static_cast<int64_t>(keys.size());
        }
        std::fill(y.begin(), y.end(), 0.0f);
        for (size_t j = 0; j < keys.size(); ++j) {
          const float wj = w[j];
          const float* eo = e_outs.data() + j * H;
          for (int i = 0; i < H; ++i) y[i] = y[i] + wj * eo[i];
        }
        sched.release(step, keys);
        h.swap(out.h);
        for (int i = 0; i < H; ++i) h[i] = h[i] + y[i];
        if (images_ != nullptr) images_->add_deepstack(pos, layer, h.data());
      }
      g.routing.push_back(state.ids);
      state.next_position();
      if (pos < n_prompt - 1) {  // still the prompt: its next token is given
        ++pos;
        continue;
      }
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
      g.prefill_graph_calls = exec_.accelerator_calls() - calls0;
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
  g.decode_graph_calls = exec_.accelerator_calls() - calls0 - g.prefill_graph_calls;
  g.reads_done = static_cast<int64_t>(reader.reads());
  g.reads_cancelled = static_cast<int64_t>(reader.cancelled());
  if (!budget_kib.empty()) {  // auto: the decode steps' medians (the budget the simulator replays)
    g.read_budget.kib = static_cast<int64_t>(lower_median(budget_kib));
    g.read_budget.step_ms = lower_median(budget_step_ms);
    g.read_budget.steps = static_cast<int64_t>(budget_kib.size());
  }
  g.expert_ms_per_call = expert_calls ? expert_s / static_cast<double>(expert_calls) * 1e3 : 0.0;
  g.plan_ms_per_layer = g.routing.empty() ? 0.0 : plan_s / static_cast<double>(g.routing.size() * L) * 1e3;
  if (events != nullptr) events->end(static_cast<int>(g.tokens.size()), seconds_since(t0) * 1e3);
  return g;
}

}  // namespace spx
