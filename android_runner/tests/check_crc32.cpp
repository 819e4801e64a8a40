// check_crc32: the runner's CRC-32 (src/crc32.h) on files, for tests/test_native_crc32.py, which
// compares it with zlib's. Built for the host and for aarch64 (run under qemu).
//
//   check_crc32 FILE...   first line: the implementation crc32() uses here; then per file:
//                         "<crc32> <crc32_portable> <crc32 of the file in two pieces, chained> <n>"
//                         in decimal, the split after n = (size * 7) / 13 bytes (any offset: the
//                         second piece starts unaligned)
//   check_crc32 --bench MIB  GB/s of crc32() and of crc32_portable() over MIB MiB of random bytes
//                         (best of 5 passes each), for docs/benchmarks.md
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <fstream>
#include <iterator>
#include <vector>

#include "crc32.h"

namespace {

template <class F>
double gbps(const std::vector<unsigned char>& b, F crc) {
  double best = 1e30;
  volatile uint32_t sink = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    sink = sink + crc(b.data(), b.size());
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return double(b.size()) / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--bench") {
    std::vector<unsigned char> b(size_t(std::atoi(argv[2])) << 20);
    std::mt19937 rng(0);
    for (auto& x : b) x = static_cast<unsigned char>(rng());
    const double hw = gbps(b, [](const void* d, size_t n) { return spx::crc32(d, n); });
    const double table = gbps(b, [](const void* d, size_t n) { return spx::crc32_portable(d, n); });
    std::printf("crc32 (%s) %.2f GB/s, table code %.2f GB/s, %.1fx\n", spx::crc32_impl(), hw, table, hw / table);
    return 0;
  }
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
