// Staleness compensation for pipeline width K >= 2 (docs/staleness.md), to the last bit where
// the math allows it:
//   - SGD's weight prediction is its update, op for op, and changes nothing;
//   - LOCAL_GRADIENT with the same gradient on every rank is synchronous SGD one step late,
//     bitwise (K = 2: w[t+1] = v[t]; K = 3: w[t+2] = v[t]);
//   - MOMENTUM follows its recurrence, computed here directly in float;
//   - on f(w) = h w^2 / 2 with momentum m, a = lr * h, each recurrence is stable exactly below
//     its threshold: width 1 a < 2(1+m); width 2 NONE a < 1-m; MOMENTUM the root of
//     m^2 a^2 + (1-m^2) a - (1-m) = 0; LOCAL_GRADIENT that of width 1;
//   - on the real MLP every rank applies bitwise the same updates, and a snapshot taken in the
//     middle resumes bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/base/error.h"
#include "core/data/dataset.h"
#include "core/train/classifier_task.h"
#include "core/train/trainer.h"
#include "layers/model.h"
#include "layers/sgd.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;
using train::StalenessCompensation;

std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

bool SameBits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// --- the optimizer's prediction ---------------------------------------------------------------

TEST(SgdPredict, IsTheUpdateToTheBitAndChangesNothing) {
  const size_t n = 1000;
  for (const layers::SgdOptions& o :
       {layers::SgdOptions{0.05f, 0.9f, 1e-4f}, layers::SgdOptions{0.1f, 0.0f, 0.0f},
        layers::SgdOptions{0.02f, 0.5f, 0.0f}, layers::SgdOptions{0.3f, 0.0f, 5e-4f}}) {
    for (int warm : {0, 1, 3}) {  // updates before the prediction: 0 is PyTorch's first step
      layers::Sgd sgd(o, n);
      std::vector<float> w = RandomFloats(n, 1, 1.0f);
      for (int i = 0; i < warm; ++i) sgd.Step(w, RandomFloats(n, 10 + i, 0.1f));
      const std::vector<float> state = sgd.SaveState();
      for (size_t ahead : {size_t{0}, size_t{1}, size_t{3}}) {
        std::vector<std::vector<float>> grads;
        std::vector<std::span<const float>> spans;
        for (size_t i = 0; i < ahead; ++i) grads.push_back(RandomFloats(n, 100 + i, 0.1f));
        for (const auto& g : grads) spans.emplace_back(g);
        std::vector<float> predicted(n);
        sgd.Predict(w, spans, predicted);
        // The same updates on a copy of the optimizer.
        layers::Sgd copy(o, n);
        copy.LoadState(state);
        std::vector<float> stepped = w;
        for (const auto& g : grads) copy.Step(stepped, g);
        EXPECT_TRUE(SameBits(predicted, stepped))
            << "lr " << o.learning_rate << " m " << o.momentum << " wd " << o.weight_decay
            << " after " << warm << " updates, " << ahead << " ahead";
        EXPECT_EQ(sgd.SaveState(), state) << "Predict changed the optimizer state";
      }
    }
  }
}

// The width-2 trainer's fused update: Step then Predict, in one pass, to the bit.
TEST(SgdPredict, StepAndPredictIsStepThenPredictToTheBit) {
  const size_t n = 1000;
  for (const layers::SgdOptions& o :
       {layers::SgdOptions{0.05f, 0.9f, 1e-4f}, layers::SgdOptions{0.1f, 0.0f, 0.0f},
        layers::SgdOptions{0.3f, 0.0f, 5e-4f}, layers::SgdOptions{0.02f, 0.5f, 0.0f}}) {
    for (int warm : {0, 2}) {
      layers::Sgd fused(o, n), apart(o, n);
      std::vector<float> w1 = RandomFloats(n, 3, 1.0f);
      std::vector<float> w2 = w1, out1(n), out2(n);
      for (int i = 0; i < warm; ++i) {  // the same history on both
        const auto g = RandomFloats(n, 20 + i, 0.1f);
        fused.Step(w1, g);
        apart.Step(w2, g);
      }
      const auto g = RandomFloats(n, 40, 0.1f), ahead = RandomFloats(n, 41, 0.1f);
      fused.StepAndPredict(w1, g, ahead, out1);
      apart.Step(w2, g);
      const std::span<const float> one[] = {ahead};
      apart.Predict(w2, one, out2);
      EXPECT_TRUE(SameBits(w1, w2)) << "weights, m " << o.momentum << " after " << warm;
      EXPECT_TRUE(SameBits(out1, out2)) << "prediction, m " << o.momentum << " after " << warm;
      EXPECT_EQ(fused.SaveState(), apart.SaveState());
    }
  }
}

// --- the quadratic ------------------------------------------------------------------------------

