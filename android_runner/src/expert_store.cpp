// ExpertStore: validation of the store's header, index and metadata; O_DIRECT self-test; reads.
#include "expert_store.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <new>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32.h"
#include "json_checked.h"

static_assert(sizeof(off_t) == 8, "64-bit file offsets needed: build 32-bit targets with -D_FILE_OFFSET_BITS=64");

namespace spx {

using jsonc::fail;
using jsonc::json;
using jsonc::quote;

namespace {

constexpr char kMagic[8] = {'S', 'P', 'X', 'S', 'T', 'O', 'R', 'E'};
constexpr uint32_t kVersion = 2;  // 2: header CRC-32, source weights' sha256 in the metadata
constexpr size_t kHeaderCrcAt = 124;  // u32: CRC-32 of header bytes [0, 124)
constexpr size_t kReservedAt = 68;    // u8[56], zero
constexpr uint32_t kMaxDim = 1u << 16;          // layers, experts
constexpr uint64_t kMaxMeta = 64ull << 20;
constexpr uint64_t kMaxBlob = 1ull << 31;
const char* const kDtypeNames[] = {"fp16", "int8", "int4"};

uint32_t u32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
uint64_t u64(const uint8_t* p) { return uint64_t(u32(p)) | (uint64_t(u32(p + 4)) << 32); }

uint64_t round_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }  // callers bound n

std::string errno_text() { return std::strerror(errno); }

struct Header {
  uint32_t dtype, L, E, H, I, group, flags, align, meta_len, index_crc;
  uint64_t index_offset, data_offset;
};

Header read_header(const uint8_t* d, size_t n, uint64_t file_size, const std::string& where, uint64_t* need) {
  if (n < ExpertStore::kHeaderSize || file_size < ExpertStore::kHeaderSize) fail(where, "truncated expert store (no header)");
  if (std::memcmp(d, kMagic, 8) != 0) fail(where, "not an expert store (bad magic)");
  uint32_t version = u32(d + 8);
  if (version != kVersion)
    fail(where, "expert store format version " + std::to_string(version) + ", this runner reads " + std::to_string(kVersion) +
                    (version < kVersion ? ": re-export the bundle with this toolkit (specprefetch export)" : ": update the runner"));
  // every header field is covered: a flipped dtype byte is refused here, not run
  if (crc32(d, kHeaderCrcAt) != u32(d + kHeaderCrcAt)) fail(where, "expert store header is corrupt (checksum mismatch)");
  for (size_t i = kReservedAt; i < kHeaderCrcAt; ++i)
    if (d[i] != 0) fail(where, "reserved header bytes are not zero (corrupt header)");
  Header h{};
  h.dtype = u32(d + 12); h.L = u32(d + 16); h.E = u32(d + 20); h.H = u32(d + 24); h.I = u32(d + 28);
  h.group = u32(d + 32); h.flags = u32(d + 36); h.align = u32(d + 40); h.meta_len = u32(d + 44);
  h.index_offset = u64(d + 48); h.data_offset = u64(d + 56); h.index_crc = u32(d + 64);
  if (h.dtype > 2) fail(where, "unknown dtype code " + std::to_string(h.dtype));
  if (h.align != ExpertStore::kAlign)
    fail(where, "alignment " + std::to_string(h.align) + ", this runner reads " + std::to_string(ExpertStore::kAlign));
  if (h.L < 1 || h.L > kMaxDim || h.E < 1 || h.E > kMaxDim)
    fail(where, "header claims " + std::to_string(h.L) + " layers x " + std::to_string(h.E) + " experts (corrupt header)");
  if (h.H < 1 || h.H > (1u << 20) || h.I < 1 || h.I > (1u << 24))
    fail(where, "header claims hidden size " + std::to_string(h.H) + ", intermediate size " + std::to_string(h.I) + " (corrupt header)");
  if (h.group != (h.dtype == 2 ? 32u : 0u))
    fail(where, "group size " + std::to_string(h.group) + " does not match dtype " + kDtypeNames[h.dtype]);
  if (h.meta_len < 2 || h.meta_len > kMaxMeta) fail(where, "metadata length " + std::to_string(h.meta_len) + " (corrupt header)");
  // every quantity below is bounded (L, E <= 2^16, meta_len <= 2^26), so only index_offset can overflow
  uint64_t body = uint64_t(h.L) * h.E * ExpertStore::kEntrySize + h.meta_len;
  if (h.index_offset < ExpertStore::kHeaderSize || h.index_offset > file_size || body > file_size - h.index_offset)
    fail(where, "index (offset " + std::to_string(h.index_offset) + ", " + std::to_string(body) + " bytes) lies outside the file (" +
                    std::to_string(file_size) + " bytes): truncated?");
  uint64_t end = h.index_offset + body;
  if (h.data_offset % ExpertStore::kAlign || h.data_offset < end || h.data_offset > file_size)
    fail(where, "data offset " + std::to_string(h.data_offset) + " is not a 4096-aligned offset after the index, inside the file");
  *need = end;
  return h;
}

}  // namespace

