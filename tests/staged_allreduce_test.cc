// The staged AllReduce's pipeline (core/collective/staged_allreduce.h) on the CPU: the "device"
// buffer is ordinary memory and the copier is HostStagingCopier (memcpy, deferred to the next
// wait, in issue order), over real ranks on loopback TCP. This exercises the segment/lane logic
// that the CUDA path uses; the CUDA copier itself (core/cuda/cuda_staging.h) is exercised by
// tests/cuda_staging_test.cc where a GPU exists (it skips without one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/collective/staged_allreduce.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using collective::HostStagingCopier;
using collective::ReduceOp;
using collective::StagedAllReduce;
using testing::RankContext;
using testing::RunRanks;

float Input(int rank, size_t i) { return static_cast<float>(1000 * rank + (i % (1 << 20))); }

// Staged sums of `count` elements with `lanes` lanes of `seg` elements; "" when every element is
// bitwise the exact sum (or average) and every rank got the same.
std::string CheckStaged(const RankContext& ctx, const std::vector<size_t>& counts, size_t seg,
                        int lanes, uint64_t chunk_bytes) {
  auto comm = testing::ConnectRing(ctx, chunk_bytes);
  HostStagingCopier copier(lanes, seg);
  StagedAllReduce staged(*comm, copier);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    for (size_t count : counts) {
      std::vector<float> data(count);
      for (size_t i = 0; i < count; ++i) data[i] = Input(ctx.rank, i);
      staged.AllReduce(data.data(), count, op, Deadline::After(60));
      for (size_t i = 0; i < count; ++i) {
        double s = 0;
        for (int r = 0; r < ctx.world_size; ++r) s += Input(r, i);
        const float sum = static_cast<float>(s);
        const float want = op == ReduceOp::kSum ? sum : sum / static_cast<float>(ctx.world_size);
        if (std::memcmp(&data[i], &want, sizeof(float)) != 0) {
          return fmt::format("rank {} op {} count {} element {}: got {} expected {}", ctx.rank,
                             static_cast<int>(op), count, i, data[i], want);
        }
      }
    }
  }
  return "";
}

class StagedAllReduceTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(StagedAllReduceTest, ExactIntegerSumsThroughHostStaging) {
  const auto [world, lanes] = GetParam();
  // Segments of 1000 elements: counts below one segment, exactly one, and not a multiple;
  // chunks of 256 bytes so each segment's ring has several chunks per block.
  auto results = RunRanks(world, [&, lanes = lanes](const RankContext& ctx) {
    return CheckStaged(ctx, {0, 1, 999, 1000, 1001, 4321}, 1000, lanes, 256);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "") << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndLanes, StagedAllReduceTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(2, 3)));

// The copies overlap the ring: segment i+1's device-to-host copy is queued before segment i's
// host-to-device copy, and a lane is not refilled before its host-to-device copy is queued.
TEST(StagedAllReduce, QueuesTheNextCopyBeforeReducingTheCurrentSegment) {
  auto results = RunRanks(2, [](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx, 1 << 20);
    HostStagingCopier copier(2, 100);
    StagedAllReduce staged(*comm, copier);
    std::vector<float> data(250, 1.0f);
    staged.AllReduce(data.data(), data.size(), ReduceOp::kSum, Deadline::After(30));
    for (float v : data) {
      if (v != 2.0f) return fmt::format("got {} expected 2", v);
    }
    std::string log;
    for (const auto& line : copier.log()) log += line + "; ";
    return fmt::format("{}max_pending {}", log, copier.max_pending());
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output,
              "begin; to_host lane 0 n 100; wait_to_host lane 0; to_host lane 1 n 100; "
              "to_device lane 0 n 100; wait_to_host lane 1; to_host lane 0 n 50; "
              "to_device lane 1 n 100; wait_to_host lane 0; to_device lane 0 n 50; wait_all; "
              "max_pending 3");
  }
}

// The trainer's loss rides in the last element: exact_tail counts from the end of the whole
// buffer, so with a codec only the tail stays float32 even when it spans two segments.
TEST(StagedAllReduce, ExactTailSpansSegments) {
  auto results = RunRanks(2, [](const RankContext& ctx) -> std::string {
    collective::CommunicatorOptions options;
    options.chunk_bytes = 1 << 20;
    options.codec.kind = CodecKind::kTrunc16;
    auto comm = testing::ConnectRing(ctx, options);
    HostStagingCopier copier(2, 100);
    StagedAllReduce staged(*comm, copier);
    // 0x1.0101p0 is not a bfloat16: truncation changes it; the last 150 elements must not be.
    // Head, 2 ranks: the left rank's 1.0101 travels truncated (1.0), the owner adds its own
    // 1.0101 (exact in float) and truncates the sum once more: 2.0 on every rank.
    std::vector<float> data(250, 0x1.0101p0f);
    collective::AllReduceOptions call;
    call.exact_tail = 150;
    staged.AllReduce(data.data(), data.size(), ReduceOp::kSum, Deadline::After(30), nullptr,
                     call);
    for (size_t i = 0; i < data.size(); ++i) {
      const float want = i < 100 ? 2.0f : 2.0f * 0x1.0101p0f;
      if (data[i] != want) return fmt::format("element {}: got {:a} expected {:a}", i, data[i], want);
    }
    return "";
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "") << "rank " << r;
  }
}

TEST(StagedAllReduce, RefusesOneLaneAndErrorFeedback) {
  auto results = RunRanks(1, [](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx, 1 << 20);
    HostStagingCopier one(1, 10);
    try {
      StagedAllReduce staged(*comm, one);
      return "one lane accepted";
    } catch (const Error& e) {
      if (std::string(e.what()).find("at least 2") == std::string::npos) return e.what();
    }
    return "";
  });
  ASSERT_EQ(results[0].exit_code, 0) << results[0].error;
  EXPECT_EQ(results[0].output, "");
  results = RunRanks(1, [](const RankContext& ctx) -> std::string {
    collective::CommunicatorOptions options;
    options.codec.kind = CodecKind::kFp16;
    options.error_feedback = true;
    auto comm = testing::ConnectRing(ctx, options);
    HostStagingCopier two(2, 10);
    try {
      StagedAllReduce staged(*comm, two);
      return "error feedback accepted";
    } catch (const Error& e) {
      if (std::string(e.what()).find("error_feedback") == std::string::npos) return e.what();
    }
    return "";
  });
  ASSERT_EQ(results[0].exit_code, 0) << results[0].error;
  EXPECT_EQ(results[0].output, "");
}

}  // namespace
}  // namespace pipesgd
