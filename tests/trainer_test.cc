// The pipelined trainer's update rule, to the last bit, on 1 and 4 ranks:
//   K = 1:  w[t+1] = w[t] - lr * G[t]            (synchronous SGD)
//   K = 2:  w[1] = w[0], w[t+1] = w[t] - lr * G[t-1]   (Pipe-SGD, one step stale)
// on f(w) = w^2/2 (G = w), plus divergence detection, and data-parallel equivalence on the real
// MLP: K = 1 on 4 workers with batch b matches 1 worker with batch 4b.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>

#include "core/base/error.h"
#include "core/data/dataset.h"
#include "core/train/classifier_task.h"
#include "core/train/trainer.h"
#include "layers/model.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;

// f(w) = w^2 / 2 on every rank: the gradient is w, so G[t] = w[t] exactly.
class Quadratic : public train::Objective {
 public:
  size_t num_params() const override { return 1; }
  float ComputeGradient(int64_t, std::span<const float> params, std::span<float> grads) override {
    grads[0] = params[0];
    return 0.5f * params[0] * params[0];
  }
};

// The recurrence computed directly in float: w[t+1] = w[t] - lr * w[t-K+1] (no update before
// t = K-1). Returns w[0..steps].
std::vector<float> Recurrence(int k, float lr, int steps) {
  std::vector<float> w(steps + 1);
  w[0] = 1.0f;
  for (int t = 0; t < steps; ++t) {
    w[t + 1] = t - k + 1 >= 0 ? w[t] - lr * w[t - k + 1] : w[t];
  }
  return w;
}

struct QuadraticRun {
  std::vector<float> trajectory;  // w after each step: w[1..steps]
  float drained = 0;              // after Drain(true)
};

std::string RunQuadratic(const RankContext& ctx, int k, float lr, int steps) {
  auto comm = testing::ConnectRing(ctx);
  Quadratic objective;
  train::SgdOptimizer sgd({lr, 0.0f, 0.0f}, 1);
  std::vector<float> w = {1.0f};
  train::Trainer trainer(*comm, objective, sgd, w, {k, 30});
  std::vector<float> trajectory;
  for (int t = 0; t < steps; ++t) {
    trainer.Step();
    trajectory.push_back(w[0]);
  }
  trainer.Drain(true);
  trajectory.push_back(w[0]);
  return testing::PackFloats(trajectory.data(), trajectory.size());
}

class StaleRecurrence : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(StaleRecurrence, MatchesToTheLastBit) {
  const int world = std::get<0>(GetParam()), k = std::get<1>(GetParam());
  const int steps = 50;
  const float lr = 0.5f;
  auto results = RunRanks(world, [&](const RankContext& ctx) { return RunQuadratic(ctx, k, lr, steps); });
  // Drain(true) applies the K-1 pending aggregates: w[steps + K - 1].
  const std::vector<float> expected = Recurrence(k, lr, steps + k - 1);
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    auto got = testing::UnpackFloats(results[r].output);
    ASSERT_EQ(got.size(), static_cast<size_t>(steps + 1));
    for (int t = 0; t < steps; ++t) {
      EXPECT_EQ(std::memcmp(&got[t], &expected[t + 1], sizeof(float)), 0)
          << "rank " << r << " K=" << k << " w[" << t + 1 << "] = " << got[t] << ", recurrence "
          << expected[t + 1];
    }
    EXPECT_EQ(std::memcmp(&got[steps], &expected[steps + k - 1], sizeof(float)), 0)
        << "after Drain(true): " << got[steps] << " vs w[" << steps + k - 1 << "] = "
        << expected[steps + k - 1];
  }
}

INSTANTIATE_TEST_SUITE_P(WorldAndWidth, StaleRecurrence,
                         ::testing::Combine(::testing::Values(1, 4), ::testing::Values(1, 2, 3)));

TEST(StaleRecurrence, HandChecked) {
  // The first steps of K = 2, lr = 0.5 by hand: 1, 1, 0.5, 0, -0.25, -0.25, -0.125.
  auto w = Recurrence(2, 0.5f, 6);
  EXPECT_EQ(w, (std::vector<float>{1, 1, 0.5f, 0, -0.25f, -0.25f, -0.125f}));
}

