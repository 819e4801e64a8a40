// zlib-compatible CRC-32: slicing-by-8 tables, and the CPU's CRC32 (aarch64) or carry-less multiply
// (x86-64) instructions where present (crc32.h).
#include "crc32.h"

#include <array>
#include <cstring>

// aarch64 Linux (Android included), little-endian: the hardware path reads 8 bytes at a time in memory order
#if defined(__aarch64__) && defined(__linux__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define SPX_CRC_ARMV8 1
#include <arm_acle.h>
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#if defined(__clang__)
#define SPX_TARGET_CRC __attribute__((target("crc")))
#else
#define SPX_TARGET_CRC __attribute__((target("+crc")))
#endif
#elif defined(__x86_64__)
#define SPX_CRC_PCLMUL 1
#include <immintrin.h>
#endif

namespace spx {
namespace {

using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (0xEDB88320u ^ (c >> 1)) : (c >> 1);
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

inline uint32_t load_le32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

// The register form (no pre- or post-inversion) of the table CRC: `c` is the running state.
uint32_t table_update(uint32_t c, const uint8_t* p, size_t n) {
  const Tables& t = tables();
  while (n >= 8) {
    uint32_t a = load_le32(p) ^ c;
    uint32_t b = load_le32(p + 4);
    c = t[7][a & 0xFF] ^ t[6][(a >> 8) & 0xFF] ^ t[5][(a >> 16) & 0xFF] ^ t[4][a >> 24] ^
        t[3][b & 0xFF] ^ t[2][(b >> 8) & 0xFF] ^ t[1][(b >> 16) & 0xFF] ^ t[0][b >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return c;
}

#if SPX_CRC_ARMV8
// The ARMv8 CRC32X/CRC32B instructions compute this polynomial's register form directly: one dependent
// chain of 8-byte steps, at the instruction's latency (a few cycles: well over the flash's rate).
SPX_TARGET_CRC uint32_t armv8_update(uint32_t c, const uint8_t* p, size_t n) {
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __crc32d(c, v);
    p += 8;
    n -= 8;
  }
  while (n--) c = __crc32b(c, *p++);
  return c;
}
#endif

#if SPX_CRC_PCLMUL
// Folding with carry-less multiplication (Gopal et al., "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ Instruction", Intel 2009), for the bit-reflected polynomial: four
// 128-bit accumulators fold 64 bytes a step, then one accumulator 16 bytes a step, then 128 -> 64 ->
// 32 bits and a Barrett reduction. The constants are x^d mod P as 33-bit bit-reflected values; each
// pair below is written (high qword, low qword), the order _mm_set_epi64x takes. `n` is a multiple of
// 16, at least 64; `c` the register-form state.
#define SPX_TARGET_PCLMUL __attribute__((target("pclmul")))

SPX_TARGET_PCLMUL inline __m128i load(const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); }

// x * k (its two halves by k's two constants) added to `next`: 128 bits folded forward
SPX_TARGET_PCLMUL inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

SPX_TARGET_PCLMUL uint32_t pclmul_update(uint32_t c, const uint8_t* p, size_t n) {
  const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);  // hi x^(4*128-32), lo x^(4*128+32)
  const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  // hi x^(128-32), lo x^(128+32)
  const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);                // lo x^64
  const __m128i poly = _mm_set_epi64x(0x1f7011641LL, 0x1db710641LL);  // hi mu = x^64 / P, lo P itself
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  p += 64;
  n -= 64;
  while (n >= 64) {
    x0 = fold(x0, k1k2, load(p));
    x1 = fold(x1, k1k2, load(p + 16));
    x2 = fold(x2, k1k2, load(p + 32));
    x3 = fold(x3, k1k2, load(p + 48));
    p += 64;
    n -= 64;
  }
  x0 = fold(x0, k3k4, x1);
  x0 = fold(x0, k3k4, x2);
  x0 = fold(x0, k3k4, x3);
  for (; n >= 16; p += 16, n -= 16) x0 = fold(x0, k3k4, load(p));
  // 128 -> 64 bits (appending 32 zero bits): the low half times x^(128-32), added to the high half
  x0 = _mm_xor_si128(_mm_srli_si128(x0, 8), _mm_clmulepi64_si128(k3k4, x0, 0x01));
  // 64 -> 32 bits
  __m128i t = _mm_srli_si128(x0, 4);
  x0 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x0, mask32), k5, 0x00), t);
  // Barrett reduction to the 32-bit remainder
  t = x0;
  x0 = _mm_clmulepi64_si128(_mm_and_si128(x0, mask32), poly, 0x10);
  x0 = _mm_clmulepi64_si128(_mm_and_si128(x0, mask32), poly, 0x00);
  x0 = _mm_xor_si128(x0, t);
  return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_srli_si128(x0, 4)));
}

uint32_t pclmul_or_table(uint32_t c, const uint8_t* p, size_t n) {
  const size_t bulk = n < 64 ? 0 : n & ~size_t{15};
  if (bulk != 0) c = pclmul_update(c, p, bulk);
  return table_update(c, p + bulk, n - bulk);
}
#endif

using Update = uint32_t (*)(uint32_t, const uint8_t*, size_t);

struct Impl {
  Update update;
  const char* name;
};

Impl choose() {
#if SPX_CRC_ARMV8
  if (getauxval(AT_HWCAP) & HWCAP_CRC32) return {armv8_update, "armv8-crc"};
#elif SPX_CRC_PCLMUL
  if (__builtin_cpu_supports("pclmul")) return {pclmul_or_table, "pclmul"};
#endif
  return {table_update, "portable"};
}

const Impl& impl() {
  static const Impl i = choose();
  return i;
}

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  return ~impl().update(~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32_portable(const void* data, size_t n, uint32_t crc) {
  return ~table_update(~crc, static_cast<const uint8_t*>(data), n);
}

const char* crc32_impl() { return impl().name; }

}  // namespace spx
