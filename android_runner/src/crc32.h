// CRC-32 as zlib computes it (reflected polynomial 0xEDB88320, init and final xor 0xFFFFFFFF):
// crc32(data, n) == zlib.crc32(data) in Python, and crc32(b, nb, crc32(a, na)) == crc32(a + b).
//
// Every expert read is checked with it (Reader, `verify`), so it must keep up with the flash: a table
// CRC (slicing-by-8, about 2 GB/s a core) made the phone-class model's streaming decode 1.13-1.27x
// slower (docs/benchmarks.md section 21). The CPU's own instructions are used where it has them,
// chosen once at start-up: aarch64's CRC32 instructions (ARMv8.1-A makes them mandatory: every phone
// core this targets), or x86-64's carry-less multiply (PCLMULQDQ) folding 64 bytes a step; the table
// code otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spx {

// `n` bytes, continuing from `crc` (0 to start), with the fastest implementation this CPU runs.
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);

// The same with the table code only (slicing-by-8): the reference the tests compare against.
uint32_t crc32_portable(const void* data, size_t n, uint32_t crc = 0);

// Which implementation crc32() uses here: "armv8-crc", "pclmul" or "portable".
const char* crc32_impl();

}  // namespace spx
