// The outer loop (core/train/outer_loop.h) on real ranks over loopback TCP, to the last bit
// against its recurrence written out in plain float code (docs/outer_loop.md):
//   blocking (width 1):   x_p = w; H inner SGD steps; d_p = w - x_p; w = Outer(w, mean d)
//   overlapped (width 2): round r starts at s_p[r]; d_p[r] = s_p[r] - x_p;
//                         w = Outer(w, mean d[r-1]); s_p[r+1] = Outer's prediction from w with
//                         d_p[r] (the eager update), after the synchronous warm-up rounds
// on f_p(x) = |x - c_p|^2 / 2 with a minimum c_p of each rank's own, so the ranks' pseudo-
// gradients differ. Two ranks, because a float sum of two is the same bits in either order, so
// the reference can average them as the ring does; three ranks for bitwise identical replicas.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/train/classifier_task.h"
#include "core/train/outer_loop.h"
#include "core/train/trainer.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;
using train::OuterKind;

constexpr size_t kDim = 3;
constexpr int kH = 3;
constexpr int kRounds = 12;
constexpr float kInnerLr = 0.3f, kInnerMomentum = 0.5f;

float Minimum(int rank, size_t i) { return 0.7f * static_cast<float>(rank + 1) - 0.45f * i; }

// f_p(x) = |x - c_p|^2 / 2: the gradient is x - c_p.
class RankQuadratic : public train::Objective {
 public:
  explicit RankQuadratic(int rank) : rank_(rank) {}
  size_t num_params() const override { return kDim; }
  float ComputeGradient(int64_t, std::span<const float> x, std::span<float> g) override {
    float loss = 0;
    for (size_t i = 0; i < kDim; ++i) {
      g[i] = x[i] - Minimum(rank_, i);
      loss += 0.5f * g[i] * g[i];
    }
    return loss;
  }

 private:
  int rank_;
};

struct Setting {
  OuterKind kind;
  float lr, momentum;
  int width;            // 1: blocking, 2: overlapped
  int64_t sync_rounds;  // the first rounds: blocking, and averaged whatever the kind
  bool reset = false;   // the inner momentum from zero at each round
};

// One rank's run: w after each round's trainer step, then after Drain(true).
std::vector<float> RunOuter(const RankContext& ctx, const Setting& s) {
  auto comm = testing::ConnectRing(ctx);
  RankQuadratic f(ctx.rank);
  train::SgdOptimizer inner({kInnerLr, kInnerMomentum, 0.0f}, kDim);
  train::OuterOptimizer outer(s.kind, s.lr, s.momentum, kDim, s.sync_rounds);
  train::LocalRounds rounds(f, inner);
  std::vector<float> w = {1.0f, -2.0f, 0.5f};
  train::TrainerOptions options{s.width, 30};
  options.sync_warmup_steps = s.sync_rounds;
  if (s.width == 2) options.compensation = train::StalenessCompensation::kLocalGradient;
  train::Trainer trainer(*comm, rounds, outer, w, options);
  std::vector<float> out;
  for (int r = 0; r < kRounds; ++r) {
    rounds.Begin(trainer.NextGradientPoint(), s.reset);
    for (int i = 0; i < kH; ++i) rounds.InnerStep(r * kH + i);
    trainer.Step();
    out.insert(out.end(), w.begin(), w.end());
  }
  trainer.Drain(true);
  out.insert(out.end(), w.begin(), w.end());
  return out;
}

// The outer optimizer written out (torch.optim.SGD(nesterov=True) for kNesterov).
// The first sync_rounds rounds average whatever the kind, and leave Nesterov's state alone.
struct OuterRef {
  Setting s;
  std::vector<float> buf = std::vector<float>(kDim, 0.0f);
  bool first = true;
  int64_t applied = 0;
  void Apply(std::vector<float>& w, const std::vector<float>& d, std::vector<float>& b, bool& f,
             int64_t round) const {
    if (s.kind == OuterKind::kAverage || round < s.sync_rounds) {
      for (size_t i = 0; i < kDim; ++i) w[i] = w[i] - d[i];
      return;
    }
    for (size_t i = 0; i < kDim; ++i) {
      b[i] = f ? d[i] : s.momentum * b[i] + d[i];
      w[i] = w[i] - s.lr * (d[i] + s.momentum * b[i]);
    }
    f = false;
  }
  void Step(std::vector<float>& w, const std::vector<float>& d) {
    Apply(w, d, buf, first, applied++);
  }
  std::vector<float> Predict(std::vector<float> w, const std::vector<float>& d) const {
    std::vector<float> b = buf;
    bool f = first;
    Apply(w, d, b, f, applied);
    return w;
  }
};

