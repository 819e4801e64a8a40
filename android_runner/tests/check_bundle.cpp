// check_bundle: validates a bundle without ExecuTorch: the manifest and every listed file (sizes,
// sha256), the expert store (header, index CRC, metadata; O_DIRECT self-test), the host tensors,
// then reads every expert through a Reader with 2 lanes and checks its CRC-32.
//
//   check_bundle BUNDLE_DIR [--no-verify] [--buffered]
//                                           JSON summary on stdout, exit 0; on a refusal
//                                           "check_bundle: error: <msg>" on stderr, exit 1
//   check_bundle --digest FILE...           {"FILE": {"size", "sha256", "crc32"}} (tests compare
//                                           these with Python's hashlib / zlib)
// --no-verify skips the expert store's sha256 (every other file is still hashed, the store's identity is
// still checked); blob CRCs are always
// checked. --buffered skips the O_DIRECT self-test (buffered reads).
//
// Build (host): g++ -std=c++17 -O2 -pthread -I android_runner/src android_runner/tests/check_bundle.cpp
//   android_runner/src/{bundle,expert_store,reader,safetensors,sha256,crc32}.cpp -o check_bundle
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <iostream>
#include <string>
#include <unistd.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "bundle.h"
#include "common.h"
#include "tool_main.h"
#include "crc32.h"
#include "expert_store.h"
#include "reader.h"
#include "safetensors.h"
#include "sha256.h"

using nlohmann::json;

namespace {

json digest(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw spx::Error(path + ": cannot open (" + std::strerror(errno) + ")");
  std::vector<uint8_t> buf(1 << 20);
  spx::Sha256 sha;
  uint32_t crc = 0;
  uint64_t n = 0;
  for (;;) {
    ssize_t r = ::read(fd, buf.data(), 123457);  // odd chunks: exercises the streaming paths
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) { ::close(fd); throw spx::Error(path + ": read failed"); }
    if (r == 0) break;
    sha.update(buf.data(), size_t(r));
    crc = spx::crc32(buf.data(), size_t(r), crc);
    n += uint64_t(r);
  }
  ::close(fd);
  std::string whole = spx::sha256_file(path);
  std::string inc = sha.hexdigest();
  if (whole != inc) throw spx::Error(path + ": streaming and whole-file sha256 differ");
  return {{"size", n}, {"sha256", whole}, {"crc32", crc}};
}

template <class T>
std::string s(T v) { return std::to_string(v); }

