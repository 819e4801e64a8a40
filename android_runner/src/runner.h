// The token generator: one decode loop over the program's step graphs, experts through the pool
// (a port of toolkit/runtime/runner.py, in the style of ExecuTorch's TextTokenGenerator: it uses,
// and does not own, the backend, the store and the kernels). Per position:
//
//   h = embed(token)
//   for each decoder layer:
//     dense layer:  h = layer(h, pos)
//     MoE layer i:  h_res, x, logits[, preds] = layer(h, pos)      step s = pos * L + i
//                   w, ids = select(logits)            the family's rule
//                   acquire(s, ids)                    hits pinned; misses read on demand, first
//                   plan(s + 1 .. s + W)               prefetches from preds / a host predictor
//                   y = sum_j w_j * expert(x, slot(ids_j))   waiting for bytes still in flight
//                   release(s, ids); h = h_res + y
//   token = argmax(head(h))
//
// The prompt goes through the bundle's prefill_T_layer_N methods in chunks where it has them,
// consecutive chunks layer by layer as one span (the reference's Runner._chunk; docs/runner.md), and a MoE layer computes its landed experts first,
// the others as their reads land (compute while loading), summed in top-k order.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "planner.h"
#include "routing.h"
#include "stats.h"

namespace spx {

class EventLog;
class Backend;
class ExpertExecutor;
class ExpertStore;
class ExpertPool;

struct ModelInfo {
  int num_layers = 0;
  std::vector<int> moe_layers;
  RoutingSpec routing;
  int hidden_size = 0;
  int vocab = 0;
  std::vector<int> eos_token_ids;
  std::map<int, std::vector<int>> preds_rows;  // MoE layer position -> horizons, row order
  std::string graph_predictor;                 // which predictor the preds rows are (adapter / next-gate)
  int max_seq = 0;
  ReuseTable reuse;                            // the reuse eviction's table (Bundle::reuse); empty: none
  int next_visits = 0;                         // preds rows of horizons L, 2L, ...: the adapter's next-visit heads
  int L() const { return static_cast<int>(moe_layers.size()); }
};

struct RunConfig {
  std::string predictor = "adapter";
  std::string eviction = "prediction";
  double pool_mib = 8.0;
  int window = 2;
  int queue_depth = 4;
  double min_confidence = 0.02;
  double candidate_threshold = 0.0;
  int64_t step_budget_kib = -1;
  int64_t read_budget_kib = -1;  // KiB the flash delivers per step (-1: no deadline check)
  // the read budget measured in the run (--read-budget-kib auto: ReadBudgetMeter): the flash's rate
  // (read_rate_mibs, or probed at start-up when 0) times the steps' measured compute time
  bool read_budget_auto = false;
  double read_rate_mibs = 0;
  int lanes = 0;       // read threads (0: queue_depth + 1)
  bool verify = true;  // CRC every blob read
  bool preload = false;  // read every expert into the pool before the first position (all resident; benchmarks)
  int prefill_chunk = -1;  // the largest prefill chunk: -1 the bundle's largest, 0 off (one position at a time)
  bool next_visit = true;  // reuse: read the adapter's next-visit heads where the bundle has them
  int max_next_visits = -1;  // at most this many of them (-1: all the bundle has)
  bool reuse_classes = true;  // reuse: score by the table's frequency classes where it has them
  std::string name() const { return predictor + "+" + eviction; }
  bool needs_future() const { return predictor == "oracle" || eviction == "belady"; }
  int64_t budget_bytes() const { return static_cast<int64_t>(pool_mib * 1048576.0); }
};

// The read budget a run had (the report's read_budget): off, fixed (--read-budget-kib N) or auto.
struct ReadBudgetReport {
  std::string mode = "off";
  int64_t kib = -1;          // fixed: the option; auto: the median of the decode steps' budgets
  double read_mibs = 0;      // auto: the flash's rate it multiplied
  std::string rate_from;     // auto: "probe" (measured at this run's start), "cached" (an earlier run of the
                             // process probed), "given" (--read-rate-mibs) or "unused" (nothing prefetched)
  int probe_reads = 0, probe_lanes = 0;  // probe_lanes: its reads in flight at most
  double probe_ms = 0;
  int64_t probe_bytes = 0;
  double step_ms = 0;        // auto: the median of the decode steps' measured compute time
  int64_t steps = 0;         // auto: decode steps measured
};

struct Generation {
  std::vector<int> tokens;
  std::vector<std::vector<int>> routing;  // per position [L * k]
  RunStats stats;                         // the figures of `specprefetch run`; the fields below follow them
  std::vector<double> stall_ms;           // per decode token
  std::vector<int64_t> bytes_read;        // per decode token
  double prefill_ms = 0;                  // the prompt's positions before the last one's head
  double first_token_ms = 0;              // = TTFT
  double preload_ms = 0;                  // --preload: reading every expert before the run
  double expert_ms_per_call = 0;          // the expert kernels' time per expert computed
  double plan_ms_per_layer = 0;           // the planner's time per MoE layer (predictions -> queue)
  std::vector<int> prefill_chunks;        // how the prompt was fed: chunk sizes, 1 = one position
  int64_t reads_done = 0;                 // reads that reached the store (prompt, decode, preload)
  int64_t reads_cancelled = 0;            // unused prefetches cancelled while still queued
  // graph calls that crossed to an accelerator (the HTP: Backend::accelerator_calls), up to the first
  // token and after it: each crossing costs ~0.3-0.5 ms on a phone, which a phone figure adds
  int64_t prefill_graph_calls = 0, decode_graph_calls = 0;
  ReadBudgetReport read_budget;
};

// How a prompt of n positions is fed: greedily the largest chunk of `chunks` that fits in what is
// left, the tail by smaller chunks and single positions (1) (backend.py's chunk_plan).
std::vector<int> chunk_plan(int n, const std::vector<int>& chunks);
// Positions per prefill span (backend.py's PREFILL_SPAN): consecutive chunks run layer by layer as
// one span, so a MoE layer's experts are read and computed once per span, not once per chunk.
constexpr int kPrefillSpan = 512;
// The prompt's spans from its chunk_plan units: consecutive chunks merged while the span stays
// within `cap` positions, single positions (1) as they are (backend.py's prefill_spans).
std::vector<int> prefill_spans(const std::vector<int>& units, int cap = kPrefillSpan);

// An image prompt (docs/export.md "Images"): the image rows' embeddings replace those positions' token
// embeddings, DeepStack features are added to them after the first decoder layers, and the M-RoPE
// positions of the prompt go to the backend (Backend::set_rope). As the toolkit's ImagePrompt.
struct ImagePrompt {
  int hidden = 0;
  int tokens = 0;                             // image tokens per image
  int taps = 0;                               // DeepStack features per image (after layers 0 .. taps-1)
  std::vector<int> starts;                    // each image's first image-token position
  std::vector<std::vector<float>> embeds;     // per image [tokens * hidden]
  std::vector<std::vector<float>> deepstack;  // per image [taps * tokens * hidden]
  std::vector<int64_t> rope;                  // [3 * prompt length]
  int64_t delta = 0;

