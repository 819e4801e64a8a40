// Small file helpers: whole-file reads and atomic writes (temp file in the same directory, fsync,
// rename), each failing with one line naming the path and the OS's reason.
#pragma once

#include <string>

namespace spx {

std::string read_file(const std::string& path);
void write_file_atomic(const std::string& path, const std::string& data);

}  // namespace spx
