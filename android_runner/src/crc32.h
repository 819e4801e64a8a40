// CRC-32 as zlib computes it (reflected polynomial 0xEDB88320, init and final xor 0xFFFFFFFF):
// crc32(data, n) == zlib.crc32(data) in Python, and crc32(b, nb, crc32(a, na)) == crc32(a + b).
#pragma once

#include <cstddef>
#include <cstdint>

namespace spx {

// Slicing-by-8 over `n` bytes, continuing from `crc` (0 to start).
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);

}  // namespace spx
