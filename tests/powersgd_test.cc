// PowerSGD (core/collective/powersgd.h) across real processes on loopback TCP: a low-rank
// average comes back exact (to float rounding), replicas are bitwise identical, error feedback
// telescopes (the results add up to the exact averages less the mean residual), uncompressed
// parts and warm-up calls are exact, small matrices are left alone, and the wire carries the
// factors only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "core/base/error.h"
#include "core/collective/powersgd.h"
#include "core/collective/ring_allreduce.h"
#include "core/train/classifier_task.h"
#include "core/train/trainer.h"
#include "core/base/rng.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using collective::AllReduceOptions;
using collective::PowerSgd;
using collective::PowerSgdOptions;
using collective::ReduceOp;
using testing::PackFloats;
using testing::RankContext;
using testing::RunRanks;
using testing::UnpackFloats;

float Uniform(uint64_t key) {
  pipesgd::Rng rng(key * 0x9E3779B97F4A7C15ull ^ 0x9051);
  return rng.Uniform(-1.0f, 1.0f);
}

// A slot of 5 plain floats, a 20 x 30 matrix, 7 plain floats.
constexpr uint64_t kRows = 20, kCols = 30, kOffset = 5, kCount = 5 + kRows * kCols + 7;

// Rank r's matrix u v_r^T (the same u on every rank): the average is u (mean v)^T, rank 1. The
// plain elements are small integers, whose average over 4 ranks is exact.
std::vector<float> RankOneSlot(int rank) {
  std::vector<float> data(kCount);
  for (uint64_t i = 0; i < kOffset; ++i) data[i] = static_cast<float>(rank + 2 * i);
  for (uint64_t i = 0; i < kRows; ++i) {
    for (uint64_t j = 0; j < kCols; ++j) {
      data[kOffset + i * kCols + j] = Uniform(i) * Uniform(1000 + 100 * rank + j);
    }
  }
  for (uint64_t i = kOffset + kRows * kCols; i < kCount; ++i) data[i] = static_cast<float>(rank * 4);
  return data;
}

TEST(PowerSgd, LowRankAverageComesBackExactAndEveryReplicaIsTheSame) {
  for (int r : {1, 3}) {
    auto results = RunRanks(4, [&](const RankContext& ctx) {
      auto comm = testing::ConnectRing(ctx);
      PowerSgdOptions options;
      options.rank = r;
      PowerSgd psgd(*comm, kCount, {{kOffset, kRows, kCols}}, options);
      if (psgd.compressed().size() != 1) Throw(ErrorCode::kInternal, "matrix not compressed");
      std::vector<float> data = RankOneSlot(ctx.rank);
      psgd.AllReduce(data, ReduceOp::kAverage, Deadline::After(30), nullptr, {});
      return PackFloats(data.data(), data.size());
    });
    for (int k = 0; k < 4; ++k) ASSERT_EQ(results[k].exit_code, 0) << results[k].error;
    for (int k = 1; k < 4; ++k) {
      ASSERT_TRUE(results[k].output == results[0].output) << "rank " << k << ", r " << r;
    }
    const std::vector<float> got = UnpackFloats(results[0].output);
    std::vector<double> exact(kCount, 0.0);
    for (int k = 0; k < 4; ++k) {
      const std::vector<float> d = RankOneSlot(k);
      for (uint64_t i = 0; i < kCount; ++i) exact[i] += d[i] / 4.0;
    }
    for (uint64_t i = 0; i < kCount; ++i) {
      const bool plain = i < kOffset || i >= kOffset + kRows * kCols;
      if (plain) {
        ASSERT_EQ(got[i], static_cast<float>(exact[i])) << "plain element " << i;
      } else {
        ASSERT_NEAR(got[i], exact[i], 2e-6) << "matrix element " << i - kOffset << ", r " << r;
      }
    }
  }
}

