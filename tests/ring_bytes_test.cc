// The ring's byte collectives (Broadcast, AllGather) across real processes on loopback TCP:
// every rank ends with bitwise the root's or every rank's bytes, for every root, world sizes 1
// to 5, awkward sizes, chunks smaller than a block and several streams; bytes that are signalling
// NaNs as float32 arrive unchanged; ranks that disagree fail by name; and the byte collectives
// interleave with AllReduces on the same ring.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/base/error.h"
#include "core/collective/ring_allreduce.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;

// Byte i of rank r's data: distinct per rank, and including 0x7f80 0001 patterns (a
// signalling NaN as float32) so that any arithmetic on the bytes would show.
std::byte Pattern(int rank, uint64_t i) {
  static constexpr uint8_t kSnan[4] = {0x01, 0x00, 0x80, 0x7f};
  if (i % 16 < 4) return std::byte{kSnan[i % 4]};
  return static_cast<std::byte>((rank * 131 + i * 7 + 3) & 0xff);
}

std::string FirstMismatch(const std::vector<std::byte>& got, int rank, int source,
                          uint64_t offset, uint64_t n, const char* what) {
  for (uint64_t i = 0; i < n; ++i) {
    if (got[offset + i] != Pattern(source, i)) {
      return fmt::format("rank {} {}: byte {} of rank {}'s data is {:#04x}, expected {:#04x}", rank,
                         what, i, source, static_cast<int>(got[offset + i]),
                         static_cast<int>(Pattern(source, i)));
    }
  }
  return "";
}

std::string CheckAll(const RankContext& ctx, uint64_t chunk_bytes, int streams,
                     const std::vector<uint64_t>& sizes) {
  auto comm = testing::ConnectRing(ctx, chunk_bytes, streams);
  for (uint64_t n : sizes) {
    for (int root = 0; root < ctx.world_size; ++root) {
      std::vector<std::byte> data(n, std::byte{0xee});
      if (ctx.rank == root) {
        for (uint64_t i = 0; i < n; ++i) data[i] = Pattern(root, i);
      }
      comm->Broadcast(data, root, Deadline::After(60));
      if (auto e = FirstMismatch(data, ctx.rank, root, 0, n, "broadcast"); !e.empty()) return e;
    }
    std::vector<std::byte> mine(n), all(n * ctx.world_size, std::byte{0xee});
    for (uint64_t i = 0; i < n; ++i) mine[i] = Pattern(ctx.rank, i);
    comm->AllGather(mine, all, Deadline::After(60));
    for (int r = 0; r < ctx.world_size; ++r) {
      if (auto e = FirstMismatch(all, ctx.rank, r, r * n, n, "all-gather"); !e.empty()) return e;
    }
    // An AllReduce on the same ring after them: the streams are still in step.
    std::vector<float> one(5, static_cast<float>(ctx.rank + 1));
    comm->AllReduce(one, collective::ReduceOp::kSum, Deadline::After(60));
    const float want = static_cast<float>(ctx.world_size * (ctx.world_size + 1) / 2);
    for (float v : one) {
      if (v != want) return fmt::format("rank {}: all-reduce after size {}: {} != {}", ctx.rank, n, v, want);
    }
  }
  return "";
}

void ExpectAllPass(const std::vector<testing::RankResult>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "") << "rank " << r;
  }
}

class RingBytesWorldSize : public ::testing::TestWithParam<int> {};

TEST_P(RingBytesWorldSize, BitwiseForEveryRootAndAwkwardSizes) {
  ExpectAllPass(RunRanks(GetParam(), [](const RankContext& ctx) {
    return CheckAll(ctx, 1 << 20, 1, {0, 1, 3, 17, 4096, (3 << 20) + 5});
  }));
}

