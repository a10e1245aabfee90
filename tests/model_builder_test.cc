// core/job/model_builder: the warning for a rank whose library threads outnumber its CPU quota.
#include <gtest/gtest.h>

#include "core/job/model_builder.h"

namespace pipesgd::job {
namespace {

ThreadPool OneDnn(int threads, const char* env = nullptr) {
  return {"oneDNN's convolutions run", "OpenMP threads", "OMP_NUM_THREADS", env, threads};
}

TEST(ThreadsOverQuota, WarnsWithTheCountTheQuotaItsFileAndTheFix) {
  const CpuQuota half{0.5, "/sys/fs/cgroup/cpu/lab/n1/cpu.cfs_quota_us"};
  const auto w = ThreadsOverQuotaWarning(OneDnn(2), half);
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(*w,
            "OMP_NUM_THREADS is unset, so oneDNN's convolutions run 2 OpenMP threads in this "
            "process, over its CPU quota of 0.50 CPU (/sys/fs/cgroup/cpu/lab/n1/cpu.cfs_quota_us); "
            "the threads wait for each other's time slices. Set OMP_NUM_THREADS=1 for each rank "
            "(`pipesgd run` sets 1 where it is unset)");
  // 64 OpenBLAS threads on a 2.5-CPU pod: 2 fit.
  const auto pod = ThreadsOverQuotaWarning(
      {"OpenBLAS's matrix products run", "threads", "OPENBLAS_NUM_THREADS", nullptr, 64},
      CpuQuota{2.5, "cpu.max"});
  ASSERT_TRUE(pod.has_value());
  EXPECT_NE(pod->find("OPENBLAS_NUM_THREADS is unset, so OpenBLAS's matrix products run 64 "
                      "threads in this process"),
            std::string::npos)
      << *pod;
  EXPECT_NE(pod->find("quota of 2.50 CPU (cpu.max)"), std::string::npos) << *pod;
  EXPECT_NE(pod->find("Set OPENBLAS_NUM_THREADS=2 "), std::string::npos) << *pod;
}

TEST(ThreadsOverQuota, SilentWhereTheThreadsFitTheUserChoseOrNothingIsKnown) {
  const CpuQuota half{0.5, "q"};
  EXPECT_FALSE(ThreadsOverQuotaWarning(OneDnn(2, "2"), half).has_value());  // the user's choice
  EXPECT_FALSE(ThreadsOverQuotaWarning(OneDnn(1), half).has_value());  // one: nothing to gain
  EXPECT_FALSE(ThreadsOverQuotaWarning(OneDnn(0), half).has_value());  // the count is unknown
  EXPECT_FALSE(ThreadsOverQuotaWarning(OneDnn(8), std::nullopt).has_value());  // no quota
  EXPECT_FALSE(ThreadsOverQuotaWarning(OneDnn(2), CpuQuota{1.5, "q"}).has_value());
  EXPECT_FALSE(ThreadsOverQuotaWarning(OneDnn(4), CpuQuota{4, "q"}).has_value());
  EXPECT_TRUE(ThreadsOverQuotaWarning(OneDnn(5), CpuQuota{4, "q"}).has_value());
}

}  // namespace
}  // namespace pipesgd::job