// f(w) = h/2 |w|^2 on every rank: the gradient is h w, the same everywhere.
class Quadratic : public train::Objective {
 public:
  Quadratic(size_t n, float h) : n_(n), h_(h) {}
  size_t num_params() const override { return n_; }
  float ComputeGradient(int64_t, std::span<const float> params, std::span<float> grads) override {
    float loss = 0;
    for (size_t i = 0; i < n_; ++i) {
      grads[i] = h_ * params[i];
      loss += 0.5f * h_ * params[i] * params[i];
    }
    return loss;
  }

 private:
  size_t n_;
  float h_;
};

struct QuadraticJob {
  int width = 1;
  StalenessCompensation compensation = StalenessCompensation::kNone;
  float lr = 0.5f;
  float momentum = 0.9f;
  int steps = 60;
  int64_t sync_warmup_steps = 0;
};

// w after every step (n = 3 params each), as packed floats; "diverged at step S" when the
// trainer stopped with kNumerical.
std::string RunQuadratic(const RankContext& ctx, const QuadraticJob& job) {
  auto comm = testing::ConnectRing(ctx);
  const size_t n = 3;
  Quadratic objective(n, 1.0f);
  train::SgdOptimizer sgd({job.lr, job.momentum, 0.0f}, n);
  std::vector<float> w = {1.0f, -0.5f, 0.25f};
  train::TrainerOptions options{job.width, 30};
  options.compensation = job.compensation;
  options.sync_warmup_steps = job.sync_warmup_steps;
  train::Trainer trainer(*comm, objective, sgd, w, options);
  std::vector<float> trajectory;
  for (int t = 0; t < job.steps; ++t) {
    try {
      trainer.Step();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kNumerical) throw;
      trainer.Drain(false);
      return fmt::format("diverged at step {}", t);
    }
    trajectory.insert(trajectory.end(), w.begin(), w.end());
  }
  trainer.Drain(true);
  return testing::PackFloats(trajectory.data(), trajectory.size());
}

std::vector<std::vector<float>> Trajectory(const testing::RankResult& r) {
  EXPECT_EQ(r.exit_code, 0) << r.error;
  const std::vector<float> flat = testing::UnpackFloats(r.output);
  std::vector<std::vector<float>> steps;
  for (size_t at = 0; at + 3 <= flat.size(); at += 3) steps.emplace_back(&flat[at], &flat[at + 3]);
  return steps;
}

// a = 0.5, m = 0.9: synchronous SGD converges; plain width 2 diverges (a > 1 - m); with the
// local-gradient prediction, width 2 (and 3) is width 1 delayed by K-1 steps, to the bit.
TEST(StalenessCompensation, LocalGradientIsSynchronousSgdOneStepLate) {
  for (int world : {1, 2}) {  // the average of identical gradients is exact for 1 and 2 ranks
    QuadraticJob sync{1, StalenessCompensation::kNone, 0.5f, 0.9f, 60};
    auto v = RunRanks(world, [&](const RankContext& c) { return RunQuadratic(c, sync); });
    const auto reference = Trajectory(v[0]);  // reference[t] = v[t+1]
    ASSERT_EQ(reference.size(), 60u);
    for (int k : {2, 3}) {
      QuadraticJob job{k, StalenessCompensation::kLocalGradient, 0.5f, 0.9f, 60 + k - 1};
      auto runs = RunRanks(world, [&](const RankContext& c) { return RunQuadratic(c, job); });
      for (int r = 0; r < world; ++r) {
        const auto got = Trajectory(runs[r]);  // got[t] = w[t+1]
        ASSERT_EQ(got.size(), reference.size() + k - 1);
        for (int t = 0; t < k - 1; ++t) {
          EXPECT_EQ(got[t], (std::vector<float>{1.0f, -0.5f, 0.25f})) << "pipeline filling";
        }
        for (size_t t = 0; t < reference.size(); ++t) {
          ASSERT_TRUE(SameBits(got[t + k - 1], reference[t]))
              << "world " << world << " K=" << k << " rank " << r << ": w[" << t + k
              << "][0] = " << got[t + k - 1][0] << ", synchronous v[" << t + 1
              << "][0] = " << reference[t][0];
        }
      }
    }
  }
}

