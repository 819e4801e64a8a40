// specprefetch-runner: the native runner's command line (docs/runner.md).
//
//   specprefetch-runner BUNDLE (--prompt TEXT | --prompt-ids 1,2,3) [...] [--max-new-tokens N]
//       [--policy PREDICTOR+EVICTION] [--pool-mib F|auto] [--window N] [--queue-depth N]
//       [--min-confidence F] [--candidate-threshold F] [--step-budget-kib N] [--read-budget-kib N|auto|off] [--no-next-visit]
//       [--next-visits N]
//       [--no-reuse-classes] [--lanes N] [--threads N] [--routing FILE]
//       [--json OUT] [--events OUT] [--no-verify] [--no-verify-hashes] [--cold] [--preload] [--isa NAME]
//
// Refusals print one line "specprefetch-runner: error: ..." naming the file or option, exit 1.
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <iostream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bundle.h"
#include "crc32.h"
#include "events.h"
#include "backend.h"
#include "expert_store.h"
#include "fileio.h"
#include "kernels.h"
#include "memwatch.h"
#include "image.h"
#include "runner.h"
#include "safetensors.h"
#include "spx_config.h"
#include "stats.h"
#include "tokenizer.h"

namespace spx {
namespace {

using json = nlohmann::ordered_json;

const char* kUsage =
    "usage: specprefetch-runner BUNDLE (--prompt TEXT | --prompt-ids IDS) [more prompts] [--max-new-tokens N]\n"
    "  [--policy PREDICTOR+EVICTION] [--pool-mib F] [--window N] [--queue-depth N] [--min-confidence F]\n"
    "  [--candidate-threshold F] [--step-budget-kib N] [--read-budget-kib N|auto|off] [--read-rate-mibs F]\n"
    "  [--no-next-visit] [--next-visits N] [--lanes N] [--threads N]\n"
    "  [--no-reuse-classes] [--routing FILE]\n"
    "  [--json OUT] [--events OUT] [--image PATH]... (before every prompt's text; a bundle that takes images)\n"
    "  [--no-verify] [--no-verify-hashes] [--cold] [--preload] [--isa NAME|best] [--prefill-chunk N|off]\n"
    "  --pool-mib auto [--pool-reserve-mib N] [--pool-low-watermark-mib N] [--pool-high-watermark-mib N]\n"
    "  [--pool-check-ms N]: the pool sized from the available memory, shrunk under the low watermark\n";

struct Args {
  std::string bundle;
  std::vector<std::vector<int>> prompts;  // ids; a --prompt's are filled in by the tokenizer
  std::vector<std::string> texts;         // per prompt: its --prompt text, empty for --prompt-ids
  std::vector<bool> is_text;
  int max_new = 32;
  std::string policy;
  double pool_mib = NAN;
  bool pool_auto = false;  // --pool-mib auto (memwatch.h)
  double pool_reserve_mib = -1, pool_low_mib = -1, pool_high_mib = -1;  // -1: the defaults
  int pool_check_ms = 100;
  int window = -1, queue_depth = -1, lanes = 0, threads = 1;
  double min_confidence = NAN, candidate_threshold = NAN;
  int64_t step_budget_kib = -2;
  int64_t read_budget_kib = -1;  // -1 off
  bool read_budget_auto = true;   // --read-budget-kib auto, the default
  double read_rate_mibs = 0;      // --read-rate-mibs (auto: instead of the probe)
  bool next_visit = true;
  int max_next_visits = -1;  // --next-visits N: at most N of the bundle's next-visit heads (-1: all)
  bool reuse_classes = true;
  std::string routing, json_out, events_out, isa;
  bool verify = true, verify_hashes = true, cold = false, preload = false;
  int prefill_chunk = -1;  // --prefill-chunk: -1 the bundle's largest, 0 off
  std::vector<std::string> images;  // --image, in order: before every prompt's tokens
};

// The report's read_budget: {"mode": off|fixed|auto, "kib"}, and for auto what it came from
// (toolkit/runtime/runner.py's read_budget report, the same keys).
json read_budget_json(const ReadBudgetReport& rb) {
  json j;
  j["mode"] = rb.mode;
  j["kib"] = rb.kib >= 0 ? json(rb.kib) : json(nullptr);
  if (rb.mode == "auto") {
    j["read_mibs"] = rb.rate_from == "unused" ? json(nullptr) : json(rb.read_mibs);
    j["rate_from"] = rb.rate_from;
    if (rb.rate_from == "probe") {  // the run that probed (later runs of the process: "cached")
      j["probe_reads"] = rb.probe_reads;
      j["probe_lanes"] = rb.probe_lanes;
      j["probe_ms"] = rb.probe_ms;
      j["probe_bytes"] = rb.probe_bytes;
    }
    if (rb.rate_from != "unused") {
      j["step_ms"] = rb.steps > 0 ? json(rb.step_ms) : json(nullptr);
      j["steps"] = rb.steps;
    }
  }
  return j;
}

double to_double(const std::string& opt, const std::string& v) {
  char* end = nullptr;
  double d = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !std::isfinite(d)) throw Error(opt + " '" + v + "': not a finite number");
  return d;
}

int64_t to_int(const std::string& opt, const std::string& v, int64_t lo) {
  char* end = nullptr;
  long long d = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0') throw Error(opt + " '" + v + "': not an integer");
  if (d < lo) throw Error(opt + " " + v + ": must be >= " + std::to_string(lo));
  if (d > 1000000000LL) throw Error(opt + " " + v + ": too large");
  return d;
}

// A probability option: in [0, 1], as the Python CLI's --min-confidence and the manifest's
// runtime.scheduler.min_confidence / candidate_threshold are.
double to_probability(const std::string& opt, const std::string& v) {
  const double d = to_double(opt, v);
  if (!(d >= 0.0 && d <= 1.0)) throw Error(opt + " " + v + ": must be a probability in [0, 1]");
  return d;
}

// The offset of the first byte of `s` that is not well-formed UTF-8 (overlong forms, surrogates
// and code points past U+10FFFF included), or npos.
size_t invalid_utf8_at(const std::string& s) {
  const auto* u = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = u[i];
    size_t len = 0;
    unsigned lo = 0x80, hi = 0xBF;  // the second byte's range
    if (c < 0x80) len = 1;
    else if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;       // overlong
      else if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;       // overlong
      else if (c == 0xF4) hi = 0x8F;  // past U+10FFFF
    } else return i;
    if (i + len > n) return i;
    for (size_t j = 1; j < len; ++j) {
      const unsigned b = u[i + j];
      if (j == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return i;
    }
    i += len;
  }
  return std::string::npos;
}