int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && args[0] == "--digest") {
    json out = json::object();
    for (size_t i = 1; i < args.size(); ++i) out[args[i]] = digest(args[i]);
    std::cout << out.dump() << "\n";
    return 0;
  }
  std::string dir;
  bool verify = true, try_direct = true;
  for (const auto& a : args) {
    if (a == "--no-verify") verify = false;
    else if (a == "--buffered") try_direct = false;
    else if (!a.empty() && a[0] == '-') throw spx::Error("option " + a + ": usage: check_bundle BUNDLE_DIR [--no-verify] [--buffered]");
    else if (dir.empty()) dir = a;
    else throw spx::Error("usage: check_bundle BUNDLE_DIR [--no-verify] [--buffered]");
  }
  if (dir.empty()) throw spx::Error("usage: check_bundle BUNDLE_DIR [--no-verify] [--buffered]");

  spx::Bundle b = spx::Bundle::open(dir, verify);
  auto st = spx::ExpertStore::open(b.store_path, try_direct);
  const std::string& sp = st->path;
  if (st->num_layers != int(b.moe_layers.size()) || st->num_experts != b.num_experts)
    throw spx::Error(sp + ": " + s(st->num_layers) + " layers x " + s(st->num_experts) + " experts, the manifest says " +
                     s(b.moe_layers.size()) + " x " + s(b.num_experts));
  if (st->moe_layers != b.moe_layers) throw spx::Error(sp + ": MoE layers differ from the manifest's model.moe_layers");
  if (st->hidden_size != b.hidden_size)
    throw spx::Error(sp + ": hidden size " + s(st->hidden_size) + ", the manifest says " + s(b.hidden_size));
  if (!b.config_hash.empty() && st->config_hash != b.config_hash)
    throw spx::Error(sp + ": built from model config " + st->config_hash + ", the bundle's is " + b.config_hash);
  if (!b.expert_dtype.empty() && st->dtype != b.expert_dtype)
    throw spx::Error(sp + ": dtype " + st->dtype + ", the manifest says " + b.expert_dtype);

  json host = json::object();
  if (!b.host_path.empty()) {
    const int L = int(b.moe_layers.size()), E = b.num_experts, H = b.hidden_size;
    auto tensors = spx::read_safetensors(b.host_path);
    auto want = [&](const char* name, std::vector<int64_t> shape, bool required) {
      auto it = tensors.find(name);
      if (it == tensors.end()) {
        if (required) throw spx::Error(b.host_path + ": no tensor " + name);
        return;
      }
      if (it->second.shape != shape) throw spx::Error(b.host_path + ": tensor " + name + " has the wrong shape");
    };
    want("router_weight", {L, E, H}, true);
    want("router_bias", {L, E}, false);
    want("score_bias", {L, E}, b.routing.score_bias);
    for (const auto& [name, t] : tensors) host[name] = t.shape;
  }

  // every expert through the reader: a ring of 8 buffers, every third read a demand read
  // (the buffers are declared before the reader: if a wait() throws, the reader is destroyed
  // first, finishing its in-flight reads while the buffers still exist)
  st->drop_cache();
  const int ring = 8;
  std::vector<spx::AlignedBuffer> bufs;
  for (int i = 0; i < ring; ++i) bufs.emplace_back(st->slot_bytes);
  spx::Reader reader(*st, 2, true);
  std::vector<spx::Key> keys;
  for (int l = 0; l < st->num_layers; ++l)
    for (int e = 0; e < st->num_experts; ++e) keys.emplace_back(l, e);
  uint64_t checked = 0;
  for (size_t i = 0; i < keys.size() + ring; ++i) {
    if (i >= size_t(ring)) {
      spx::Key k = keys[i - ring];
      reader.wait(k);
      if (!reader.landed(k)) throw spx::Error(sp + ": reader: waited-for read not landed");
      reader.forget(k);
      ++checked;
    }
    if (i < keys.size()) reader.submit(keys[i], bufs[i % ring].ptr, i % 3 == 0);
  }

  // cancellation: with the lanes paused, demand reads and then a prefetch are queued; the prefetch
  // is cancelled before it reaches the disk; a landed read and a cancelled (untracked) key cannot be
  json cancel;
  if (keys.size() >= 2) {
    const int n = std::min<int>(ring - 1, static_cast<int>(keys.size()) - 1);
    spx::Reader one(*st, 1, true);
    one.pause(true);
    for (int i = 0; i < n; ++i) one.submit(keys[static_cast<size_t>(i)], bufs[static_cast<size_t>(i)].ptr, true);
    const spx::Key late = keys[static_cast<size_t>(n)];
    one.submit(late, bufs[static_cast<size_t>(n)].ptr, false);
    const bool queued = one.cancel(late);
    one.pause(false);
    for (int i = 0; i < n; ++i) one.wait(keys[static_cast<size_t>(i)]);
    const bool landed = one.cancel(keys[0]);
    const bool unknown = one.cancel(late);  // already cancelled: no longer tracked
    bool waited = true;
    try {
      one.wait(late);
    } catch (const spx::Error&) {
      waited = false;  // "was waited for but never submitted": nothing left to wait for
    }
    cancel = {{"queued", queued}, {"landed", landed}, {"again", unknown}, {"wait_after", waited},
              {"cancelled", one.cancelled()}, {"reads", one.reads()}, {"demand_reads", n}};
  }

  json preds = json::object();
  for (const auto& [pos, hs] : b.preds_rows) preds[std::to_string(pos)] = hs;
  json out = {
      {"bundle", b.dir}, {"target", b.target}, {"family", b.family}, {"model_type", b.model_type},
      {"layers", b.num_layers}, {"moe_layers", b.moe_layers}, {"experts", b.num_experts}, {"top_k", b.top_k},
      {"hidden_size", b.hidden_size}, {"vocab_size", b.vocab_size}, {"dtype", st->dtype},
      {"blob_size", st->blob_size}, {"slot_bytes", st->slot_bytes}, {"direct", st->direct()},
      {"io_note", st->io_note()}, {"experts_checked", checked}, {"bytes_read", reader.bytes_read()},
      {"direct_reads", reader.direct_reads()}, {"verified_hashes", verify}, {"files", b.files.size()},
      {"eos_token_ids", b.eos_token_ids}, {"max_seq", b.max_seq}, {"kv_mode", b.kv_mode},
      {"pool_mib", b.pool_mib}, {"predictor", b.predictor_kind}, {"horizons", b.horizons}, {"preds_rows", preds},
      {"scheduler", {{"window", b.scheduler.window}, {"queue_depth", b.scheduler.queue_depth},
                     {"min_confidence", b.scheduler.min_confidence}, {"candidate_threshold", b.scheduler.candidate_threshold},
                     {"step_budget_bytes", b.scheduler.step_budget_bytes}}},
      {"routing", {{"score_func", b.routing.score_func}, {"norm_topk_prob", b.routing.norm_topk_prob},
                   {"topk_before_softmax", b.routing.topk_before_softmax}, {"n_group", b.routing.n_group},
                   {"topk_group", b.routing.topk_group}, {"score_bias", b.routing.score_bias}}},
      {"methods", b.methods}, {"hidden_act", b.hidden_act}, {"swiglu_limit", b.swiglu_limit},
      {"program", b.program_path}, {"store", b.store_path}, {"tokenizer", b.tokenizer_path},
      {"host_tensors", host}, {"cancel", cancel}};
  std::cout << out.dump() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return spx_tool::main("check_bundle", run, argc, argv); }