// Both ranks' inner SGD (torch's momentum: buf = g first, then m * buf + g) from `start`.
struct InnerRef {
  std::vector<float> buf = std::vector<float>(kDim, 0.0f);
  bool first = true;
  std::vector<float> Round(int rank, const std::vector<float>& start, bool reset) {
    if (reset) first = true;  // a fresh torch SGD: its first step sets buf = g
    std::vector<float> x = start;
    for (int i = 0; i < kH; ++i) {
      for (size_t j = 0; j < kDim; ++j) {
        const float g = x[j] - Minimum(rank, j);
        buf[j] = first ? g : kInnerMomentum * buf[j] + g;
        x[j] = x[j] - kInnerLr * buf[j];
      }
      first = false;
    }
    std::vector<float> d(kDim);
    for (size_t j = 0; j < kDim; ++j) d[j] = start[j] - x[j];
    return d;
  }
};

std::vector<float> Mean(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> m(kDim);
  for (size_t j = 0; j < kDim; ++j) m[j] = (a[j] + b[j]) * 0.5f;  // the ring's average of two
  return m;
}

std::vector<float> Reference(const Setting& s) {
  OuterRef outer{s};
  InnerRef inner[2];
  std::vector<float> w = {1.0f, -2.0f, 0.5f};
  std::vector<float> start[2] = {w, w};
  std::vector<float> in_flight;  // the mean pseudo-gradient of the last round, not yet applied
  std::vector<float> out;
  for (int r = 0; r < kRounds; ++r) {
    const std::vector<float> d0 = inner[0].Round(0, start[0], s.reset);
    const std::vector<float> d1 = inner[1].Round(1, start[1], s.reset);
    const std::vector<float> mean = Mean(d0, d1);
    if (s.width == 1 || r < s.sync_rounds) {
      outer.Step(w, mean);
      start[0] = start[1] = w;
    } else {
      if (!in_flight.empty()) outer.Step(w, in_flight);  // round r-1's, one round late
      in_flight = mean;
      start[0] = outer.Predict(w, d0);  // the eager start: this rank's own d in the average's place
      start[1] = outer.Predict(w, d1);
    }
    out.insert(out.end(), w.begin(), w.end());
  }
  if (!in_flight.empty()) outer.Step(w, in_flight);
  out.insert(out.end(), w.begin(), w.end());
  return out;
}

class OuterRecurrence : public ::testing::TestWithParam<Setting> {};

TEST_P(OuterRecurrence, MatchesItsReferenceToTheLastBit) {
  const Setting s = GetParam();
  auto results = RunRanks(2, [&](const RankContext& ctx) {
    const std::vector<float> w = RunOuter(ctx, s);
    return testing::PackFloats(w.data(), w.size());
  });
  const std::vector<float> want = Reference(s);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    const std::vector<float> got = testing::UnpackFloats(results[r].output);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
          << "rank " << r << ", round " << i / kDim << ", element " << i % kDim << ": " << got[i]
          << ", reference " << want[i];
    }
  }
  // The weights move every round but the first pipelined one (it applies nothing).
  for (int r = 1; r < kRounds; ++r) {
    if (s.width == 2 && r == s.sync_rounds) continue;
    EXPECT_NE(std::memcmp(&want[r * kDim], &want[(r - 1) * kDim], kDim * sizeof(float)), 0)
        << "round " << r;
  }
}