TEST(PowerSgd, ErrorFeedbackGivesBackWhatTheRankRLeftOut) {
  // Full-rank random matrices, rank 2: each call alone is far off, but over T calls
  // sum_t result_t = sum_t mean_r M_r,t - mean_r e_r,T (up to float rounding).
  const int world = 3, steps = 30;
  auto input = [](int rank, int step, uint64_t i) {
    return Uniform((static_cast<uint64_t>(step) << 32) ^ (static_cast<uint64_t>(rank) << 24) ^ i);
  };
  auto results = RunRanks(world, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx);
    PowerSgdOptions options;
    options.rank = 2;
    options.seed = 9;
    PowerSgd psgd(*comm, kCount, {{kOffset, kRows, kCols}}, options);
    std::vector<double> total(kCount, 0.0);
    for (int step = 0; step < steps; ++step) {
      std::vector<float> data(kCount);
      for (uint64_t i = 0; i < kCount; ++i) data[i] = input(ctx.rank, step, i);
      psgd.AllReduce(data, ReduceOp::kAverage, Deadline::After(30), nullptr, {});
      for (uint64_t i = 0; i < kCount; ++i) total[i] += data[i];
    }
    std::vector<float> out(kCount + kRows * kCols);
    for (uint64_t i = 0; i < kCount; ++i) out[i] = static_cast<float>(total[i]);
    for (uint64_t i = 0; i < kRows * kCols; ++i) out[kCount + i] = psgd.residual()[i];
    return PackFloats(out.data(), out.size());
  });
  for (int k = 0; k < world; ++k) ASSERT_EQ(results[k].exit_code, 0) << results[k].error;
  std::vector<std::vector<float>> got(world);
  for (int k = 0; k < world; ++k) got[k] = UnpackFloats(results[k].output);
  double worst = 0, largest_residual = 0;
  for (uint64_t i = 0; i < kCount; ++i) {
    double exact = 0;
    for (int step = 0; step < steps; ++step) {
      double mean = 0;
      for (int k = 0; k < world; ++k) mean += input(k, step, i) / double(world);
      exact += mean;
    }
    double mean_residual = 0;
    const bool in_matrix = i >= kOffset && i < kOffset + kRows * kCols;
    if (in_matrix) {
      for (int k = 0; k < world; ++k) {
        const double e = got[k][kCount + (i - kOffset)];
        mean_residual += e / world;
        largest_residual = std::max(largest_residual, std::fabs(e));
      }
    }
    worst = std::max(worst, std::fabs(got[0][i] + mean_residual - exact));
  }
  EXPECT_LE(worst, 1e-4) << "largest residual " << largest_residual;
  // The residual is not negligible: rank 2 of a random 20 x 30 matrix leaves most of it out.
  EXPECT_GT(largest_residual, 0.1);
}

TEST(PowerSgd, WarmupCallsAndSmallMatricesTravelAsFloat32) {
  auto results = RunRanks(3, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx);
    PowerSgdOptions options;
    options.rank = 4;
    // 3 x 3 at rank 4 would grow: left alone. The 20 x 30 one is compressed.
    PowerSgd psgd(*comm, kCount, {{0, 1, 3}, {kOffset, kRows, kCols}}, options);
    std::string out = std::to_string(psgd.compressed().size()) + " ";
    std::vector<float> data(kCount);
    for (uint64_t i = 0; i < kCount; ++i) data[i] = static_cast<float>((i * 7 + ctx.rank) % 100);
    AllReduceOptions warmup;
    warmup.compress = false;
    psgd.AllReduce(data, ReduceOp::kSum, Deadline::After(30), nullptr, warmup);
    bool exact = true;
    for (uint64_t i = 0; i < kCount; ++i) {
      float s = 0;
      for (int k = 0; k < 3; ++k) s += static_cast<float>((i * 7 + k) % 100);
      exact = exact && data[i] == s;
    }
    float residual = 0;
    for (float e : psgd.residual()) residual = std::max(residual, std::fabs(e));
    out += (exact ? "exact " : "inexact ") + std::to_string(residual) + " ";
    out += std::to_string(psgd.last_wire_stats().compressed);
    return out;
  });
  for (int k = 0; k < 3; ++k) {
    ASSERT_EQ(results[k].exit_code, 0) << results[k].error;
    EXPECT_EQ(results[k].output, "1 exact 0.000000 0");
  }
}

