// The trainer with device gradient slots (TrainerOptions::gradient_slots, the GPU path's
// structure) against the trainer with host slots, on the CPU: "device" memory is host memory and
// the slots are AllReduced through the staged AllReduce with the memcpy copier
// (HostStagingCopier), in segments of a few floats over 3 lanes or in one segment. Integer
// gradients make every sum exact whatever the segmentation, so parameters, losses and pending
// aggregates must be bitwise those of the host-slot trainer. The same trainer code with
// CudaDeviceGradients runs in cuda_staging_test.cc where a GPU exists.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/collective/staged_allreduce.h"
#include "core/train/classifier_task.h"
#include "core/train/trainer.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;

constexpr size_t kParams = 1000;

// Slots in host memory standing in for device memory, reduced like CudaDeviceGradients: through
// the staged AllReduce, as a GradientReducer, with the summary taken from the staging lanes.
class HostDeviceGradients final : public train::GradientSlots {
 public:
  HostDeviceGradients(collective::Communicator& comm, int slots, size_t elems, int lanes,
                      size_t segment)
      : elems_(elems), copier_(lanes, segment), staged_(comm, copier_) {
    slots_.assign(slots, std::vector<float>(elems, -1.0f));
    summaries_.resize(slots);
  }
  int slots() const override { return static_cast<int>(slots_.size()); }
  size_t slot_elems() const override { return elems_; }
  float* slot(int i) { return slots_.at(i).data(); }
  void Compute(train::Objective& objective, int i, int64_t step,
               std::span<const float> at) override {
    slots_[i].back() = objective.ComputeGradientOnDevice(step, at, slot(i));
  }
  void AllReduce(int i, collective::ReduceOp op, Deadline deadline,
                 const std::atomic<bool>* abort,
                 const collective::AllReduceOptions& call) override {
    ++allreduces;
    train::SlotSummaryBuilder summary(elems_);
    staged_.set_observer([&summary](size_t offset, std::span<const float> values) {
      summary.Add(offset, values);
    });
    struct Unobserve {  // `summary` ends with this call, however it ends
      collective::StagedAllReduce& staged;
      ~Unobserve() { staged.set_observer(nullptr); }
    } unobserve{staged_};
    collective::GradientReducer& reducer = staged_;
    reducer.AllReduce(slots_[i], op, deadline, abort, call);
    summaries_[i] = summary.Get();
  }
  collective::WireStats last_wire_stats() const override { return staged_.last_wire_stats(); }
  float Loss(int i) override { return Summary(i).loss; }
  train::SlotSummary Summary(int i) override {
    if (summaries_[i]) return *summaries_[i];
    ++computed_summaries;  // after a Write: from the data itself
    train::SlotSummaryBuilder summary(elems_);
    summary.Add(0, slots_[i]);
    return summary.Get();
  }
  void Apply(train::Optimizer& optimizer, int i, std::span<float> params) override {
    optimizer.ApplyFromDevice(params, slot(i));
  }
  void Read(int i, std::span<float> out) override {
    std::memcpy(out.data(), slot(i), out.size_bytes());
  }
  void Write(int i, std::span<const float> in) override {
    std::memcpy(slot(i), in.data(), in.size_bytes());
    summaries_[i].reset();
  }
  int computed_summaries = 0;
  int allreduces = 0;

 private:
  size_t elems_;
  std::vector<std::vector<float>> slots_;
  std::vector<std::optional<train::SlotSummary>> summaries_;
  collective::HostStagingCopier copier_;
  collective::StagedAllReduce staged_;
};

// Integer gradients in [-8, 8] depending on step, rank and index (sums exact in float), and a
// NaN at parameter 123 of step `nan_step` on rank 1.
class IntegerObjective : public train::Objective {
 public:
  IntegerObjective(int rank, int64_t nan_step = -1) : rank_(rank), nan_step_(nan_step) {}
  size_t num_params() const override { return kParams; }
  float ComputeGradient(int64_t step, std::span<const float>, std::span<float> grads) override {
    for (size_t i = 0; i < grads.size(); ++i) {
      grads[i] = static_cast<float>(static_cast<int64_t>(i * 7 + step * 3 + rank_) % 17 - 8);
    }
    if (step == nan_step_ && rank_ == 1) grads[123] = std::numeric_limits<float>::quiet_NaN();
    return static_cast<float>(step % 5 + rank_);
  }
  float ComputeGradientOnDevice(int64_t step, std::span<const float> params,
                                float* device_grads) override {
    return ComputeGradient(step, params, {device_grads, kParams});
  }

