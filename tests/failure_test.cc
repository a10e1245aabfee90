// Peer failure: one rank of four is killed with SIGKILL before the first collective, in the
// middle of a large AllReduce, and during the width-2 overlap of a training step, at every rank
// position. Every other rank must fail within the collective timeout plus 2 s with an error that
// names the killed rank (its neighbours see the broken connection; the others get the abort
// notice relayed around the ring), never hang, and never blame a healthy rank.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/collective/ring_allreduce.h"
#include "core/train/trainer.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"
#include "transport/rendezvous.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/wire.pb.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

namespace pipesgd {
namespace {

using collective::ReduceOp;
using testing::RankContext;
using testing::RunRanks;

constexpr double kTimeoutS = 10;

enum class When { kBeforeFirstCollective, kMidAllReduce, kDuringOverlap };

// Each rank's gradient is its rank; rank `victim` kills itself while computing step 5, when
// step 4's AllReduce is in flight on the communication thread (width 2).
class KillAtStep : public train::Objective {
 public:
  KillAtStep(int rank, int victim) : rank_(rank), victim_(victim) {}
  size_t num_params() const override { return 1 << 18; }
  float ComputeGradient(int64_t step, std::span<const float>, std::span<float> grads) override {
    if (rank_ == victim_ && step == 5) raise(SIGKILL);
    std::fill(grads.begin(), grads.end(), static_cast<float>(rank_));
    return 1.0f;
  }

 private:
  int rank_, victim_;
};

class NoOptimizer : public train::Optimizer {
 public:
  void Apply(std::span<float>, std::span<const float>) override {}
};

// Runs the scenario on one rank; returns "<seconds from the kill window to the error>|<error>".
std::string RunScenario(const RankContext& ctx, When when, int victim) {
  auto comm = testing::ConnectRing(ctx, 1 << 20);
  // 64 MiB for kMidAllReduce: long enough on loopback that the kill lands inside it. Filled, and
  // every rank past its fill, before the clock starts: under TSan, 4 ranks on 2 cores took 9 s
  // to fill it, which the clock counted (18 s in a loaded CI run, against the 12 s bound).
  std::vector<float> big;
  if (when == When::kMidAllReduce) {
    big.assign(1 << 24, 1.0f);
    std::vector<float> one(1, 1.0f);
    comm->AllReduce(one, ReduceOp::kSum, Deadline::After(kTimeoutS));
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    switch (when) {
      case When::kBeforeFirstCollective: {
        if (ctx.rank == victim) raise(SIGKILL);
        std::vector<float> data(1 << 20, 1.0f);
        comm->AllReduce(data, ReduceOp::kSum, Deadline::After(kTimeoutS));
        break;
      }
      case When::kMidAllReduce: {
        std::thread killer;
        if (ctx.rank == victim) {
          killer = std::thread([] {
            std::this_thread::sleep_for(std::chrono::milliseconds(30));
            raise(SIGKILL);
          });
        }
        for (int i = 0; i < 20; ++i) comm->AllReduce(big, ReduceOp::kSum, Deadline::After(kTimeoutS));
        if (killer.joinable()) killer.join();
        break;
      }
      case When::kDuringOverlap: {
        KillAtStep objective(ctx.rank, victim);
        NoOptimizer optimizer;
        std::vector<float> params(objective.num_params(), 0.0f);
        train::Trainer trainer(*comm, objective, optimizer, params, {2, kTimeoutS});
        for (int step = 0; step < 50; ++step) trainer.Step();
        trainer.Drain(true);
        break;
      }
    }
  } catch (const Error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return fmt::format("{:.3f}|{}", s, e.what());
  }
  return "no error";
}

class PeerFailure : public ::testing::TestWithParam<std::tuple<When, int>> {};

TEST_P(PeerFailure, EveryOtherRankFailsInTimeNamingTheKilledRank) {
  const When when = std::get<0>(GetParam());
  const int victim = std::get<1>(GetParam());
  auto results = RunRanks(4, [&](const RankContext& ctx) { return RunScenario(ctx, when, victim); },
                          60);
  EXPECT_EQ(results[victim].exit_code, 128 + SIGKILL) << results[victim].output;
  // Ways an error can name the victim: a neighbour's broken connection, or the relayed notice.
  const std::vector<std::string> names = {
      fmt::format("from rank {} failed", victim), fmt::format("to rank {} failed", victim),
      fmt::format("rank {} failed or is gone", victim),
      fmt::format("rank {} closed the connection", victim)};
  for (int r = 0; r < 4; ++r) {
    if (r == victim) continue;
    const std::string& out = results[r].output;
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    const size_t bar = out.find('|');
    ASSERT_NE(bar, std::string::npos) << "rank " << r << " did not fail: " << out;
    const double seconds = std::stod(out.substr(0, bar));
    const std::string message = out.substr(bar + 1);
    EXPECT_LT(seconds, kTimeoutS + 2) << "rank " << r << ": " << message;
    bool named = false;
    for (const auto& n : names) named |= message.find(n) != std::string::npos;
    EXPECT_TRUE(named) << "rank " << r << " does not name rank " << victim << ": " << message;
    std::printf("victim %d, rank %d after %.3f s: %s\n", victim, r, seconds, message.c_str());
  }
}

std::string ScenarioName(const ::testing::TestParamInfo<std::tuple<When, int>>& param_info) {
  static const char* const kWhen[] = {"before_first_collective", "mid_allreduce", "during_overlap"};
  return fmt::format("{}_rank{}", kWhen[static_cast<int>(std::get<0>(param_info.param))],
                     std::get<1>(param_info.param));
}

INSTANTIATE_TEST_SUITE_P(AllPositions, PeerFailure,
                         ::testing::Combine(::testing::Values(When::kBeforeFirstCollective,
                                                              When::kMidAllReduce,
                                                              When::kDuringOverlap),
                                            ::testing::Range(0, 4)),
                         ScenarioName);

// The abort notice can queue behind the rest of a chunk already on the wire. Rank 1 dies; rank 2
// sees it at once, but its 16 MiB chunk to rank 3 is stuck half-sent because rank 3 does not
// read for 2.5 s (a rank descheduled on a loaded machine). Rank 2 must keep the notice pending
// longer than that instead of closing after 1 s: otherwise rank 3 reads "rank 2 closed the
// connection" and blames a healthy rank (seen once in CI under TSan).
TEST(PeerFailure, TheNoticeWaitsBehindAHalfSentChunkForASlowRightNeighbour) {
  constexpr uint64_t kChunk = 16 << 20;  // bigger than loopback's socket buffers
  auto results = RunRanks(4, [&](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx, kChunk);
    if (ctx.rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      raise(SIGKILL);
    }
    if (ctx.rank == 3) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    std::vector<float> data(4 * kChunk / sizeof(float), 1.0f);  // one chunk per block
    try {
      comm->AllReduce(data, ReduceOp::kSum, Deadline::After(kTimeoutS));
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  }, 60);
  EXPECT_EQ(results[1].exit_code, 128 + SIGKILL) << results[1].output;
  for (int r : {0, 2, 3}) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    const std::string& out = results[r].output;
    EXPECT_TRUE(out.find("rank 1 failed or is gone") != std::string::npos ||
                out.find("rank 1 failed after") != std::string::npos ||
                out.find("rank 1 closed the connection") != std::string::npos)
        << "rank " << r << " does not name rank 1: " << out;
    EXPECT_EQ(out.find("rank 2 closed the connection"), std::string::npos) << "rank " << r << ": " << out;
  }
  EXPECT_NE(results[3].output.find("rank 1 failed or is gone (relayed by rank 2"), std::string::npos)
      << results[3].output;
}

// A neighbour that stalls (alive, silent) fails the wait at the deadline, naming it; the stall
// warning names it well before.
TEST(PeerStall, SilentNeighbourFailsAtTheDeadlineByName) {
  auto results = RunRanks(2, [](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx, 1 << 20);
    if (ctx.rank == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(6));
      return "slept";
    }
    std::vector<float> data(1000, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->AllReduce(data, ReduceOp::kSum, Deadline::After(2));
    } catch (const Error& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return fmt::format("{:.1f}|{}", s, e.what());
    }
    return "no error";
  }, 30);
  ASSERT_EQ(results[0].exit_code, 0) << results[0].error;
  const std::string& out = results[0].output;
  const double seconds = std::stod(out.substr(0, out.find('|')));
  EXPECT_GE(seconds, 2.0) << out;
  EXPECT_LT(seconds, 3.0) << out;
  EXPECT_NE(out.find("timed out waiting for a chunk header from rank 1 (left neighbour)"),
            std::string::npos)
      << out;
}

