// The CPU quota of this process's cgroup (a CFS quota: Kubernetes' CPU limit, Docker's --cpus,
// a Slurm or lab node held to part of a core). OpenMP and BLAS size their thread pools by the
// CPUs a process may run on, which a quota does not shrink: a rank held to half a core still
// starts a thread per CPU, and each waits for the others' time slices.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace pipesgd {

struct CpuQuota {
  double cpus = 0;   // quota / period: 0.5 is half a CPU
  std::string file;  // where it was read, for the message
};

// From /proc/self/cgroup's text and the cgroup mount point: cgroup v2's cpu.max ("max" is no
// quota), else v1's cpu.cfs_quota_us over cpu.cfs_period_us (-1 is none), in the process's
// cgroup and, up to the mount, its parents (the tightest one holds). nullopt: no quota, or
// nothing readable (a container whose cgroup paths are not mounted where /proc says).
std::optional<CpuQuota> CpuQuotaOf(std::string_view proc_self_cgroup,
                                   const std::filesystem::path& cgroup_root);

// The same for this process (/proc/self/cgroup, /sys/fs/cgroup).
std::optional<CpuQuota> ProcessCpuQuota();

// The CPU time per second this process may take: the CPUs its affinity mask allows (taskset,
// cpusets), or the quota where that is lower. >= 1 CPU's worth unless a quota says less.
double ProcessCpus();

}  // namespace pipesgd
