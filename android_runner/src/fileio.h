// Small file helpers: bounded whole-file reads of regular files, output paths checked before a run,
// and atomic writes (temp file in the same directory, fsync, rename), each failing with one line
// naming the option or path and the OS's reason.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spx {

// What an input file read whole may hold: a larger one is refused before it is read.
constexpr uint64_t kMaxInputBytes = uint64_t(256) << 20;

// The whole of `path`, which must be a regular file of at most `max_bytes` (a FIFO, /dev/zero or a
// directory is refused before it is read, so it can neither block nor fill memory). Errors are one
// line, "WHAT PATH: ..." ("PATH: ..." when `what` is empty).
std::string read_file(const std::string& path, const std::string& what = "", uint64_t max_bytes = kMaxInputBytes);
// read_file's checks alone (nothing is opened): for an early refusal before slow work.
void check_input_file(const std::string& path, const std::string& what = "", uint64_t max_bytes = kMaxInputBytes);

// An output file named by an option, checked before the run so that a run never fails only at its
// end: `path` is not empty, not a directory, nothing but a regular file if it exists (a rename
// would replace a device or FIFO there), and its directory exists and is writable. Returns the
// path's identity for same_output(): the real path of its directory plus its name.
std::string check_output_path(const std::string& option, const std::string& path);

// Whether the output at `path` (identity `id` from check_output_path) would replace the file
// `other`: the same name after resolving directories, the same file `other` resolves to, or the
// same inode (a hard link, a symlink to it).
bool same_output(const std::string& id, const std::string& path, const std::string& other);

void write_file_atomic(const std::string& path, const std::string& data);

}  // namespace spx
