#include "tokenizer.h"

#include "common.h"

#ifdef SPX_WITH_TOKENIZER
#include <pytorch/tokenizers/hf_tokenizer.h>
#endif

namespace spx {

#ifdef SPX_WITH_TOKENIZER
struct Tokenizer::Impl {
  tokenizers::HFTokenizer tok;
};

bool Tokenizer::built_in() { return true; }
const char* Tokenizer::name() { return "HFTokenizer (pytorch-tokenizers " SPX_TOKENIZERS_VERSION ")"; }

Tokenizer::Tokenizer(const std::string& path) : impl_(std::make_unique<Impl>()), path_(path) {
  if (path.empty()) throw Error("the bundle lists no tokenizer.json: give --prompt-ids");
  if (impl_->tok.load(path) != tokenizers::Error::Ok)
    throw Error(path + ": not a tokenizer this runner can load (a Hugging Face tokenizer.json with a BPE model)");
}

std::vector<int> Tokenizer::encode(const std::string& text) const {
  auto r = impl_->tok.encode(text, 0, 0);
  if (!r.ok()) throw Error("--prompt: " + path_ + " could not encode the text");
  std::vector<int> out;
  out.reserve(r.get().size());
  for (uint64_t id : r.get()) out.push_back(static_cast<int>(id));
  if (out.empty()) throw Error("--prompt: the text encodes to no tokens");
  return out;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  std::string out;
  uint64_t prev = 0;
  for (int id : ids) {
    auto piece = impl_->tok.decode(prev, static_cast<uint64_t>(id));
    if (!piece.ok()) throw Error(path_ + ": cannot decode token " + std::to_string(id));
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
