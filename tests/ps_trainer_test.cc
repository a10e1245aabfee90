// The parameter-server baselines (core/train/ps_trainer.h) on loopback TCP, rank 0 serving:
//  - synchronous: integer-valued gradients, lr 1: the weights after every step are exactly
//    w[t+1] = w[t] - (1/W) sum_w g_w[t], on every worker; the loss returned is the mean;
//  - asynchronous: gradients that do not depend on the weights, so whatever the order of the
//    pushes the server ends at w = -(1/W) sum over all pushes, exactly; each worker gets its own
//    loss back;
//  - synchronous PS equals ring SGD of width 1 up to reassociation, on the real MLP.
#include <gtest/gtest.h>

#include <cmath>

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/data/dataset.h"
#include "core/train/classifier_task.h"
#include "core/train/ps_trainer.h"
#include "core/train/trainer.h"
#include "layers/model.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"
#include "transport/rendezvous.h"
#include "transport/tcp/tcp_transport.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;

constexpr size_t kParams = 1000;

// g_w[t][i] = rank * (i % 7 + 1) + t: integers; the loss is the rank.
class IntegerGradients : public train::Objective {
 public:
  explicit IntegerGradients(int rank) : rank_(rank) {}
  size_t num_params() const override { return kParams; }
  float ComputeGradient(int64_t step, std::span<const float>, std::span<float> grads) override {
    for (size_t i = 0; i < grads.size(); ++i) {
      grads[i] = static_cast<float>(rank_ * static_cast<int>(i % 7 + 1) + step);
    }
    return static_cast<float>(rank_);
  }

 private:
  int rank_;
};

struct Star {
  std::unique_ptr<transport::Transport> transport;
  std::vector<std::unique_ptr<transport::Connection>> connections;
};