 private:
  int rank_;
  int64_t nan_step_;
};

class DeviceSgd : public train::SgdOptimizer {
 public:
  using SgdOptimizer::SgdOptimizer;
  void ApplyFromDevice(std::span<float> params, const float* device_grads) override {
    Apply(params, {device_grads, kParams});
  }
};

struct Case {
  int world;
  int width;
  size_t segment;  // floats per staging segment
};

// Trains 9 steps, snapshots (pending aggregates), trains 6 more and drains; returns the params,
// the losses and the snapshot's pending aggregates, packed.
std::string TrainRun(const RankContext& ctx, const Case& c, bool device) {
  auto comm = testing::ConnectRing(ctx, 64);  // 16-float chunks: many chunks per segment
  IntegerObjective objective(ctx.rank);
  DeviceSgd sgd({0.125f, 0.5f, 0.0f}, kParams);
  std::vector<float> params(kParams);
  for (size_t i = 0; i < kParams; ++i) params[i] = static_cast<float>(i % 13);
  std::unique_ptr<HostDeviceGradients> slots;
  train::TrainerOptions options{c.width, 60};
  if (device) {
    slots = std::make_unique<HostDeviceGradients>(*comm, c.width, kParams + 1, 3, c.segment);
    options.gradient_slots = slots.get();
  }
  train::Trainer trainer(*comm, objective, sgd, params, options);
  std::vector<float> out;
  for (int t = 0; t < 9; ++t) trainer.Step();
  train::TrainerSnapshot snapshot = trainer.Snapshot();
  for (const auto& p : snapshot.pending) out.insert(out.end(), p.aggregate.begin(), p.aggregate.end());
  for (int t = 0; t < 6; ++t) trainer.Step();
  trainer.Drain(true);
  for (int64_t s = 0; s < trainer.steps(); ++s) out.push_back(trainer.StepLoss(s));
  out.insert(out.end(), params.begin(), params.end());
  if (device && slots->allreduces != trainer.steps()) {
    return fmt::format("device slots AllReduced {} times for {} steps", slots->allreduces,
                       trainer.steps());
  }
  return testing::PackFloats(out.data(), out.size());
}

class DeviceSlots : public ::testing::TestWithParam<Case> {};

TEST_P(DeviceSlots, BitwiseTheHostSlotTrainer) {
  const Case c = GetParam();
  auto host = RunRanks(c.world, [&](const RankContext& ctx) { return TrainRun(ctx, c, false); }, 120);
  auto device = RunRanks(c.world, [&](const RankContext& ctx) { return TrainRun(ctx, c, true); }, 120);
  for (int r = 0; r < c.world; ++r) {
    ASSERT_EQ(host[r].exit_code, 0) << host[r].error;
    ASSERT_EQ(device[r].exit_code, 0) << device[r].error;
    auto want = testing::UnpackFloats(host[r].output);
    auto got = testing::UnpackFloats(device[r].output);
    ASSERT_EQ(got.size(), want.size()) << "rank " << r << ": " << device[r].output;
    // (K-1) pending aggregates of kParams + 1, 15 losses, kParams params.
    ASSERT_EQ(want.size(), (c.width - 1) * (kParams + 1) + 15 + kParams);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
          << "rank " << r << " element " << i << ": device " << got[i] << " host " << want[i];
    }
    EXPECT_EQ(device[r].output, device[0].output) << "rank " << r << " drifted from rank 0";
  }
  // The run really moved the parameters (lr 1/8 of integer averages).
  auto p = testing::UnpackFloats(device[0].output);
  EXPECT_NE(p.back(), static_cast<float>((kParams - 1) % 13));
}

