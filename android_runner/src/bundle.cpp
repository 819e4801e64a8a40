// Bundle: manifest.json parsed and validated, every listed file checked (see bundle.h).
#include "bundle.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <set>
#include <sys/stat.h>
#include <unistd.h>

#include "json_checked.h"
#include "sha256.h"

namespace spx {

using jsonc::as_bool;
using jsonc::as_int;
using jsonc::as_int_list;
using jsonc::as_list;
using jsonc::as_num;
using jsonc::as_probability;
using jsonc::as_str;
using jsonc::as_u64;
using jsonc::fail;
using jsonc::field;
using jsonc::json;
using jsonc::optional;
using jsonc::quote;

namespace {

constexpr const char* kFormat = "specprefetch-bundle";
constexpr int64_t kVersion = 1;
constexpr uint64_t kMaxManifestBytes = 64ull << 20;
constexpr uint64_t kMaxConfigBytes = 16ull << 20;
constexpr int kMaxHorizon = 1024;

// A manifest path must name a file inside the bundle: relative, no "..", no NUL.
void check_rel(const std::string& rel, const std::string& where, const std::string& what) {
  bool ok = !rel.empty() && rel.size() <= 4096 && rel[0] != '/' && rel.find('\0') == std::string::npos;
  size_t start = 0;
  while (ok && start <= rel.size()) {
    size_t end = rel.find('/', start);
    if (end == std::string::npos) end = rel.size();
    if (rel.compare(start, end - start, "..") == 0 && end - start == 2) ok = false;
    start = end + 1;
  }
  if (!ok) fail(where, what + " " + quote(rel) + " is not a path inside the bundle");
}

std::string listed(const Bundle& b, const json& v, const std::string& where, const std::string& key) {
  std::string rel = as_str(v, where, key);
  check_rel(rel, where, key);
  if (!b.files.count(rel)) fail(where, key + " " + quote(rel) + " is not among the hashed files");
  return rel;
}

int to_int(int64_t v) { return static_cast<int>(v); }  // callers range-checked v

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A sha256 in hex (64 digits, either case), lowercased; anything else is refused naming `key`.
std::string hex64(std::string sha, const std::string& where, const std::string& key) {
  bool hex = sha.size() == 64;
  for (char& c : sha) {
    if (c >= 'A' && c <= 'F') c = char(c - 'A' + 'a');
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) hex = false;
  }
  if (!hex) fail(where, key + " is not 64 hex digits");
  return sha;
}

// "12" -> 12; anything but 1..9 decimal digits -> -1.
int64_t parse_key(const std::string& s) {
  if (s.empty() || s.size() > 9) return -1;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

}  // namespace

namespace {

// graphs.vision: the image size, grid, token ids and preprocessing of a bundle that takes images.
void parse_vision(Bundle& b, const json& v, const std::string& where) {
  const std::string p = "graphs.vision";
  jsonc::need_object(v, where, p);
  if (!b.mrope) fail(where, p + " is present but kv.rope is not \"mrope\": image prompts need M-RoPE layer graphs");
  auto num = [&](const json& o, const char* key, const std::string& path, int64_t lo, int64_t hi) {
    return as_int(field(o, key, where, path), where, path + "." + key, lo, hi);
  };
  Bundle::Vision& V = b.vision;
  V.method = as_str(field(v, "method", where, p), where, p + ".method");
  if (std::find(b.methods.begin(), b.methods.end(), V.method) == b.methods.end())
    fail(where, p + ".method " + quote(V.method) + " is not one of " +
                    (b.target == "executorch" ? "graphs.methods" : "the graphs of graphs.files"));
  const std::vector<int64_t> size = as_int_list(field(v, "image_size", where, p), where, p + ".image_size", 1, 1 << 14);
  const std::vector<int64_t> grid = as_int_list(field(v, "grid_thw", where, p), where, p + ".grid_thw", 1, 1 << 12);
  if (size.size() != 2 || grid.size() != 3 || grid[0] != 1) fail(where, p + ": image_size [h, w] and grid_thw [1, gh, gw]");
  V.image_height = to_int(size[0]), V.image_width = to_int(size[1]);
  V.grid_h = to_int(grid[1]), V.grid_w = to_int(grid[2]);
  V.tokens = to_int(num(v, "tokens", p, 1, 1 << 20));
  V.deepstack_layers = to_int(num(v, "deepstack_layers", p, 0, b.num_layers));
  V.image_token_id = to_int(num(v, "image_token_id", p, 0, b.vocab_size - 1));
  V.vision_start_token_id = to_int(num(v, "vision_start_token_id", p, 0, b.vocab_size - 1));
  V.vision_end_token_id = to_int(num(v, "vision_end_token_id", p, 0, b.vocab_size - 1));
  if (const json* pr = optional(v, "precision", where, p)) {  // absent: a bundle from before the field (fp32)
    const std::string prec = as_str(*pr, where, p + ".precision");
    if (prec != "fp32" && prec != "fp16") fail(where, p + ".precision " + quote(prec) + ": expected fp32 or fp16");
  }
  const std::string pp = p + ".preprocess";
  const json& pre = field(v, "preprocess", where, p);
  jsonc::need_object(pre, where, pp);
  const std::string resize = as_str(field(pre, "resize", where, pp), where, pp + ".resize");
  if (resize != "bicubic") fail(where, pp + ".resize " + quote(resize) + ": only bicubic is implemented");
  V.patch_size = to_int(num(pre, "patch_size", pp, 1, 1024));
  V.merge_size = to_int(num(pre, "merge_size", pp, 1, 64));
  V.temporal_patch_size = to_int(num(pre, "temporal_patch_size", pp, 1, 64));
  V.min_pixels = num(pre, "min_pixels", pp, 1, int64_t{1} << 40);
  V.max_pixels = num(pre, "max_pixels", pp, 1, int64_t{1} << 40);
  V.rescale_factor = as_num(field(pre, "rescale_factor", where, pp), where, pp + ".rescale_factor");
  for (const char* key : {"image_mean", "image_std"}) {
    const json& a = as_list(field(pre, key, where, pp), where, pp + "." + key);
    if (a.size() != 3) fail(where, pp + "." + key + " must list 3 channels");
    for (int c = 0; c < 3; ++c)
      (std::string(key) == "image_mean" ? V.image_mean : V.image_std)[c] =
          as_num(a[static_cast<size_t>(c)], where, pp + "." + key + "[" + std::to_string(c) + "]");
  }
  if (!(V.rescale_factor > 0) || !std::isfinite(V.rescale_factor)) fail(where, pp + ".rescale_factor must be above 0");
  for (int c = 0; c < 3; ++c)
    if (V.image_std[c] == 0 || !std::isfinite(V.image_std[c]) || !std::isfinite(V.image_mean[c]))
      fail(where, pp + ".image_mean and image_std must be finite, image_std nonzero");
  const int unit = V.patch_size * V.merge_size;
  if (V.grid_h * V.patch_size != V.image_height || V.grid_w * V.patch_size != V.image_width ||
      V.image_height % unit || V.image_width % unit ||
      static_cast<int64_t>(V.grid_h / V.merge_size) * (V.grid_w / V.merge_size) != V.tokens ||
      static_cast<int64_t>(V.image_height) * V.image_width < V.min_pixels ||
      static_cast<int64_t>(V.image_height) * V.image_width > V.max_pixels)
    fail(where, p + ": image_size, grid_thw, merge_size, tokens and the pixel bounds disagree");
  b.has_vision = true;
}

}  // namespace

Bundle parse_manifest(const std::string& text, const std::string& where) {
  Bundle b;
  b.manifest_path = where;
  json j = jsonc::parse(text, where, "manifest");
  jsonc::need_object(j, where, "");

  // format, version, target first: a foreign file or a bundle for another runner is named as such
  auto fmt = j.find("format");
  if (fmt == j.end() || !fmt->is_string() || fmt->get<std::string>() != kFormat)
    fail(where, std::string("format ") + (fmt == j.end() ? "missing" : fmt->is_string() ? quote(fmt->get<std::string>()) : jsonc::type_of(*fmt)) +
                    ", expected '" + kFormat + "' (not a specprefetch bundle)");
  const json& ver = field(j, "version", where, "");
  if (!(ver.is_number_integer() || ver.is_number_unsigned()) || !(ver.is_number_unsigned() ? ver.get<uint64_t>() == uint64_t(kVersion) : ver.get<int64_t>() == kVersion)) {
    std::string got = (ver.is_number_integer() || ver.is_number_unsigned()) ? ver.dump() : jsonc::type_of(ver);
    fail(where, "bundle version " + jsonc::one_line(got, 40) + "; this runner reads version " + std::to_string(kVersion));
  }
  b.target = as_str(field(j, "target", where, ""), where, "target");
  if (b.target != "executorch" && b.target != "qnn" && b.target != "qai-hub")
    fail(where, "target " + quote(b.target) + ": the native runner runs executorch, qnn and qai-hub bundles");

  // files first: every other path must be among them
  const json& files = field(j, "files", where, "");
  if (!files.is_object() || files.empty()) fail(where, "'files' must map paths to sizes and hashes");
  for (auto it = files.begin(); it != files.end(); ++it) {
    const std::string& rel = it.key();
    check_rel(rel, where, "files entry");
    std::string key = "files[" + quote(rel) + "]";
    FileEntry fe;
    fe.size = as_u64(field(it.value(), "size", where, key), where, key + ".size");
    fe.sha256 = hex64(as_str(field(it.value(), "sha256", where, key), where, key + ".sha256"), where, key + ".sha256");
    b.files[rel] = fe;
  }

  // model
  const json& model = field(j, "model", where, "");
  b.family = as_str(field(model, "family", where, "model"), where, "model.family");
  if (const json* v = optional(model, "model_type", where, "model")) b.model_type = as_str(*v, where, "model.model_type");
  else b.model_type = b.family;
  if (const json* v = optional(model, "config_hash", where, "model")) b.config_hash = as_str(*v, where, "model.config_hash");
  b.num_layers = to_int(as_int(field(model, "num_layers", where, "model"), where, "model.num_layers", 1, 1 << 16));
  b.hidden_size = to_int(as_int(field(model, "hidden_size", where, "model"), where, "model.hidden_size", 1, 1 << 20));
  b.vocab_size = to_int(as_int(field(model, "vocab_size", where, "model"), where, "model.vocab_size", 1, 1 << 26));
  b.num_experts = to_int(as_int(field(model, "num_experts", where, "model"), where, "model.num_experts", 1, 1 << 16));
  b.top_k = to_int(as_int(field(model, "top_k", where, "model"), where, "model.top_k", 1, b.num_experts));
  for (int64_t l : as_int_list(field(model, "moe_layers", where, "model"), where, "model.moe_layers", 0, b.num_layers - 1)) {
    if (!b.moe_layers.empty() && l <= b.moe_layers.back())
      fail(where, "model.moe_layers must be increasing (" + std::to_string(l) + " after " + std::to_string(b.moe_layers.back()) + ")");
    b.moe_layers.push_back(to_int(l));
  }
  if (b.moe_layers.empty()) fail(where, "model.moe_layers is empty (no MoE layer)");
  b.config_file = listed(b, field(model, "config", where, "model"), where, "model.config");

  // routing
  const json& r = field(j, "routing", where, "");
  Routing& R = b.routing;
  R.num_experts = to_int(as_int(field(r, "num_experts", where, "routing"), where, "routing.num_experts", 1, 1 << 16));
  R.top_k = to_int(as_int(field(r, "top_k", where, "routing"), where, "routing.top_k", 1, R.num_experts));
  if (R.num_experts != b.num_experts || R.top_k != b.top_k)
    fail(where, "routing.num_experts/top_k (" + std::to_string(R.num_experts) + ", " + std::to_string(R.top_k) +
                    ") differ from model.num_experts/top_k (" + std::to_string(b.num_experts) + ", " + std::to_string(b.top_k) + ")");
  if (const json* v = optional(r, "score_func", where, "routing")) R.score_func = as_str(*v, where, "routing.score_func");
  if (R.score_func != "softmax" && R.score_func != "sigmoid")
    fail(where, "routing.score_func " + quote(R.score_func) + ": expected 'softmax' or 'sigmoid'");
  if (const json* v = optional(r, "topk_before_softmax", where, "routing")) R.topk_before_softmax = as_bool(*v, where, "routing.topk_before_softmax");
  if (const json* v = optional(r, "norm_topk_prob", where, "routing")) R.norm_topk_prob = as_bool(*v, where, "routing.norm_topk_prob");
  if (const json* v = optional(r, "routed_scaling_factor", where, "routing")) {
    R.routed_scaling_factor = as_num(*v, where, "routing.routed_scaling_factor");
    if (!(R.routed_scaling_factor > 0)) fail(where, "routing.routed_scaling_factor must be > 0");
  }
  if (const json* v = optional(r, "n_group", where, "routing")) R.n_group = to_int(as_int(*v, where, "routing.n_group", 0, R.num_experts));
  if (const json* v = optional(r, "topk_group", where, "routing")) R.topk_group = to_int(as_int(*v, where, "routing.topk_group", 0, R.num_experts));
  if (R.n_group > 1) {
    if (R.num_experts % R.n_group != 0)
      fail(where, "routing.n_group " + std::to_string(R.n_group) + " does not divide num_experts " + std::to_string(R.num_experts));
    if (R.topk_group < 1 || R.topk_group > R.n_group)
      fail(where, "routing.topk_group " + std::to_string(R.topk_group) + " must be in 1..n_group (" + std::to_string(R.n_group) + ")");
    if (int64_t(R.topk_group) * (R.num_experts / R.n_group) < R.top_k)
      fail(where, "routing.topk_group " + std::to_string(R.topk_group) + " groups hold fewer than top_k experts");
  }
  if (const json* v = optional(r, "group_score", where, "routing")) R.group_score = as_str(*v, where, "routing.group_score");
  if (R.group_score != "max" && R.group_score != "top2sum")
    fail(where, "routing.group_score " + quote(R.group_score) + ": expected 'max' or 'top2sum'");
  if (const json* v = optional(r, "score_bias", where, "routing")) R.score_bias = as_bool(*v, where, "routing.score_bias");

  // end of sequence
  const json* eos = optional(j, "eos_token_ids", where, "");
  std::string eos_key = "eos_token_ids";
  if (!eos) { eos = optional(j, "eos_token_id", where, ""); eos_key = "eos_token_id"; }
  if (eos) {
    if (eos->is_array()) {
      for (int64_t id : as_int_list(*eos, where, eos_key, 0, INT32_MAX)) b.eos_token_ids.push_back(to_int(id));
    } else {
      b.eos_token_ids.push_back(to_int(as_int(*eos, where, eos_key, 0, INT32_MAX)));
    }
  }

  // kv
  const json& kv = field(j, "kv", where, "");
  b.kv_mode = as_str(field(kv, "mode", where, "kv"), where, "kv.mode");
  b.max_seq = to_int(as_int(field(kv, "max_seq", where, "kv"), where, "kv.max_seq", 1, 1 << 24));
  if (const json* v = optional(kv, "mask_value", where, "kv")) b.kv_mask_value = as_num(*v, where, "kv.mask_value");
  if (const json* v = optional(kv, "rope", where, "kv")) {
    const std::string rope = as_str(*v, where, "kv.rope");
    if (rope != "1d" && rope != "mrope") fail(where, "kv.rope is '" + rope + "': expected 1d or mrope");
    b.mrope = rope == "mrope";
  }
  if (const json* v = optional(kv, "layers", where, "kv")) {
    as_list(*v, where, "kv.layers");
    if (v->size() != size_t(b.num_layers))
      fail(where, "kv.layers lists " + std::to_string(v->size()) + " layers, model.num_layers is " + std::to_string(b.num_layers));
    for (size_t i = 0; i < v->size(); ++i) {
      std::string key = "kv.layers[" + std::to_string(i) + "]";
      KvLayer kl;
      kl.k = as_int_list(field((*v)[i], "k", where, key), where, key + ".k", 0, 1 << 30);
      kl.v = as_int_list(field((*v)[i], "v", where, key), where, key + ".v", 0, 1 << 30);
      if (const json* w = optional((*v)[i], "window", where, key)) kl.window = to_int(as_int(*w, where, key + ".window", 0, INT32_MAX));
      b.kv_layers.push_back(std::move(kl));
    }
  }

  // predictor
  const json& pred = field(j, "predictor", where, "");
  b.predictor_kind = as_str(field(pred, "kind", where, "predictor"), where, "predictor.kind");
  if (const json* v = optional(pred, "horizons", where, "predictor"))
    for (int64_t h : as_int_list(*v, where, "predictor.horizons", 1, kMaxHorizon)) b.horizons.push_back(to_int(h));
  if (const json* v = optional(pred, "preds_rows", where, "predictor")) {
    jsonc::need_object(*v, where, "predictor.preds_rows");
    for (auto it = v->begin(); it != v->end(); ++it) {
      std::string key = "predictor.preds_rows[" + quote(it.key()) + "]";
      int64_t layer = parse_key(it.key());
      int pos = -1;
      for (size_t i = 0; i < b.moe_layers.size(); ++i)
        if (b.moe_layers[i] == layer) pos = int(i);
      if (pos < 0) fail(where, key + ": not an MoE layer number (model.moe_layers)");
      std::vector<int> hs;
      for (int64_t h : as_int_list(it.value(), where, key, 1, kMaxHorizon)) {
        for (int seen : hs)
          if (seen == h) fail(where, key + " lists horizon " + std::to_string(h) + " twice");
        hs.push_back(to_int(h));
      }
      b.preds_rows[pos] = std::move(hs);
    }
  }
  if (const json* v = optional(pred, "reuse", where, "predictor"); v != nullptr && !v->is_null()) {
    jsonc::need_object(*v, where, "predictor.reuse");
    ReuseTable& t = b.reuse;
    t.bits = to_int(as_int(field(*v, "bits", where, "predictor.reuse"), where, "predictor.reuse.bits", 1, 16));
    const int64_t cap = as_int(field(*v, "cap", where, "predictor.reuse"), where, "predictor.reuse.cap", 1, 1 << 20);
    as_int(field(*v, "scale", where, "predictor.reuse"), where, "predictor.reuse.scale", 16, 16);  // 16 only
    const size_t n = size_t{1} << t.bits;
    auto table = [&](const json& x, const std::string& path) {
      std::vector<int64_t> out = as_int_list(x, where, path, 16, 16 * cap);
      if (out.size() != n) fail(where, path + " must hold 2^bits values");
      return out;
    };
    t.visits16 = table(field(*v, "visits16", where, "predictor.reuse"), "predictor.reuse.visits16");
    // frequency classes (adapters/reuse.py): both or neither; a class id per MoE layer and expert
    const json* cls = optional(*v, "classes", where, "predictor.reuse");
    const json* ct = optional(*v, "class_visits16", where, "predictor.reuse");
    if ((cls != nullptr && !cls->is_null()) != (ct != nullptr && !ct->is_null()))
      fail(where, "predictor.reuse.classes and predictor.reuse.class_visits16 come together");
    if (cls != nullptr && !cls->is_null()) {
      as_list(*ct, where, "predictor.reuse.class_visits16");
      if (ct->empty() || ct->size() > 64) fail(where, "predictor.reuse.class_visits16 must hold 1..64 tables");
      for (size_t c = 0; c < ct->size(); ++c)
        t.class_visits16.push_back(table((*ct)[c], "predictor.reuse.class_visits16[" + std::to_string(c) + "]"));
      as_list(*cls, where, "predictor.reuse.classes");
      if (cls->size() != b.moe_layers.size())
        fail(where, "predictor.reuse.classes must hold a list per MoE layer (" + std::to_string(b.moe_layers.size()) + ")");
      for (size_t li = 0; li < cls->size(); ++li) {
        const std::string path = "predictor.reuse.classes[" + std::to_string(li) + "]";
        std::vector<int> row;
        for (int64_t c : as_int_list((*cls)[li], where, path, 0, static_cast<int64_t>(ct->size()) - 1))
          row.push_back(to_int(c));
        if (row.size() != static_cast<size_t>(b.num_experts))
          fail(where, path + " must hold a class per expert (" + std::to_string(b.num_experts) + ")");
        t.classes.push_back(std::move(row));
      }
    }
  }
  if (const json* v = optional(pred, "next_visits", where, "predictor"))
    b.next_visits = to_int(as_int(*v, where, "predictor.next_visits", 0, kMaxNextVisits));
  else if (const json* old = optional(pred, "next_visit", where, "predictor"))  // exported before next_visits
    b.next_visits = as_bool(*old, where, "predictor.next_visit") ? 1 : 0;
  const int L = static_cast<int>(b.moe_layers.size());
  for (size_t i = 0; i < b.moe_layers.size() && b.next_visits > 0; ++i)
    for (int jl = L; jl <= b.next_visits * L; jl += L) {
      auto it = b.preds_rows.find(static_cast<int>(i));
      if (it == b.preds_rows.end() || std::find(it->second.begin(), it->second.end(), jl) == it->second.end())
        fail(where, "predictor.next_visits is " + std::to_string(b.next_visits) + " but predictor.preds_rows[" +
                        quote(std::to_string(b.moe_layers[i])) + "] lacks horizon " + std::to_string(jl) +
                        " (its next visits' rows: " + std::to_string(L) + ".." + std::to_string(b.next_visits * L) +
                        ")");
    }

  // runtime
  const json& rt = field(j, "runtime", where, "");
  b.pool_mib = as_num(field(rt, "pool_mib", where, "runtime"), where, "runtime.pool_mib");
  if (!(b.pool_mib > 0) || b.pool_mib > double(1 << 24))
    fail(where, "runtime.pool_mib must be > 0 (and at most 16 TiB)");
  b.store_file = listed(b, field(rt, "expert_store", where, "runtime"), where, "runtime.expert_store");
  for (auto [key, dst] : {std::pair<const char*, std::string*>{"expert_store_source", &b.store_source},
                          {"expert_store_index_sha256", &b.store_index_sha256}}) {
    const std::string k = std::string("runtime.") + key;
    const json* v = optional(rt, key, where, "runtime");
    if (!v)
      fail(where, k + " missing (a bundle exported before specprefetch recorded its expert store's identity): "
                      "export it again");
    *dst = hex64(as_str(*v, where, k), where, k);
  }
  if (const json* s = optional(rt, "scheduler", where, "runtime")) {
    jsonc::need_object(*s, where, "runtime.scheduler");
    SchedulerDefaults& S = b.scheduler;
    const std::string p = "runtime.scheduler";
    if (const json* v = optional(*s, "window", where, p)) S.window = to_int(as_int(*v, where, p + ".window", 1, kMaxHorizon));
    if (const json* v = optional(*s, "queue_depth", where, p)) S.queue_depth = to_int(as_int(*v, where, p + ".queue_depth", 1, 1 << 20));
    if (const json* v = optional(*s, "min_confidence", where, p)) S.min_confidence = as_probability(*v, where, p + ".min_confidence");
    // `floor`: candidate_threshold's name in bundles exported before the rename (checked wherever present,
    // as the Python side checks it; candidate_threshold wins when both are there)
    if (const json* v = optional(*s, "floor", where, p)) S.candidate_threshold = as_probability(*v, where, p + ".floor");
    if (const json* v = optional(*s, "candidate_threshold", where, p))
      S.candidate_threshold = as_probability(*v, where, p + ".candidate_threshold");
    if (const json* v = optional(*s, "step_budget_bytes", where, p)) S.step_budget_bytes = as_int(*v, where, p + ".step_budget_bytes", 0, INT64_MAX);
    if (const json* v = optional(*s, "candidates", where, p)) S.candidates = to_int(as_int(*v, where, p + ".candidates", 1, b.num_experts));
    if (const json* v = optional(*s, "prefetch", where, p)) S.prefetch = as_bool(*v, where, p + ".prefetch");
  }

  // graphs
  const json& g = field(j, "graphs", where, "");
  std::string gformat = b.target == "executorch" ? "executorch" : "qnn-context-binary";
  if (const json* v = optional(g, "format", where, "graphs")) {
    std::string f = as_str(*v, where, "graphs.format");
    if (f != gformat) fail(where, "graphs.format " + quote(f) + ": a " + b.target + " bundle's graphs are " + gformat);
  }
  if (b.target == "executorch") {
    b.program_file = listed(b, field(g, "file", where, "graphs"), where, "graphs.file");
    const json& methods = as_list(field(g, "methods", where, "graphs"), where, "graphs.methods");
    for (size_t i = 0; i < methods.size(); ++i) b.methods.push_back(as_str(methods[i], where, "graphs.methods[" + std::to_string(i) + "]"));
    if (const json* v = optional(g, "vision", where, "graphs")) parse_vision(b, *v, where);
  } else {  // qnn / qai-hub: an EPContext model per graph, its context binary beside it
    const json& gf = field(g, "files", where, "graphs");
    const json& gb = field(g, "binaries", where, "graphs");
    if (!gf.is_object() || !gb.is_object()) fail(where, "graphs.files and graphs.binaries must map graph names to files");
    for (auto it = gf.begin(); it != gf.end(); ++it) {
      const std::string key = "graphs.files." + it.key();
      b.graph_files[it.key()] = listed(b, it.value(), where, key);
      auto bin = gb.find(it.key());
      if (bin == gb.end()) fail(where, "graphs.binaries has no binary for graph " + quote(it.key()));
      const std::string& rel_bin = b.graph_binaries[it.key()] = listed(b, *bin, where, "graphs.binaries." + it.key());
      const std::string& rel = b.graph_files[it.key()];
      // the EPContext model names its binary by file name: it must lie beside the model
      if (!ends_with(rel, "_ctx.onnx") || rel_bin != rel.substr(0, rel.size() - 5) + "_qnn.bin")
        fail(where, "graph " + quote(it.key()) + ": its binary " + quote(rel_bin) + " is not beside " + quote(rel));
      b.methods.push_back(it.key());
    }
    if (const json* v = optional(g, "vision", where, "graphs")) parse_vision(b, *v, where);
    if (const json* e = optional(g, "embedding", where, "graphs")) {
      jsonc::need_object(*e, where, "graphs.embedding");
      b.embedding_file = listed(b, field(*e, "file", where, "graphs.embedding"), where, "graphs.embedding.file");
    } else if (gf.find("embed") == gf.end()) {
      fail(where, "graphs has neither an embed graph nor an embedding table (graphs.embedding)");
    }
  }
  if (b.methods.empty()) fail(where, "the bundle lists no graphs");

  // host tensors, tokenizer, quantization
  if (const json* v = optional(j, "host_file", where, "")) b.host_file = listed(b, *v, where, "host_file");
  if (const json* v = optional(j, "tokenizer", where, "")) {
    as_list(*v, where, "tokenizer");
    for (size_t i = 0; i < v->size(); ++i) {
      std::string rel = listed(b, (*v)[i], where, "tokenizer[" + std::to_string(i) + "]");
      if (b.tokenizer_file.empty() && ends_with(rel, "tokenizer.json")) b.tokenizer_file = rel;
    }
  }
  if (const json* q = optional(j, "quantization", where, ""))
    if (const json* v = optional(*q, "experts", where, "quantization")) b.expert_dtype = as_str(*v, where, "quantization.experts");
  return b;
}

void parse_model_config(Bundle& b, const std::string& text, const std::string& where) {
  json j = jsonc::parse(text, where, "model config");
  jsonc::need_object(j, where, "");
  const json* tc = &j;
  std::string mt;
  if (const json* v = optional(j, "model_type", where, "")) mt = v->is_string() ? v->get<std::string>() : "";
  if (b.family == "qwen3_vl_moe" || b.model_type == "qwen3_vl_moe" || mt == "qwen3_vl_moe") {
    tc = &field(j, "text_config", where, "");
    jsonc::need_object(*tc, where, "text_config");
  }
  std::string path = tc == &j ? "" : "text_config";
  if (const json* v = optional(*tc, "hidden_act", where, path)) b.hidden_act = as_str(*v, where, jsonc::join(path, "hidden_act"));
  if (const json* v = optional(*tc, "swiglu_limit", where, path)) {
    b.swiglu_limit = as_num(*v, where, jsonc::join(path, "swiglu_limit"));
    if (!(b.swiglu_limit > 0)) fail(where, jsonc::join(path, "swiglu_limit") + " must be > 0");
  }
}

namespace {

// Reads the regular file open on `fd` (at most max_bytes); closes fd; errors name `path`.
std::string read_fd_text(int fd, const std::string& path, uint64_t max_bytes) {
  std::string out;
  try {
    struct stat st;
    if (::fstat(fd, &st) != 0) throw Error(jsonc::one_line(path + ": cannot stat (" + std::strerror(errno) + ")"));
    if (!S_ISREG(st.st_mode)) throw Error(jsonc::one_line(path + ": not a regular file"));
    if (uint64_t(st.st_size) > max_bytes)
      throw Error(jsonc::one_line(path + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                                  std::to_string(max_bytes) + " read at most"));
    char buf[65536];
    for (;;) {
      ssize_t r = ::read(fd, buf, sizeof buf);
      if (r < 0) {
        if (errno == EINTR) continue;
        throw Error(jsonc::one_line(path + ": read failed (" + std::strerror(errno) + ")"));
      }
      if (r == 0) break;
      if (out.size() + size_t(r) > max_bytes) throw Error(jsonc::one_line(path + ": grew while being read"));
      out.append(buf, size_t(r));
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return out;
}

uint32_t le32(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }
uint64_t le64(const uint8_t* p) { return uint64_t(le32(p)) | uint64_t(le32(p + 4)) << 32; }

// pread all of [off, off + n) of `fd` into `dst`; false on an error or end of file.
bool pread_all(int fd, uint8_t* dst, size_t n, uint64_t off) {
  while (n > 0) {
    ssize_t r = ::pread(fd, dst, n, off_t(off));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    dst += r, n -= size_t(r), off += uint64_t(r);
  }
  return true;
}

// The bundle's store is the one it was exported with: its header (128 bytes) and its index +
// metadata block hash to the manifest's runtime.expert_store_index_sha256 (the blobs are not read,
// but the index holds every blob's CRC-32, checked on each read). A store whose header does not
// place that block inside the file is left to ExpertStore::open, which names the damage.
void check_store_identity(const Bundle& b) {
  int fd = ::open(b.store_path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw Error(jsonc::one_line(b.store_path + ": cannot open (" + std::strerror(errno) + ")"));
  std::vector<uint8_t> head(128), body;
  bool readable = false;
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size >= 128 && pread_all(fd, head.data(), head.size(), 0)) {
    const uint64_t L = le32(&head[16]), E = le32(&head[20]), meta_len = le32(&head[44]), index_offset = le64(&head[48]);
    const uint64_t body_len = 32 * L * E + meta_len;  // L, E < 2^32: no overflow in 64 bits
    const bool inside = L <= (1u << 16) && E <= (1u << 16) && meta_len <= (64u << 20) && index_offset >= 128 &&
                        index_offset <= uint64_t(st.st_size) && body_len <= uint64_t(st.st_size) - index_offset;
    // every entry implies a blob slot of at least 4096 bytes: an index larger than that is no store of
    // this bundle, and is refused here (not left to ExpertStore::open, whose bounds are the format's)
    if (inside && 32 * L * E > uint64_t(st.st_size) / 128) {
      ::close(fd);
      throw Error(jsonc::one_line(b.store_path + ": not the expert store the bundle was exported with (an index of " +
                                  std::to_string(L) + " x " + std::to_string(E) + " entries cannot have its blobs in " +
                                  std::to_string(st.st_size) + " bytes)"));
    }
    if (inside) {
      body.resize(size_t(body_len));
      readable = pread_all(fd, body.data(), body.size(), index_offset);
    }
  }
  ::close(fd);
  if (!readable) return;
  Sha256 h;
  h.update(head.data(), head.size());
  h.update(body.data(), body.size());
  if (h.hexdigest() == b.store_index_sha256) return;
  // name the cause where the metadata says it: the weights it was built from
  const uint64_t meta_len = le32(&head[44]);
  std::string source;
  try {
    json meta = jsonc::parse(std::string(body.end() - ptrdiff_t(meta_len), body.end()), b.store_path, "metadata");
    source = meta.at("source").at("digest").get<std::string>();
  } catch (const std::exception&) {
  }
  if (!source.empty() && source != b.store_source)
    throw Error(jsonc::one_line(b.store_path + ": expert store built from other weights (source digest " +
                                source.substr(0, 16) + "...) than the bundle was exported with (" +
                                b.store_source.substr(0, 16) + "...): another store was put in its place; export again"));
  throw Error(jsonc::one_line(b.store_path + ": not the expert store the bundle was exported with (its header, index "
                              "and metadata do not hash to the manifest's runtime.expert_store_index_sha256): "
                              "damaged, rebuilt or replaced"));
}

}  // namespace

std::string read_text_file(const std::string& path, uint64_t max_bytes) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw Error(jsonc::one_line(path + ": cannot open (" + std::strerror(errno) + ")"));
  return read_fd_text(fd, path, max_bytes);
}

Bundle Bundle::open(const std::string& dir_in, bool verify_hashes) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty()) dir = ".";
  const std::string where = dir + "/manifest.json";
  auto sys = [&](const std::string& who, const std::string& what) {
    throw Error(jsonc::one_line(who + ": " + what + " (" + std::strerror(errno) + ")"));
  };

