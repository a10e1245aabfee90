// core/base: errors carry their code and context; deadlines expire when they should; the median;
// the cgroup CPU quota.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <thread>

#include "core/base/cpu_quota.h"
#include "core/base/deadline.h"
#include "core/base/error.h"
#include "core/base/measure.h"
#include "tests/support/temp_dir.h"

namespace pipesgd {
namespace {

TEST(Error, CarriesCodeAndFormattedMessage) {
  try {
    Throw(ErrorCode::kDataLoss, "{}: expected {} bytes, got {}", "file.idx", 16, 3);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_STREQ(e.what(), "file.idx: expected 16 bytes, got 3");
  }
}

TEST(Error, WrapAddsContextAndKeepsTheCode) {
  Error e(ErrorCode::kUnavailable, "connection reset");
  Error wrapped = e.Wrap("rank 2: AllReduce #7");
  EXPECT_EQ(wrapped.code(), ErrorCode::kUnavailable);
  EXPECT_STREQ(wrapped.what(), "rank 2: AllReduce #7: connection reset");
  EXPECT_EQ(ErrorCodeName(ErrorCode::kDeadlineExceeded), "deadline exceeded");
}

TEST(Deadline, ExpiresAfterItsTime) {
  Deadline d = Deadline::After(0.05);
  EXPECT_FALSE(d.expired());
  EXPECT_GT(d.remaining_s(), 0.0);
  EXPECT_LE(d.remaining_s(), 0.05);
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  EXPECT_TRUE(d.expired());
  EXPECT_EQ(d.remaining_s(), 0.0);
  EXPECT_TRUE(Deadline::After(0).expired());
  EXPECT_TRUE(Deadline::After(-1).expired());
  EXPECT_FALSE(Deadline::Infinite().expired());
}

TEST(Deadline, MinPicksTheEarlier) {
  Deadline far = Deadline::After(100);
  EXPECT_LE(far.Min(1).remaining_s(), 1.0);
  Deadline near = Deadline::After(1);
  EXPECT_EQ(near.Min(100).when(), near.when());
}

TEST(Median, MiddleSampleOrTheMeanOfTheTwoMiddleOnes) {
  EXPECT_EQ(Median({}), 0.0);
  EXPECT_EQ(Median({7.0}), 7.0);
  EXPECT_EQ(Median({3.0, 1.0, 2.0}), 2.0);
  // Two ranks: their mean, not the slower one (the spread printed min / max / max).
  EXPECT_EQ(Median({1.0, 4.0}), 2.5);
  EXPECT_EQ(Median({9.0, 1.0, 5.0, 3.0}), 4.0);
  EXPECT_EQ(Median({2.0, 2.0, 2.0, 8.0}), 2.0);
}

// A cgroup tree of files, as the kernel shows one, under a temporary folder.
struct FakeCgroups : testing::TempDir {
  void Write(const std::string& file, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(path(file)).parent_path());
    File(file, text + "\n");
  }
  std::filesystem::path root() const { return path(); }
};

TEST(CpuQuota, CgroupV2CpuMaxInTheProcessGroupOrAParent) {
  FakeCgroups fs;
  fs.Write("cpu.max", "max 100000");
  fs.Write("kubepods/pod1/cpu.max", "150000 100000");
  fs.Write("kubepods/pod1/c1/cpu.max", "max 100000");
  const auto q = CpuQuotaOf("0::/kubepods/pod1/c1\n", fs.root());
  ASSERT_TRUE(q.has_value());
  EXPECT_DOUBLE_EQ(q->cpus, 1.5);  // the parent's quota holds the child
  EXPECT_EQ(q->file, (fs.root() / "kubepods/pod1/cpu.max").string());
  // The tightest of the chain.
  fs.Write("kubepods/pod1/c1/cpu.max", "25000 50000");
  EXPECT_DOUBLE_EQ(CpuQuotaOf("0::/kubepods/pod1/c1\n", fs.root())->cpus, 0.5);
  // "max" all the way up: no quota.
  fs.Write("kubepods/pod1/cpu.max", "max 100000");
  fs.Write("kubepods/pod1/c1/cpu.max", "max 100000");
  EXPECT_FALSE(CpuQuotaOf("0::/kubepods/pod1/c1\n", fs.root()).has_value());
}

TEST(CpuQuota, CgroupV1CfsQuotaBesideOtherControllers) {
  FakeCgroups fs;
  fs.Write("cpu/lab/n1/cpu.cfs_quota_us", "50000");
  fs.Write("cpu/lab/n1/cpu.cfs_period_us", "100000");
  fs.Write("cpu/cpu.cfs_quota_us", "-1");
  fs.Write("cpu/cpu.cfs_period_us", "100000");
  const std::string proc = "4:memory:/x\n2:cpuacct:/\n1:cpu:/lab/n1\n0::/\n";
  const auto q = CpuQuotaOf(proc, fs.root());
  ASSERT_TRUE(q.has_value());
  EXPECT_DOUBLE_EQ(q->cpus, 0.5);
  EXPECT_EQ(q->file, (fs.root() / "cpu/lab/n1/cpu.cfs_quota_us").string());
  // -1: none; the joint mount name "cpu,cpuacct" too.
  FakeCgroups none;
  none.Write("cpu,cpuacct/cpu.cfs_quota_us", "-1");
  none.Write("cpu,cpuacct/cpu.cfs_period_us", "100000");
  EXPECT_FALSE(CpuQuotaOf("3:cpu,cpuacct:/\n", none.root()).has_value());
}

TEST(CpuQuota, UnreadableOrMalformedIsNoQuota) {
  FakeCgroups fs;
  EXPECT_FALSE(CpuQuotaOf("0::/not/mounted\n", fs.root()).has_value());
  EXPECT_FALSE(CpuQuotaOf("garbage\n\n", fs.root()).has_value());
  fs.Write("cpu.max", "12abc 100000");
  EXPECT_FALSE(CpuQuotaOf("0::/\n", fs.root()).has_value());
  fs.Write("cpu.max", "50000 0");
  EXPECT_FALSE(CpuQuotaOf("0::/\n", fs.root()).has_value());
}

}  // namespace
}  // namespace pipesgd
