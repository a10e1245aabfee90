// Pipeline-parallel pieces without the network: the 1F1B schedule (exact order, invariants and a
// step-by-step simulation of M stages with blocking receives), balanced stage boundaries, and the
// pipeline stage (split model gradients equal the unsplit layers::Model's; weight stashing: the
// backward of micro-batch i uses exactly the weights of its forward, by version number).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "core/base/error.h"
#include "core/train/classifier_task.h"
#include "core/train/pipeline_schedule.h"
#include "core/train/pipeline_stage.h"
#include "core/train/pipeline_trainer.h"
#include "layers/layer.h"
#include "layers/model.h"
#include "core/base/rng.h"

namespace pipesgd::train {
namespace {

using layers::Shape;

std::string Order(int stages, int stage, int m) {
  return ToString(OneFOneBSchedule(stages, stage, m));
}

TEST(PipelineSchedule, FourStagesEightMicroBatches) {
  EXPECT_EQ(Order(4, 0, 8), "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(Order(4, 1, 8), "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
  EXPECT_EQ(Order(4, 2, 8), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  EXPECT_EQ(Order(4, 3, 8), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
}

TEST(PipelineSchedule, FewerMicroBatchesThanStages) {
  EXPECT_EQ(Order(4, 0, 2), "F0 F1 B0 B1");
  EXPECT_EQ(Order(4, 1, 2), "F0 F1 B0 B1");
  EXPECT_EQ(Order(4, 2, 2), "F0 F1 B0 B1");
  EXPECT_EQ(Order(4, 3, 2), "F0 B0 F1 B1");
  EXPECT_EQ(Order(2, 0, 1), "F0 B0");
  EXPECT_EQ(Order(2, 1, 1), "F0 B0");
}

TEST(PipelineSchedule, OneStageAlternates) {
  EXPECT_EQ(Order(1, 0, 3), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(Order(2, 0, 3), "F0 F1 B0 F2 B1 B2");
  EXPECT_EQ(Order(2, 1, 3), "F0 B0 F1 B1 F2 B2");
}

TEST(PipelineSchedule, InvariantsForManyShapes) {
  for (int stages = 1; stages <= 5; ++stages) {
    for (int stage = 0; stage < stages; ++stage) {
      for (int m = 1; m <= 9; ++m) {
        SCOPED_TRACE(testing::Message() << "M=" << stages << " s=" << stage << " m=" << m);
        const auto ops = OneFOneBSchedule(stages, stage, m);
        ASSERT_EQ(ops.size(), 2u * m);
        int next_f = 0, next_b = 0, max_in_flight = 0;
        for (const auto& op : ops) {
          if (op.kind == PipelineOp::Kind::kForward) {
            EXPECT_EQ(op.micro_batch, next_f++);  // ascending, each once
          } else {
            EXPECT_EQ(op.micro_batch, next_b++);
            EXPECT_LT(op.micro_batch, next_f);  // backward after its forward
          }
          max_in_flight = std::max(max_in_flight, next_f - next_b);
        }
        EXPECT_EQ(next_f, m);
        EXPECT_EQ(next_b, m);
        EXPECT_EQ(max_in_flight, MaxInFlight(stages, stage, m));
      }
    }
  }
}

// Runs every stage's schedule with blocking receives: F(i) on stage s > 0 waits for F(i) on
// s-1 (its activations), B(i) on s < M-1 waits for B(i) on s+1 (its gradient); sends never
// block. Each round every stage whose next op is ready runs it. All must finish (no deadlock),
// and the steady state must keep the last stage busy every round once it is filled.
TEST(PipelineSchedule, SimulatedPipelineNeverDeadlocks) {
  for (int stages = 1; stages <= 5; ++stages) {
    for (int m = 1; m <= 9; ++m) {
      SCOPED_TRACE(testing::Message() << "M=" << stages << " m=" << m);
      std::vector<std::vector<PipelineOp>> sched;
      for (int s = 0; s < stages; ++s) sched.push_back(OneFOneBSchedule(stages, s, m));
      std::vector<size_t> pos(stages, 0);
      std::vector<int> forwarded(stages, 0), backwarded(stages, 0);
      int rounds = 0;
      bool all_done = false;
      while (!all_done) {
        ASSERT_LT(rounds, 10 * (stages + m)) << "deadlock";
        std::vector<std::pair<int, PipelineOp>> run;
        for (int s = 0; s < stages; ++s) {
          if (pos[s] == sched[s].size()) continue;
          const PipelineOp& op = sched[s][pos[s]];
          const bool ready = op.kind == PipelineOp::Kind::kForward
                                 ? (s == 0 || forwarded[s - 1] > op.micro_batch)
                                 : (s == stages - 1 || backwarded[s + 1] > op.micro_batch);
          if (ready) run.push_back({s, op});
        }
        ASSERT_FALSE(run.empty()) << "deadlock after " << rounds << " rounds";
        for (const auto& [s, op] : run) {
          (op.kind == PipelineOp::Kind::kForward ? forwarded : backwarded)[s]++;
          pos[s]++;
        }
        ++rounds;
        all_done = true;
        for (int s = 0; s < stages; ++s) all_done = all_done && pos[s] == sched[s].size();
      }
      // Fill (M-1 rounds each way) plus 2m ops on a stage: the 1F1B makespan in unit ops.
      EXPECT_EQ(rounds, 2 * m + 2 * (stages - 1));
    }
  }
}

TEST(PipelineSchedule, RejectsBadArguments) {
  EXPECT_THROW(OneFOneBSchedule(0, 0, 1), Error);
  EXPECT_THROW(OneFOneBSchedule(2, 2, 1), Error);
  EXPECT_THROW(OneFOneBSchedule(2, -1, 1), Error);
  EXPECT_THROW(OneFOneBSchedule(2, 0, 0), Error);
}

TEST(PipelineBoundaries, BalancedByParameterCount) {
  // The Fashion-MNIST MLP: linear(784->256) relu linear(256->128) relu linear(128->10).
  EXPECT_EQ(BalancedBoundaries({200960, 0, 32896, 0, 1290}, 2), (std::vector<size_t>{1}));
  EXPECT_EQ(BalancedBoundaries({10, 10, 10, 10}, 2), (std::vector<size_t>{2}));
  EXPECT_EQ(BalancedBoundaries({10, 10, 10, 10}, 4), (std::vector<size_t>{1, 2, 3}));
  // Target 50; the prefixes at boundaries 1, 2, 3 are 0, 0, 100, all 50 away: the smallest wins.
  EXPECT_EQ(BalancedBoundaries({0, 0, 100, 0}, 2), (std::vector<size_t>{1}));
  EXPECT_EQ(BalancedBoundaries({5}, 1), (std::vector<size_t>{}));
  EXPECT_THROW(BalancedBoundaries({5, 5}, 3), Error);
  EXPECT_THROW(BalancedBoundaries({5, 5}, 0), Error);
  EXPECT_NO_THROW(CheckBoundaries({1, 3}, 5));
  EXPECT_THROW(CheckBoundaries({3, 3}, 5), Error);
  EXPECT_THROW(CheckBoundaries({0}, 5), Error);
  EXPECT_THROW(CheckBoundaries({5}, 5), Error);
}

// A small CNN with every layer kind that keeps state from forward to backward (max-pool argmax)
// or draws random numbers (dropout): conv(1x6x6->3x6x6) relu maxpool(->3x3x3) dropout flatten
// linear(27->8) relu linear(8->4).
std::vector<std::unique_ptr<layers::Layer>> SmallCnn() {
  std::vector<std::unique_ptr<layers::Layer>> l;
  l.push_back(layers::MakeConv2d(Shape{1, 6, 6}, 3, 3, 1, 1));
  l.push_back(layers::MakeRelu(Shape{3, 6, 6}));
  l.push_back(layers::MakeMaxPool2d(Shape{3, 6, 6}, 2, 2));
  l.push_back(layers::MakeDropout(Shape{3, 3, 3}, 0.25f));
  l.push_back(layers::MakeFlatten(Shape{3, 3, 3}));
  l.push_back(layers::MakeLinear(27, 8));
  l.push_back(layers::MakeRelu(8));
  l.push_back(layers::MakeLinear(8, 4));
  return l;
}

std::vector<PipelineStage> Split(std::vector<std::unique_ptr<layers::Layer>> all,
                                 const std::vector<size_t>& boundaries,
                                 std::span<const float> params, size_t max_batch,
                                 int max_in_flight) {
  std::vector<PipelineStage> stages;
  std::vector<size_t> starts{0};
  starts.insert(starts.end(), boundaries.begin(), boundaries.end());
  starts.push_back(all.size());
  size_t offset = 0;
  for (size_t k = 0; k + 1 < starts.size(); ++k) {
    std::vector<std::unique_ptr<layers::Layer>> part;
    size_t n = 0;
    for (size_t i = starts[k]; i < starts[k + 1]; ++i) {
      n += all[i]->num_params();
      part.push_back(std::move(all[i]));
    }
    stages.emplace_back(std::move(part), starts[k], k + 2 == starts.size(), max_batch,
                        max_in_flight, params.subspan(offset, n));
    offset += n;
  }
  return stages;
}

TEST(PipelineStage, SplitGradientsEqualTheUnsplitModel) {
  const size_t batch = 5;
  layers::Model model(SmallCnn(), batch);
  std::vector<float> params(model.num_params());
  model.Init(params, 42);
  std::vector<float> x(batch * 36);
  pipesgd::Rng rng(7);
  for (auto& v : x) v = rng.Uniform(-1, 1);
  const std::vector<uint8_t> labels{0, 3, 1, 2, 3};
  const layers::BatchKey key{42, 11, 20};
  std::vector<float> want(model.num_params());
  const float want_loss = model.ForwardBackward(params, x.data(), labels.data(), batch, want, key);

  for (const auto& boundaries : std::vector<std::vector<size_t>>{{}, {3}, {2, 5}, {1, 4, 7}}) {
    SCOPED_TRACE(testing::Message() << boundaries.size() + 1 << " stages");
    auto stages = Split(SmallCnn(), boundaries, params, batch, 1);
    const size_t M = stages.size();
    std::copy(x.begin(), x.end(), stages[0].InputBuffer(0));
    float loss = 0;
    for (size_t s = 0; s < M; ++s) {
      if (s > 0) {
        const size_t n = batch * stages[s].in_shape().size();
        ASSERT_EQ(stages[s].in_shape(), stages[s - 1].out_shape());
        std::copy_n(stages[s - 1].Output(0), n, stages[s].InputBuffer(0));
      }
      loss = stages[s].Forward(0, batch, key, s + 1 == M ? labels.data() : nullptr);
    }
    EXPECT_EQ(loss, want_loss);
    std::vector<float> got;
    std::vector<std::vector<float>> grads(M);
    for (size_t s = M; s-- > 0;) {
      if (s + 1 < M) {
        std::copy_n(stages[s + 1].InputGrad(0), batch * stages[s].out_shape().size(),
                    stages[s].OutputGradBuffer(0));
      }
      grads[s].resize(stages[s].num_params());
      EXPECT_EQ(stages[s].Backward(0, grads[s]), 0);
    }
    for (const auto& g : grads) got.insert(got.end(), g.begin(), g.end());
    // The same layer code on the same floats in the same order: equal bitwise, not just within
    // a tolerance.
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], want[i]) << "param " << i;
  }
}

// w -= 0.5 g: an optimizer without state.
class PlainSgd : public Optimizer {
 public:
  void Apply(std::span<float> params, std::span<const float> grads) override {
    for (size_t i = 0; i < params.size(); ++i) params[i] -= 0.5f * grads[i];
  }
};

TEST(PipelineStage, BackwardUsesTheWeightsItsForwardStashed) {
  const size_t batch = 3;
  auto make = [] {
    std::vector<std::unique_ptr<layers::Layer>> l;
    l.push_back(layers::MakeLinear(4, 3));
    l.push_back(layers::MakeRelu(3));
    return l;
  };
  std::vector<float> w0(4 * 3 + 3);
  pipesgd::Rng rng(3);
  for (auto& v : w0) v = rng.Uniform(-1, 1);
  // A middle stage (first_layer 2): it computes input gradients too.
  PipelineStage stage(make(), 2, false, batch, 3, w0);
  PlainSgd sgd;
  std::vector<std::vector<float>> inputs(3, std::vector<float>(batch * 4));
  std::vector<float> dy(batch * 3);
  for (auto& in : inputs) {
    for (auto& v : in) v = rng.Uniform(-1, 1);
  }
  for (auto& v : dy) v = rng.Uniform(-1, 1);
  std::vector<float> update(w0.size());
  for (auto& v : update) v = rng.Uniform(-1, 1);

  // The reference gradient of one micro-batch at given weights, on a fresh stage.
  auto reference = [&](std::span<const float> w, int mb, std::vector<float>* dx) {
    PipelineStage fresh(make(), 2, false, batch, 1, w);
    std::copy(inputs[mb].begin(), inputs[mb].end(), fresh.InputBuffer(0));
    fresh.Forward(0, batch, {});
    std::copy(dy.begin(), dy.end(), fresh.OutputGradBuffer(0));
    std::vector<float> g(w.size());
    fresh.Backward(0, g);
    dx->assign(fresh.InputGrad(0), fresh.InputGrad(0) + batch * 4);
    return g;
  };

  // F0 at v0, update, F1 at v1, update, F2 at v2, update; then B0, B1, B2 (a first stage's
  // warm-up with three micro-batches in flight, updates from elsewhere in between).
  std::vector<std::vector<float>> versions{w0};
  for (int mb = 0; mb < 3; ++mb) {
    std::copy(inputs[mb].begin(), inputs[mb].end(), stage.InputBuffer(mb));
    stage.Forward(mb, batch, {});
    stage.Update(sgd, update);
    versions.emplace_back(stage.params().begin(), stage.params().end());
    EXPECT_EQ(stage.version(), mb + 1);
  }
  for (int mb = 0; mb < 3; ++mb) {
    std::copy(dy.begin(), dy.end(), stage.OutputGradBuffer(mb));
    std::vector<float> g(w0.size());
    EXPECT_EQ(stage.Backward(mb, g), mb);  // the version its forward used
    std::vector<float> want_dx;
    EXPECT_EQ(g, reference(versions[mb], mb, &want_dx));
    EXPECT_EQ(std::vector<float>(stage.InputGrad(mb), stage.InputGrad(mb) + batch * 4), want_dx);
    // The latest weights would give another input gradient (dx = dy W): the stash is what
    // made it right.
    std::vector<float> latest_dx;
    reference(versions[3], mb, &latest_dx);
    EXPECT_NE(want_dx, latest_dx);
  }
  // Backward never touched the latest weights.
  EXPECT_EQ(std::vector<float>(stage.params().begin(), stage.params().end()), versions[3]);
  EXPECT_EQ(stage.version(), 3);
}

TEST(PipelineStage, RejectsASlotStillInFlight) {
  std::vector<std::unique_ptr<layers::Layer>> l;
  l.push_back(layers::MakeLinear(2, 2));
  std::vector<float> w(6, 0.1f);
  PipelineStage stage(std::move(l), 0, false, 4, 2, w);
  stage.Forward(0, 4, {});
  stage.Forward(1, 4, {});
  try {
    stage.InputBuffer(2);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("held by micro-batch 0"), std::string::npos) << e.what();
  }
  std::vector<float> g(6);
  EXPECT_THROW(stage.Backward(2, g), Error);
  EXPECT_EQ(stage.Backward(0, g), 0);
  EXPECT_THROW(stage.Backward(0, g), Error);  // already backwarded
  EXPECT_NO_THROW(stage.InputBuffer(2));
  EXPECT_THROW(stage.Forward(2, 5, {}), Error);  // more rows than max_batch
}

// Each stage's layers and its slice of the whole model's parameters; parameterless layers
// (relu) count in layers, not in parameters.
TEST(StageSlices, LayersAndParameterRangesOfEachStage) {
  const std::vector<size_t> layer_params = {10, 0, 20, 0, 5};
  const std::vector<size_t> boundaries = {2, 4};
  const StageSlice s0 = StageSliceOf(layer_params, boundaries, 0);
  const StageSlice s1 = StageSliceOf(layer_params, boundaries, 1);
  const StageSlice s2 = StageSliceOf(layer_params, boundaries, 2);
  EXPECT_EQ(s0.first_layer, 0u);
  EXPECT_EQ(s0.end_layer, 2u);
  EXPECT_EQ(s0.param_offset, 0u);
  EXPECT_EQ(s0.param_count, 10u);
  EXPECT_EQ(s1.first_layer, 2u);
  EXPECT_EQ(s1.end_layer, 4u);
  EXPECT_EQ(s1.param_offset, 10u);
  EXPECT_EQ(s1.param_count, 20u);
  EXPECT_EQ(s2.first_layer, 4u);
  EXPECT_EQ(s2.end_layer, 5u);
  EXPECT_EQ(s2.param_offset, 30u);
  EXPECT_EQ(s2.param_count, 5u);
  const StageSlice whole = StageSliceOf(layer_params, {}, 0);
  EXPECT_EQ(whole.end_layer, 5u);
  EXPECT_EQ(whole.param_count, 35u);
}

// Period 3, 2 epochs of 5 steps, an evaluation every 4 steps: full synchronizations at every
// third step and at every evaluation point; the scheduler's last request is the last step that
// is not one of them.
TEST(FullSync, EveryPeriodAndEveryEvaluationPoint) {
  RunPlan plan;
  plan.steps_per_epoch = 5;
  plan.epochs = 2;
  plan.eval_every_steps = 4;
  const FullSyncPlan sync(3, plan, 3);
  std::vector<int64_t> full;
  for (int64_t step = 1; step <= 10; ++step) {
    if (sync.FullSync(step)) full.push_back(step);
  }
  EXPECT_EQ(full, (std::vector<int64_t>{3, 4, 5, 6, 8, 9, 10}));
  EXPECT_EQ(sync.last_request(), 7);

  const GroupDecision epoch_end = sync.Decision(5);
  EXPECT_EQ(epoch_end.kind, RoundKind::kBarrier);
  EXPECT_TRUE(epoch_end.epoch_end);
  EXPECT_TRUE(epoch_end.evaluate);
  EXPECT_EQ(epoch_end.epoch, 1);
  EXPECT_FALSE(epoch_end.stop);
  EXPECT_EQ(epoch_end.members, (std::vector<int>{0, 1, 2}));
  const GroupDecision periodic = sync.Decision(3);
  EXPECT_EQ(periodic.kind, RoundKind::kConnect);
  EXPECT_FALSE(periodic.evaluate);
  EXPECT_FALSE(periodic.epoch_end);
  const GroupDecision last = sync.Decision(10);
  EXPECT_TRUE(last.stop);
  EXPECT_TRUE(last.epoch_end);
  EXPECT_EQ(last.epoch, 2);

  // Every step a full one: no request at all.
  EXPECT_EQ(FullSyncPlan(1, plan, 2).last_request(), 0);
}

// A pipeline's micro-batches are its Sampler batch in order, cut into `rows`; two sources of
// the same pipeline (its first and last stage) load the same samples.
TEST(MicroBatches, ThePipelinesSamplerBatchInOrderTheSameForEveryStage) {
  data::Dataset d;
  d.count = 48;
  d.rows = 1;
  d.cols = 2;
  d.features = 2;
  d.num_classes = 10;
  for (size_t i = 0; i < d.count; ++i) {
    d.pixels.push_back(static_cast<uint8_t>(i));
    d.pixels.push_back(static_cast<uint8_t>(200 + i % 50));
    d.labels.push_back(static_cast<uint8_t>(i % 10));
  }
  const data::InputScaling scaling{0, 1};
  DatasetMicroBatches first(d, 8, 2, 1, 3, 7, scaling), last(d, 8, 2, 1, 3, 7, scaling);
  data::Sampler sampler(d.count, 8, 1, 3, 7);
  ASSERT_EQ(first.steps_per_epoch(), sampler.steps_per_epoch());
  for (int64_t step : {0, 1, 2, 3}) {  // into the second epoch (2 steps per epoch)
    const auto per_epoch = static_cast<int64_t>(sampler.steps_per_epoch());
    const auto want = sampler.Batch(static_cast<int>(step / per_epoch),
                                    static_cast<size_t>(step % per_epoch));
    for (int mb = 0; mb < 4; ++mb) {
      std::vector<float> x(4), y(4);
      std::vector<uint8_t> lx(2), ly(2);
      first.Load(step, 1, mb, x.data(), lx.data());
      last.Load(step, 1, mb, nullptr, ly.data());  // the last stage needs only the labels
      last.Load(step, 1, mb, y.data(), nullptr);
      for (int r = 0; r < 2; ++r) {
        const uint32_t sample = want[static_cast<size_t>(mb) * 2 + r];
        EXPECT_EQ(lx[r], d.labels[sample]) << step << " " << mb;
        EXPECT_EQ(ly[r], d.labels[sample]) << step << " " << mb;
        EXPECT_FLOAT_EQ(x[r * 2], static_cast<float>(sample) / 255.0f);
      }
      EXPECT_EQ(x, y);
    }
  }
}

}  // namespace
}  // namespace pipesgd::train
