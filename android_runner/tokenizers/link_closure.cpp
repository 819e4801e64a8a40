// Links the tokenizer library and everything it needs; `specprefetch runner build` merges the
// archives this produced. Also a smoke test: encode argv[2] with the tokenizer.json argv[1].
#include <pytorch/tokenizers/hf_tokenizer.h>

#include <cstdio>

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  tokenizers::HFTokenizer tok;
  if (tok.load(argv[1]) != tokenizers::Error::Ok) return 1;
  auto ids = tok.encode(argv[2], 0, 0);
  if (!ids.ok()) return 1;
  for (auto id : ids.get()) std::printf("%llu ", static_cast<unsigned long long>(id));
  std::printf("\n");
  return 0;
}
