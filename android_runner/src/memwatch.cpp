#include "memwatch.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "common.h"

namespace spx {

namespace {

constexpr int64_t kUnlimited = int64_t(1) << 62;  // v1 prints ~2^63 for "no limit"

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The first whitespace-separated word of a file, or "" when it cannot be read.
std::string first_word(const std::string& path) {
  std::ifstream f(path);
  std::string w;
  if (!(f >> w)) return "";
  return w;
}

// A non-negative integer file (`max` / an unreadable file: -1).
int64_t read_bytes(const std::string& path) {
  const std::string w = first_word(path);
  if (w.empty() || w == "max") return -1;
  char* end = nullptr;
  const long long v = std::strtoll(w.c_str(), &end, 10);
  if (*end != '\0' || v < 0) return -1;
  return v;
}

// `name value` lines (memory.stat); -1 when absent.
int64_t stat_field(const std::string& path, const std::string& name) {
  std::ifstream f(path);
  std::string k;
  long long v = 0;
  while (f >> k >> v)
    if (k == name) return v;
  return -1;
}

// mountinfo escapes space, tab, newline and backslash as \ooo
std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    auto oct = [&](size_t j) { return s[j] >= '0' && s[j] <= '7'; };
    if (s[i] == '\\' && i + 3 < s.size() && oct(i + 1) && oct(i + 2) && oct(i + 3)) {
      out.push_back(static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

std::string strip_slashes(std::string s) {
  while (!s.empty() && s.back() == '/') s.pop_back();
  return s;
}

}  // namespace

std::string proc_root() {
  const char* r = std::getenv("SPX_PROC_ROOT");
  return r != nullptr ? strip_slashes(r) : std::string();
}

CgroupPaths find_memory_cgroup(const std::string& root) {
  CgroupPaths out;
  std::ifstream cg(root + "/proc/self/cgroup");
  std::string line, v1_path, v2_path;
  bool have_v1 = false, have_v2 = false;
  while (std::getline(cg, line)) {  // hierarchy-ID:controller-list:path
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string ctrl = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && ctrl.empty()) {
      have_v2 = true;
      v2_path = path;
    }
    std::stringstream ss(ctrl);
    std::string c;
    while (std::getline(ss, c, ','))
      if (c == "memory") {
        have_v1 = true;
        v1_path = path;
      }
  }
  if (!have_v1 && !have_v2) return out;
  const int version = have_v1 ? 1 : 2;  // the memory controller is in one hierarchy only
  const std::string rel = have_v1 ? v1_path : v2_path;
  std::ifstream mi(root + "/proc/self/mountinfo");
  while (std::getline(mi, line)) {
    const size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream left(line.substr(0, dash)), right(line.substr(dash + 3));
    std::vector<std::string> lf, rf;
    for (std::string w; left >> w;) lf.push_back(w);
    for (std::string w; right >> w;) rf.push_back(w);
    if (lf.size() < 5 || rf.size() < 3) continue;
    bool match = false;
    if (version == 2) {
      match = rf[0] == "cgroup2";
    } else if (rf[0] == "cgroup") {
      std::stringstream ss(rf[2]);
      for (std::string o; std::getline(ss, o, ',');) match = match || o == "memory";
    }
    if (!match) continue;
    const std::string mroot = unescape(lf[3]), mnt = root + strip_slashes(unescape(lf[4]));
    std::string sub = rel;
    if (mroot != "/" && sub.compare(0, mroot.size(), mroot) == 0) sub = sub.substr(mroot.size());
    sub = strip_slashes(sub);
    while (!sub.empty() && sub[0] == '/') sub.erase(0, 1);
    std::string dir = sub.empty() ? mnt : mnt + "/" + sub;
    if (!is_dir(dir)) return out;
    out.version = version;
    while (true) {  // this cgroup, then each ancestor up to the mount point
      out.dirs.push_back(dir);
      if (dir.size() <= mnt.size()) break;
      dir = dir.substr(0, dir.rfind('/'));
      if (dir.size() < mnt.size()) break;
    }
    return out;
  }
  return out;
}

MemSample sample_memory(const std::string& root, const CgroupPaths& cg) {
  MemSample s;
  {
    std::ifstream f(root + "/proc/meminfo");
    std::string k;
    long long v = 0;
    std::string unit;
    std::string line;
    while (std::getline(f, line)) {
      std::istringstream ls(line);
      if (!(ls >> k >> v)) continue;
      ls >> unit;
      const int64_t bytes = unit == "kB" ? static_cast<int64_t>(v) * 1024 : static_cast<int64_t>(v);
      if (k == "MemAvailable:") s.meminfo_available = bytes;
      else if (k == "MemTotal:") s.meminfo_total = bytes;
    }
  }
  s.cgroup_version = cg.version;
  if (!cg.dirs.empty()) s.cgroup_dir = cg.dirs.front();
  for (const auto& d : cg.dirs) {
    const int64_t limit = read_bytes(d + (cg.version == 1 ? "/memory.limit_in_bytes" : "/memory.max"));
    if (limit < 0 || limit >= kUnlimited) continue;
    const int64_t usage = read_bytes(d + (cg.version == 1 ? "/memory.usage_in_bytes" : "/memory.current"));
    if (usage < 0) continue;
    // page cache no process maps: inactive + active file - mapped file (v1: the hierarchical total_*)
    const std::string stat = d + "/memory.stat";
    auto field = [&](const char* v1, const char* v2) {
      int64_t v = stat_field(stat, cg.version == 1 ? std::string("total_") + v1 : std::string(v2));
      if (v < 0 && cg.version == 1) v = stat_field(stat, v1);
      return std::max<int64_t>(v, 0);
    };
    const int64_t inactive = std::max<int64_t>(
        0, field("inactive_file", "inactive_file") + field("active_file", "active_file") -
               field("mapped_file", "file_mapped"));
    const int64_t room = std::max<int64_t>(0, limit - std::max<int64_t>(0, usage - inactive));
    if (!s.cgroup_limited || room < s.cgroup_room) {
      s.cgroup_limited = true;
      s.cgroup_limit = limit;
      s.cgroup_usage = usage;
      s.cgroup_inactive_file = inactive;
      s.cgroup_room = room;
    }
  }
  if (s.cgroup_limited && (s.meminfo_available < 0 || s.cgroup_room <= s.meminfo_available)) {
    s.available = s.cgroup_room;
    s.source = cg.version == 1 ? "cgroup v1" : "cgroup v2";
  } else if (s.meminfo_available >= 0) {
    s.available = s.meminfo_available;
    s.source = "meminfo";
  }
  return s;
}

static std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", bytes / 1048576.0);
  return buf;
}

int64_t default_reserve(int64_t available) {
  return std::min<int64_t>(int64_t(512) << 20, std::max<int64_t>(available, 0) / 4);
}

PoolSizing size_pool(const MemSample& sample, double reserve_mib, double low_mib, double high_mib, int check_ms,
                     int64_t program_bytes, int64_t slot_bytes, int64_t min_slots, int64_t all_slots) {
  constexpr double MiB = 1048576.0;
  if (sample.available < 0)
    throw Error("--pool-mib auto: cannot measure the available memory (no MemAvailable in " +
                (proc_root().empty() ? std::string("/proc/meminfo") : proc_root() + "/proc/meminfo") +
                " and no memory cgroup limit); give --pool-mib F");
  PoolSizing z;
  z.sample = sample;
  z.reserve_default = reserve_mib < 0;
  z.reserve_bytes = reserve_mib < 0 ? default_reserve(sample.available) : static_cast<int64_t>(reserve_mib * MiB);
  z.low_bytes = low_mib < 0 ? z.reserve_bytes / 2 : static_cast<int64_t>(low_mib * MiB);
  z.high_bytes = high_mib < 0 ? z.reserve_bytes + z.reserve_bytes / 2 : static_cast<int64_t>(high_mib * MiB);
  z.check_ms = check_ms;
  if (z.low_bytes > z.reserve_bytes)
    throw Error("--pool-low-watermark-mib " + mib(z.low_bytes) + ": above the reserve (" +
                mib(z.reserve_bytes) + " MiB), so a full pool would shrink at once; give at most the reserve");
  if (z.high_bytes != 0 && z.high_bytes <= z.reserve_bytes)
    throw Error("--pool-high-watermark-mib " + mib(z.high_bytes) + ": must be above the reserve (" +
                mib(z.reserve_bytes) + " MiB), or 0 (never grow)");
  z.program_bytes = std::max<int64_t>(program_bytes, 0);
  z.slot_bytes = slot_bytes;
  z.min_slots = min_slots;
  z.all_slots = all_slots;
  const int64_t room = sample.available - z.reserve_bytes - z.program_bytes;
  z.slots = room > 0 ? room / slot_bytes : 0;
  z.capped = z.slots >= all_slots;
  z.slots = std::min(z.slots, all_slots);
  if (z.slots < min_slots) {
    char buf[400];
    std::snprintf(buf, sizeof buf,
                  "--pool-mib auto: %.1f MiB available (%s) minus the %.1f MiB reserve and the program's %.1f MiB "
                  "leaves %.2f MiB: %lld expert slots of %.0f KiB, but one layer needs %lld at once; free memory or "
                  "lower --pool-reserve-mib",
                  sample.available / MiB, sample.source.c_str(), z.reserve_bytes / MiB, z.program_bytes / MiB,
                  std::max<int64_t>(room, 0) / MiB, static_cast<long long>(z.slots), slot_bytes / 1024.0,
                  static_cast<long long>(min_slots));
    throw Error(buf);
  }
  return z;
}

namespace {
std::atomic<MemWatch*> g_active{nullptr};
}

MemWatch* MemWatch::active() { return g_active.load(); }
void MemWatch::set_active(MemWatch* w) { g_active.store(w); }

MemWatch::MemWatch(const MemWatchConfig& cfg, const CgroupPaths& cg, Clock::time_point t0)
    : cfg_(cfg), cg_(cg), t0_(t0) {}

MemWatch::~MemWatch() {
  stop();
  if (active() == this) set_active(nullptr);
}

double MemWatch::t_ms() const { return std::chrono::duration<double, std::milli>(Clock::now() - t0_).count(); }

int64_t MemWatch::decide(int64_t available, int64_t resident, int64_t cur) const {
  if (cur < 0) cur = cfg_.start_slots;
  const int64_t room = resident + available - cfg_.reserve_bytes;  // what the pool may hold
  int64_t ideal = room >= 0 ? room / cfg_.slot_bytes : -((-room + cfg_.slot_bytes - 1) / cfg_.slot_bytes);
  ideal = std::min(std::max(ideal, cfg_.min_slots), cfg_.start_slots);
  if (available < cfg_.low_bytes) return std::min(cur, ideal);
  if (cfg_.high_bytes > 0 && available > cfg_.high_bytes) return std::max(cur, ideal);
  return cur;
}

void MemWatch::tick() {
  const int64_t r1 = resident_.load(std::memory_order_relaxed);
  const MemSample s = sample_memory(cfg_.root, cg_);
  const int64_t r2 = resident_.load(std::memory_order_relaxed);
  if (s.available < 0) return;
  samples_.fetch_add(1);
  const int64_t m = min_available_.load();
  if (m < 0 || s.available < m) min_available_.store(s.available);
  const int64_t cur = target_.load(std::memory_order_relaxed);
  const int64_t nxt = decide(s.available, std::min(r1, r2), cur);
  if (nxt != (cur < 0 ? cfg_.start_slots : cur)) {
    target_available_.store(s.available, std::memory_order_relaxed);
    target_.store(nxt, std::memory_order_relaxed);
  }
}

void MemWatch::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    lk.unlock();
    tick();
    lk.lock();
    cv_.wait_for(lk, std::chrono::milliseconds(cfg_.check_ms), [this] { return stop_; });
  }
}

void MemWatch::start() {
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread([this] { loop(); });
}

void MemWatch::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void MemWatch::record(CapacityChange c) {
  c.t_ms = t_ms();
  std::lock_guard<std::mutex> lk(mu_);
  changes_.push_back(c);
}

std::vector<CapacityChange> MemWatch::changes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return changes_;
}

}  // namespace spx