INSTANTIATE_TEST_SUITE_P(
    WorldWidthSegment, DeviceSlots,
    ::testing::Values(Case{1, 1, 4096}, Case{1, 2, 7}, Case{3, 2, 7}, Case{4, 1, 7},
                      Case{4, 2, 7}, Case{4, 2, 4096}, Case{4, 3, 100}),
    [](const auto& test_info) {
      return fmt::format("world{}_width{}_segment{}", test_info.param.world, test_info.param.width,
                         test_info.param.segment);
    });

TEST(DeviceSlots, NonFiniteAggregateStopsEveryRankNamingTheParameter) {
  auto results = RunRanks(4, [](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx, 64);
    IntegerObjective objective(ctx.rank, /*nan_step=*/3);
    DeviceSgd sgd({0.125f, 0.0f, 0.0f}, kParams);
    std::vector<float> params(kParams, 1.0f);
    HostDeviceGradients slots(*comm, 2, kParams + 1, 2, 100);
    train::TrainerOptions options{2, 60};
    options.gradient_slots = &slots;
    train::Trainer trainer(*comm, objective, sgd, params, options);
    try {
      for (int t = 0; t < 10; ++t) trainer.Step();
    } catch (const Error& e) {
      trainer.Drain(false);
      return fmt::format("{} at applied {}: {}", ErrorCodeName(e.code()), trainer.applied(),
                         e.what());
    }
    return "no error";
  }, 120);
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    // Step 3's aggregate is applied during step 4 (width 2): updates 0..2 went through.
    EXPECT_NE(results[r].output.find("numerical at applied 3"), std::string::npos)
        << results[r].output;
    EXPECT_NE(results[r].output.find("step 3: the averaged gradient has a non-finite value (nan) "
                                     "at parameter 123"),
              std::string::npos)
        << results[r].output;
  }
}

TEST(SlotSummaryBuilder, LowestNonFiniteAndTheLossFromPiecesInAnyOrder) {
  train::SlotSummaryBuilder builder(10);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  builder.Add(6, std::vector<float>{1, inf, 3, 2.5f});  // elements 6..9: 9 is the loss
  EXPECT_EQ(builder.Get().first_nonfinite, 7);
  EXPECT_EQ(builder.Get().loss, 2.5f);
  builder.Add(0, std::vector<float>{0, 1, 2, nan, -inf, 5});
  const train::SlotSummary summary = builder.Get();
  EXPECT_EQ(summary.first_nonfinite, 3);
  EXPECT_TRUE(std::isnan(summary.nonfinite_value));
  EXPECT_EQ(summary.loss, 2.5f);
  train::SlotSummaryBuilder clean(3);
  clean.Add(0, std::vector<float>{1, 2, 0.75f});
  EXPECT_EQ(clean.Get().first_nonfinite, -1);
  EXPECT_EQ(clean.Get().loss, 0.75f);
}

TEST(DeviceSlots, HostOnlyObjectiveIsAClearError) {
  auto results = RunRanks(1, [](const RankContext& ctx) -> std::string {
    auto comm = testing::ConnectRing(ctx);
    class HostOnly : public train::Objective {
     public:
      size_t num_params() const override { return kParams; }
      float ComputeGradient(int64_t, std::span<const float>, std::span<float>) override {
        return 0;
      }
    } objective;
    DeviceSgd sgd({0.125f, 0.0f, 0.0f}, kParams);
    std::vector<float> params(kParams, 1.0f);
    HostDeviceGradients slots(*comm, 1, kParams + 1, 2, 100);
    train::TrainerOptions options{1, 60};
    options.gradient_slots = &slots;
    train::Trainer trainer(*comm, objective, sgd, params, options);
    try {
      trainer.Step();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  });
  ASSERT_EQ(results[0].exit_code, 0) << results[0].error;
  EXPECT_NE(results[0].output.find("computes gradients in host memory only"), std::string::npos)
      << results[0].output;
}

}  // namespace
}  // namespace pipesgd