  // (image, row) of prompt position p, or (-1, -1)
  std::pair<int, int> at(int p) const;
  // h [hidden] of position p: its image embedding, if an image row
  void embed(int p, float* h) const;
  // h [hidden] of position p after decoder layer `layer`: plus that tap's feature, if an image row
  void add_deepstack(int p, int layer, float* h) const;
};

// M-RoPE positions [3 * n] of an n-position prompt whose images (each a gh x gw merged grid) start at
// `starts`, and its delta: the model's get_rope_index (toolkit/runtime/images.py: rope_rows).
void mrope_positions(int n, const std::vector<int>& starts, int gh, int gw, std::vector<int64_t>& rows,
                     int64_t& delta);

class Runner {
 public:
  Runner(const ModelInfo& model, Backend& exec, const ExpertStore& store, const ExpertExecutor& kernel,
         const HostRouters* host);

  void configure(const RunConfig& cfg);  // checked: a bad configuration throws and changes nothing
  const RunConfig& config() const { return cfg_; }
  std::vector<std::string> predictors() const;
  std::vector<int> chunk_sizes() const;  // the prefill chunk sizes this configuration uses

  // Greedy decoding of up to max_new tokens (stopping after EOS). `future`: a recorded run's
  // routing (oracle / Belady); `events`: a log to append every decision to.
  Generation generate(const std::vector<int>& prompt, int max_new, const std::vector<std::vector<int>>* future,
                      EventLog* events);
  // `generate` with the recorded first pass the policy needs (oracle, Belady), unless given.
  Generation run(const std::vector<int>& prompt, int max_new, EventLog* events,
                 const std::vector<std::vector<int>>* recorded = nullptr);
  // The image prompt of the next runs (its rows are the prompt's), or nullptr for text.
  void set_images(const ImagePrompt* images) { images_ = images; }

 private:
  Source source_of(const std::string& predictor) const;
  // The flash's rate for --read-budget-kib auto: given, or measured once (per lane count and checking)
  // by reading expert slots into the pool's scratch at the run's lanes before anything else is read.
  struct ReadProbe {
    int lanes = 0;      // the run's lanes (with in_flight and verify, what the probe is cached by)
    bool verify = true;
    double mibs = 0, ms = 0;
    int reads = 0, in_flight = 0;
    int64_t bytes = 0;
  };
  const ReadProbe& read_probe(const ExpertPool& pool, int lanes);

  std::vector<ReadProbe> probes_;

  ModelInfo m_;
  Backend& exec_;
  const ExpertStore& store_;
  const ExpertExecutor& kernel_;
  const HostRouters* host_;
  RunConfig cfg_;
  const ImagePrompt* images_ = nullptr;
};

}  // namespace spx