std::vector<int> to_ids(const std::string& v) {
  std::vector<int> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(static_cast<int>(to_int("--prompt-ids", item, 0)));
  if (out.empty()) throw Error("--prompt-ids: empty");
  if (v.back() == ',') throw Error("--prompt-ids '" + v + "': a trailing comma");
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  std::set<std::string> once;  // options naming a file: given twice, which one was meant?
  for (int i = 1; i < argc; ++i) {
    std::string o = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(o + ": needs a value");
      return argv[++i];
    };
    if ((o == "--json" || o == "--events" || o == "--routing") && !once.insert(o).second)
      throw Error(o + ": given twice");
    if (o == "--prompt-ids") {
      a.prompts.push_back(to_ids(val()));
      a.texts.emplace_back();
      a.is_text.push_back(false);
    } else if (o == "--prompt") {
      a.texts.push_back(val());
      if (a.texts.back().empty()) throw Error("--prompt: empty text");
      const size_t bad = invalid_utf8_at(a.texts.back());
      if (bad != std::string::npos)
        throw Error("--prompt: not valid UTF-8 text (byte " + std::to_string(bad) + " of prompt " +
                    std::to_string(a.texts.size()) + "); give UTF-8 text or --prompt-ids");
      a.prompts.emplace_back();
      a.is_text.push_back(true);
    }
    else if (o == "--image") a.images.push_back(val());
    else if (o == "--max-new-tokens") a.max_new = static_cast<int>(to_int(o, val(), 1));
    else if (o == "--policy") a.policy = val();
    else if (o == "--pool-mib") {
      const std::string v = val();
      a.pool_auto = v == "auto";
      a.pool_mib = a.pool_auto ? NAN : to_double(o, v);
    }
    else if (o == "--pool-reserve-mib" || o == "--pool-low-watermark-mib" || o == "--pool-high-watermark-mib") {
      const double d = to_double(o, val());
      if (d < 0 || d > 1e9) throw Error(o + " " + argv[i] + ": must be 0..1e9 MiB");
      (o == "--pool-reserve-mib" ? a.pool_reserve_mib : o == "--pool-low-watermark-mib" ? a.pool_low_mib : a.pool_high_mib) = d;
    }
    else if (o == "--pool-check-ms") a.pool_check_ms = static_cast<int>(to_int(o, val(), 1));
    else if (o == "--window") a.window = static_cast<int>(to_int(o, val(), 1));
    else if (o == "--queue-depth") a.queue_depth = static_cast<int>(to_int(o, val(), 1));
    else if (o == "--lanes") {
      a.lanes = static_cast<int>(to_int(o, val(), 1));
      if (a.lanes > 64) throw Error("--lanes " + std::to_string(a.lanes) + ": at most 64");
    }
    else if (o == "--threads") {
      a.threads = static_cast<int>(to_int(o, val(), 0));
      if (a.threads > 256) throw Error("--threads " + std::to_string(a.threads) + ": at most 256");
    }
    else if (o == "--min-confidence") a.min_confidence = to_probability(o, val());
    else if (o == "--candidate-threshold" || o == "--floor")  // --floor: its name before the rename
      a.candidate_threshold = to_probability(o, val());
    else if (o == "--step-budget-kib") a.step_budget_kib = to_int(o, val(), 1);
    else if (o == "--read-budget-kib") {
      const std::string v = val();
      a.read_budget_auto = v == "auto";
      if (v != "auto" && v != "off" && (v.empty() || v.find_first_not_of("0123456789") != std::string::npos))
        throw Error("--read-budget-kib '" + v + "': KiB a step (a whole number), auto or off");
      a.read_budget_kib = v == "auto" || v == "off" ? -1 : to_int(o, v, 1);
    }
    else if (o == "--read-rate-mibs") {
      const std::string v = val();
      a.read_rate_mibs = to_double(o, v);
      if (!(a.read_rate_mibs > 0 && a.read_rate_mibs <= 1e9))
        throw Error("--read-rate-mibs " + v + ": MiB/s above 0 and at most 1e9");
    }
    else if (o == "--no-next-visit") a.next_visit = false;
    else if (o == "--next-visits") a.max_next_visits = static_cast<int>(to_int(o, val(), 0));
    else if (o == "--no-reuse-classes") a.reuse_classes = false;
    else if (o == "--routing") a.routing = val();
    else if (o == "--json") a.json_out = val();
    else if (o == "--events") a.events_out = val();
    else if (o == "--isa") a.isa = val();
    else if (o == "--no-verify") a.verify = false;
    else if (o == "--no-verify-hashes") a.verify_hashes = false;
    else if (o == "--cold") a.cold = true;
    else if (o == "--preload") a.preload = true;
    else if (o == "--prefill-chunk") {
      const std::string v = val();
      a.prefill_chunk = v == "off" ? 0 : static_cast<int>(to_int(o, v, 1));
    }
    else if (o == "-h" || o == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (!o.empty() && o[0] == '-') throw Error("unknown option " + o);
    else if (a.bundle.empty()) a.bundle = o;
    else throw Error("unexpected argument " + o);
  }
  if (a.bundle.empty()) throw Error("no BUNDLE given (--help shows the usage)");
  if (a.prompts.empty()) throw Error("no prompt: give --prompt TEXT or --prompt-ids 1,2,3");
  if (!(std::isnan(a.pool_mib) || a.pool_mib > 0)) throw Error("--pool-mib: must be a positive number");
  if (a.read_rate_mibs > 0 && !a.read_budget_auto)
    throw Error("--read-rate-mibs: only with --read-budget-kib auto (the rate the budget multiplies)");
  if (!a.pool_auto)
    for (int i = 1; i < argc; ++i)
      for (const char* o : {"--pool-reserve-mib", "--pool-low-watermark-mib", "--pool-high-watermark-mib", "--pool-check-ms"})
        if (std::string(argv[i]) == o) throw Error(std::string(o) + ": only with --pool-mib auto");
  return a;
}