uint64_t ExpertStore::index_bytes(const uint8_t* data, size_t n, uint64_t file_size, const std::string& where) {
  uint64_t need = 0;
  read_header(data, n, file_size, where, &need);
  return need;
}

ExpertStore::Index ExpertStore::parse_index(const uint8_t* data, size_t n, uint64_t file_size, const std::string& where) {
  uint64_t need = 0;
  Header h = read_header(data, n, file_size, where, &need);
  if (n < need) fail(where, "truncated expert store (index)");
  const uint8_t* body = data + h.index_offset;
  const uint64_t index_len = uint64_t(h.L) * h.E * kEntrySize;
  if (crc32(body, size_t(need - h.index_offset)) != h.index_crc)
    fail(where, "expert store index is corrupt (checksum mismatch)");

  Index ix;
  ix.dtype = kDtypeNames[h.dtype];
  ix.num_layers = int(h.L); ix.num_experts = int(h.E); ix.hidden_size = int(h.H); ix.intermediate_size = int(h.I);
  ix.group_size = int(h.group); ix.has_bias = (h.flags & 1u) != 0;
  ix.index_offset = h.index_offset; ix.data_offset = h.data_offset;

  // metadata
  const std::string mw = where;  // messages: "<store>: metadata.<key> ..."
  json meta = jsonc::parse(std::string(reinterpret_cast<const char*>(body + index_len), h.meta_len), mw, "expert store metadata");
  jsonc::need_object(meta, mw, "metadata");
  auto F = [&](const char* k) -> const json& { return jsonc::field(meta, k, mw, "metadata"); };
  ix.blob_size = uint32_t(jsonc::as_int(F("blob_size"), mw, "metadata.blob_size", 1, int64_t(kMaxBlob)));
  ix.slot_bytes = uint32_t(round_up(ix.blob_size, kAlign));  // <= 2^31
  std::string dt = jsonc::as_str(F("dtype"), mw, "metadata.dtype");
  if (dt != ix.dtype) fail(mw, "metadata.dtype " + quote(dt) + " differs from the header's " + ix.dtype);
  ix.family = jsonc::as_str(F("family"), mw, "metadata.family");
  ix.config_hash = jsonc::as_str(F("config_hash"), mw, "metadata.config_hash");
  {  // the weights it was built from (checked against a model by the toolkit; required here too)
    const json& src = F("source");
    jsonc::need_object(src, mw, "metadata.source");
    ix.source_digest = jsonc::as_str(jsonc::field(src, "digest", mw, "metadata.source"), mw, "metadata.source.digest");
    if (ix.source_digest.size() != 64) fail(mw, "metadata.source.digest is not a sha256");
  }
  {
    int64_t g = jsonc::as_int(F("group_size"), mw, "metadata.group_size", 0, 1 << 20);
    if (uint32_t(g) != h.group) fail(mw, "metadata.group_size " + std::to_string(g) + " differs from the header's " + std::to_string(h.group));
  }
  for (int64_t l : jsonc::as_int_list(F("moe_layers"), mw, "metadata.moe_layers", 0, 1 << 16)) {
    if (!ix.moe_layers.empty() && l <= ix.moe_layers.back()) fail(mw, "metadata.moe_layers must be increasing");
    ix.moe_layers.push_back(int(l));
  }
  if (ix.moe_layers.size() != h.L)
    fail(mw, "metadata.moe_layers lists " + std::to_string(ix.moe_layers.size()) + " layers, the header " + std::to_string(h.L));
  const json& mats = jsonc::as_list(F("matrices"), mw, "metadata.matrices");
  for (size_t i = 0; i < mats.size(); ++i) {
    std::string k = "metadata.matrices[" + std::to_string(i) + "]";
    Matrix m;
    m.role = jsonc::as_str(jsonc::field(mats[i], "role", mw, k), mw, k + ".role");
    m.shape = jsonc::as_int_list(jsonc::field(mats[i], "shape", mw, k), mw, k + ".shape", 1, 1 << 24);
    if (m.shape.empty() || m.shape.size() > 2) fail(mw, k + ".shape must be [out, in] or [out]");
    ix.matrices.push_back(std::move(m));
  }
  if (ix.matrices.empty()) fail(mw, "metadata.matrices is empty");
  const json& secs = jsonc::as_list(F("sections"), mw, "metadata.sections");
  for (size_t i = 0; i < secs.size(); ++i) {
    std::string k = "metadata.sections[" + std::to_string(i) + "]";
    const json& s = secs[i];
    Section x;
    x.role = jsonc::as_str(jsonc::field(s, "role", mw, k), mw, k + ".role");
    x.kind = jsonc::as_str(jsonc::field(s, "kind", mw, k), mw, k + ".kind");
    x.dtype = jsonc::as_str(jsonc::field(s, "dtype", mw, k), mw, k + ".dtype");
    if (x.kind != "weight" && x.kind != "scale" && x.kind != "bias") fail(mw, k + ".kind " + quote(x.kind) + ": expected weight, scale or bias");
    uint64_t item = x.dtype == "f16" ? 2 : (x.dtype == "i8" || x.dtype == "u8") ? 1 : 0;
    if (!item) fail(mw, k + ".dtype " + quote(x.dtype) + ": expected f16, i8 or u8");
    x.shape = jsonc::as_int_list(jsonc::field(s, "shape", mw, k), mw, k + ".shape", 1, 1 << 24);
    if (x.shape.empty() || x.shape.size() > 2) fail(mw, k + ".shape must have 1 or 2 dimensions");
    uint64_t numel = 1;
    for (int64_t d : x.shape) numel *= uint64_t(d);  // <= 2^48
    int64_t off = jsonc::as_int(jsonc::field(s, "offset", mw, k), mw, k + ".offset", 0, int64_t(ix.blob_size));
    int64_t nb = jsonc::as_int(jsonc::field(s, "nbytes", mw, k), mw, k + ".nbytes", 0, int64_t(ix.blob_size));
    if (uint64_t(nb) != numel * item) fail(mw, k + ".nbytes " + std::to_string(nb) + " does not match its shape and dtype");
    if (off % 64) fail(mw, k + ".offset " + std::to_string(off) + " is not a multiple of 64");
    if (uint64_t(off) + uint64_t(nb) > ix.blob_size) fail(mw, k + " ends past the blob (" + std::to_string(ix.blob_size) + " bytes)");
    x.offset = size_t(off);
    x.nbytes = size_t(nb);
    ix.sections.push_back(std::move(x));
  }
  if (ix.sections.empty()) fail(mw, "metadata.sections is empty");

  // entries
  const uint64_t count = uint64_t(h.L) * h.E;
  ix.entries.assign(size_t(count), Entry{});
  std::vector<bool> seen(size_t(count), false);
  for (uint64_t i = 0; i < count; ++i) {
    const uint8_t* p = body + i * kEntrySize;
    uint32_t layer = u32(p), expert = u32(p + 4), crc = u32(p + 24);
    uint64_t off = u64(p + 8), size = u64(p + 16);
    if (layer >= h.L || expert >= h.E || seen[size_t(layer) * h.E + expert] || size != ix.blob_size)
      fail(where, "index entry " + std::to_string(i) + " is invalid (layer " + std::to_string(layer) + ", expert " +
                      std::to_string(expert) + ", size " + std::to_string(size) + "; expected < " + std::to_string(h.L) +
                      ", < " + std::to_string(h.E) + ", unique, " + std::to_string(ix.blob_size) + " B)");
    if (off % kAlign || off < h.data_offset || off > file_size || ix.slot_bytes > file_size - off)
      fail(where, "expert (" + std::to_string(layer) + ", " + std::to_string(expert) + ") lies outside the file (offset " +
                      std::to_string(off) + ", size " + std::to_string(size) + ", file " + std::to_string(file_size) +
                      " bytes): truncated?");
    seen[size_t(layer) * h.E + expert] = true;
    ix.entries[size_t(layer) * h.E + expert] = Entry{off, uint32_t(size), crc};
  }
  std::vector<uint64_t> offs;
  offs.reserve(ix.entries.size());
  for (const Entry& e : ix.entries) offs.push_back(e.offset);
  std::sort(offs.begin(), offs.end());
  for (size_t i = 1; i < offs.size(); ++i)
    if (offs[i] - offs[i - 1] < ix.slot_bytes) fail(where, "two experts' slots overlap at offset " + std::to_string(offs[i]) + " (corrupt index)");
  return ix;
}

