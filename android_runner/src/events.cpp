#include "events.h"

#include <cstdio>

#include "fileio.h"

namespace spx {

std::string EventLog::fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

void EventLog::header(const std::string& policy, int64_t budget_bytes, int64_t slot_bytes, int64_t capacity,
                      int window, int queue_depth, double min_confidence, int layers, int top_k,
                      const std::string& read_budget) {
  lines_.push_back("# specprefetch-events " + std::to_string(kVersion) + " policy=" + policy +
                   " budget_bytes=" + std::to_string(budget_bytes) + " slot_bytes=" + std::to_string(slot_bytes) +
                   " capacity=" + std::to_string(capacity) + " window=" + std::to_string(window) +
                   " queue_depth=" + std::to_string(queue_depth) + " min_confidence=" + fixed(min_confidence, 3) +
                   " layers=" + std::to_string(layers) + " top_k=" + std::to_string(top_k) +
                   " read_budget=" + read_budget);
}

void EventLog::budget(int64_t step, int64_t kib) {
  lines_.push_back(std::to_string(step) + " budget kib=" + std::to_string(kib));
}

void EventLog::sequence(int prompt_tokens) {
  lines_.push_back("seq " + std::to_string(sequences_++) + " prompt_tokens=" + std::to_string(prompt_tokens));
}

void EventLog::at(int64_t step, int pos, int layer) {
  step_ = step;
  lines_.push_back("step " + std::to_string(step) + " pos=" + std::to_string(pos) + " layer=" + std::to_string(layer));
}

void EventLog::emit(const char* kind, Key k, const std::string& extra) {
  lines_.push_back(std::to_string(step_) + " " + kind + " " + key(k) + extra);
}

void EventLog::token(int n, int pos, int id, double t_ms) {
  lines_.push_back("token " + std::to_string(n) + " pos=" + std::to_string(pos) + " id=" + std::to_string(id) +
                   " t_ms=" + fixed(t_ms, 3));
}

void EventLog::end(int tokens, double t_ms) {
  lines_.push_back("end tokens=" + std::to_string(tokens) + " t_ms=" + fixed(t_ms, 3));
}

void EventLog::write(const std::string& path) const {
  std::string text;
  for (const auto& l : lines_) text += l + "\n";
  write_file_atomic(path, text);
}

}  // namespace spx
