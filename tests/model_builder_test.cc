// core/job/model_builder: the warning for a rank whose oneDNN threads outnumber its CPU quota.
#include <gtest/gtest.h>

#include "core/job/model_builder.h"

namespace pipesgd::job {
namespace {

TEST(ThreadsOverQuota, WarnsWithTheCountTheQuotaItsFileAndTheFix) {
  const CpuQuota half{0.5, "/sys/fs/cgroup/cpu/lab/n1/cpu.cfs_quota_us"};
  const auto w = ThreadsOverQuotaWarning(2, half, nullptr);
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(*w,
            "OMP_NUM_THREADS is unset, so oneDNN's convolutions run 2 OpenMP threads in this "
            "process, over its CPU quota of 0.50 CPU (/sys/fs/cgroup/cpu/lab/n1/cpu.cfs_quota_us); "
            "the threads wait for each other's time slices. Set OMP_NUM_THREADS=1 for each rank "
            "(`pipesgd run` sets 1, as torchrun does)");
  // 64 threads on a 2.5-CPU pod: 2 fit.
  const auto pod = ThreadsOverQuotaWarning(64, CpuQuota{2.5, "cpu.max"}, nullptr);
  ASSERT_TRUE(pod.has_value());
  EXPECT_NE(pod->find("run 64 OpenMP threads"), std::string::npos) << *pod;
  EXPECT_NE(pod->find("quota of 2.50 CPU (cpu.max)"), std::string::npos) << *pod;
  EXPECT_NE(pod->find("Set OMP_NUM_THREADS=2 "), std::string::npos) << *pod;
}

TEST(ThreadsOverQuota, SilentWhereTheThreadsFitTheUserChoseOrNothingIsKnown) {
  const CpuQuota half{0.5, "q"};
  EXPECT_FALSE(ThreadsOverQuotaWarning(2, half, "2").has_value());  // the user's choice
  EXPECT_FALSE(ThreadsOverQuotaWarning(1, half, nullptr).has_value());  // one thread: nothing to gain
  EXPECT_FALSE(ThreadsOverQuotaWarning(0, half, nullptr).has_value());  // not OpenMP
  EXPECT_FALSE(ThreadsOverQuotaWarning(8, std::nullopt, nullptr).has_value());  // no quota
  EXPECT_FALSE(ThreadsOverQuotaWarning(2, CpuQuota{1.5, "q"}, nullptr).has_value());
  EXPECT_FALSE(ThreadsOverQuotaWarning(4, CpuQuota{4, "q"}, nullptr).has_value());
  EXPECT_TRUE(ThreadsOverQuotaWarning(5, CpuQuota{4, "q"}, nullptr).has_value());
}

}  // namespace
}  // namespace pipesgd::job