// AVERAGE and NESTEROV; blocking (also after 2 averaged rounds, and with the inner momentum
// reset each round), and overlapped after 0 and 2 blocking rounds.
INSTANTIATE_TEST_SUITE_P(
    KindWidthWarmup, OuterRecurrence,
    ::testing::Values(Setting{OuterKind::kAverage, 0.7f, 0.5f, 1, 0},
                      Setting{OuterKind::kNesterov, 0.7f, 0.5f, 1, 0},
                      Setting{OuterKind::kNesterov, 0.7f, 0.5f, 1, 2},
                      Setting{OuterKind::kAverage, 0.7f, 0.5f, 1, 0, true},
                      Setting{OuterKind::kAverage, 0.7f, 0.5f, 2, 0},
                      Setting{OuterKind::kNesterov, 0.7f, 0.5f, 2, 0},
                      Setting{OuterKind::kNesterov, 0.7f, 0.5f, 2, 2}),
    [](const ::testing::TestParamInfo<Setting>& param_info) {
      const Setting& s = param_info.param;
      return std::string(s.kind == OuterKind::kAverage ? "Average" : "Nesterov") +
             (s.width == 1 ? "Blocking" : "Overlapped") + "After" +
             std::to_string(s.sync_rounds) + "Rounds" + (s.reset ? "ResetMomentum" : "");
    });

TEST(OuterLoop, ReplicasAreBitwiseIdenticalOnThreeRanks) {
  for (int width : {1, 2}) {
    const Setting s{OuterKind::kNesterov, 0.7f, 0.9f, width, 1};
    auto results = RunRanks(3, [&](const RankContext& ctx) {
      const std::vector<float> w = RunOuter(ctx, s);
      return testing::PackFloats(w.data(), w.size());
    });
    for (int r = 0; r < 3; ++r) ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[1].output, results[0].output) << "width " << width;
    EXPECT_EQ(results[2].output, results[0].output) << "width " << width;
  }
}

TEST(OuterOptimizer, PredictIsApplyToTheBitAndTheStateRoundTrips) {
  for (OuterKind kind : {OuterKind::kAverage, OuterKind::kNesterov}) {
    train::OuterOptimizer a(kind, 0.7f, 0.9f, 2), b(kind, 0.7f, 0.9f, 2);
    std::vector<float> w = {0.3f, -1.1f};
    const std::vector<float> d1 = {0.01f, -0.2f}, d2 = {0.05f, 0.07f};
    std::vector<float> predicted(2);
    const std::vector<std::span<const float>> both = {d1, d2};
    a.Predict(w, both, predicted);
    std::vector<float> applied = w;
    a.Apply(applied, d1);
    b.LoadState(a.SaveState());  // b continues from a's state after d1
    std::vector<float> continued = applied;
    a.Apply(applied, d2);
    b.Apply(continued, d2);
    EXPECT_EQ(std::memcmp(predicted.data(), applied.data(), 2 * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(continued.data(), applied.data(), 2 * sizeof(float)), 0);
    EXPECT_EQ(a.SaveState().size(), kind == OuterKind::kNesterov ? 4u : 2u);
  }
  // Nesterov by hand: buf = d, w -= lr (d + m d) on the first step.
  train::OuterOptimizer n(OuterKind::kNesterov, 0.5f, 0.5f, 1);
  std::vector<float> w = {1.0f};
  const std::vector<float> d = {0.25f};
  n.Apply(w, d);
  EXPECT_EQ(w[0], 1.0f - 0.5f * (0.25f + 0.5f * 0.25f));
  // Two averaged rounds first: w -= d twice, then Nesterov's first step as above.
  train::OuterOptimizer late(OuterKind::kNesterov, 0.5f, 0.5f, 1, 2);
  std::vector<float> v = {1.0f};
  late.Apply(v, d);
  late.Apply(v, d);
  EXPECT_EQ(v[0], 0.5f);
  late.Apply(v, d);
  EXPECT_EQ(v[0], 0.5f - 0.5f * (0.25f + 0.5f * 0.25f));
  EXPECT_THROW(train::OuterOptimizer(OuterKind::kNesterov, 0.0f, 0.9f, 1), Error);
  EXPECT_THROW(train::OuterOptimizer(OuterKind::kNesterov, 0.7f, 1.0f, 1), Error);
}

}  // namespace
}  // namespace pipesgd
