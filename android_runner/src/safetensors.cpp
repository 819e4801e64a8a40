// safetensors reader (float32 only), every offset and size checked against the file.
#include "safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json_checked.h"

namespace spx {

using jsonc::fail;
using jsonc::json;
using jsonc::quote;

namespace {
constexpr uint64_t kMaxHeader = 100ull << 20;
constexpr uint64_t kMaxFile = 16ull << 30;
}  // namespace

std::map<std::string, Tensor> parse_safetensors(const uint8_t* data, size_t n, const std::string& where) {
  static_assert(sizeof(float) == 4, "float32");
  if (n < 8) fail(where, "truncated safetensors file (no header length)");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | data[i];
  if (hlen < 2 || hlen > kMaxHeader || hlen > n - 8)
    fail(where, "safetensors header length " + std::to_string(hlen) + " does not fit the file (" +
                    std::to_string(n) + " bytes)");
  const uint8_t* base = data + 8 + hlen;
  const uint64_t dlen = n - 8 - hlen;
  json h = jsonc::parse(std::string(reinterpret_cast<const char*>(data + 8), size_t(hlen)), where, "safetensors header");
  jsonc::need_object(h, where, "");
  std::map<std::string, Tensor> out;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    std::string key = "tensor " + quote(it.key());
    const json& t = it.value();
    std::string dtype = jsonc::as_str(jsonc::field(t, "dtype", where, key), where, key + ".dtype");
    if (dtype != "F32") fail(where, key + " has dtype " + quote(dtype) + "; only F32 tensors are read");
    Tensor x;
    x.shape = jsonc::as_int_list(jsonc::field(t, "shape", where, key), where, key + ".shape", 0, INT64_MAX);
    uint64_t numel = 1;
    for (int64_t d : x.shape) {
      if (d != 0 && numel > (dlen / 4) / uint64_t(d)) fail(where, key + ": shape larger than the file's data");
      numel *= uint64_t(d);
    }
    const json& offs = jsonc::as_list(jsonc::field(t, "data_offsets", where, key), where, key + ".data_offsets");
    if (offs.size() != 2) fail(where, key + ".data_offsets must be [begin, end]");
    uint64_t b = jsonc::as_u64(offs[0], where, key + ".data_offsets[0]");
    uint64_t e = jsonc::as_u64(offs[1], where, key + ".data_offsets[1]");
    if (b > e || e > dlen)
      fail(where, key + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + "] outside the data (" +
                      std::to_string(dlen) + " bytes)");
    if (e - b != numel * 4)
      fail(where, key + ": " + std::to_string(e - b) + " bytes, its shape needs " + std::to_string(numel * 4));
    x.data.resize(size_t(numel));
    if (numel) std::memcpy(x.data.data(), base + b, size_t(numel * 4));  // little-endian hosts (arm64, x86-64)
    if (e > b) spans.emplace_back(b, e);
    out.emplace(it.key(), std::move(x));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second) fail(where, "safetensors tensors overlap in the data");
  return out;
}

std::map<std::string, Tensor> read_safetensors(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw Error(jsonc::one_line(path + ": cannot open (" + std::strerror(errno) + ")"));
  std::vector<uint8_t> buf;
  try {
    struct stat st;
    if (::fstat(fd, &st) != 0) throw Error(jsonc::one_line(path + ": cannot stat (" + std::strerror(errno) + ")"));
    if (!S_ISREG(st.st_mode)) throw Error(jsonc::one_line(path + ": not a regular file"));
    if (uint64_t(st.st_size) > kMaxFile) throw Error(jsonc::one_line(path + ": larger than 16 GiB"));
    buf.resize(size_t(st.st_size));
    size_t got = 0;
    while (got < buf.size()) {
      ssize_t r = ::pread(fd, buf.data() + got, buf.size() - got, off_t(got));
      if (r < 0) {
        if (errno == EINTR) continue;
        throw Error(jsonc::one_line(path + ": read failed (" + std::strerror(errno) + ")"));
      }
      if (r == 0) throw Error(jsonc::one_line(path + ": short read (file truncated while reading?)"));
      got += size_t(r);
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return parse_safetensors(buf.data(), buf.size(), path);
}

}  // namespace spx