TEST_P(RingBytesWorldSize, BitwiseWithTinyChunksOnTwoStreams) {
  // 12-byte chunks: many chunks per block, a partial last one, and alternating streams.
  ExpectAllPass(RunRanks(GetParam(), [](const RankContext& ctx) {
    return CheckAll(ctx, 12, 2, {1, 12, 13, 1000});
  }));
}

INSTANTIATE_TEST_SUITE_P(Worlds, RingBytesWorldSize, ::testing::Values(1, 2, 3, 4, 5));

TEST(RingBytes, AutoChunkSizeMovesLargeBuffers) {
  ExpectAllPass(RunRanks(3, [](const RankContext& ctx) {
    return CheckAll(ctx, collective::CommunicatorOptions::kAutoChunkBytes, 1, {(5 << 20) + 3});
  }));
}

// Runs `fn` on every rank and returns each rank's error text ("" where it passed).
std::vector<std::string> Errors(int world, const std::function<void(collective::Communicator&,
                                                                    const RankContext&)>& fn) {
  auto results = RunRanks(world, [&](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx);
    try {
      fn(*comm, ctx);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  });
  std::vector<std::string> out;
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 0) << r.error;
    out.push_back(r.output);
  }
  return out;
}

TEST(RingBytes, RanksThatDisagreeOnTheSizeFailByName) {
  auto errors = Errors(3, [](collective::Communicator& comm, const RankContext& ctx) {
    std::vector<std::byte> data(ctx.rank == 2 ? 40 : 32);
    comm.Broadcast(data, 0, Deadline::After(20));
  });
  // Rank 2 receives rank 1's header of 32 bytes and expects 40.
  EXPECT_NE(errors[2].find("count (elements) = 32"), std::string::npos) << errors[2];
  EXPECT_NE(errors[2].find("count (elements) = 40"), std::string::npos) << errors[2];
}

TEST(RingBytes, RanksThatDisagreeOnTheRootFailByName) {
  auto errors = Errors(3, [](collective::Communicator& comm, const RankContext& ctx) {
    std::vector<std::byte> data(8);
    comm.Broadcast(data, ctx.rank == 1 ? 2 : 0, Deadline::After(20));
  });
  // Rank 1 expects root 2's chain (from rank 0, its left neighbour) and gets root 0's.
  EXPECT_NE(errors[1].find("broadcast root = 0"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("broadcast root = 2"), std::string::npos) << errors[1];
}

TEST(RingBytes, ACollectiveThatMeetsAnotherFailsNamingBoth) {
  auto errors = Errors(2, [](collective::Communicator& comm, const RankContext& ctx) {
    std::vector<std::byte> mine(4), all(8), data(4);
    if (ctx.rank == 0) {
      comm.AllGather(mine, all, Deadline::After(20));
    } else {
      comm.Broadcast(data, 1, Deadline::After(20));
    }
  });
  EXPECT_NE(errors[0].find("collective = broadcast"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("collective = all-gather"), std::string::npos) << errors[0];
}

TEST(RingBytes, BadArgumentsAreRefusedBeforeAnythingIsSent) {
  ExpectAllPass(RunRanks(2, [](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx);
    std::vector<std::byte> mine(4), all(7), data(4);
    std::string got;
    try {
      comm->AllGather(mine, all, Deadline::After(5));
    } catch (const Error& e) {
      got += e.what();
    }
    try {
      comm->Broadcast(data, 2, Deadline::After(5));
    } catch (const Error& e) {
      got += e.what();
    }
    if (got.find("expected world size 2 x 4 = 8") == std::string::npos ||
        got.find("broadcast root 2: expected 0 <= root < 2") == std::string::npos) {
      return "unexpected: " + got;
    }
    // Nothing went out: the ring still works.
    std::vector<float> one(1, 1.0f);
    comm->AllReduce(one, collective::ReduceOp::kSum, Deadline::After(30));
    return one[0] == 2.0f ? "" : "the ring is out of step";
  }));
}

}  // namespace
}  // namespace pipesgd
