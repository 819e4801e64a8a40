// The decision log (`--events FILE`), line for line the format of toolkit/runtime/events.py
// (docs/runtime.md): for the same bundle, prompt, policy and budget the Python reference runner
// and this runner write the same lines, apart from the `t_ms` and `conf` fields.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace spx {

class EventLog {
 public:
  static constexpr int kVersion = 1;

  // read_budget: off, auto or the KiB a step
  void header(const std::string& policy, int64_t budget_bytes, int64_t slot_bytes, int64_t capacity, int window,
              int queue_depth, double min_confidence, int layers, int top_k, const std::string& read_budget);
  void sequence(int prompt_tokens);  // `seq N prompt_tokens=T`, N counting the prompts logged
  void at(int64_t step, int pos, int layer);
  // `STEP KIND L:E[ extra]`; extra is the already formatted " k=v" fields.
  void emit(const char* kind, Key key, const std::string& extra = "");
  void token(int n, int pos, int id, double t_ms);
  // `STEP budget kib=K`: the read budget measured in the run changed at this step (kib -1: none)
  void budget(int64_t step, int64_t kib);
  void end(int tokens, double t_ms);

  const std::vector<std::string>& lines() const { return lines_; }
  void write(const std::string& path) const;  // atomically (temp file, then rename)

  static std::string key(Key k) { return std::to_string(k.first) + ":" + std::to_string(k.second); }
  static std::string fixed(double v, int digits);  // like Python's f"{v:.{digits}f}"

 private:
  std::vector<std::string> lines_;
  int64_t step_ = 0;
  int sequences_ = 0;
};

}  // namespace spx