AlignedBuffer::AlignedBuffer(size_t bytes) : size(bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, ExpertStore::kAlign, std::max<size_t>(bytes, 1)) != 0) throw std::bad_alloc();
  ptr = static_cast<uint8_t*>(p);
}
AlignedBuffer::~AlignedBuffer() { std::free(ptr); }

std::unique_ptr<ExpertStore> ExpertStore::open(const std::string& path, bool try_direct) {
  std::unique_ptr<ExpertStore> s(new ExpertStore());
  s->path = path;
  s->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (s->fd_ < 0) {
    if (errno == ENOENT) fail(path, "expert store not found");
    fail(path, "cannot open the expert store (" + errno_text() + ")");
  }
  struct stat st;
  if (::fstat(s->fd_, &st) != 0) fail(path, "cannot stat (" + errno_text() + ")");
  if (!S_ISREG(st.st_mode)) fail(path, "the expert store is not a regular file");
  s->file_size = uint64_t(st.st_size);

  auto pread_all = [&](uint8_t* dst, size_t n, uint64_t off) {
    size_t got = 0;
    while (got < n) {
      ssize_t r = ::pread(s->fd_, dst + got, n - got, off_t(off + got));
      if (r < 0) {
        if (errno == EINTR) continue;
        fail(path, "read failed (" + errno_text() + ")");
      }
      if (r == 0) fail(path, "truncated expert store (short read at offset " + std::to_string(off + got) + ")");
      got += size_t(r);
    }
  };
  std::vector<uint8_t> head(kHeaderSize);
  if (s->file_size < kHeaderSize) fail(path, "truncated expert store (no header)");
  pread_all(head.data(), head.size(), 0);
  uint64_t need = index_bytes(head.data(), head.size(), s->file_size, path);
  std::vector<uint8_t> prefix(static_cast<size_t>(need));  // need <= file size, and < 2^37
  pread_all(prefix.data(), prefix.size(), 0);
  Index ix = parse_index(prefix.data(), prefix.size(), s->file_size, path);

  s->dtype = ix.dtype;
  s->num_layers = ix.num_layers; s->num_experts = ix.num_experts;
  s->hidden_size = ix.hidden_size; s->intermediate_size = ix.intermediate_size;
  s->group_size = ix.group_size; s->has_bias = ix.has_bias;
  s->blob_size = ix.blob_size; s->slot_bytes = ix.slot_bytes;
  s->sections = std::move(ix.sections); s->matrices = std::move(ix.matrices);
  s->moe_layers = std::move(ix.moe_layers);
  s->family = std::move(ix.family); s->config_hash = std::move(ix.config_hash);
  s->source_digest = std::move(ix.source_digest);
  s->entries_ = std::move(ix.entries);
  if (try_direct) s->self_test();
  else s->io_note_ = "O_DIRECT not tried (asked for buffered reads); buffered reads with posix_fadvise(DONTNEED)";
  return s;
}

