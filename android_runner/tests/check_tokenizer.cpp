// check_tokenizer TOKENIZER_JSON: one JSON string per stdin line; prints per line the ids of its
// encoding and the decoding of those ids, as JSON {"ids": [...], "text": "..."} (compared with
// Hugging Face's tokenizers by tests/test_native_tokenizer.py).
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <string>

#include "common.h"
#include "tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: check_tokenizer TOKENIZER_JSON < lines\n");
    return 2;
  }
  try {
    spx::Tokenizer tok(argv[1]);
    std::string line;
    while (std::getline(std::cin, line)) {
      const std::string text = nlohmann::json::parse(line).get<std::string>();
      nlohmann::json out;
      const auto ids = tok.encode(text);
      out["ids"] = ids;
      out["text"] = tok.decode(ids);
      std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    }
  } catch (const spx::Error& e) {
    std::fprintf(stderr, "check_tokenizer: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