// Rank 0 connects to every other rank, the others to rank 0.
Star ConnectStar(const RankContext& ctx) {
  transport::tcp::TcpOptions tcp;
  tcp.rank = ctx.rank;
  tcp.world_size = ctx.world_size;
  tcp.bind_host = "127.0.0.1";
  Star star;
  star.transport = transport::tcp::CreateTcpTransport(tcp);
  transport::RendezvousOptions rdv{"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size, "ps", ""};
  auto addresses =
      transport::RendezvousAllGather(rdv, star.transport->LocalAddress(), Deadline::After(30));
  std::vector<std::pair<int, std::string>> peers;
  if (ctx.rank == 0) {
    for (int r = 1; r < ctx.world_size; ++r) peers.emplace_back(r, addresses[r]);
  } else {
    peers.emplace_back(0, addresses[0]);
  }
  star.connections = star.transport->Connect(peers, Deadline::After(30));
  return star;
}

// Server: returns its final weights. Worker: its weights after every step, then its losses.
std::string RunPs(const RankContext& ctx, train::PsMode mode, int steps) {
  Star star = ConnectStar(ctx);
  std::vector<float> w(kParams, 0.0f);
  const train::PsOptions options{mode, 30};
  if (ctx.rank == 0) {
    train::SgdOptimizer sgd({1.0f, 0.0f, 0.0f}, kParams);
    std::vector<transport::Connection*> conns;
    for (auto& c : star.connections) conns.push_back(c.get());
    train::PsServer server(*star.transport, conns, sgd, w, options);
    server.Run();
    std::vector<float> out = w;
    out.push_back(static_cast<float>(server.updates()));
    return testing::PackFloats(out.data(), out.size());
  }
  IntegerGradients objective(ctx.rank);
  train::PsWorker worker(*star.transport, *star.connections[0], objective, w, ctx.rank, options);
  std::vector<float> out;
  for (int t = 0; t < steps; ++t) {
    worker.Step();
    out.insert(out.end(), w.begin(), w.end());
  }
  for (int t = 0; t < steps; ++t) out.push_back(worker.StepLoss(t));
  std::vector<float> sums = {static_cast<float>(ctx.rank), 1.0f};
  worker.SumOverWorkers(sums);
  out.insert(out.end(), sums.begin(), sums.end());
  worker.Bye();
  return testing::PackFloats(out.data(), out.size());
}

TEST(PsSync, ExactAveragedUpdatesOnEveryWorker) {
  const int world = 5, workers = 4, steps = 6;
  auto results = RunRanks(world, [&](const RankContext& ctx) {
    return RunPs(ctx, train::PsMode::kSync, steps);
  });
  for (int r = 0; r < world; ++r) ASSERT_EQ(results[r].exit_code, 0) << r << ": " << results[r].error;
  // By hand: sum over ranks 1..4 of rank * (i % 7 + 1) + t = 10 (i % 7 + 1) + 4t; divided by 4.
  std::vector<double> w(kParams, 0.0);
  std::vector<std::vector<double>> expected;
  for (int t = 0; t < steps; ++t) {
    for (size_t i = 0; i < kParams; ++i) w[i] -= (10.0 * (i % 7 + 1) + 4.0 * t) / workers;
    expected.push_back(w);
  }
  for (int r = 1; r < world; ++r) {
    const auto got = testing::UnpackFloats(results[r].output);
    ASSERT_EQ(got.size(), steps * kParams + steps + 2);
    for (int t = 0; t < steps; ++t) {
      for (size_t i = 0; i < kParams; ++i) {
        ASSERT_EQ(got[t * kParams + i], static_cast<float>(expected[t][i]))
            << "rank " << r << " step " << t << " param " << i;
      }
      EXPECT_EQ(got[steps * kParams + t], 2.5f);  // mean of the ranks' losses 1..4
    }
    EXPECT_EQ(got[steps * kParams + steps], 10.0f);  // 1 + 2 + 3 + 4
    EXPECT_EQ(got[steps * kParams + steps + 1], 4.0f);
  }
  const auto server = testing::UnpackFloats(results[0].output);
  ASSERT_EQ(server.size(), kParams + 1);
  for (size_t i = 0; i < kParams; ++i) ASSERT_EQ(server[i], static_cast<float>(expected.back()[i]));
  EXPECT_EQ(server[kParams], static_cast<float>(steps));  // one update per step
}

TEST(PsAsync, EveryPushAppliedOnceScaledByOneOverW) {
  const int world = 4, workers = 3, steps = 8;
  auto results = RunRanks(world, [&](const RankContext& ctx) {
    return RunPs(ctx, train::PsMode::kAsync, steps);
  });
  for (int r = 0; r < world; ++r) ASSERT_EQ(results[r].exit_code, 0) << r << ": " << results[r].error;
  // Every push applied once: w_i = -(1/3) sum_{rank 1..3, t < 8} rank (i % 7 + 1) + t
  //                              = -(1/3) (6 * 8 (i % 7 + 1) + 3 * 28). Each push is
  // (g * 1/3) rounded to float, then subtracted: compare with that same rounding, in order-free
  // form, by checking the exact total with a tolerance of one rounding per push.
  const auto server = testing::UnpackFloats(results[0].output);
  ASSERT_EQ(server.size(), kParams + 1);
  EXPECT_EQ(server[kParams], static_cast<float>(workers * steps));  // one update per push
  for (size_t i = 0; i < kParams; ++i) {
    const double exact = -(48.0 * (i % 7 + 1) + 84.0) / 3.0;
    ASSERT_NEAR(server[i], exact, 24 * 4e-6 * std::abs(exact)) << "param " << i;
  }
  // Each worker's final weights are the server's right after its own last push: a partial sum
  // of the same pushes, never beyond the total.
  for (int r = 1; r < world; ++r) {
    const auto got = testing::UnpackFloats(results[r].output);
    ASSERT_EQ(got.size(), steps * kParams + steps + 2);
    for (int t = 0; t < steps; ++t) EXPECT_EQ(got[steps * kParams + t], static_cast<float>(r));
    EXPECT_EQ(got[steps * kParams + steps], 6.0f);  // the sum goes through the server too
    EXPECT_GE(got[(steps - 1) * kParams], server[0] - 1e-3f);
  }
}

TEST(PsHeader, MismatchNamesBothSides) {
  train::PsHeader h;
  h.kind = train::PsHeader::kWeights;
  h.step = 3;
  h.count = 10;
  try {
    train::CheckPsHeader(h, train::PsHeader::kWeights, 4, 10, 2, 0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_NE(std::string(e.what()).find("rank 0 sent a weights message for step 3 with 10 values"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("expected a weights message for step 4"), std::string::npos);
  }
}

// A worker sends a push of 5 values where 1001 are due: the server throws kDataLoss naming it,
// and closes its transport first, so the header receive it had posted for the other worker
// fails while the server still holds it (without the close, the connection's destructor later
// failed that op after the server had freed it: ASan's heap-use-after-free). Both workers see
// their connection end.
TEST(PsServer, ABadPushFailsTheServerAndItsPostedReceivesInOrder) {
  auto results = RunRanks(3, [&](const RankContext& ctx) -> std::string {
    Star star = ConnectStar(ctx);
    std::vector<float> w(kParams, 0.0f);
    const train::PsOptions options{train::PsMode::kSync, 30};
    if (ctx.rank == 0) {
      train::SgdOptimizer sgd({1.0f, 0.0f, 0.0f}, kParams);
      std::vector<transport::Connection*> conns;
      for (auto& c : star.connections) conns.push_back(c.get());
      train::PsServer server(*star.transport, conns, sgd, w, options);
      try {
        server.Run();
      } catch (const Error& e) {
        return fmt::format("{} {}", static_cast<int>(e.code()), e.what());
      }
      return "no error";
    }
    transport::Connection& conn = *star.connections[0];
    transport::Op send, recv;
    train::PsHeader bad;
    bad.kind = train::PsHeader::kPush;
    bad.count = 5;
    bad.sender_rank = static_cast<uint32_t>(ctx.rank);
    std::vector<float> payload(5, 1.0f);
    uint64_t word = 0;
    recv.Set(&word, sizeof(word));
    conn.PostRecv(recv);
    if (ctx.rank == 1) {
      send.Set(&bad, sizeof(bad), payload.data(), payload.size() * sizeof(float));
      conn.PostSend(send);
      star.transport->Wait(send, Deadline::After(30), "the bad push");
    }
    try {
      star.transport->Wait(recv, Deadline::After(30), "the server's end");
    } catch (const Error& e) {
      return fmt::format("closed {}", static_cast<int>(e.code()));
    }
    return "received";
  });
  for (int r = 0; r < 3; ++r) ASSERT_EQ(results[r].exit_code, 0) << r << ": " << results[r].error;
  EXPECT_NE(results[0].output.find(fmt::format("{} ", static_cast<int>(ErrorCode::kDataLoss))),
            std::string::npos)
      << results[0].output;
  EXPECT_NE(results[0].output.find("rank 1 sent a push message (kind 1) with 5 values"),
            std::string::npos)
      << results[0].output;
  for (int r : {1, 2}) {
    EXPECT_EQ(results[r].output.rfind("closed ", 0), 0u) << r << ": " << results[r].output;
  }
}

constexpr const char* kImages = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz";
constexpr const char* kLabels = "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz";

std::unique_ptr<layers::Model> Mlp(size_t batch) {
  std::vector<std::unique_ptr<layers::Layer>> stack;
  stack.push_back(layers::MakeLinear(784, 64));
  stack.push_back(layers::MakeRelu(64));
  stack.push_back(layers::MakeLinear(64, 10));
  return std::make_unique<layers::Model>(std::move(stack), batch);
}

// PS_SYNC with W workers vs ring width 1 on W ranks: the same samples per worker, the same
// optimizer (momentum 0.5), only the summation order differs.
TEST(PsSync, EqualsRingSyncUpToReassociation) {
  const int workers = 4, steps = 15;
  const size_t batch = 16;
  auto ps = RunRanks(workers + 1, [&](const RankContext& ctx) {
    auto data = data::LoadDataset(kImages, kLabels, 10, 4096);
    auto model = Mlp(batch);
    std::vector<float> w(model->num_params());
    model->Init(w, 3);
    Star star = ConnectStar(ctx);
    const train::PsOptions options{train::PsMode::kSync, 30};
    if (ctx.rank == 0) {
      train::SgdOptimizer sgd({0.1f, 0.5f, 0.0f}, w.size());
      std::vector<transport::Connection*> conns;
      for (auto& c : star.connections) conns.push_back(c.get());
      train::PsServer server(*star.transport, conns, sgd, w, options);
      server.Run();
      return std::string();
    }
    train::ClassifierTask task(*model, data, batch, ctx.rank - 1, workers, 5);
    train::PsWorker worker(*star.transport, *star.connections[0], task, w, ctx.rank, options);
    for (int t = 0; t < steps; ++t) worker.Step();
    worker.Bye();
    return testing::PackFloats(w.data(), w.size());
  });
  auto ring = RunRanks(workers, [&](const RankContext& ctx) {
    auto data = data::LoadDataset(kImages, kLabels, 10, 4096);
    auto model = Mlp(batch);
    std::vector<float> w(model->num_params());
    model->Init(w, 3);
    auto comm = testing::ConnectRing(ctx);
    train::ClassifierTask task(*model, data, batch, ctx.rank, workers, 5);
    train::SgdOptimizer sgd({0.1f, 0.5f, 0.0f}, w.size());
    train::Trainer trainer(*comm, task, sgd, w, {1, 30});
    for (int t = 0; t < steps; ++t) trainer.Step();
    trainer.Drain(true);
    return testing::PackFloats(w.data(), w.size());
  });
  for (const auto& r : ps) ASSERT_EQ(r.exit_code, 0) << r.error;
  for (const auto& r : ring) ASSERT_EQ(r.exit_code, 0) << r.error;
  const auto want = testing::UnpackFloats(ring[0].output);
  for (int r = 1; r <= workers; ++r) {
    const auto got = testing::UnpackFloats(ps[r].output);
    ASSERT_EQ(got.size(), want.size());
    double max_diff = 0, max_abs = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_diff = std::max(max_diff, std::abs(static_cast<double>(got[i]) - want[i]));
      max_abs = std::max(max_abs, std::abs(static_cast<double>(want[i])));
    }
    // float32 reassociation of 4 addends per step, 15 steps: far below 1e-5 of the weights' scale.
    EXPECT_LT(max_diff, 1e-5 * max_abs) << "rank " << r;
    EXPECT_GT(max_diff, -1.0);
  }
}

}  // namespace
}  // namespace pipesgd
