// float32 tensors from a safetensors file (host.safetensors: router_weight [L, E, H], router_bias
// [L, E], score_bias [L, E]). Format: u64 little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data
// (offsets relative to its start). Only dtype F32 is read; anything else is refused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common.h"

namespace spx {

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // product(shape) values, row-major
  size_t numel() const { return data.size(); }
};

// Validates the header (length within the file and at most 100 MiB, a JSON object, dtype F32,
// non-negative shape, data_offsets inside the data and of exactly product(shape) * 4 bytes, no
// two tensors overlapping) and copies every tensor out. Errors name `where`.
std::map<std::string, Tensor> parse_safetensors(const uint8_t* data, size_t n, const std::string& where);

// The same for the file at `path` (read whole; at most 16 GiB).
std::map<std::string, Tensor> read_safetensors(const std::string& path);

}  // namespace spx
