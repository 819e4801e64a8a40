// A bundle directory written by `specprefetch export --target executorch` (export/bundle.py,
// export/manifest.py): its manifest, validated, and the absolute paths of the files the native
// runner opens. Every refusal is an spx::Error of one line naming the file (manifest.json, and the
// key or listed file at fault).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common.h"

namespace spx {

// The manifest's "routing" block (toolkit.models.families.base.RoutingSpec).
struct Routing {
  int num_experts = 0;
  int top_k = 0;
  std::string score_func = "softmax";  // "softmax" or "sigmoid"
  bool topk_before_softmax = false;    // GPT-OSS: top-k on logits, then softmax over the k
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  int n_group = 0;                     // 0 when null (no group-limited top-k)
  int topk_group = 0;                  // 0 when null
  std::string group_score = "max";     // "max" or "top2sum"
  bool score_bias = false;             // host.safetensors holds score_bias [L, E]
};

// runtime.scheduler defaults (toolkit.runtime.scheduler.SchedulerConfig).
struct SchedulerDefaults {
  int window = 2;                    // >= 1
  int queue_depth = 4;               // >= 1
  double min_confidence = 0.02;
  double candidate_threshold = 0.0;
  int64_t step_budget_bytes = -1;    // -1: unbounded (null in the manifest)
  int candidates = 0;                // 0: top-k (null in the manifest)
  bool prefetch = true;
};

// One KV cache of kv.layers (shapes as the graphs use them; window 0 = full attention).
struct KvLayer {
  std::vector<int64_t> k, v;
  int window = 0;
};

struct FileEntry {
  uint64_t size = 0;
  std::string sha256;  // 64 lowercase hex digits
};

struct Bundle {
  std::string dir;            // absolute, symlinks resolved (empty from parse_manifest)
  std::string manifest_path;  // as named in messages: <dir as given>/manifest.json
  std::string target;         // "executorch", "qnn" or "qai-hub" (anything else is refused)
  std::string family, model_type, config_hash;
  int num_layers = 0;
  std::vector<int> moe_layers;  // layer numbers of the MoE layers, increasing, < num_layers
  int hidden_size = 0, vocab_size = 0, num_experts = 0, top_k = 0;
  Routing routing;
  std::vector<int> eos_token_ids;  // "eos_token_ids", else "eos_token_id" (int, list or null)
  int max_seq = 0;                 // kv.max_seq
  std::string kv_mode;             // kv.mode ("buffer": caches inside the program; "io")
  double kv_mask_value = -10000.0; // kv.mask_value when present
  // graphs.vision (a vision-language bundle that takes images; docs/export.md "Images"): present = has_vision
  struct Vision {
    std::string method;                 // "vision"
    int image_height = 0, image_width = 0;
    int grid_h = 0, grid_w = 0;         // patches (grid_thw's last two)
    int tokens = 0;                     // image tokens per image (merged patches)
    int deepstack_layers = 0;           // DeepStack features added after decoder layers 0 .. this - 1
    int image_token_id = 0, vision_start_token_id = 0, vision_end_token_id = 0;
    int patch_size = 0, merge_size = 0, temporal_patch_size = 0;
    int64_t min_pixels = 0, max_pixels = 0;
    double rescale_factor = 0, image_mean[3] = {0, 0, 0}, image_std[3] = {0, 0, 0};
  };
  bool has_vision = false;
  Vision vision;
  bool mrope = false;  // kv.rope == "mrope": layer graphs take (t, h, w) positions last ([3, T]; io: one-hot [3, T, S])
  std::vector<KvLayer> kv_layers;  // kv.layers (empty when absent)
  std::string predictor_kind;      // predictor.kind: "adapter", "next-gate", ...
  std::vector<int> horizons;       // predictor.horizons
  // MoE layer POSITION (0..moe_layers.size()-1, as in spx::Key) -> the horizons of the rows the
  // program's predictor output holds for it, in row order. The manifest keys this map by layer
  // NUMBER (str(moe_layers[i]), as export/session.py reads it); it is translated here. Empty when
  // the manifest has no predictor.preds_rows.
  std::map<int, std::vector<int>> preds_rows;
  // predictor.reuse: the `reuse` eviction's table (toolkit/runtime/reuse.py), learned with the
  // adapter, its frequency classes checked against moe_layers x num_experts; empty if absent
  ReuseTable reuse;
  // predictor.next_visits N (an older bundle's predictor.next_visit true: 1): every layer's preds rows
  // hold horizons L, 2L, ..., NL (L = moe_layers.size()), the adapter's next-visit heads, which the reuse
  // eviction reads (pool.h, ReuseHistory)
  int next_visits = 0;
  double pool_mib = 0;             // runtime.pool_mib: default expert pool budget (> 0, finite)
  // runtime.expert_store_source / expert_store_index_sha256: the exported store's identity (the
  // digest of the weights it was built from; the sha256 of its header, index and metadata), both
  // 64 lowercase hex digits. open() compares them with the store on every open, hashes or not.
  std::string store_source, store_index_sha256;
  SchedulerDefaults scheduler;     // runtime.scheduler
  std::string expert_dtype;        // quantization.experts when present ("fp16", "int8", "int4")
  std::vector<std::string> methods;  // graphs.methods (executorch); the names of graphs.files (qnn, qai-hub)
  // qnn / qai-hub: graph name -> its EPContext model (manifest-relative; absolute in graph_paths)
  // and its context binary (graphs.binaries, manifest-relative), which lies beside the model
  std::map<std::string, std::string> graph_files, graph_binaries, graph_paths;
  // Manifest-relative names (as listed in "files") and absolute paths of what the runner opens.
  std::string program_file, store_file, host_file, config_file, tokenizer_file;
  std::string program_path;    // graphs.file (the .pte); empty for qnn and qai-hub (graph_paths)
  // qnn: graphs.embedding.file, the token embedding table the runner looks rows up in on the CPU
  // (float16 [vocab, hidden] `weight` in safetensors); empty for a bundle with an `embed` graph
  std::string embedding_file, embedding_path;
  std::string store_path;      // runtime.expert_store
  std::string host_path;       // host_file; empty when the manifest has none
  std::string config_path;     // model.config
  std::string tokenizer_path;  // first of "tokenizer" ending in tokenizer.json; empty when none
  // From config.json (for qwen3_vl_moe: its "text_config"); set by open() / parse_model_config().
  std::string hidden_act = "silu";
  double swiglu_limit = 7.0;
  std::map<std::string, FileEntry> files;  // the manifest's "files"

  // Open and validate the bundle in `dir`: manifest.json (not a symlink; format, version 1,
  // target executorch, every value's type and range), every listed file (relative, no "..",
  // inside the bundle after resolving symlinks, a regular file of the listed size and of the
  // listed sha256; `verify_hashes` = false skips the sha256 of the expert store only, the one file
  // too large to hash at every start: each of its blobs' CRC-32 is still checked as it is read, and
  // the program and every other file are still hashed), the expert store's identity (its header,
  // index and metadata hash to runtime.expert_store_index_sha256, read without its blobs: a store
  // of other weights put in its place is refused naming its source), then config.json.
  static Bundle open(const std::string& dir, bool verify_hashes = true);
};

// The JSON part of Bundle::open without touching the filesystem: everything but `dir`, the
// absolute paths and the config.json settings. `where` names the manifest in messages.
Bundle parse_manifest(const std::string& text, const std::string& where);

// hidden_act and swiglu_limit of `b` from the text of its config.json (`where` names it).
void parse_model_config(Bundle& b, const std::string& text, const std::string& where);

// Reads a whole regular file (at most `max_bytes`) into a string; errors name `path`.
std::string read_text_file(const std::string& path, uint64_t max_bytes);

}  // namespace spx
