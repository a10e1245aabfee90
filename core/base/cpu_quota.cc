#include "core/base/cpu_quota.h"

#include <sched.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

namespace pipesgd {

namespace {

// The first two words of a file (a missing one: nullopt).
std::pair<std::optional<std::string>, std::optional<std::string>> ReadWords(
    const std::filesystem::path& file) {
  std::ifstream in(file);
  std::string first, second;
  if (!(in >> first)) return {};
  if (!(in >> second)) return {first, std::nullopt};
  return {first, second};
}

std::optional<double> Number(const std::optional<std::string>& word) {
  if (!word) return std::nullopt;
  double v = 0;
  const char* end = word->data() + word->size();
  const auto [p, ec] = std::from_chars(word->data(), end, v);
  if (ec != std::errc() || p != end) return std::nullopt;
  return v;
}

// quota / period where both are numbers and the quota is positive (v1 writes -1, v2 "max").
std::optional<double> Ratio(const std::optional<std::string>& quota,
                            const std::optional<std::string>& period) {
  const auto q = Number(quota), p = Number(period);
  if (!q || !p || *q <= 0 || *p <= 0) return std::nullopt;
  return *q / *p;
}

// The tightest quota from `dir` up to `root` (a parent's quota holds its children too).
std::optional<CpuQuota> Tightest(const std::filesystem::path& root, std::string_view cgroup,
                                 bool v2) {
  std::optional<CpuQuota> best;
  std::filesystem::path rel = std::filesystem::path(cgroup).relative_path();
  for (;;) {
    const std::filesystem::path dir = root / rel;
    // v2: "QUOTA PERIOD" in one file; v1: one number in each of two.
    const auto cpus = v2 ? std::apply(Ratio, ReadWords(dir / "cpu.max"))
                         : Ratio(ReadWords(dir / "cpu.cfs_quota_us").first,
                                 ReadWords(dir / "cpu.cfs_period_us").first);
    if (cpus && (!best || *cpus < best->cpus)) {
      best = CpuQuota{*cpus, (dir / (v2 ? "cpu.max" : "cpu.cfs_quota_us")).string()};
    }
    if (rel.empty()) break;
    rel = rel.parent_path();
  }
  return best;
}

}  // namespace

std::optional<CpuQuota> CpuQuotaOf(std::string_view proc_self_cgroup,
                                   const std::filesystem::path& cgroup_root) {
  // Lines "ID:CONTROLLERS:PATH": v2's is "0::PATH", v1's cpu controller "N:cpu,cpuacct:PATH".
  std::istringstream lines{std::string(proc_self_cgroup)};
  std::string line;
  std::optional<CpuQuota> v1, v2;
  while (std::getline(lines, line)) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) {
      // v2 alone is mounted at the root; beside v1 ("hybrid") at unified/.
      v2 = Tightest(cgroup_root, path, true);
      if (!v2) v2 = Tightest(cgroup_root / "unified", path, true);
      continue;
    }
    std::stringstream names(controllers);
    std::string name;
    while (std::getline(names, name, ',')) {
      if (name != "cpu") continue;
      for (const char* mount : {"cpu", "cpu,cpuacct", "cpuacct,cpu"}) {
        v1 = Tightest(cgroup_root / mount, path, false);
        if (v1) break;
      }
    }
  }
  if (v1 && (!v2 || v1->cpus < v2->cpus)) return v1;
  return v2;
}

std::optional<CpuQuota> ProcessCpuQuota() {
  std::ifstream in("/proc/self/cgroup");
  std::stringstream text;
  text << in.rdbuf();
  return CpuQuotaOf(text.str(), "/sys/fs/cgroup");
}

double ProcessCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  double cpus = sched_getaffinity(0, sizeof(set), &set) == 0
                    ? CPU_COUNT(&set)
                    : std::max(1u, std::thread::hardware_concurrency());
  if (const auto quota = ProcessCpuQuota(); quota && quota->cpus > 0) {
    cpus = std::min(cpus, quota->cpus);
  }
  return cpus;
}

}  // namespace pipesgd