// MOMENTUM on the 1-D quadratic (h = 1), K = 2, written out in float with SGD's own operations:
//   e[t] = w[t] - lr * (m * buf)   (just w[t] while nothing is in flight or before any update)
//   buf <- first ? g : m * buf + g;  w[t+1] = w[t] - lr * buf,  g = e[t-1] (the aggregate of t-1)
TEST(StalenessCompensation, MomentumFollowsItsRecurrenceToTheLastBit) {
  const float lr = 0.2f, m = 0.9f;
  const int steps = 80;
  QuadraticJob job{2, StalenessCompensation::kMomentum, lr, m, steps};
  auto runs = RunRanks(2, [&](const RankContext& c) { return RunQuadratic(c, job); });
  for (int r = 0; r < 2; ++r) {
    const auto got = Trajectory(runs[r]);
    ASSERT_EQ(got.size(), static_cast<size_t>(steps));
    for (size_t i = 0; i < 3; ++i) {
      float w = std::vector<float>{1.0f, -0.5f, 0.25f}[i];
      float buf = 0;
      bool first = true;
      bool pending = false;
      float g_pending = 0;
      for (int t = 0; t < steps; ++t) {
        float e = w;
        if (pending) {
          const float b = first ? 0.0f : m * buf + 0.0f;
          e = w - lr * b;
        }
        const float g = 1.0f * e;
        if (pending) {
          buf = first ? g_pending : m * buf + g_pending;
          first = false;
          w = w - lr * buf;
        }
        g_pending = g;
        pending = true;
        ASSERT_EQ(std::memcmp(&got[t][i], &w, sizeof(float)), 0)
            << "rank " << r << " param " << i << " w[" << t + 1 << "] = " << got[t][i]
            << ", recurrence " << w;
      }
    }
  }
}

// --- stability thresholds ---------------------------------------------------------------------

double Threshold(int width, StalenessCompensation c, double m) {
  if (width == 1 || c == StalenessCompensation::kLocalGradient) return 2 * (1 + m);
  if (c == StalenessCompensation::kNone) return 1 - m;
  // Jury's criterion for z^3 - (1+m) z^2 + (m + a(1+m)) z - a m (docs/staleness.md).
  return ((m * m - 1) + std::sqrt((1 - m * m) * (1 - m * m) + 4 * m * m * (1 - m))) / (2 * m * m);
}

// "converged", "diverged" (kNumerical or |w| grew past 1e3) or "neither".
std::string Fate(int width, StalenessCompensation c, float lr, float m) {
  QuadraticJob job{width, c, lr, m, 5000};
  auto runs = RunRanks(1, [&](const RankContext& ctx) { return RunQuadratic(ctx, job); });
  EXPECT_EQ(runs[0].exit_code, 0) << runs[0].error;
  if (runs[0].output.rfind("diverged", 0) == 0) return "diverged";
  const std::vector<float> flat = testing::UnpackFloats(runs[0].output);
  const float last = std::fabs(flat.at(flat.size() - 3));
  if (last < 1e-3f) return "converged";
  if (last > 1e3f) return "diverged";
  return fmt::format("neither (|w[0]| = {})", last);
}

TEST(StalenessStability, EachRecurrenceIsStableExactlyBelowItsThreshold) {
  struct Scheme {
    int width;
    StalenessCompensation c;
    const char* name;
  };
  for (const Scheme& s : {Scheme{1, StalenessCompensation::kNone, "width 1"},
                          Scheme{2, StalenessCompensation::kNone, "width 2 NONE"},
                          Scheme{2, StalenessCompensation::kMomentum, "width 2 MOMENTUM"},
                          Scheme{2, StalenessCompensation::kLocalGradient,
                                 "width 2 LOCAL_GRADIENT"}}) {
    for (float m : {0.5f, 0.9f}) {
      const double a = Threshold(s.width, s.c, m);
      EXPECT_EQ(Fate(s.width, s.c, static_cast<float>(0.9 * a), m), "converged")
          << s.name << " m " << m << " a = 0.9 x " << a;
      EXPECT_EQ(Fate(s.width, s.c, static_cast<float>(1.1 * a), m), "diverged")
          << s.name << " m " << m << " a = 1.1 x " << a;
    }
  }
}

// Synchronous warm-up steps apply their own aggregate; the first pipelined step applies
// nothing; after that the recurrence is width 2's (checked against width 1 for the warm-up).
TEST(SyncWarmup, FirstStepsAreSynchronousThenThePipelineFills) {
  QuadraticJob sync{1, StalenessCompensation::kNone, 0.05f, 0.9f, 10};
  QuadraticJob warm{2, StalenessCompensation::kNone, 0.05f, 0.9f, 12, 10};
  const auto v = Trajectory(RunRanks(1, [&](const RankContext& c) { return RunQuadratic(c, sync); })[0]);
  const auto w = Trajectory(RunRanks(1, [&](const RankContext& c) { return RunQuadratic(c, warm); })[0]);
  ASSERT_EQ(w.size(), 12u);
  for (int t = 0; t < 10; ++t) EXPECT_TRUE(SameBits(w[t], v[t])) << "warm-up step " << t;
  EXPECT_TRUE(SameBits(w[10], w[9])) << "the first pipelined step applies nothing";
  EXPECT_FALSE(SameBits(w[11], w[10])) << "then G[10] is applied";
}