// lr = 1.5: synchronous SGD contracts (w <- -0.5 w); one step of staleness makes it diverge
// (|roots of z^2 - z + 1.5| = sqrt(1.5) > 1). The trainer must stop with kNumerical.
std::string RunUntilDiverged(const RankContext& ctx, int k) {
  auto comm = testing::ConnectRing(ctx);
  Quadratic objective;
  train::SgdOptimizer sgd({1.5f, 0.0f, 0.0f}, 1);
  std::vector<float> w = {1.0f};
  train::Trainer trainer(*comm, objective, sgd, w, {k, 30});
  for (int t = 0; t < 1000; ++t) {
    try {
      trainer.Step();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kNumerical) throw;
      trainer.Drain(false);
      return fmt::format("diverged at step {}: {}", t, e.what());
    }
  }
  trainer.Drain(true);
  return std::string(std::fabs(w[0]) < 1e-30f ? "converged" : fmt::format("not converged: {}", w[0]));
}

TEST(Divergence, Lr15ConvergesSynchronousDivergesStale) {
  for (int world : {1, 4}) {
    auto sync = RunRanks(world, [](const RankContext& ctx) { return RunUntilDiverged(ctx, 1); });
    auto stale = RunRanks(world, [](const RankContext& ctx) { return RunUntilDiverged(ctx, 2); });
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(sync[r].exit_code, 0) << sync[r].error;
      EXPECT_EQ(sync[r].output, "converged") << "world " << world;
      ASSERT_EQ(stale[r].exit_code, 0) << stale[r].error;
      EXPECT_NE(stale[r].output.find("diverged at step"), std::string::npos) << stale[r].output;
      EXPECT_NE(stale[r].output.find("training diverged"), std::string::npos) << stale[r].output;
      // Every rank stops at the same step with the same message (but for its own rank).
      auto strip_rank = [](std::string s) {
        auto at = s.find("rank ");
        return at == std::string::npos ? s : s.erase(at, s.find(':', at) - at);
      };
      EXPECT_EQ(strip_rank(stale[r].output), strip_rank(stale[0].output));
    }
  }
}

// The real MLP on the first samples of Fashion-MNIST.
constexpr const char* kImages = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz";
constexpr const char* kLabels = "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz";

std::unique_ptr<layers::Model> MakeMlp(size_t max_batch) {
  std::vector<std::unique_ptr<layers::Layer>> layers;
  layers.push_back(layers::MakeLinear(784, 256));
  layers.push_back(layers::MakeRelu(256));
  layers.push_back(layers::MakeLinear(256, 128));
  layers.push_back(layers::MakeRelu(128));
  layers.push_back(layers::MakeLinear(128, 10));
  return std::make_unique<layers::Model>(std::move(layers), max_batch);
}

std::string TrainMlp(const RankContext& ctx, size_t batch, int k, int steps) {
  auto dataset = data::LoadDataset(kImages, kLabels, 10, 8192);
  auto model = MakeMlp(batch);
  std::vector<float> params(model->num_params());
  model->Init(params, 7);
  train::ClassifierTask task(*model, dataset, batch, ctx.rank, ctx.world_size, 7);
  train::SgdOptimizer sgd({0.05f, 0.9f, 1e-4f}, params.size());
  auto comm = testing::ConnectRing(ctx);
  train::Trainer trainer(*comm, task, sgd, params, {k, 60});
  for (int t = 0; t < steps; ++t) trainer.Step();
  trainer.Drain(true);
  return testing::PackFloats(params.data(), params.size());
}

TEST(DataParallel, FourWorkersMatchOneWorkerWithFourTimesTheBatch) {
  const int steps = 50;
  auto one = RunRanks(1, [&](const RankContext& ctx) { return TrainMlp(ctx, 64, 1, steps); }, 300);
  auto four = RunRanks(4, [&](const RankContext& ctx) { return TrainMlp(ctx, 16, 1, steps); }, 300);
  ASSERT_EQ(one[0].exit_code, 0) << one[0].error;
  auto reference = testing::UnpackFloats(one[0].output);
  ASSERT_EQ(reference.size(), 235146u);
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(four[r].exit_code, 0) << four[r].error;
    auto got = testing::UnpackFloats(four[r].output);
    ASSERT_EQ(got.size(), reference.size());
    double max_diff = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      max_diff = std::max(max_diff, static_cast<double>(std::fabs(got[i] - reference[i])));
    }
    EXPECT_LE(max_diff, 1e-5) << "rank " << r;
    // Replicas are bitwise identical.
    EXPECT_EQ(four[r].output, four[0].output) << "rank " << r << " drifted from rank 0";
  }
}

TEST(DataParallel, PipeSgdReplicasStayBitwiseIdentical) {
  auto four = RunRanks(4, [](const RankContext& ctx) { return TrainMlp(ctx, 16, 2, 30); }, 300);
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(four[r].exit_code, 0) << four[r].error;
    EXPECT_EQ(four[r].output, four[0].output) << "rank " << r << " drifted from rank 0";
  }
}

}  // namespace
}  // namespace pipesgd