// Strangers on a data port while the ring connects: random bytes, a truncated frame header, a
// frame whose body is not a ConnectionHello, and a hello with an impossible rank. Each is
// dropped (and logged by the accepting rank); the ring connects and reduces exactly.
void SendAndClose(const std::string& address, const std::string& bytes) {
  wire::TcpAddress a;
  if (!a.ParseFromString(address)) return;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(a.port()));
  inet_pton(AF_INET, a.host().c_str(), &sa.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
    (void)!write(fd, bytes.data(), bytes.size());
  }
  close(fd);
}

std::string Frame(const std::string& body) {
  std::string f(8, '\0');
  const uint32_t magic = 0x4d475350, length = static_cast<uint32_t>(body.size());
  std::memcpy(f.data(), &magic, 4);
  std::memcpy(f.data() + 4, &length, 4);
  return f + body;
}

TEST(Strangers, GarbageOnADataPortIsDroppedAndTheRingWorks) {
  auto results = RunRanks(3, [](const RankContext& ctx) -> std::string {
    transport::tcp::TcpOptions tcp;
    tcp.rank = ctx.rank;
    tcp.world_size = ctx.world_size;
    tcp.bind_host = "127.0.0.1";
    auto transport = transport::tcp::CreateTcpTransport(tcp);
    transport::RendezvousOptions rdv{"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size,
                                     "test", ""};
    auto addresses =
        transport::RendezvousAllGather(rdv, transport->LocalAddress(), Deadline::After(30));
    if (ctx.rank == 0) {
      // Rank 2 accepts its ring connections (from ranks 0 and 1) while these arrive.
      wire::ConnectionHello impostor;
      impostor.set_protocol_version(1);
      impostor.set_rank(7);
      impostor.set_world_size(3);
      for (const std::string& bytes :
           {std::string("GET / HTTP/1.0\r\n\r\n") + std::string(200, '\x5a'), std::string("PSG"),
            Frame("not a protobuf \xff\xff\xff"), Frame(impostor.SerializeAsString())}) {
        SendAndClose(addresses[2], bytes);
      }
    }
    auto comm = collective::Communicator::Create(std::move(transport), ctx.world_size, addresses,
                                                 {}, Deadline::After(30));
    std::vector<float> data(100003);
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(ctx.rank * 1000 + i % 977);
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(30));
    for (size_t i = 0; i < data.size(); ++i) {
      const float expected = static_cast<float>(3000 + 3 * (i % 977));
      if (data[i] != expected) return fmt::format("element {}: {} != {}", i, data[i], expected);
    }
    return "exact";
  }, 60);
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "exact") << "rank " << r;
  }
}

}  // namespace
}  // namespace pipesgd
