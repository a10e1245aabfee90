// core/job/model_builder: a rank whose library threads outnumber its CPU quota runs the quota's
// count instead, and the setters that does it through take effect.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "core/job/model_builder.h"
#include "layers/model.h"

namespace pipesgd::job {
namespace {

ThreadPool OneDnn(int threads, const char* env = nullptr) {
  return {"oneDNN's convolutions", "OpenMP threads", "OMP_NUM_THREADS", env, threads};
}

TEST(ThreadsForQuota, TheQuotaRoundedUpWhereTheVariableIsUnsetAndTheThreadsExceedIt) {
  EXPECT_EQ(ThreadsForQuota(OneDnn(2), CpuQuota{0.5, "q"}), 1);
  EXPECT_EQ(ThreadsForQuota(OneDnn(5), CpuQuota{4, "q"}), 4);
  // Values the libraries ignore (libgomp warns, OpenBLAS takes 0 as unset) give no count.
  for (const char* ignored : {"", "0", "abc", "-2"}) {
    EXPECT_EQ(ThreadsForQuota(OneDnn(2, ignored), CpuQuota{0.5, "q"}), 1) << ignored;
  }
  // 64 OpenBLAS threads on a 2.5-CPU pod: 3.
  EXPECT_EQ(ThreadsForQuota({"OpenBLAS's matrix products", "threads", "OPENBLAS_NUM_THREADS",
                             nullptr, 64},
                            CpuQuota{2.5, "cpu.max"}),
            3);
}

TEST(ThreadsForQuota, NothingWhereTheThreadsFitTheUserChoseOrNothingIsKnown) {
  const CpuQuota half{0.5, "q"};
  EXPECT_EQ(ThreadsForQuota(OneDnn(2, "2"), half), std::nullopt);  // the user's choice
  EXPECT_EQ(ThreadsForQuota(OneDnn(2, "4,2"), half), std::nullopt);  // OpenMP's list form
  EXPECT_EQ(ThreadsForQuota(OneDnn(1), half), std::nullopt);       // one: nothing to gain
  EXPECT_EQ(ThreadsForQuota(OneDnn(0), half), std::nullopt);       // the count is unknown
  EXPECT_EQ(ThreadsForQuota(OneDnn(8), std::nullopt), std::nullopt);  // no quota
  EXPECT_EQ(ThreadsForQuota(OneDnn(2), CpuQuota{1.5, "q"}), std::nullopt);
  EXPECT_EQ(ThreadsForQuota(OneDnn(4), CpuQuota{4, "q"}), std::nullopt);
}

TEST(ThreadsForQuota, TheMessageNamesTheVariableTheCountsTheQuotaAndItsFile) {
  EXPECT_EQ(ThreadsForQuotaMessage(OneDnn(2), 1,
                                   CpuQuota{0.5, "/sys/fs/cgroup/cpu/lab/n1/cpu.cfs_quota_us"}),
            "OMP_NUM_THREADS is unset and oneDNN's convolutions would run 2 OpenMP threads in "
            "this process, over its CPU quota of 0.50 CPU "
            "(/sys/fs/cgroup/cpu/lab/n1/cpu.cfs_quota_us), where they wait for each other's time "
            "slices: they run 1 (set OMP_NUM_THREADS to choose; `pipesgd run` sets 1 where it is "
            "unset)");
  const std::string ignored = ThreadsForQuotaMessage(OneDnn(2, "abc"), 1, CpuQuota{0.5, "q"});
  EXPECT_EQ(ignored.rfind("OMP_NUM_THREADS='abc' is not a thread count and oneDNN's convolutions "
                          "would run 2 OpenMP threads",
                          0),
            0u)
      << ignored;
}

TEST(ThreadsForQuota, InfoDescribesTheQuotaAndTheCountsAWorkerWouldRun) {
  const ThreadPool blas_set{"OpenBLAS's matrix products", "threads", "OPENBLAS_NUM_THREADS", "1",
                            1};
  EXPECT_EQ(ThreadFittingDescription(CpuQuota{0.5, "q"}, OneDnn(2), blas_set),
            "CPU quota 0.50 CPU (q); a worker started here runs oneDNN's convolutions: OpenMP "
            "threads 1, fitted (OMP_NUM_THREADS is unset; the library counts 2); OpenBLAS's "
            "matrix products: threads 1 (OPENBLAS_NUM_THREADS=1)");
  EXPECT_EQ(ThreadFittingDescription(CpuQuota{2.5, "q"}, OneDnn(2, "abc"), OneDnn(0)),
            "CPU quota 2.50 CPU (q); a worker started here runs oneDNN's convolutions: OpenMP "
            "threads 2 (within the quota); oneDNN's convolutions: OpenMP threads not known");
  EXPECT_EQ(ThreadFittingDescription(CpuQuota{0.3, "q"}, OneDnn(4, "0"), OneDnn(2, "2")),
            "CPU quota 0.30 CPU (q); a worker started here runs oneDNN's convolutions: OpenMP "
            "threads 1, fitted (OMP_NUM_THREADS='0' is no count; the library counts 4); oneDNN's "
            "convolutions: OpenMP threads 2 (OMP_NUM_THREADS=2)");
  // A quota below 0.005 CPU does not read 0.00.
  const std::string tiny = ThreadsForQuotaMessage(OneDnn(2), 1, CpuQuota{0.001, "q"});
  EXPECT_NE(tiny.find("over its CPU quota of 0.001 CPU (q)"), std::string::npos) << tiny;
  EXPECT_EQ(ThreadFittingDescription(std::nullopt, OneDnn(2), blas_set),
            "no CPU quota on this process: the libraries' own thread counts hold");
}

TEST(ThreadsForQuota, OpenBlasCountIsSetForTheProcess) {
  const int before = layers::BlasThreads();
  if (before == 0) GTEST_SKIP() << "this BLAS cannot say its thread count";
  ASSERT_TRUE(layers::SetBlasThreads(3));
  EXPECT_EQ(layers::BlasThreads(), 3);
  int other = -1;
  std::thread([&] { other = layers::BlasThreads(); }).join();
  EXPECT_EQ(other, 3);
  EXPECT_FALSE(layers::SetBlasThreads(0));
  ASSERT_TRUE(layers::SetBlasThreads(before));
  EXPECT_EQ(layers::BlasThreads(), before);
}

TEST(ThreadsForQuota, OneDnnCountIsSetForTheCallingThreadOnly) {
  const int before = layers::OneDnnThreads();
  if (before == 0) GTEST_SKIP() << "no oneDNN on OpenMP in this build";
  int in_thread = -1;
  std::thread([&] {
    in_thread = layers::SetOneDnnThreads(before + 2) ? layers::OneDnnThreads() : -2;
  }).join();
  EXPECT_EQ(in_thread, before + 2);
  EXPECT_EQ(layers::OneDnnThreads(), before);  // OpenMP keeps the count per thread
  EXPECT_FALSE(layers::SetOneDnnThreads(0));
}

}  // namespace
}  // namespace pipesgd::job
