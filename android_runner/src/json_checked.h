// Checked access to untrusted JSON (manifest.json, model config, expert store metadata,
// safetensors headers): every type or range error is an spx::Error of one line naming the file
// and the key, never a crash or UB (numbers are range-checked before any conversion).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common.h"

namespace spx {
namespace jsonc {

using json = nlohmann::json;

// `s` on one line: control characters become '?', at most `max` bytes (then "...").
inline std::string one_line(const std::string& s, size_t max = 4000) {
  std::string out;
  for (char c : s) {
    if (out.size() >= max) { out += "..."; break; }
    out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
  }
  return out;
}

// A value from the file quoted for a message: 'abc' (one line, at most 80 bytes).
inline std::string quote(const std::string& s) { return "'" + one_line(s, 80) + "'"; }

[[noreturn]] inline void fail(const std::string& where, const std::string& what) {
  throw Error(one_line(where + ": " + what));
}

inline const char* type_of(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "a list";
  if (v.is_object()) return "an object";
  return "binary";
}

// Parse `text` as JSON; nesting deeper than `max_depth` is refused before parsing.
inline json parse(const std::string& text, const std::string& where, const std::string& what,
                  int max_depth = 64) {
  int depth = 0;
  bool in_str = false, esc = false;
  for (char c : text) {
    if (in_str) {
      if (esc) esc = false;
      else if (c == '\\') esc = true;
      else if (c == '"') in_str = false;
    } else if (c == '"') {
      in_str = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) fail(where, what + " nested deeper than " + std::to_string(max_depth) + " levels");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(where, what + " is not valid JSON (" + e.what() + ")");
  }
}

inline void need_object(const json& v, const std::string& where, const std::string& path) {
  if (!v.is_object()) fail(where, (path.empty() ? std::string("top level") : path) + " must be an object, not " + type_of(v));
}

// obj[key]; missing (or null unless `null_ok`) is an error naming path.key.
inline const json& field(const json& obj, const std::string& key, const std::string& where,
                         const std::string& path) {
  need_object(obj, where, path);
  auto it = obj.find(key);
  std::string p = path.empty() ? key : path + "." + key;
  if (it == obj.end()) fail(where, "missing field '" + p + "'");
  return *it;
}

// obj[key] or nullptr when missing or null.
inline const json* optional(const json& obj, const std::string& key, const std::string& where,
                            const std::string& path) {
  need_object(obj, where, path);
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

inline std::string join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

inline int64_t as_int(const json& v, const std::string& where, const std::string& path,
                      int64_t lo = std::numeric_limits<int64_t>::min(),
                      int64_t hi = std::numeric_limits<int64_t>::max()) {
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max()))
      fail(where, path + " is " + std::to_string(u) + ", out of range");
    x = int64_t(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else {
    fail(where, path + " must be an integer, not " + type_of(v));
  }
  if (x < lo || x > hi)
    fail(where, path + " is " + std::to_string(x) + ", must be in " + std::to_string(lo) + ".." + std::to_string(hi));
  return x;
}

inline uint64_t as_u64(const json& v, const std::string& where, const std::string& path) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    int64_t x = v.get<int64_t>();
    if (x < 0) fail(where, path + " is " + std::to_string(x) + ", must be >= 0");
    return uint64_t(x);
  }
  fail(where, path + " must be a non-negative integer, not " + type_of(v));
}

inline double as_num(const json& v, const std::string& where, const std::string& path) {
  if (!v.is_number()) fail(where, path + " must be a number, not " + type_of(v));
  double d = v.get<double>();
  if (!std::isfinite(d)) fail(where, path + " must be finite");
  return d;
}

// A probability in [0, 1] (the scheduler's confidence thresholds), as the Python side checks them.
inline double as_probability(const json& v, const std::string& where, const std::string& path) {
  const double d = as_num(v, where, path);
  if (d < 0.0 || d > 1.0) fail(where, path + " is " + v.dump() + "; it must be a probability in [0, 1]");
  return d;
}

inline bool as_bool(const json& v, const std::string& where, const std::string& path) {
  if (!v.is_boolean()) fail(where, path + " must be true or false, not " + type_of(v));
  return v.get<bool>();
}

inline std::string as_str(const json& v, const std::string& where, const std::string& path) {
  if (!v.is_string()) fail(where, path + " must be a string, not " + type_of(v));
  return v.get<std::string>();
}

inline const json& as_list(const json& v, const std::string& where, const std::string& path) {
  if (!v.is_array()) fail(where, path + " must be a list, not " + type_of(v));
  return v;
}

inline std::vector<int64_t> as_int_list(const json& v, const std::string& where, const std::string& path,
                                        int64_t lo, int64_t hi) {
  as_list(v, where, path);
  std::vector<int64_t> out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) out.push_back(as_int(v[i], where, path + "[" + std::to_string(i) + "]", lo, hi));
  return out;
}

}  // namespace jsonc
}  // namespace spx
