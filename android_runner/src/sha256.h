// SHA-256 (FIPS 180-4): incremental hashing and whole-file hashing (1 MiB reads).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace spx {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  std::array<uint8_t, 32> digest();  // finishes the hash; the object must not be updated after
  std::string hexdigest();           // lowercase hex of digest()

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t used_ = 0;
  uint64_t total_ = 0;
  bool done_ = false;
};

std::string sha256_hex(const void* data, size_t n);

// Lowercase hex SHA-256 of everything readable from `fd` (from its current offset, with read()
// in 1 MiB chunks, retrying on EINTR); `bytes` gets the byte count. I/O errors throw spx::Error
// naming `where`.
std::string sha256_fd(int fd, const std::string& where, uint64_t* bytes = nullptr);

// The same for the file at `path` (opened read-only; errors name the path).
std::string sha256_file(const std::string& path, uint64_t* bytes = nullptr);

}  // namespace spx
