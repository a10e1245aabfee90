// Steady-state AllReduce allocates nothing: after the first calls of a given size have grown
// the communicator's reusable buffers, later calls of that size or smaller make no heap
// allocation at all (issue: "no heap allocation per call in steady state"). This binary
// replaces the global operator new with a counting one, so it is its own test executable.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include <fmt/format.h>

#include "core/collective/ring_allreduce.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace {
std::atomic<uint64_t> g_allocations{0};
}  // namespace

void* operator new(std::size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return operator new(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(size == 0 ? 1 : size);
}
void* operator new[](std::size_t size, const std::nothrow_t& tag) noexcept {
  return operator new(size, tag);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace pipesgd {
namespace {

using collective::ReduceOp;
using testing::RankContext;
using testing::RunRanks;

// Counts allocations made by `calls` AllReduces after `warmup` of the same shape.
std::string CountSteadyStateAllocations(const RankContext& ctx, uint64_t chunk_bytes, int streams,
                                        size_t count, bool timeline = false) {
  auto comm = testing::ConnectRing(ctx, chunk_bytes, streams);
  // The recorder allocates its events once, here; recording a span allocates nothing.
  std::unique_ptr<timeline::Recorder> recorder;
  if (timeline) {
    recorder = std::make_unique<timeline::Recorder>(ctx.rank, 0, 1000);
    recorder->SetStep(timeline::kComm, 0);
    comm->set_timeline(recorder.get());
  }
  std::vector<float> data(count, 1.0f);
  for (int i = 0; i < 3; ++i) comm->AllReduce(data, ReduceOp::kSum, Deadline::After(30));
  const uint64_t before = g_allocations.load();
  for (int i = 0; i < 20; ++i) {
    std::fill(data.begin(), data.end(), static_cast<float>(ctx.rank));
    comm->AllReduce(data, i % 2 ? ReduceOp::kSum : ReduceOp::kAverage, Deadline::After(30));
  }
  // A smaller call after a larger one reuses the larger one's buffers.
  comm->AllReduce(std::span<float>(data).first(count / 3), ReduceOp::kSum, Deadline::After(30));
  comm->AllReduce(std::span<float>(data).first(0), ReduceOp::kSum, Deadline::After(30));
  const uint64_t after = g_allocations.load();
  if (recorder && recorder->size() == 0) return std::string("no spans recorded");
  return fmt::format("{}", after - before);
}

TEST(RingAllReduceAllocations, NoneInSteadyState) {
  struct Case {
    uint64_t chunk_bytes;
    int streams;
    size_t count;
  };
  for (const Case& c : {Case{4096, 1, 100003}, Case{1 << 20, 1, 1 << 20},
                        Case{collective::CommunicatorOptions::kAutoChunkBytes, 2, 3 << 20}}) {
    auto results = RunRanks(3, [&](const RankContext& ctx) {
      return CountSteadyStateAllocations(ctx, c.chunk_bytes, c.streams, c.count);
    });
    for (int r = 0; r < 3; ++r) {
      ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
      EXPECT_EQ(results[r].output, "0")
          << "rank " << r << " allocated during steady-state AllReduces (chunk_bytes "
          << c.chunk_bytes << ", streams " << c.streams << ", count " << c.count << ")";
    }
  }
}

// With a timeline the ring records its per-chunk spans into preallocated storage: still none.
TEST(RingAllReduceAllocations, NoneWithTimelineOn) {
  auto results = RunRanks(3, [&](const RankContext& ctx) {
    return CountSteadyStateAllocations(ctx, 4096, 1, 100003, /*timeline=*/true);
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "0") << "rank " << r;
  }
}

}  // namespace
}  // namespace pipesgd
