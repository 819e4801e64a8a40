// Shared types of the native runner: the error every part throws, expert keys, blob sections.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace spx {

// the adapter's next-visit heads per MoE layer, at most (adapters/reuse.py: MAX_NEXT_VISITS)
constexpr int kMaxNextVisits = 4;

// Every refusal is an Error whose message is one line naming the file or option at fault; main()
// prints "specprefetch-runner: error: <message>" and exits non-zero.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// (MoE layer position 0..L-1, expert id): the unit the store, pool and scheduler deal in.
using Key = std::pair<int, int>;

// The `reuse` eviction's table (adapters/reuse.py, ReuseTable), learned with the adapter: per
// history of `bits` visits, the mean visits until reuse in sixteenths; with frequency classes, each
// layer's experts in classes (0 the most routed in the train split) and one table per class.
struct ReuseTable {
  int bits = 0;
  std::vector<int64_t> visits16;                     // [2^bits]; empty: no table
  std::vector<std::vector<int>> classes;             // [MoE layers][experts] class ids; empty: one table
  std::vector<std::vector<int64_t>> class_visits16;  // [classes][2^bits]
  bool empty() const { return visits16.empty(); }
  // the table without its frequency classes (every expert scored with visits16)
  ReuseTable whole() const { return ReuseTable{bits, visits16, {}, {}}; }
  // the table that scores expert `e` of MoE layer `li`
  const std::vector<int64_t>& of(int li, int e) const {
    return classes.empty() ? visits16 : class_visits16[static_cast<size_t>(classes[static_cast<size_t>(li)][static_cast<size_t>(e)])];
  }
};

// One array inside an expert blob (docs/expert-store.md, toolkit/models/expert_layout.py).
struct Section {
  std::string role;   // gate, up, down, bias_gate, bias_up, bias_down
  std::string kind;   // weight, scale, bias
  std::string dtype;  // f16, i8, u8 (int4 packed two per byte, low nibble first)
  std::vector<int64_t> shape;
  size_t offset = 0;  // bytes from the blob's start (a multiple of 64)
  size_t nbytes = 0;
};

// One expert matrix in the family's canonical order: [out, in] for weights, [out] for biases.
struct Matrix {
  std::string role;
  std::vector<int64_t> shape;
};

}  // namespace spx
