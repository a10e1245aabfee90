// SDPipe on loopback: the scheduler service (every member gets the same group; a dead, late or
// bad peer gives a clear error, never a hang), group-wise ring averaging (the mean over all ranks
// is preserved exactly, non-members are untouched, connections are made on first use), a rank
// alone skips synchronization, and P = 1 equals ring synchronous SGD bitwise. The whole job
// through the binary: sdpipe_job_test.cc.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>

#include "core/base/error.h"
#include "core/collective/group_allreduce.h"
#include "core/train/classifier_task.h"
#include "core/train/sdpipe_service.h"
#include "core/train/sdpipe_trainer.h"
#include "core/train/straggler.h"
#include "core/train/trainer.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"
#include "transport/asio.h"
#include "transport/rendezvous.h"
#include "transport/tcp/tcp_transport.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;
using train::GroupDecision;
using train::GroupSchedulerClient;
using train::GroupSchedulerOptions;
using train::GroupSchedulerService;

GroupSchedulerOptions Options(int n, int period) {
  GroupSchedulerOptions o;
  o.world_size = n;
  o.period = period;
  o.min_group = std::min(2, n);
  return o;
}

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// --- the scheduler service ------------------------------------------------------------------

TEST(SdpipeService, EveryMemberGetsTheSameSortedGroup) {
  GroupSchedulerOptions o = Options(4, 1);
  o.total_updates = 16;  // 3 rounds of everyone, then the last barrier ends at the total
  GroupSchedulerService service(o, 1, "127.0.0.1", "");
  std::vector<std::vector<GroupDecision>> got(4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.emplace_back([&, r] {
      GroupSchedulerClient client("127.0.0.1", service.port(), r, 4, "", Deadline::After(10));
      for (int step = 1; step <= 4; ++step) {
        // Stagger the arrivals: P = 1 still waits for everyone.
        std::this_thread::sleep_for(std::chrono::milliseconds(5 * r));
        got[r].push_back(client.Request(0, step, Deadline::After(10)));
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(got[r].size(), 4u);
    for (int k = 0; k < 4; ++k) {
      EXPECT_EQ(got[r][k].members, (std::vector<int>{0, 1, 2, 3})) << "rank " << r;
      EXPECT_EQ(got[r][k].round, k);
      EXPECT_EQ(got[r][k].stop, k == 3);
    }
    EXPECT_EQ(got[r][3].kind, train::RoundKind::kBarrier);
  }
  EXPECT_EQ(service.decisions().size(), 4u);
  // Every rank closed its connection after the last round: not a failure.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(service.error(), "");
}

TEST(SdpipeService, ARankThatDiesWhileTheSchedulerWaitsFailsTheOthersAtOnce) {
  GroupSchedulerService service(Options(3, 1), 1, "127.0.0.1", "");
  std::vector<std::string> errors(2);
  double waited_s[2] = {0, 0};
  {
    auto dying = std::make_unique<GroupSchedulerClient>("127.0.0.1", service.port(), 2, 3, "",
                                                        Deadline::After(10));
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        GroupSchedulerClient client("127.0.0.1", service.port(), r, 3, "", Deadline::After(10));
        client.Request(0, 1, Deadline::After(10));
        const auto start = std::chrono::steady_clock::now();
        errors[r] = ErrorOf([&] { client.Request(0, 2, Deadline::After(60)); });
        waited_s[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      });
    }
    dying->Request(0, 1, Deadline::After(10));  // round 1 with everyone
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // 0 and 1 wait in round 2
    dying.reset();  // rank 2's connection closes, as when its process dies
    for (auto& t : ranks) t.join();
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank 2 disconnected from the group scheduler"), std::string::npos)
        << errors[r];
    EXPECT_LT(waited_s[r], 10.0) << "the error came only at the deadline";
  }
  EXPECT_NE(service.error().find("rank 2"), std::string::npos);
}

TEST(SdpipeService, AWrongTokenIsRefusedAndTheJobGoesOn) {
  GroupSchedulerService service(Options(1, 1), 1, "127.0.0.1", "secret");
  // Another job's token: the scheduler cannot prove it, so the stranger stops before sending
  // anything of its job. No token: the scheduler refuses it.
  const std::string other = ErrorOf([&] {
    GroupSchedulerClient stranger("127.0.0.1", service.port(), 0, 1, "guess", Deadline::After(10));
  });
  EXPECT_NE(other.find("did not prove that it knows this job's token"), std::string::npos)
      << other;
  const std::string none = ErrorOf([&] {
    GroupSchedulerClient stranger("127.0.0.1", service.port(), 0, 1, "", Deadline::After(10));
  });
  EXPECT_NE(none.find("the group scheduler refused this process: it presented no job token"),
            std::string::npos)
      << none;
  EXPECT_EQ(service.error(), "");
  GroupSchedulerClient member("127.0.0.1", service.port(), 0, 1, "secret", Deadline::After(10));
  EXPECT_EQ(member.Request(0, 1, Deadline::After(10)).members, (std::vector<int>{0}));
}

TEST(SdpipeService, GarbageOnThePortIsDroppedAndTheJobGoesOn) {
  GroupSchedulerService service(Options(1, 1), 1, "127.0.0.1", "");
  {
    boost::asio::io_context io;
    boost::asio::ip::tcp::socket junk(io);
    junk.connect({boost::asio::ip::make_address("127.0.0.1"), service.port()});
    const char bytes[] = "GET / HTTP/1.0\r\n\r\n";
    boost::asio::write(junk, boost::asio::buffer(bytes, sizeof(bytes)));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  GroupSchedulerClient member("127.0.0.1", service.port(), 0, 1, "", Deadline::After(10));
  EXPECT_EQ(member.Request(0, 1, Deadline::After(10)).members, (std::vector<int>{0}));
  EXPECT_EQ(service.error(), "");
}

TEST(SdpipeService, ProtocolViolationsNameTheRankAndTheValue) {
  {
    GroupSchedulerService service(Options(2, 1), 1, "127.0.0.1", "");
    GroupSchedulerClient c("127.0.0.1", service.port(), 1, 5, "", Deadline::After(10));
    const std::string e = ErrorOf([&] { c.Request(0, 1, Deadline::After(10)); });
    EXPECT_NE(e.find("world size 5 (the job has 2)"), std::string::npos) << e;
  }
  {
    GroupSchedulerService service(Options(2, 1), 1, "127.0.0.1", "");
    GroupSchedulerClient c("127.0.0.1", service.port(), 7, 2, "", Deadline::After(10));
    const std::string e = ErrorOf([&] { c.Request(0, 1, Deadline::After(10)); });
    EXPECT_NE(e.find("rank 7 (expected a rank in [0, 2))"), std::string::npos) << e;
  }
  {
    GroupSchedulerService service(Options(1, 1), 1, "127.0.0.1", "");
    GroupSchedulerClient c("127.0.0.1", service.port(), 0, 1, "", Deadline::After(10));
    c.Request(0, 1, Deadline::After(10));
    const std::string e = ErrorOf([&] { c.Request(0, 1, Deadline::After(10)); });
    EXPECT_NE(e.find("rank 0 broke the scheduling protocol: step 1 after step 1"),
              std::string::npos)
        << e;
  }
  {
    // A late peer: rank 1 never asks; rank 0's wait ends at its deadline with a clear error.
    GroupSchedulerService service(Options(2, 1), 1, "127.0.0.1", "");
    GroupSchedulerClient c("127.0.0.1", service.port(), 0, 2, "", Deadline::After(10));
    const std::string e = ErrorOf([&] { c.Request(0, 1, Deadline::After(0.3)); });
    EXPECT_NE(e.find("no group from the group scheduler"), std::string::npos) << e;
  }
}

// --- group-wise averaging -------------------------------------------------------------------

std::unique_ptr<collective::GroupCommunicator> ConnectGroup(
    const RankContext& ctx, const collective::CommunicatorOptions& options) {
  transport::tcp::TcpOptions tcp;
  tcp.rank = ctx.rank;
  tcp.world_size = ctx.world_size;
  auto transport = transport::tcp::CreateTcpTransport(tcp);
  transport::RendezvousOptions rdv{"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size, "test", ""};
  auto addresses =
      transport::RendezvousAllGather(rdv, transport->LocalAddress(), Deadline::After(30));
  return std::make_unique<collective::GroupCommunicator>(std::move(transport), ctx.world_size,
                                                         addresses, options);
}

TEST(GroupAveraging, PreservesTheMeanExactlyAndLeavesNonMembersUntouched) {
  constexpr int kWorld = 4;
  constexpr size_t kCount = 1001;  // not a multiple of any group size: uneven ring blocks
  // Concurrent groups per round; every rank is in exactly one group of each round.
  const std::vector<std::vector<std::vector<int>>> rounds = {
      {{0, 2}, {1, 3}}, {{0, 1, 2}, {3}}, {{1, 2, 3}, {0}}};
  auto initial = [](int r, size_t i) {
    return static_cast<float>(144 * ((r * 7 + static_cast<int>(i) * 3) % 11) - 720);
  };
  auto results = RunRanks(kWorld, [&](const RankContext& ctx) {
    collective::CommunicatorOptions options;
    options.chunk_bytes = 1024;  // several chunks per block
    // A separate job ring (its own transport) keeps the scripted rounds in step, as the
    // scheduler does in a job: a rank learns a group only once every member has finished its
    // previous round, so no rank dials a peer that is still connecting for an earlier group.
    auto barrier = testing::ConnectRing(ctx);
    auto comm = ConnectGroup(ctx, options);
    std::vector<float> x(kCount);
    for (size_t i = 0; i < kCount; ++i) x[i] = initial(ctx.rank, i);
    std::vector<float> out;
    for (const auto& round : rounds) {
      std::vector<float> token = {0};
      barrier->AllReduce(token, collective::ReduceOp::kSum, Deadline::After(30));
      for (const auto& group : round) {
        if (std::find(group.begin(), group.end(), ctx.rank) == group.end()) continue;
        comm->AllReduce(x, collective::ReduceOp::kAverage, group, Deadline::After(30));
      }
      out.insert(out.end(), x.begin(), x.end());
    }
    for (int p : comm->connected_peers()) out.push_back(static_cast<float>(p));
    return testing::PackFloats(out.data(), out.size());
  });
  std::vector<std::vector<float>> got(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    got[r] = testing::UnpackFloats(results[r].output);
  }
  // The same rounds in exact (double, integer-valued) arithmetic.
  std::vector<std::vector<double>> x(kWorld, std::vector<double>(kCount));
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < kCount; ++i) x[r][i] = initial(r, i);
  }
  for (size_t k = 0; k < rounds.size(); ++k) {
    const auto before = x;
    for (const auto& group : rounds[k]) {
      for (size_t i = 0; i < kCount; ++i) {
        double sum = 0;
        for (int m : group) sum += before[m][i];
        for (int m : group) x[m][i] = sum / static_cast<double>(group.size());
      }
    }
    for (size_t i = 0; i < kCount; ++i) {
      double mean_before = 0, mean_after = 0;
      for (int r = 0; r < kWorld; ++r) {
        mean_before += before[r][i];
        // Bitwise what the ring produced; a rank alone keeps its values bit for bit.
        ASSERT_EQ(got[r][k * kCount + i], static_cast<float>(x[r][i]))
            << "round " << k << " rank " << r << " element " << i;
        mean_after += got[r][k * kCount + i];
      }
      ASSERT_EQ(mean_after, mean_before) << "round " << k << " element " << i;
    }
  }
  // Connections on first use: ring neighbours in some group, and no others.
  // Ranks 0 and 3 never shared a group: no connection between them.
  const std::vector<std::vector<float>> peers = {{1, 2}, {0, 2, 3}, {0, 1, 3}, {1, 2}};
  for (int r = 0; r < kWorld; ++r) {
    std::vector<float> p(got[r].begin() + rounds.size() * kCount, got[r].end());
    EXPECT_EQ(p, peers[r]) << "rank " << r;
  }
}

// --- the trainer ----------------------------------------------------------------------------

// f_r(w) = |w - c_r|^2 / 2 on rank r: gradient w - c_r. Dyadic values keep every sum exact.
class Pull : public train::Objective {
 public:
  Pull(int rank, size_t n) : c_(n) {
    for (size_t i = 0; i < n; ++i) c_[i] = static_cast<float>(4 * ((rank + 3 * i) % 9));
  }
  size_t num_params() const override { return c_.size(); }
  float ComputeGradient(int64_t, std::span<const float> w, std::span<float> g) override {
    float loss = 0;
    for (size_t i = 0; i < c_.size(); ++i) {
      g[i] = w[i] - c_[i];
      loss += 0.5f * g[i] * g[i];
    }
    return loss;
  }

 private:
  std::vector<float> c_;
};

class ScriptedGroups : public train::GroupSource {
 public:
  explicit ScriptedGroups(std::vector<int> group) : group_(std::move(group)) {}
  GroupDecision Next(int64_t) override {
    GroupDecision d;
    d.members = group_;
    return d;
  }

 private:
  std::vector<int> group_;
};

class ServiceGroups : public train::GroupSource {
 public:
  explicit ServiceGroups(GroupSchedulerClient& c) : c_(c) {}
  GroupDecision Next(int64_t step) override { return c_.Request(0, step, Deadline::After(30)); }

 private:
  GroupSchedulerClient& c_;
};

// Rank 0 starts the service; its port reaches everyone through the group communicator.
struct Scheduler {
  std::unique_ptr<GroupSchedulerService> service;
  std::unique_ptr<GroupSchedulerClient> client;
};
Scheduler StartScheduler(collective::GroupCommunicator& comm, const GroupSchedulerOptions& o) {
  Scheduler s;
  std::vector<float> port = {0};
  if (comm.rank() == 0) {
    s.service = std::make_unique<GroupSchedulerService>(o, 1, "127.0.0.1", "");
    port[0] = s.service->port();
  }
  std::vector<int> all(comm.world_size());
  std::iota(all.begin(), all.end(), 0);
  comm.AllReduce(port, collective::ReduceOp::kSum, all, Deadline::After(30));
  s.client = std::make_unique<GroupSchedulerClient>("127.0.0.1", static_cast<uint16_t>(port[0]),
                                                    comm.rank(), comm.world_size(), "",
                                                    Deadline::After(30));
  return s;
}

// With a lossy codec and error feedback, a rank's residual follows it from group to group,
// whatever its position in each group's ring. Residuals are in summed units, so every round
// keeps sum over ranks of (x + e) unchanged (up to float rounding): what a round's encodes
// lost is exactly what the residuals hold. With a role-dependent unit (the owner of a block
// keeping its loss in averaged units) this failed by up to a q4 step.
TEST(GroupAveraging, ErrorFeedbackConservesParametersPlusResidualsAcrossChangingGroups) {
  constexpr int kWorld = 4;
  constexpr size_t kCount = 1001;
  const std::vector<std::vector<std::vector<int>>> rounds = {
      {{0, 2}, {1, 3}}, {{0, 1, 2}, {3}}, {{1, 2, 3}, {0}}, {{0, 1, 2, 3}}, {{0, 3}, {1, 2}}};
  auto results = RunRanks(kWorld, [&](const RankContext& ctx) {
    collective::CommunicatorOptions options;
    options.chunk_bytes = 1024;
    options.codec.kind = CodecKind::kQ4;
    options.error_feedback = true;
    auto barrier = testing::ConnectRing(ctx);
    auto comm = ConnectGroup(ctx, options);
    std::vector<float> x(kCount);
    for (size_t i = 0; i < kCount; ++i) {
      x[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(ctx.rank));
    }
    std::vector<float> out;
    for (const auto& round : rounds) {
      std::vector<float> token = {0};
      barrier->AllReduce(token, collective::ReduceOp::kSum, Deadline::After(30));
      for (const auto& group : round) {
        if (std::find(group.begin(), group.end(), ctx.rank) == group.end()) continue;
        comm->AllReduce(x, collective::ReduceOp::kAverage, group, Deadline::After(30));
      }
      out.insert(out.end(), x.begin(), x.end());
      const auto e = comm->residual();
      for (size_t i = 0; i < kCount; ++i) out.push_back(e.empty() ? 0.0f : e[i]);
    }
    return testing::PackFloats(out.data(), out.size());
  });
  std::vector<std::vector<float>> got(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    got[r] = testing::UnpackFloats(results[r].output);
  }
  double worst = 0, largest_residual = 0;
  for (size_t i = 0; i < kCount; ++i) {
    double before = 0;
    for (int r = 0; r < kWorld; ++r) {
      before += std::sin(0.37f * static_cast<float>(i) + static_cast<float>(r));
    }
    for (size_t k = 0; k < rounds.size(); ++k) {
      double after = 0;
      for (int r = 0; r < kWorld; ++r) {
        const size_t at = k * 2 * kCount;
        after += double{got[r][at + i]} + got[r][at + kCount + i];
        largest_residual = std::max(largest_residual, std::fabs(double{got[r][at + kCount + i]}));
      }
      worst = std::max(worst, std::fabs(after - before));
    }
  }
  EXPECT_GT(largest_residual, 1e-3);  // q4 did lose something
  EXPECT_LT(worst, 1e-5) << "largest residual " << largest_residual;
}

TEST(SdpipeTrainer, ARankAloneSkipsSynchronization) {
  auto results = RunRanks(2, [](const RankContext& ctx) {
    auto comm = ConnectGroup(ctx, {});
    Pull objective(ctx.rank, 8);
    train::SgdOptimizer sgd({0.5f, 0.0f, 0.0f}, 8);
    std::vector<float> w(8, 0.0f);
    ScriptedGroups alone({ctx.rank});
    train::SdpipeTrainer trainer(*comm, objective, sgd, w, alone, {});
    for (int t = 0; t < 3; ++t) trainer.Step();
    std::vector<float> out = w;
    out.push_back(static_cast<float>(comm->connected_peers().size()));
    out.push_back(static_cast<float>(trainer.skipped()));
    out.push_back(static_cast<float>(trainer.wire_bytes()));
    return testing::PackFloats(out.data(), out.size());
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    auto got = testing::UnpackFloats(results[r].output);
    Pull objective(r, 8);
    std::vector<float> w(8, 0.0f), g(8);
    for (int t = 0; t < 3; ++t) {  // plain local SGD
      objective.ComputeGradient(t, w, g);
      for (int i = 0; i < 8; ++i) w[i] -= 0.5f * g[i];
    }
    for (int i = 0; i < 8; ++i) EXPECT_EQ(got[i], w[i]) << "rank " << r << " param " << i;
    EXPECT_EQ(got[8], 0) << "a rank alone connected to a peer";
    EXPECT_EQ(got[9], 3);
    EXPECT_EQ(got[10], 0) << "a rank alone sent bytes";
  }
}

TEST(SdpipeTrainer, PeriodOneWithoutStragglersEqualsRingSynchronousSgdBitwise) {
  constexpr int kWorld = 4, kSteps = 10;
  constexpr size_t kParams = 64;
  auto sdpipe = RunRanks(kWorld, [&](const RankContext& ctx) {
    auto comm = ConnectGroup(ctx, {});
    Scheduler s = StartScheduler(*comm, Options(kWorld, 1));
    ServiceGroups groups(*s.client);
    Pull objective(ctx.rank, kParams);
    train::SgdOptimizer sgd({0.5f, 0.0f, 0.0f}, kParams);
    std::vector<float> w(kParams, 0.0f);
    train::SdpipeTrainer trainer(*comm, objective, sgd, w, groups, {});
    std::vector<float> out;
    for (int t = 0; t < kSteps; ++t) {
      const GroupDecision d = trainer.Step();
      if (d.members.size() != kWorld) Throw(ErrorCode::kInternal, "a group of {}", d.members.size());
      out.insert(out.end(), w.begin(), w.end());
    }
    return testing::PackFloats(out.data(), out.size());
  });
  auto ring = RunRanks(kWorld, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx);
    Pull objective(ctx.rank, kParams);
    train::SgdOptimizer sgd({0.5f, 0.0f, 0.0f}, kParams);
    std::vector<float> w(kParams, 0.0f);
    train::Trainer trainer(*comm, objective, sgd, w, {1, 30});
    std::vector<float> out;
    for (int t = 0; t < kSteps; ++t) {
      trainer.Step();
      out.insert(out.end(), w.begin(), w.end());
    }
    trainer.Drain(true);
    return testing::PackFloats(out.data(), out.size());
  });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(sdpipe[r].exit_code, 0) << sdpipe[r].error;
    ASSERT_EQ(ring[r].exit_code, 0) << ring[r].error;
    auto a = testing::UnpackFloats(sdpipe[r].output);
    auto b = testing::UnpackFloats(ring[r].output);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i], b[i]) << "rank " << r << " step " << i / kParams << " param " << i % kParams;
    }
  }
}

