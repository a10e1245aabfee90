// Ring AllReduce across real processes on loopback TCP: exact sums for integer-valued inputs,
// bitwise-identical averages, every world size from 1 to 8 and awkward element counts; plus the
// pure arithmetic of the ring plan, and mismatched collectives failing with a clear error.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <tuple>

#include "core/base/error.h"
#include "core/collective/ring_allreduce.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using collective::Communicator;
using collective::ReduceOp;
using collective::RingPlan;
using testing::RankContext;
using testing::RunRanks;

std::unique_ptr<Communicator> Connect(const RankContext& ctx, uint64_t chunk_bytes,
                                      int streams = 1) {
  return testing::ConnectRing(ctx, chunk_bytes, streams);
}

// Rank r element i = 1000*r + i (mod 2^20 to keep sums exact in float).
float Input(int rank, uint64_t i) { return static_cast<float>(1000 * rank + (i % (1 << 20))); }
double ExactSum(int world, uint64_t i) {
  double s = 0;
  for (int r = 0; r < world; ++r) s += Input(r, i);
  return s;
}

// Runs AllReduce on every count, returns "" if every element is exactly right, else the first
// mismatch.
std::string CheckCounts(const RankContext& ctx, const std::vector<uint64_t>& counts,
                        uint64_t chunk_bytes) {
  auto comm = Connect(ctx, chunk_bytes);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    for (uint64_t count : counts) {
      std::vector<float> data(count);
      for (uint64_t i = 0; i < count; ++i) data[i] = Input(ctx.rank, i);
      comm->AllReduce(data, op, Deadline::After(60));
      for (uint64_t i = 0; i < count; ++i) {
        const float sum = static_cast<float>(ExactSum(ctx.world_size, i));
        // The owner divides the exact float sum once; the all-gather copies its bits.
        const float expected =
            op == ReduceOp::kSum ? sum : sum / static_cast<float>(ctx.world_size);
        if (std::memcmp(&data[i], &expected, sizeof(float)) != 0) {
          return fmt::format("rank {} op {} count {} element {}: got {} expected {}", ctx.rank,
                             static_cast<int>(op), count, i, data[i], expected);
        }
      }
    }
  }
  return "";
}

class RingAllReduceWorldSize : public ::testing::TestWithParam<int> {};

TEST_P(RingAllReduceWorldSize, ExactForAwkwardCounts) {
  const int world = GetParam();
  const std::vector<uint64_t> counts = {0, 1, 3, 5, 7, 1023, 1 << 20};
  auto results = RunRanks(world, [&](const RankContext& ctx) {
    return CheckCounts(ctx, counts, 1 << 20);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "") << "rank " << r;
  }
}

TEST_P(RingAllReduceWorldSize, ExactWithTinyChunks) {
  // 20-byte chunks (5 floats) force many chunks per block and partial last chunks.
  const int world = GetParam();
  auto results = RunRanks(world, [&](const RankContext& ctx) {
    return CheckCounts(ctx, {1, 2, 13, 1023, 4097}, 20);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "") << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, RingAllReduceWorldSize, ::testing::Range(1, 9));

// The matrix of the line-rate issue: world sizes x counts x chunk sizes, on buffers that start
// at an odd float offset (not 16-byte aligned). 4-byte chunks (one float each) run only the
// counts up to 4097: every chunk is a message, and a million of them would take minutes.
class RingMatrix : public ::testing::TestWithParam<std::tuple<int, uint64_t>> {};

TEST_P(RingMatrix, ExactOnUnalignedBuffers) {
  const int world = std::get<0>(GetParam());
  const uint64_t chunk_bytes = std::get<1>(GetParam());
  std::vector<uint64_t> counts = {0, 1, 2, 3, 5, 7, 13, 1023, 4097};
  if (chunk_bytes >= 4096) counts.push_back((1 << 20) + 3);
  auto results = RunRanks(world, [&](const RankContext& ctx) {
    auto comm = Connect(ctx, chunk_bytes);
    for (uint64_t count : counts) {
      std::vector<float> storage(count + 1);
      std::span<float> data(storage.data() + 1, count);  // 4-byte aligned only
      for (uint64_t i = 0; i < count; ++i) data[i] = Input(ctx.rank, i);
      comm->AllReduce(data, ReduceOp::kSum, Deadline::After(120));
      for (uint64_t i = 0; i < count; ++i) {
        const float expected = static_cast<float>(ExactSum(ctx.world_size, i));
        if (data[i] != expected) {
          return fmt::format("count {} element {}: {} != {}", count, i, data[i], expected);
        }
      }
    }
    return std::string();
  }, 300);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "") << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    WorldsAndChunks, RingMatrix,
    ::testing::Combine(::testing::Values(2, 3, 4, 5, 8),
                       ::testing::Values(4u, 20u, 4096u, 1u << 20)));

