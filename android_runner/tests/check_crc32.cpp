// check_crc32: the runner's CRC-32 (src/crc32.h) on files, for tests/test_native_crc32.py, which
// compares it with zlib's. Built for the host and for aarch64 (run under qemu).
//
//   check_crc32 FILE...   first line: the implementation crc32() uses here; then per file:
//                         "<crc32> <crc32_portable> <crc32 of the file in two pieces, chained> <n>"
//                         in decimal, the split after n = (size * 7) / 13 bytes (any offset: the
//                         second piece starts unaligned)
#include <cstdio>
#include <fstream>
#include <iterator>
#include <vector>

#include "crc32.h"

int main(int argc, char** argv) {
  std::printf("%s\n", spx::crc32_impl());
  for (int i = 1; i < argc; ++i) {
    std::ifstream f(argv[i], std::ios::binary);
    if (!f) {
      std::fprintf(stderr, "%s: cannot open\n", argv[i]);
      return 1;
    }
    std::vector<unsigned char> b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t n = b.size() * 7 / 13;
    const uint32_t head = spx::crc32(b.data(), n);
    std::printf("%u %u %u %zu\n", spx::crc32(b.data(), b.size()), spx::crc32_portable(b.data(), b.size()),
                spx::crc32(b.data() + n, b.size() - n, head), n);
  }
  return 0;
}