TEST(SdpipeTrainer, ARankThatDiesGivesTheOthersAClearErrorNotAHang) {
  auto results = RunRanks(3, [](const RankContext& ctx) -> std::string {
    auto comm = ConnectGroup(ctx, {});
    Scheduler s = StartScheduler(*comm, Options(3, 1));
    ServiceGroups groups(*s.client);
    Pull objective(ctx.rank, 16);
    train::SgdOptimizer sgd({0.5f, 0.0f, 0.0f}, 16);
    std::vector<float> w(16, 0.0f);
    train::SdpipeTrainer trainer(*comm, objective, sgd, w, groups, {});
    for (int t = 0; t < 2; ++t) trainer.Step();
    if (ctx.rank == 2) _exit(3);  // dies between rounds
    if (ctx.rank == 0) {
      // Rank 0 hosts the scheduler: it must outlive rank 1's error to report it.
      const std::string e = ErrorOf([&] { trainer.Step(); });
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      Throw(ErrorCode::kAborted, "{}", e);
    }
    trainer.Step();
    return "";
  }, 60);
  EXPECT_EQ(results[2].exit_code, 3);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(results[r].exit_code, 0);
    EXPECT_NE(results[r].error.find("rank 2 disconnected from the group scheduler"),
              std::string::npos)
        << "rank " << r << ": " << results[r].error;
  }
}

TEST(Straggler, SleepsAreADeterministicFunctionOfSeedRankAndStep) {
  train::StragglerOptions o;
  o.ranks = {1};
  o.sleep_s = 1;
  o.probability = 0.25;
  int count = 0;
  for (int64_t step = 0; step < 10000; ++step) {
    EXPECT_FALSE(train::StragglerSleeps(o, 0, step));  // not a straggler
    const bool s = train::StragglerSleeps(o, 1, step);
    EXPECT_EQ(s, train::StragglerSleeps(o, 1, step));
    count += s;
  }
  // Binomial(10000, 0.25): mean 2500, sd 43; 5 sd either side.
  EXPECT_GT(count, 2500 - 217);
  EXPECT_LT(count, 2500 + 217);
  o.probability = 0;
  EXPECT_FALSE(train::StragglerSleeps(o, 1, 3));
  o.probability = 1;
  EXPECT_TRUE(train::StragglerSleeps(o, 1, 3));
}

}  // namespace
}  // namespace pipesgd