class RingStreams : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(RingStreams, ExactWithSeveralConnectionsPerNeighbour) {
  const int world = std::get<0>(GetParam()), streams = std::get<1>(GetParam());
  auto results = RunRanks(world, [&](const RankContext& ctx) {
    auto comm = Connect(ctx, 4096, streams);
    for (int repeat = 0; repeat < 3; ++repeat) {
      for (uint64_t count : {0ull, 1ull, 13ull, 1023ull, 4097ull, (1ull << 20) + 3}) {
        std::vector<float> data(count);
        for (uint64_t i = 0; i < count; ++i) data[i] = Input(ctx.rank, i);
        comm->AllReduce(data, ReduceOp::kSum, Deadline::After(60));
        for (uint64_t i = 0; i < count; ++i) {
          if (data[i] != static_cast<float>(ExactSum(ctx.world_size, i))) {
            return fmt::format("count {} element {}: {}", count, i, data[i]);
          }
        }
      }
    }
    return std::string();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "") << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndStreams, RingStreams,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Values(2, 3, 4)));

TEST(RingAllReduce, ZeroAgainstNonZeroCountFailsByName) {
  auto results = RunRanks(2, [](const RankContext& ctx) {
    auto comm = Connect(ctx, 1 << 20);
    std::vector<float> data(ctx.rank == 0 ? 0 : 5, 1.0f);
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(10));
    return std::string("no error");
  }, 30);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].exit_code, 1) << "rank " << r << ": " << results[r].output;
    EXPECT_NE(results[r].error.find("count (elements)"), std::string::npos) << results[r].error;
    EXPECT_EQ(results[r].error.find("timed out"), std::string::npos) << results[r].error;
  }
}

TEST(RingAllReduce, ManyCallsReuseBuffersAndStayExact) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    auto comm = Connect(ctx, 4096);
    std::vector<float> data(10007);
    for (int call = 0; call < 50; ++call) {
      for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(ctx.rank + call + i % 7);
      comm->AllReduce(data, ReduceOp::kSum, Deadline::After(30));
      for (size_t i = 0; i < data.size(); ++i) {
        float expected = static_cast<float>(0 + 1 + 2 + 3 * (call + i % 7));
        if (data[i] != expected) return fmt::format("call {} element {}: {} != {}", call, i, data[i], expected);
      }
    }
    return std::string(comm->sequence() == 50 ? "" : "bad sequence");
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "");
  }
}

TEST(RingAllReduce, AutoChunkSizeIsExact) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    return CheckCounts(ctx, {0, 5, (1 << 20) + 3, 3 << 20},
                       collective::CommunicatorOptions::kAutoChunkBytes);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "") << "rank " << r;
  }
}

TEST(RingAllReduce, MismatchedCountsFailWithBothValues) {
  auto results = RunRanks(2, [](const RankContext& ctx) {
    auto comm = Connect(ctx, 1 << 20);
    std::vector<float> data(ctx.rank == 0 ? 1000 : 1024, 1.0f);
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(10));
    return std::string("no error");
  });
  bool named_both = false;
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(results[r].exit_code, 0) << "rank " << r << " returned " << results[r].output;
    if (results[r].error.find("count (elements)") != std::string::npos &&
        results[r].error.find("1000") != std::string::npos &&
        results[r].error.find("1024") != std::string::npos) {
      named_both = true;
    }
  }
  EXPECT_TRUE(named_both) << results[0].error << "\n" << results[1].error;
}