// --- the real MLP -------------------------------------------------------------------------------

constexpr const char* kImages = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz";
constexpr const char* kLabels = "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz";

std::unique_ptr<layers::Model> MakeMlp(size_t max_batch) {
  std::vector<std::unique_ptr<layers::Layer>> layers;
  layers.push_back(layers::MakeLinear(784, 128));
  layers.push_back(layers::MakeRelu(128));
  layers.push_back(layers::MakeLinear(128, 10));
  return std::make_unique<layers::Model>(std::move(layers), max_batch);
}

// Trains `steps` steps; with snapshot_at >= 0, snapshots there, throws the trainer away and
// continues on a new one restored from the snapshot (optimizer state carried over).
std::string TrainMlp(const RankContext& ctx, StalenessCompensation c, int steps,
                     int snapshot_at) {
  auto dataset = data::LoadDataset(kImages, kLabels, 10, 4096);
  auto model = MakeMlp(16);
  std::vector<float> params(model->num_params());
  model->Init(params, 7);
  train::ClassifierTask task(*model, dataset, 16, ctx.rank, ctx.world_size, 7);
  train::SgdOptimizer sgd({0.05f, 0.9f, 1e-4f}, params.size());
  auto comm = testing::ConnectRing(ctx);
  train::TrainerOptions options{2, 60};
  options.compensation = c;
  auto trainer = std::make_unique<train::Trainer>(*comm, task, sgd, params, options);
  for (int t = 0; t < steps; ++t) {
    if (t == snapshot_at) {
      const train::TrainerSnapshot snapshot = trainer->Snapshot();
      if (c == StalenessCompensation::kLocalGradient) {
        EXPECT_EQ(snapshot.pending.size(), 1u);
        EXPECT_EQ(snapshot.pending.at(0).local.size(), params.size());
      }
      trainer = std::make_unique<train::Trainer>(*comm, task, sgd, params, options);
      trainer->Restore(snapshot);
    }
    trainer->Step();
  }
  trainer->Drain(true);
  return testing::PackFloats(params.data(), params.size());
}

TEST(StalenessCompensation, ReplicasStayBitwiseIdenticalAndSnapshotsResumeBitwise) {
  for (StalenessCompensation c :
       {StalenessCompensation::kMomentum, StalenessCompensation::kLocalGradient}) {
    auto straight = RunRanks(4, [&](const RankContext& ctx) { return TrainMlp(ctx, c, 40, -1); }, 300);
    auto resumed = RunRanks(4, [&](const RankContext& ctx) { return TrainMlp(ctx, c, 40, 17); }, 300);
    auto plain = RunRanks(4, [&](const RankContext& ctx) {
      return TrainMlp(ctx, StalenessCompensation::kNone, 40, -1);
    }, 300);
    for (int r = 0; r < 4; ++r) {
      ASSERT_EQ(straight[r].exit_code, 0) << straight[r].error;
      ASSERT_EQ(resumed[r].exit_code, 0) << resumed[r].error;
      EXPECT_EQ(straight[r].output, straight[0].output) << "rank " << r << " drifted from rank 0";
      EXPECT_EQ(resumed[r].output, straight[r].output) << "rank " << r << ": resumed run differs";
    }
    EXPECT_NE(straight[0].output, plain[0].output) << "the compensation changed nothing";
  }
}

// A compensation needs host slots: a trainer with device slots refuses it by name.
TEST(StalenessCompensation, NeedsAnOptimizerThatPredicts) {
  class PlainSgd : public train::Optimizer {
   public:
    void Apply(std::span<float> params, std::span<const float> grads) override {
      for (size_t i = 0; i < params.size(); ++i) params[i] -= 0.1f * grads[i];
    }
  };
  auto runs = RunRanks(1, [](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx);
    Quadratic objective(3, 1.0f);
    PlainSgd opt;
    std::vector<float> w = {1, 2, 3};
    train::TrainerOptions options{2, 30};
    options.compensation = StalenessCompensation::kLocalGradient;
    train::Trainer trainer(*comm, objective, opt, w, options);
    trainer.Step();  // nothing in flight yet: no prediction
    try {
      trainer.Step();
    } catch (const Error& e) {
      trainer.Drain(false);
      return fmt::format("{}: {}", ErrorCodeName(e.code()), e.what());
    }
    trainer.Drain(false);
    return "no error";
  });
  ASSERT_EQ(runs[0].exit_code, 0) << runs[0].error;
  EXPECT_NE(runs[0].output.find("cannot predict weights"), std::string::npos) << runs[0].output;
  EXPECT_NE(runs[0].output.find("staleness_compensation = NONE"), std::string::npos)
      << runs[0].output;
}

}  // namespace
}  // namespace pipesgd