ExpertStore::~ExpertStore() {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (fd_ >= 0) ::close(fd_);
}

void ExpertStore::self_test() {
  const char* fallback = "; buffered reads with posix_fadvise(DONTNEED)";
  // the same inode as fd_ (never the path again: it may have been replaced since)
  std::string proc = "/proc/self/fd/" + std::to_string(fd_);
  int dfd = ::open(proc.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (dfd < 0 && errno != EINVAL) {
    dfd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT | O_NONBLOCK);
    struct stat a, b;
    if (dfd >= 0 && (::fstat(dfd, &a) != 0 || ::fstat(fd_, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino)) {
      ::close(dfd);
      io_note_ = std::string("the store file changed on disk while opening it") + fallback;
      return;
    }
  }
  if (dfd < 0) {
    int e = errno;
    io_note_ = e == EINVAL ? std::string("O_DIRECT not supported by the filesystem (EINVAL)") + fallback
                           : "O_DIRECT open failed (" + std::string(std::strerror(e)) + ")" + fallback;
    return;
  }
  const Entry& en = entry(0, 0);
  try {
    AlignedBuffer d(slot_bytes), b(slot_bytes);
    size_t got = 0;
    while (got < slot_bytes) {
      ssize_t r = ::pread(dfd, d.ptr + got, slot_bytes - got, off_t(en.offset + got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        int e = r < 0 ? errno : 0;
        ::close(dfd);
        io_note_ = (e == EINVAL ? std::string("O_DIRECT reads not supported here (EINVAL)")
                                : e ? "O_DIRECT read failed (" + std::string(std::strerror(e)) + ")"
                                    : std::string("O_DIRECT read came back short")) + fallback;
        return;
      }
      got += size_t(r);
    }
    read(0, 0, b.ptr);  // buffered (direct_ is still false)
    if (std::memcmp(d.ptr, b.ptr, slot_bytes) != 0) {
      ::close(dfd);
      io_note_ = std::string("O_DIRECT read differed from a buffered read of the same expert") + fallback;
      return;
    }
  } catch (...) {
    ::close(dfd);
    throw;
  }
  direct_fd_ = dfd;
  direct_ = true;
  io_note_ = "O_DIRECT reads (self-test: the first expert read identically with O_DIRECT and buffered)";
}

const ExpertStore::Entry& ExpertStore::entry(int layer, int expert) const {
  if (layer < 0 || layer >= num_layers || expert < 0 || expert >= num_experts)
    fail(path, "no expert (" + std::to_string(layer) + ", " + std::to_string(expert) + ") (the store has " +
                   std::to_string(num_layers) + " layers x " + std::to_string(num_experts) + " experts)");
  return entries_[size_t(layer) * size_t(num_experts) + size_t(expert)];
}

bool ExpertStore::check(int layer, int expert, const void* blob) const {
  const Entry& e = entry(layer, expert);
  return crc32(blob, e.size) == e.crc32;
}

void ExpertStore::drop_cache() const {
  if (fd_ >= 0) (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
}

void ExpertStore::read(int layer, int expert, void* dst) const {
  const Entry& e = entry(layer, expert);
  const bool use_direct = direct_ && (reinterpret_cast<uintptr_t>(dst) % kAlign) == 0;
  const int fd = use_direct ? direct_fd_ : fd_;
  uint8_t* out = static_cast<uint8_t*>(dst);
  size_t got = 0;
  while (got < slot_bytes) {
    ssize_t r = ::pread(fd, out + got, slot_bytes - got, off_t(e.offset + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail(path, "read of expert (" + std::to_string(layer) + ", " + std::to_string(expert) + ") failed (" + errno_text() + ")");
    }
    if (r == 0)
      fail(path, "short read of expert (" + std::to_string(layer) + ", " + std::to_string(expert) + ") at offset " +
                     std::to_string(e.offset + got) + " (file truncated?)");
    got += size_t(r);
  }
  // buffered: drop the range from the page cache, so this run's pool (not the kernel) decides
  // what stays resident, and the next run starts cold too
  if (!use_direct) (void)::posix_fadvise(fd_, off_t(e.offset), off_t(slot_bytes), POSIX_FADV_DONTNEED);
}

}  // namespace spx
