#include "fileio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "common.h"

namespace spx {

namespace {

std::string kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  if (!::realpath(p.c_str(), buf)) return {};
  return buf;
}

std::string dir_of(const std::string& p) {
  const auto slash = p.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return p.substr(0, slash);
}

std::string base_of(const std::string& p) {
  const auto slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

// real directory + name: the file a rename onto `p` would replace
std::string lexical_id(const std::string& p) {
  const std::string d = real_path(dir_of(p));
  if (d.empty()) return {};
  return (d == "/" ? "" : d) + "/" + base_of(p);
}

}  // namespace

namespace {

void check_regular(const std::string& name, const struct stat& st, uint64_t max_bytes) {
  if (!S_ISREG(st.st_mode)) throw Error(name + ": is " + kind_of(st.st_mode) + ", not a regular file");
  if (static_cast<uint64_t>(st.st_size) > max_bytes)
    throw Error(name + ": " + std::to_string(st.st_size) + " bytes, more than the " + std::to_string(max_bytes >> 20) +
                " MiB this file may hold");
}

std::string named(const std::string& path, const std::string& what) { return what.empty() ? path : what + " " + path; }

}  // namespace

void check_input_file(const std::string& path, const std::string& what, uint64_t max_bytes) {
  const std::string name = named(path, what);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw Error(name + ": cannot read (" + std::strerror(errno) + ")");
  check_regular(name, st, max_bytes);
}

std::string read_file(const std::string& path, const std::string& what, uint64_t max_bytes) {
  const std::string name = named(path, what);
  auto fail = [&](const std::string& why) { throw Error(name + ": " + why); };
  // checked before the open (a device is never opened) and after it on the descriptor, opened
  // non-blocking so that a FIFO put there meanwhile cannot hang the open: the file checked is the one read
  check_input_file(path, what, max_bytes);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail(std::string("cannot read (") + std::strerror(errno) + ")");
  std::string out;
  try {
    struct stat st {};
    if (::fstat(fd, &st) != 0) fail(std::string("cannot read (") + std::strerror(errno) + ")");
    check_regular(name, st, max_bytes);
    out.resize(static_cast<size_t>(st.st_size));
    size_t done = 0;
    for (;;) {
      if (done == out.size()) {  // read all fstat said: read on, in case the file grew
        if (done > max_bytes) break;
        out.resize(std::min<uint64_t>(max_bytes + 1, done + (uint64_t(1) << 16)));
        if (done == out.size()) break;
      }
      const ssize_t n = ::read(fd, &out[done], out.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(std::string("cannot read (") + std::strerror(errno) + ")");
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    if (done > max_bytes)
      fail("grew past the " + std::to_string(max_bytes >> 20) + " MiB this file may hold while it was read");
    out.resize(done);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return out;
}

std::string check_output_path(const std::string& option, const std::string& path) {
  const std::string name = option + " " + path;
  if (path.empty()) throw Error(option + ": an empty path");
  struct stat st {};
  if (path.back() == '/' || (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)))
    throw Error(name + ": is a directory; name a file");
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw Error(name + ": is " + kind_of(st.st_mode) + ", not a regular file (the output would replace it)");
  const std::string dir = dir_of(path);
  if (::stat(dir.c_str(), &st) != 0)
    throw Error(name + ": directory " + dir + " does not exist (" + std::strerror(errno) + ")");
  if (!S_ISDIR(st.st_mode)) throw Error(name + ": " + dir + " is not a directory");
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw Error(name + ": directory " + dir + " is not writable (" + std::strerror(errno) + ")");
  const std::string id = lexical_id(path);
  if (id.empty()) throw Error(name + ": directory " + dir + " cannot be resolved (" + std::strerror(errno) + ")");
  return id;
}

bool same_output(const std::string& id, const std::string& path, const std::string& other) {
  const std::string other_id = lexical_id(other), other_real = real_path(other);
  if ((!other_id.empty() && id == other_id) || (!other_real.empty() && id == other_real)) return true;
  struct stat a {}, b {};
  return ::stat(path.c_str(), &a) == 0 && ::stat(other.c_str(), &b) == 0 && a.st_dev == b.st_dev &&
         a.st_ino == b.st_ino;
}

void write_file_atomic(const std::string& path, const std::string& data) {
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(path + ": cannot write (" + std::strerror(errno) + ")");
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error(path + ": cannot write (" + std::strerror(err) + ")");
    }
    done += static_cast<size_t>(n);
  }
  int err = 0;
  if (::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;  // closed whatever fsync did
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    throw Error(path + ": cannot write (" + std::strerror(err) + ")");
  }
}

}  // namespace spx
