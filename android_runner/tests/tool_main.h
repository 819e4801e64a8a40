// The main() of the check tools (check_bundle, check_image): run(argc, argv), with a refusal
// (spx::Error) as one line "NAME: error: ..." and exit 1, anything else as "NAME: internal error: ..."
// and exit 2 (control characters in the message turned into spaces).
#pragma once

#include <exception>
#include <iostream>
#include <string>

#include "common.h"

namespace spx_tool {

inline std::string one_line(std::string m) {
  for (char& c : m)
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  return m;
}

inline int main(const char* name, int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const spx::Error& e) {
    std::cerr << name << ": error: " << one_line(e.what()) << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << name << ": internal error: " << one_line(e.what()) << "\n";
    return 2;
  }
}

}  // namespace spx_tool