  char buf[PATH_MAX];
  if (!::realpath(dir.c_str(), buf)) sys(dir, "not a bundle directory");
  const std::string root = buf;
  struct stat st;
  if (::stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw Error(jsonc::one_line(dir + ": not a bundle directory"));
  if (::lstat(where.c_str(), &st) != 0) {
    if (errno == ENOENT) throw Error(jsonc::one_line(where + ": missing (not a specprefetch bundle)"));
    sys(where, "cannot stat");
  }
  if (S_ISLNK(st.st_mode)) throw Error(jsonc::one_line(where + ": is a symlink; a bundle's manifest must be a regular file"));
  if (!S_ISREG(st.st_mode)) throw Error(jsonc::one_line(where + ": not a regular file"));
  // O_NOFOLLOW: a symlink swapped in since the lstat is refused too (ELOOP)
  int mfd = ::open(where.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (mfd < 0) {
    if (errno == ELOOP) throw Error(jsonc::one_line(where + ": is a symlink; a bundle's manifest must be a regular file"));
    sys(where, "cannot open");
  }
  std::string text = read_fd_text(mfd, where, kMaxManifestBytes);
  Bundle b = parse_manifest(text, where);
  b.dir = root;

  std::map<std::string, std::string> resolved;
  for (const auto& [rel, fe] : b.files) {
    std::string p = root + "/" + rel;
    if (::lstat(p.c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) fail(where, "lists " + quote(rel) + ", which is missing");
      sys(p, "cannot stat");
    }
    if (!::realpath(p.c_str(), buf)) {
      if (errno == ENOENT || errno == ENOTDIR) fail(where, "lists " + quote(rel) + ", which is missing (dangling symlink?)");
      sys(p, "cannot resolve");
    }
    std::string real = buf;
    const std::string prefix = root == "/" ? root : root + "/";
    if (real.compare(0, prefix.size(), prefix) != 0 || real.size() <= prefix.size())
      fail(where, "file " + quote(rel) + " resolves outside the bundle");
    if (::stat(real.c_str(), &st) != 0) sys(real, "cannot stat");
    if (!S_ISREG(st.st_mode)) fail(where, "file " + quote(rel) + " is not a regular file");
    int fd = ::open(real.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) sys(real, "cannot open");
    try {
      if (::fstat(fd, &st) != 0) sys(real, "cannot stat");
      if (!S_ISREG(st.st_mode)) fail(where, "file " + quote(rel) + " is not a regular file");
      if (uint64_t(st.st_size) != fe.size)
        fail(where, quote(rel) + " is " + std::to_string(st.st_size) + " bytes, the manifest says " +
                        std::to_string(fe.size) + " (truncated or modified?)");
      // without verify_hashes only the store goes unhashed: the program is hashed on every start
      if (verify_hashes || rel != b.store_file || rel == b.program_file) {
        uint64_t n = 0;
        std::string got = sha256_fd(fd, real, &n);
        if (n != fe.size || got != fe.sha256) fail(where, "sha256 mismatch for " + quote(rel) + " (tampered or truncated?)");
      }
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    resolved[rel] = real;
  }
  if (!b.program_file.empty()) b.program_path = resolved.at(b.program_file);
  for (const auto& [name, rel] : b.graph_files) b.graph_paths[name] = resolved.at(rel);
  b.store_path = resolved.at(b.store_file);
  check_store_identity(b);
  b.config_path = resolved.at(b.config_file);
  if (!b.host_file.empty()) b.host_path = resolved.at(b.host_file);
  if (!b.embedding_file.empty()) b.embedding_path = resolved.at(b.embedding_file);
  if (!b.tokenizer_file.empty()) b.tokenizer_path = resolved.at(b.tokenizer_file);
  parse_model_config(b, read_text_file(b.config_path, kMaxConfigBytes), b.config_path);
  return b;
}

}  // namespace spx
