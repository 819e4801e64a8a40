// Tokenizer: text in and text out with the bundle's tokenizer.json, through the Hugging Face
// tokenizer of ExecuTorch's LLM runners (meta-pytorch/tokenizers' HFTokenizer). Built in when the
// runner is configured with SPX_TOKENIZERS_DIR (the default of `specprefetch runner build`);
// without it the runner takes token ids only (--prompt-ids).
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace spx {

class Tokenizer {
 public:
  static bool built_in();
  static const char* name();  // what tokenizer implementation, for the run's JSON
  // Loads tokenizer.json; throws Error naming the file when it cannot.
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();
  // The ids of `text` with no special tokens added (transformers' add_special_tokens=False);
  // special tokens written in the text (e.g. <|im_start|>) are matched as such.
  std::vector<int> encode(const std::string& text) const;
  // The text of `ids`, special tokens included (transformers' decode). The bytes may end inside a
  // UTF-8 character when generation stopped there.
  std::string decode(const std::vector<int>& ids) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
};

}  // namespace spx