// The runner is generated for one bundle (spx_config.h): refuse another.
void check_build(const Bundle& b, const ExpertStore& st) {
  std::string why;
  if (b.family != SPX_FAMILY) why = "family " + b.family;
  else if (b.config_hash != SPX_CONFIG_HASH) why = "model config " + b.config_hash;
  else if (b.hidden_size != SPX_HIDDEN || b.num_experts != SPX_NUM_EXPERTS || b.top_k != SPX_TOP_K ||
           static_cast<int>(b.moe_layers.size()) != SPX_MOE_LAYERS || b.num_layers != SPX_NUM_LAYERS)
    why = "geometry";
  else if (st.dtype != SPX_EXPERT_DTYPE) why = "expert dtype " + st.dtype;
  else if (b.routing.score_func != SPX_SCORE_FUNC) why = "router score function " + b.routing.score_func;
  if (!why.empty())
    throw Error(b.manifest_path + ": this runner was generated for another bundle (" SPX_FAMILY ", config " +
                std::string(SPX_CONFIG_HASH) + ", " SPX_EXPERT_DTYPE " experts; this one differs in " + why +
                "): build one for it with `specprefetch runner build`");
  // the store must be the one exported with this model (not another model's of the same shape)
  if (st.config_hash != b.config_hash || st.family != b.family || st.moe_layers != b.moe_layers)
    throw Error(b.store_path + ": expert store of model config " + st.config_hash + " (" + st.family +
                "), but the bundle's model is " + b.config_hash + " (" + b.family + ")");
}