TEST(PowerSgd, TheWireCarriesTheFactors) {
  // The MLP's first layer: 256 x 784 at rank 4 is 4160 floats instead of 200704.
  const uint64_t rows = 256, cols = 784, count = rows * cols + 256 + 1;
  auto results = RunRanks(2, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx);
    PowerSgd psgd(*comm, count, {{0, rows, cols}}, PowerSgdOptions{});
    std::vector<float> data(count, 0.5f);
    psgd.AllReduce(data, ReduceOp::kAverage, Deadline::After(30), nullptr, {});
    const auto& s = psgd.last_wire_stats();
    return fmt::format("{} {} {}", static_cast<int>(s.compressed), s.payload_bytes,
                       s.raw_payload_bytes);
  });
  for (int k = 0; k < 2; ++k) ASSERT_EQ(results[k].exit_code, 0) << results[k].error;
  // 2 ranks: each sends one block in the reduce-scatter and the other in the all-gather, the
  // whole of each collective: P (256 x 4) with the 257 plain floats, then Q (784 x 4).
  uint64_t compressed = 0, payload = 0, raw = 0;
  ASSERT_EQ(std::sscanf(results[1].output.c_str(), "%lu %lu %lu", &compressed, &payload, &raw), 3);
  EXPECT_EQ(compressed, 1u);
  EXPECT_EQ(payload, (1024u + 257u + 3136u) * 4u);
  EXPECT_EQ(raw, count * 4);  // what one float32 AllReduce of the slot would have sent
}

// f_r(W) = |W - T_r|^2 / 2 with a different target per rank: the mean gradient is W - mean T.
// Through the pipelined trainer's communication thread (width 2, momentum), every rank keeps
// bitwise the same weights, and the weights approach the mean target in spite of rank 2.
class RankTarget : public train::Objective {
 public:
  explicit RankTarget(int rank) : rank_(rank) {}
  size_t num_params() const override { return kCount; }
  float ComputeGradient(int64_t, std::span<const float> params, std::span<float> grads) override {
    float loss = 0;
    for (uint64_t i = 0; i < kCount; ++i) {
      grads[i] = params[i] - Target(rank_, i);
      loss += 0.5f * grads[i] * grads[i];
    }
    return loss;
  }
  static float Target(int rank, uint64_t i) { return Uniform((uint64_t{7} << 40) ^ (rank << 20) ^ i); }

 private:
  int rank_;
};

TEST(PowerSgd, PipelinedTrainerKeepsReplicasIdenticalAndConverges) {
  const int world = 3;
  auto results = RunRanks(world, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx);
    RankTarget objective(ctx.rank);
    train::SgdOptimizer sgd({0.1f, 0.5f, 0.0f}, kCount);
    std::vector<float> w(kCount, 0.0f);
    PowerSgdOptions options;
    options.rank = 2;
    PowerSgd psgd(*comm, kCount + 1, {{kOffset, kRows, kCols}}, options);
    train::TrainerOptions topt{2, 30};
    topt.reducer = &psgd;
    train::Trainer trainer(*comm, objective, sgd, w, topt);
    for (int t = 0; t < 300; ++t) trainer.Step();
    trainer.Drain(true);
    const auto totals = trainer.wire_totals();
    if (totals.compressed_steps != 300) Throw(ErrorCode::kInternal, "compressed steps {}", totals.compressed_steps);
    return PackFloats(w.data(), w.size());
  });
  for (int k = 0; k < world; ++k) ASSERT_EQ(results[k].exit_code, 0) << results[k].error;
  for (int k = 1; k < world; ++k) ASSERT_TRUE(results[k].output == results[0].output) << k;
  const std::vector<float> w = UnpackFloats(results[0].output);
  double worst = 0, start = 0;
  for (uint64_t i = 0; i < kCount; ++i) {
    double mean = 0;
    for (int k = 0; k < world; ++k) mean += RankTarget::Target(k, i) / world;
    worst = std::max(worst, std::fabs(w[i] - mean));
    start = std::max(start, std::fabs(mean));  // w starts at 0
  }
  // Rank 2 of a full-rank 20 x 30 difference each step; error feedback delivers the rest, more
  // slowly than float32 would (measured: 0.028 after 300 steps).
  EXPECT_GT(start, 0.5);
  EXPECT_LT(worst, 0.1 * start) << "from " << start;
}

