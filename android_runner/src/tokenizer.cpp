#include "tokenizer.h"

#include "common.h"

#ifdef SPX_WITH_TOKENIZER
#include <pytorch/tokenizers/hf_tokenizer.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#endif

namespace spx {

#ifdef SPX_WITH_TOKENIZER
struct Tokenizer::Impl {
  tokenizers::HFTokenizer tok;
};

namespace {

// HFTokenizer (pytorch-tokenizers 1.0.1) logs and skips the parts of a tokenizer.json it does not
// know, and would then encode or decode differently from Hugging Face: so they are refused here.
void check_supported(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw Error(path + ": cannot read");
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  auto refuse = [&](const std::string& what) {
    throw Error(path + ": " + what + " is not supported by the runner's tokenizer (HFTokenizer of pytorch-tokenizers "
                SPX_TOKENIZERS_VERSION "); give --prompt-ids");
  };
  auto walk = [&](const nlohmann::json& node, const char* field, const std::set<std::string>& ok,
                  const char* list_key, bool null_ok, auto&& self) -> void {
    if (node.is_null()) {
      if (!null_ok) refuse(std::string("no ") + field);
      return;
    }
    if (!node.is_object() || !node.contains("type") || !node["type"].is_string()) refuse(std::string("a malformed ") + field);
    const std::string type = node["type"].get<std::string>();
    if (!ok.count(type)) refuse(std::string(field) + " '" + type + "'");
    if (type == "Sequence") {
      if (!node.contains(list_key) || !node[list_key].is_array()) refuse(std::string("a malformed ") + field + " Sequence");
      for (const auto& child : node[list_key]) self(child, field, ok, list_key, false, self);
    }
  };
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object()) refuse("a tokenizer.json without a model");
  if (j["model"].value("type", std::string()) != "BPE") refuse("model type '" + j["model"].value("type", std::string("?")) + "'");
  walk(j.value("normalizer", nlohmann::json()), "normalizer", {"Replace", "Sequence", "NFC"}, "normalizers", true, walk);
  walk(j.value("pre_tokenizer", nlohmann::json()), "pre_tokenizer", {"Split", "Digits", "ByteLevel", "Sequence"},
       "pretokenizers", true, walk);
  walk(j.value("decoder", nlohmann::json()), "decoder", {"ByteLevel", "Replace", "ByteFallback", "Fuse", "Sequence"},
       "decoders", false, walk);
}

}  // namespace

bool Tokenizer::built_in() { return true; }
const char* Tokenizer::name() { return "HFTokenizer (pytorch-tokenizers " SPX_TOKENIZERS_VERSION ")"; }

Tokenizer::Tokenizer(const std::string& path) : impl_(std::make_unique<Impl>()), path_(path) {
  if (path.empty()) throw Error("the bundle lists no tokenizer.json: give --prompt-ids");
  check_supported(path);
  if (impl_->tok.load(path) != tokenizers::Error::Ok)
    throw Error(path + ": not a tokenizer this runner can load (a Hugging Face tokenizer.json with a BPE model)");
}

std::vector<int> Tokenizer::encode(const std::string& text) const {
  // main() refuses text that is not UTF-8 first; whatever HFTokenizer still throws on (its UTF-8
  // and regex code throws std::runtime_error) is a refusal of this --prompt too, not an internal error
  std::vector<int> out;
  try {
    auto r = impl_->tok.encode(text, 0, 0);
    if (!r.ok()) throw Error("--prompt: " + path_ + " could not encode the text");
    out.reserve(r.get().size());
    for (uint64_t id : r.get()) out.push_back(static_cast<int>(id));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error("--prompt: " + path_ + " could not encode the text (" + e.what() + ")");
  }
  if (out.empty()) throw Error("--prompt: the text encodes to no tokens");
  return out;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  std::string out;
  uint64_t prev = 0;
  for (int id : ids) {
    // an id the tokenizer has no token for (a model vocabulary padded past the tokenizer's) is
    // skipped, as Hugging Face's decode does; decoding never fails a finished run
    auto piece = impl_->tok.decode(prev, static_cast<uint64_t>(id));
    if (!piece.ok()) continue;
    out += piece.get();
    prev = static_cast<uint64_t>(id);
  }
  return out;
}
#else
struct Tokenizer::Impl {};

bool Tokenizer::built_in() { return false; }
const char* Tokenizer::name() { return "none"; }

Tokenizer::Tokenizer(const std::string& path) : path_(path) {
  throw Error("--prompt: this runner was built without a tokenizer; give --prompt-ids, or rebuild it with "
              "`specprefetch runner build` (the tokenizer is built in by default)");
}

std::vector<int> Tokenizer::encode(const std::string&) const { return {}; }
std::string Tokenizer::decode(const std::vector<int>&) const { return {}; }
#endif

Tokenizer::~Tokenizer() = default;

}  // namespace spx