std::vector<std::vector<std::vector<int>>> read_routing(const std::string& path, size_t prompts, int L, int k, int E) {
  json j;
  try {
    j = json::parse(read_file(path, "--routing"));
  } catch (const json::exception& e) {
    throw Error(path + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  std::vector<std::vector<std::vector<int>>> out;
  try {
    const auto& runs = j.at("routing");
    if (!runs.is_array() || runs.size() != prompts)
      throw Error(path + ": 'routing' must hold one entry per prompt (" + std::to_string(prompts) + ")");
    for (const auto& r : runs) {
      std::vector<std::vector<int>> per;
      for (const auto& p : r) {
        // a position is [L][k] expert ids, or the L * k of them flat (the runner's own "routing" output)
        std::vector<int> flat;
        const bool nested = p.is_array() && !p.empty() && p[0].is_array();
        if (!p.is_array() || static_cast<int>(p.size()) != (nested ? L : L * k))
          throw Error(path + ": each position needs " + std::to_string(L) + " layers of " + std::to_string(k) + " experts");
        for (const auto& layer : p) {
          if (nested && (!layer.is_array() || static_cast<int>(layer.size()) != k))
            throw Error(path + ": each layer needs " + std::to_string(k) + " experts");
          for (const auto& e : nested ? layer : json::array({layer})) {
            if (!e.is_number_integer()) throw Error(path + ": expert ids must be integers");
            const int64_t v = e.get<int64_t>();
            if (v < 0 || v >= E) throw Error(path + ": expert id " + std::to_string(v) + " out of range");
            flat.push_back(static_cast<int>(v));
          }
        }
        per.push_back(std::move(flat));
      }
      out.push_back(std::move(per));
    }
  } catch (const json::exception& e) {
    throw Error(path + ": malformed routing (" + std::string(e.what()) + ")");
  }
  return out;
}

RoutingSpec rule_of(const Routing& r) {
  RoutingSpec o;
  o.num_experts = r.num_experts;
  o.top_k = r.top_k;
  o.score_func = r.score_func;
  o.topk_before_softmax = r.topk_before_softmax;
  o.norm_topk_prob = r.norm_topk_prob;
  o.routed_scaling_factor = static_cast<float>(r.routed_scaling_factor);
  o.n_group = r.n_group;
  o.topk_group = r.topk_group;
  o.group_score = r.group_score;
  o.score_bias = r.score_bias;
  return o;
}

HostRouters load_host(const Bundle& b) {
  HostRouters h;
  if (b.host_path.empty()) return h;
  auto t = read_safetensors(b.host_path);
  const size_t L = b.moe_layers.size(), E = b.num_experts, H = b.hidden_size;
  auto take = [&](const char* name, size_t n, std::vector<float>& dst) {
    auto it = t.find(name);
    if (it == t.end()) return;
    if (it->second.data.size() != n)
      throw Error(b.host_path + ": " + name + " holds " + std::to_string(it->second.data.size()) + " values, expected " +
                  std::to_string(n));
    dst = std::move(it->second.data);
  };
  take("router_weight", L * E * H, h.weight);
  take("router_bias", L * E, h.bias);
  take("score_bias", L * E, h.score_bias);
  if (b.routing.score_bias && h.score_bias.empty())
    throw Error(b.host_path + ": the routing uses a selection bias but score_bias is missing");
  return h;
}

// The outputs checked before the run (it would otherwise fail only at its end): each a file in a
// writable directory, not the other output, not the --routing or an --image input; `b`: nor one of the
// bundle's files.
struct Outputs {
  std::vector<std::pair<const char*, std::string>> paths;  // (option, path)
  std::vector<std::string> ids;

  explicit Outputs(const Args& a) {
    if (!a.json_out.empty()) paths.emplace_back("--json", a.json_out);
    if (!a.events_out.empty()) paths.emplace_back("--events", a.events_out);
    for (const auto& [opt, path] : paths) ids.push_back(check_output_path(opt, path));
    if (paths.size() == 2 && same_output(ids[0], paths[0].second, paths[1].second))
      throw Error("--events " + a.events_out + ": the same file as --json " + a.json_out + "; name two files");
    for (size_t i = 0; i < paths.size(); ++i) {
      if (!a.routing.empty() && same_output(ids[i], paths[i].second, a.routing))
        throw Error(std::string(paths[i].first) + " " + paths[i].second + ": the same file as --routing " + a.routing +
                    ", which it would replace");
      for (const auto& img : a.images)
        if (same_output(ids[i], paths[i].second, img))
          throw Error(std::string(paths[i].first) + " " + paths[i].second + ": the same file as --image " + img +
                      ", which it would replace");
    }
  }

  void check_bundle(const Bundle& b) const {
    std::vector<std::string> names{"manifest.json"};
    for (const auto& kv : b.files) names.push_back(kv.first);
    for (size_t i = 0; i < paths.size(); ++i)
      for (const auto& n : names)
        if (same_output(ids[i], paths[i].second, b.dir + "/" + n))
          throw Error(std::string(paths[i].first) + " " + paths[i].second + ": is the bundle's file '" + n +
                      "', which it would replace; name a file outside the bundle's files");
  }
};

// The bytes of the dense graphs the backend loads: the .pte, or each loaded EPContext model and its binary.
int64_t program_bytes(const Bundle& b, const std::vector<std::string>& methods) {
  if (b.graph_files.empty()) return b.files.count(b.program_file) ? static_cast<int64_t>(b.files.at(b.program_file).size) : 0;
  int64_t n = 0;
  for (const auto& m : methods)
    n += static_cast<int64_t>(b.files.at(b.graph_files.at(m)).size + b.files.at(b.graph_binaries.at(m)).size);
  return n;
}

int main_(int argc, char** argv) {
  const auto t_start = std::chrono::steady_clock::now();
  Args a = parse(argc, argv);
  if (!a.routing.empty()) check_input_file(a.routing, "--routing");  // read later, after the program loads
  const Outputs outputs(a);
  Bundle b = Bundle::open(a.bundle, a.verify_hashes);
  if (!backend_runs_target(b.target))
    throw Error(b.manifest_path + ": a " + b.target + " bundle, and this runner was built for " +
                (backend_runs_target("executorch") ? "executorch" : "qnn and qai-hub") +
                " bundles: build the runner for this bundle (specprefetch runner build " + a.bundle + ")");
  outputs.check_bundle(b);
  auto store = ExpertStore::open(b.store_path);
  check_build(b, *store);
  // text in needs the tokenizer; ids in use it only to decode, so one it cannot load is no error then
  std::unique_ptr<Tokenizer> tokenizer;
  std::string tokenizer_note;
  const bool text_in = std::find(a.is_text.begin(), a.is_text.end(), true) != a.is_text.end();
  if (text_in || (Tokenizer::built_in() && !b.tokenizer_path.empty())) {
    try {
      tokenizer = std::make_unique<Tokenizer>(b.tokenizer_path);
    } catch (const Error& e) {
      if (text_in) throw;
      tokenizer_note = std::string("no text output: ") + e.what();
    }
  }
  for (size_t p = 0; p < a.prompts.size(); ++p)
    if (a.is_text[p]) a.prompts[p] = tokenizer->encode(a.texts[p]);
  if (a.cold) store->drop_cache();
  HostRouters host = load_host(b);
  Isa isa = a.isa.empty() ? best_isa() : isa_from_name(a.isa);
  ExpertExecutor kernel(store->sections, store->matrices, b.family, b.hidden_act, static_cast<float>(b.swiglu_limit), isa);
  if (kernel.hidden_size() != b.hidden_size) throw Error(b.store_path + ": experts of width " + std::to_string(kernel.hidden_size()) + ", the model's is " + std::to_string(b.hidden_size));
  std::vector<std::string> methods;
  if (!a.images.empty() && !b.has_vision)
    throw Error("--image: " + a.bundle + " takes no images (a text-only bundle; a vision-language model exported "
                "with --target executorch or qnn takes them)");
  for (const auto& m : b.methods)  // experts: the runner's own kernels; the vision method only for images
    if (m != "expert" && (m != b.vision.method || !a.images.empty())) methods.push_back(m);
  std::unique_ptr<Backend> backend = open_backend(b, methods, a.threads);
  Backend& exec = *backend;
  // --image: each image decoded and preprocessed as the toolkit does (src/image.h, the bundle's fixed
  // size), through the vision method once; every prompt gets the image blocks before its tokens
  ImagePrompt images;
  if (!a.images.empty()) {
    const Bundle::Vision& V = b.vision;
    ImagePreprocess pre;
    pre.patch_size = V.patch_size, pre.merge_size = V.merge_size, pre.temporal_patch_size = V.temporal_patch_size;
    pre.min_pixels = V.min_pixels, pre.max_pixels = V.max_pixels, pre.rescale_factor = V.rescale_factor;
    for (int c = 0; c < 3; ++c) pre.image_mean[c] = V.image_mean[c], pre.image_std[c] = V.image_std[c];
    pre.fixed_height = V.image_height, pre.fixed_width = V.image_width;
    images.hidden = b.hidden_size, images.tokens = V.tokens, images.taps = V.deepstack_layers;
    for (const auto& path : a.images) {
      const PixelValues px = load_image(path, pre);
      if (px.grid_h != V.grid_h || px.grid_w != V.grid_w)
        throw Error("--image " + path + ": preprocessed to a " + std::to_string(px.grid_h) + "x" +
                    std::to_string(px.grid_w) + " grid, the bundle's vision method takes " + std::to_string(V.grid_h) +
                    "x" + std::to_string(V.grid_w));
      images.embeds.emplace_back();
      images.deepstack.emplace_back();
      exec.vision(V.method, px.values, px.rows, px.cols, images.embeds.back(), images.deepstack.back());
      const size_t n = static_cast<size_t>(V.tokens) * b.hidden_size;
      if (images.embeds.back().size() != n || images.deepstack.back().size() != n * V.deepstack_layers)
        throw Error((b.program_path.empty() ? b.graph_paths.at(V.method) : b.program_path) + ": method '" + V.method +
                    "' returned outputs of the wrong size");
    }
    for (auto& ids : a.prompts) {  // the image blocks, then the prompt's own tokens
      std::vector<int> full;
      for (size_t k = 0; k < a.images.size(); ++k) {
        full.push_back(V.vision_start_token_id);
        full.insert(full.end(), static_cast<size_t>(V.tokens), V.image_token_id);
        full.push_back(V.vision_end_token_id);
      }
      full.insert(full.end(), ids.begin(), ids.end());
      ids.swap(full);
    }
  }

  ModelInfo m;
  m.num_layers = b.num_layers;
  m.moe_layers = b.moe_layers;
  m.routing = rule_of(b.routing);
  m.hidden_size = b.hidden_size;
  m.vocab = b.vocab_size;
  m.eos_token_ids = b.eos_token_ids;
  m.preds_rows = b.preds_rows;
  m.graph_predictor = b.predictor_kind;
  m.max_seq = b.max_seq;
  m.reuse = b.reuse;
  m.next_visits = b.next_visits;
  // host routers (next-gate, fate) and / or the selection bias: whichever host.safetensors holds
  Runner runner(m, exec, *store, kernel, host.weight.empty() && host.score_bias.empty() ? nullptr : &host);

  RunConfig cfg;
  cfg.predictor = b.preds_rows.empty() ? "on-demand" : b.predictor_kind;  // the bundle's own heads by default
  if (!a.policy.empty()) {
    auto plus = a.policy.find('+');
    cfg.predictor = a.policy.substr(0, plus);
    cfg.eviction = plus == std::string::npos || plus + 1 == a.policy.size() ? "lru" : a.policy.substr(plus + 1);
  }
  cfg.pool_mib = std::isnan(a.pool_mib) ? b.pool_mib : a.pool_mib;
  // --pool-mib auto: sized now, with the program loaded (its planned memory, the KV cache, is allocated)
  std::unique_ptr<MemWatch> watch;
  PoolSizing sizing;
  if (a.pool_auto) {
    const std::string root = proc_root();
    const CgroupPaths cg = find_memory_cgroup(root);
    sizing = size_pool(sample_memory(root, cg), a.pool_reserve_mib, a.pool_low_mib, a.pool_high_mib, a.pool_check_ms,
                       program_bytes(b, methods), static_cast<int64_t>(store->slot_bytes), m.routing.top_k,
                       static_cast<int64_t>(m.L()) * m.routing.num_experts);
    cfg.pool_mib = static_cast<double>(sizing.slots * sizing.slot_bytes) / 1048576.0;
    MemWatchConfig wc;
    wc.root = root;
    wc.slot_bytes = sizing.slot_bytes;
    wc.start_slots = sizing.slots;
    wc.min_slots = sizing.min_slots;
    wc.reserve_bytes = sizing.reserve_bytes;
    wc.low_bytes = sizing.low_bytes;
    wc.high_bytes = sizing.high_bytes;
    wc.check_ms = sizing.check_ms;
    watch = std::make_unique<MemWatch>(wc, cg, t_start);
  }
  cfg.window = a.window > 0 ? a.window : b.scheduler.window;
  cfg.queue_depth = a.queue_depth > 0 ? a.queue_depth : b.scheduler.queue_depth;
  cfg.min_confidence = std::isnan(a.min_confidence) ? b.scheduler.min_confidence : a.min_confidence;
  cfg.candidate_threshold = std::isnan(a.candidate_threshold) ? b.scheduler.candidate_threshold : a.candidate_threshold;
  cfg.step_budget_kib = a.step_budget_kib > 0 ? a.step_budget_kib
                        : b.scheduler.step_budget_bytes > 0 ? b.scheduler.step_budget_bytes / 1024 : -1;
  cfg.read_budget_kib = a.read_budget_kib;
  cfg.read_budget_auto = a.read_budget_auto;
  cfg.read_rate_mibs = a.read_rate_mibs;
  cfg.lanes = a.lanes;
  cfg.verify = a.verify;
  cfg.preload = a.preload;
  cfg.prefill_chunk = a.prefill_chunk;
  cfg.next_visit = a.next_visit;
  cfg.max_next_visits = a.max_next_visits;
  cfg.reuse_classes = a.reuse_classes;
  if (cfg.eviction != "lru" && cfg.eviction != "lfu" && cfg.eviction != "prediction" && cfg.eviction != "belady" &&
      cfg.eviction != "reuse")
    throw Error("--policy " + a.policy + ": unknown eviction '" + cfg.eviction +
                "'; choose from lru, lfu, prediction, belady, reuse");
  if (cfg.eviction == "reuse" && b.reuse.empty())
    throw Error("--policy " + a.policy + ": eviction 'reuse' needs the adapter's reuse table (predictor.reuse), which " +
                b.dir + "/manifest.json lacks: train the adapter with this version and export again");
  runner.configure(cfg);

  std::vector<std::vector<std::vector<int>>> recorded;
  if (!a.routing.empty()) {
    recorded = read_routing(a.routing, a.prompts.size(), m.L(), m.routing.top_k, m.routing.num_experts);
    for (size_t p = 0; p < recorded.size(); ++p) {  // a recorded run of this prompt: every position it fed
      const size_t lo = a.prompts[p].size(), hi = a.prompts[p].size() + a.max_new - 1;
      if (recorded[p].size() < lo || recorded[p].size() > hi)
        throw Error(a.routing + ": prompt " + std::to_string(p) + " has " + std::to_string(recorded[p].size()) +
                    " positions of routing; a run of it feeds " + std::to_string(lo) + ".." + std::to_string(hi));
    }
  }
  const double setup_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_start).count();

  EventLog log;
  json runs = json::array();
  if (watch) {  // every pool the runner makes from here on takes its capacity changes from it
    MemWatch::set_active(watch.get());
    watch->start();
  }
  for (size_t p = 0; p < a.prompts.size(); ++p) {
    if (!a.images.empty()) {  // this prompt's M-RoPE positions: the image grids after the image blocks' starts
      const Bundle::Vision& V = b.vision;
      images.starts.clear();
      for (size_t k = 0; k < a.images.size(); ++k) images.starts.push_back(static_cast<int>(k) * (V.tokens + 2) + 1);
      mrope_positions(static_cast<int>(a.prompts[p].size()), images.starts, V.grid_h / V.merge_size,
                      V.grid_w / V.merge_size, images.rope, images.delta);
      runner.set_images(&images);
    }
    Generation g = runner.run(a.prompts[p], a.max_new, a.events_out.empty() ? nullptr : &log,
                              recorded.empty() ? nullptr : &recorded[p]);
    // greedy decoding is deterministic: a recording of this prompt fed exactly these positions
    if (!recorded.empty() && runner.config().needs_future() && recorded[p] != g.routing)
      throw Error(a.routing + ": prompt " + std::to_string(p) + "'s routing is not this run's (" +
                  std::to_string(recorded[p].size()) + " positions recorded, " + std::to_string(g.routing.size()) +
                  " run): record it with the same prompt and --max-new-tokens");
    json r;
    if (a.is_text[p]) r["prompt"] = a.texts[p];
    r["prompt_ids"] = a.prompts[p];
    if (!a.images.empty()) {
      r["images"] = a.images;
      r["image_tokens"] = static_cast<int64_t>(a.images.size()) * (b.vision.tokens + 2);
    }
    r["source"] = a.bundle;
    r["tokens"] = g.tokens;
    if (tokenizer) r["text"] = tokenizer->decode(g.tokens);
    r.update(g.stats.to_json());  // the RunStats keys, in order, after the above
    r["direct_io"] = store->direct();
    r["prefill_ms"] = g.prefill_ms;
    r["first_token_ms"] = g.first_token_ms;
    if (a.preload) r["preload_ms"] = g.preload_ms;
    r["prefill_chunks"] = g.prefill_chunks;
    r["prefill_tokens_per_s"] = g.first_token_ms > 0 ? json(a.prompts[p].size() / (g.first_token_ms / 1e3)) : json(nullptr);
    r["expert_ms_per_call"] = g.expert_ms_per_call;
    r["plan_ms_per_layer"] = g.plan_ms_per_layer;
    r["reads_done"] = g.reads_done;            // timing-dependent: which prefetches were still queued
    r["reads_cancelled"] = g.reads_cancelled;
    r["read_budget"] = read_budget_json(g.read_budget);
    if (exec.accelerator_calls() > 0) {  // the HTP's crossings: up to the first token, per decode token
      r["prefill_graph_calls"] = g.prefill_graph_calls;
      r["decode_graph_calls_per_token"] =
          g.tokens.size() > 1 ? json(static_cast<double>(g.decode_graph_calls) / static_cast<double>(g.tokens.size() - 1))
                              : json(nullptr);
    }
    r["stall_ms"] = g.stall_ms;
    r["bytes_read"] = g.bytes_read;
    r["routing"] = g.routing;
    runs.push_back(r);
    const RunStats& st = g.stats;
    std::fprintf(stderr, "%s: TTFT %.1f ms, TPOT %s ms, stall %s ms/token, hit rate %.3f, %.1f MiB read\n",
                 cfg.name().c_str(), st.ttft_ms, std::isfinite(st.tpot_ms) ? std::to_string(st.tpot_ms).c_str() : "n/a",
                 st.stall_ms_per_token >= 0 ? std::to_string(st.stall_ms_per_token).c_str() : "n/a", st.hit_rate,
                 st.mib_read);
  }
  if (watch) watch->stop();
  json out;
  out["engine"] = "native";
  out["policy"] = cfg.name();
  out["runs"] = runs;
  out["peak_rss_bytes"] = peak_rss_bytes();
  out["load_ms"] = exec.load_ms;
  out["setup_ms"] = setup_ms;
  out["kernel_isa"] = isa_name(kernel.isa());
  out["threads"] = exec.threads;
  out["backend"] = exec.kind();
  out["tokenizer"] = tokenizer ? json(Tokenizer::name()) : json(nullptr);
  if (!tokenizer_note.empty()) out["tokenizer_note"] = tokenizer_note;
  out["direct_io"] = store->direct();
  out["io_note"] = store->io_note();
  out["crc32_impl"] = crc32_impl();
  out["pool_mib"] = cfg.pool_mib;
  if (watch) out["pool_auto"] = pool_auto_json(sizing, *watch);
  out["arena_bytes"] = std::min<int64_t>(cfg.budget_bytes() / static_cast<int64_t>(store->slot_bytes),
                                         static_cast<int64_t>(m.L()) * m.routing.num_experts) *
                       static_cast<int64_t>(store->slot_bytes);
  // generated text can end inside a UTF-8 character: written with U+FFFD there, as transformers decodes it
  const std::string text = out.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
  if (!a.json_out.empty()) write_file_atomic(a.json_out, text);
  else std::cout << text;
  if (!a.events_out.empty()) log.write(a.events_out);
  return 0;
}

}  // namespace
}  // namespace spx

int main(int argc, char** argv) {
  try {
    return spx::main_(argc, argv);
  } catch (const spx::Error& e) {
    std::fprintf(stderr, "specprefetch-runner: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "specprefetch-runner: internal error: %s\n", e.what());
    return 3;
  }
}