// PowerSGD's residual and warm-start factors are in no snapshot: a trainer whose slots reduce
// through it refuses to take one, whether it was given the reducer or slots that hold it.
TEST(PowerSgd, ATrainerThatReducesThroughItTakesNoSnapshot) {
  auto results = RunRanks(2, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx);
    RankTarget objective(ctx.rank);
    train::SgdOptimizer sgd({0.1f, 0.5f, 0.0f}, kCount);
    std::vector<float> w(kCount, 0.0f);
    PowerSgd psgd(*comm, kCount + 1, {{kOffset, kRows, kCols}}, PowerSgdOptions{});
    train::HostGradientSlots slots(*comm, psgd, 2, kCount + 1);
    std::string errors;
    for (const bool given_slots : {false, true}) {
      train::TrainerOptions topt{2, 30};
      if (given_slots) {
        topt.gradient_slots = &slots;
      } else {
        topt.reducer = &psgd;
      }
      train::Trainer trainer(*comm, objective, sgd, w, topt);
      for (int t = 0; t < 3; ++t) trainer.Step();
      try {
        (void)trainer.Snapshot();
        errors += "no error;";
      } catch (const Error& e) {
        errors += std::string(e.what()).find("checkpoints with a gradient reducer") !=
                          std::string::npos
                      ? "refused;"
                      : std::string(e.what()) + ";";
      }
      trainer.Drain(true);
    }
    return errors;
  });
  for (int k = 0; k < 2; ++k) {
    ASSERT_EQ(results[k].exit_code, 0) << results[k].error;
    EXPECT_EQ(results[k].output, "refused;refused;") << k;
  }
}

TEST(PowerSgd, ARestoredInstanceGoesOnBitwiseAsTheOneItWasTakenFrom) {
  // A checkpoint of the warm-start factors and the residual, restored into an instance made with
  // another seed, gives the same next result to the bit; a state of another rank is named.
  auto results = RunRanks(2, [&](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx);
    PowerSgdOptions options;
    options.rank = 2;
    options.seed = 5;
    PowerSgd taken(*comm, kCount, {{kOffset, kRows, kCols}}, options);
    auto slot = [&](int step) {
      std::vector<float> data(kCount);
      for (uint64_t i = 0; i < kCount; ++i) data[i] = Uniform(1000003 * (step + 7) + 31 * ctx.rank + i);
      return data;
    };
    for (int step = 0; step < 3; ++step) {
      std::vector<float> data = slot(step);
      taken.AllReduce(data, ReduceOp::kAverage, Deadline::After(30), nullptr, {});
    }
    options.seed = 6;
    PowerSgd restored(*comm, kCount, {{kOffset, kRows, kCols}}, options);
    restored.Restore(taken.factors(), taken.residual());
    std::vector<float> a = slot(3), b = slot(3);
    taken.AllReduce(a, ReduceOp::kAverage, Deadline::After(30), nullptr, {});
    restored.AllReduce(b, ReduceOp::kAverage, Deadline::After(30), nullptr, {});
    std::string out;
    if (a != b) out += "the restored instance's result differs; ";
    if (!std::equal(taken.residual().begin(), taken.residual().end(), restored.residual().begin())) {
      out += "the residuals differ; ";
    }
    options.rank = 3;
    PowerSgd other(*comm, kCount, {{kOffset, kRows, kCols}}, options);
    try {
      other.Restore(taken.factors(), taken.residual());
      out += "a rank-2 state restored at rank 3; ";
    } catch (const Error& e) {
      if (std::string(e.what()).find("60 factor and 600 residual floats; expected 90 and 600") ==
          std::string::npos) {
        out += e.what();
      }
    }
    return out;
  });
  for (int k = 0; k < 2; ++k) {
    ASSERT_EQ(results[k].exit_code, 0) << results[k].error;
    EXPECT_EQ(results[k].output, "") << "rank " << k;
  }
}

TEST(PowerSgd, BadLayoutsAndRanksAreNamed) {
  auto results = RunRanks(1, [&](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx);
    std::string out;
    auto expect = [&](std::vector<PowerSgd::Matrix> m, int rank, const char* needle) {
      PowerSgdOptions o;
      o.rank = rank;
      try {
        PowerSgd p(*comm, 100, m, o);
        out += std::string("no error for ") + needle + "; ";
      } catch (const Error& e) {
        if (std::string(e.what()).find(needle) == std::string::npos) out += e.what();
      }
    };
    expect({{0, 5, 5}}, 0, "PowerSGD rank 0: expected an integer in [1, 64]");
    expect({{90, 5, 5}}, 1, "matrix 0 (5 x 5 at element 90)");
    expect({{0, 5, 5}, {20, 2, 2}}, 1, "matrix 1 (2 x 2 at element 20)");
    return out;
  });
  ASSERT_EQ(results[0].exit_code, 0) << results[0].error;
  EXPECT_EQ(results[0].output, "");
}

}  // namespace
}  // namespace pipesgd