TEST(RingAllReduce, MismatchedSequenceFails) {
  // Rank 0 runs one extra collective first: its second chunk stream carries seq 1 where rank 1
  // expects 0... the ranks must fail (not hang) well within the deadline.
  auto results = RunRanks(3, [](const RankContext& ctx) {
    auto comm = Connect(ctx, 1 << 20);
    std::vector<float> data(64, 1.0f);
    if (ctx.rank == 0) comm->AllReduce(data, ReduceOp::kAverage, Deadline::After(5));
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(5));
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(5));
    return std::string("no error");
  }, 30);
  int named = 0;
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(results[r].exit_code, 0) << "rank " << r;
    EXPECT_NE(results[r].exit_code, 128 + 9) << "rank " << r << " hung until killed";
    if (results[r].error.find("disagrees") != std::string::npos) ++named;
  }
  EXPECT_GE(named, 1);
}

TEST(RingPlan, BlocksPartitionTheBuffer) {
  for (int world : {1, 2, 3, 5, 8}) {
    for (uint64_t count : {0ull, 1ull, 7ull, 1023ull, (1ull << 31) + 5}) {
      RingPlan plan(count, world, 1 << 18);
      uint64_t next = 0;
      for (int b = 0; b < world; ++b) {
        auto block = plan.Block(b);
        EXPECT_EQ(block.offset, next);
        EXPECT_LE(block.count, count / world + 1);
        EXPECT_GE(block.count, count / world);
        uint64_t chunk_next = block.offset;
        for (uint64_t c = 0; c < plan.ChunksInBlock(b); ++c) {
          auto chunk = plan.Chunk(b, c);
          EXPECT_EQ(chunk.offset, chunk_next);
          EXPECT_GT(chunk.count, 0u);
          chunk_next += chunk.count;
        }
        EXPECT_EQ(chunk_next, block.offset + block.count);
        next += block.count;
      }
      EXPECT_EQ(next, count);
    }
  }
}

TEST(RingPlan, AutoChunkBytesAimsAtSixteenChunksPerBlock) {
  using collective::AutoChunkBytes;
  constexpr uint64_t KiB = 1024, MiB = 1024 * KiB;
  EXPECT_EQ(AutoChunkBytes(0, 4), 256 * KiB);
  EXPECT_EQ(AutoChunkBytes(1, 1), 256 * KiB);
  EXPECT_EQ(AutoChunkBytes(1 << 20, 4), 256 * KiB);         // 4 MiB: 1 MiB blocks
  EXPECT_EQ(AutoChunkBytes(3 << 22, 4), 512 * KiB);         // 48 MiB: 12 MiB blocks, 768 KiB -> 512
  EXPECT_EQ(AutoChunkBytes(1 << 24, 4), 1 * MiB);           // 64 MiB: 16 MiB blocks
  EXPECT_EQ(AutoChunkBytes(1ull << 26, 4), 4 * MiB);        // 256 MiB: 64 MiB blocks
  EXPECT_EQ(AutoChunkBytes((1ull << 31) + 5, 4), 4 * MiB);  // 8 GiB: clamped
  EXPECT_EQ(AutoChunkBytes(1ull << 26, 8), 2 * MiB);        // 256 MiB over 8: 32 MiB blocks
}

TEST(RingPlan, LargeCountIs64BitExact) {
  const uint64_t count = (1ull << 31) + 5;
  RingPlan plan(count, 4, 1 << 20);
  // 2^31+5 = 4 * 536870913 + 1: block 0 has one extra element.
  EXPECT_EQ(plan.Block(0).count, 536870914u);
  EXPECT_EQ(plan.Block(1).offset, 536870914u);
  EXPECT_EQ(plan.Block(3).offset + plan.Block(3).count, count);
  EXPECT_EQ(plan.ChunksInBlock(0), 512u + 1);  // 536870914 = 512 * 2^20 + 2
  EXPECT_EQ(plan.Chunk(0, 512).count, 2u);
}

}  // namespace
}  // namespace pipesgd
