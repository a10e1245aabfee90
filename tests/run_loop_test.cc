// The shared training loop (core/train/run_loop.h) with a scripted mode: which steps are
// evaluated, what each evaluation reports, the stop at the target, a resume at the end, and the
// evaluation time left out of wall_s.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include "core/train/run_loop.h"

namespace pipesgd {
namespace {

using train::Evaluation;
using train::RunPlan;

// Accuracy after step t is accuracy(t); the loss of step t is t.
class ScriptedMode : public train::TrainingMode {
 public:
  explicit ScriptedMode(std::vector<double> accuracy_by_step, int64_t start = 0,
                        double eval_sleep_s = 0)
      : accuracy_(std::move(accuracy_by_step)), steps_(start), eval_sleep_s_(eval_sleep_s) {}
  int64_t steps() const override { return steps_; }
  void Step() override {
    if (steps_ < slow_until) std::this_thread::sleep_for(std::chrono::duration<double>(slow_s));
    ++steps_;
  }
  double LatestLoss() const override { return static_cast<double>(steps_ - 1); }
  void PrepareEvaluation(bool last) override { prepared.push_back({steps_, last}); }
  Result Evaluate(int64_t from) override {
    if (eval_sleep_s_ > 0) std::this_thread::sleep_for(std::chrono::duration<double>(eval_sleep_s_));
    Result r;
    r.test_accuracy = accuracy_.at(static_cast<size_t>(steps_));
    r.test_loss = 1 - r.test_accuracy;
    double sum = 0;
    for (int64_t t = from; t < steps_; ++t) sum += static_cast<double>(t);
    r.train_loss = steps_ > from ? sum / static_cast<double>(steps_ - from) : NAN;
    return r;
  }
  void Finish(bool at_target) override { finished.push_back(at_target); }

  std::vector<std::pair<int64_t, bool>> prepared;
  std::vector<bool> finished;
  int64_t slow_until = 0;  // steps before this one sleep slow_s (a warm-up)
  double slow_s = 0;

 private:
  std::vector<double> accuracy_;
  int64_t steps_;
  double eval_sleep_s_;
};

class Recorder : public train::Reporter {
 public:
  void Progress(const train::Progress& p) override {
    progress.push_back({p.epoch, p.done, p.total});
    eta_s.push_back(p.eta_s);
    elapsed_s.push_back(p.elapsed_s);
  }
  void Evaluated(const Evaluation& e, int total_epochs) override {
    evaluations.push_back(e);
    epochs = total_epochs;
  }
  struct Line {
    int epoch;
    int64_t done, total;
  };
  std::vector<Line> progress;
  std::vector<double> eta_s, elapsed_s;
  std::vector<Evaluation> evaluations;
  int epochs = 0;
};

std::vector<double> Ramp(size_t n) {  // accuracy t / 100 after t steps
  std::vector<double> a(n + 1);
  for (size_t t = 0; t <= n; ++t) a[t] = static_cast<double>(t) / 100.0;
  return a;
}

TEST(RunPlan, EvaluatesAtEpochEndsEveryNStepsAndTheLastStep) {
  RunPlan plan;
  plan.steps_per_epoch = 10;
  plan.epochs = 3;
  plan.eval_every_steps = 4;
  EXPECT_EQ(plan.total_steps(), 30);
  EXPECT_EQ(plan.epochs_to_run(), 3);
  std::vector<int64_t> points;
  for (int64_t t = 1; t <= plan.total_steps(); ++t) {
    if (plan.EvaluatesAfter(t)) points.push_back(t);
  }
  EXPECT_EQ(points, (std::vector<int64_t>{4, 8, 10, 12, 16, 20, 24, 28, 30}));
  EXPECT_EQ(plan.EpochOf(1), 1);
  EXPECT_EQ(plan.EpochOf(10), 1);
  EXPECT_EQ(plan.EpochOf(11), 2);
  plan.max_steps = 25;  // a partial last epoch, evaluated at its last step
  EXPECT_EQ(plan.total_steps(), 25);
  EXPECT_EQ(plan.epochs_to_run(), 3);
  EXPECT_TRUE(plan.EpochEndAt(25));
  EXPECT_TRUE(plan.EvaluatesAfter(25));
  EXPECT_FALSE(plan.EvaluatesAfter(23));
}

// max_steps caps the epochs, it does not extend them: epochs 1 and max_steps 300 with 234 steps
// per epoch is one epoch of 234 steps (it once ran 300, into a second epoch).
TEST(RunPlan, MaxStepsCapsTheEpochsAndNeverExtendsThem) {
  RunPlan plan;
  plan.steps_per_epoch = 234;
  plan.epochs = 1;
  plan.max_steps = 300;
  EXPECT_EQ(plan.total_steps(), 234);
  EXPECT_EQ(plan.epochs_to_run(), 1);
  plan.max_steps = 200;
  EXPECT_EQ(plan.total_steps(), 200);
  EXPECT_TRUE(plan.EvaluatesAfter(200));
  plan.max_steps = 0;
  plan.epochs = 3;
  EXPECT_EQ(plan.total_steps(), 702);
}

// 2 epochs of 10 steps, an evaluation every 6 steps and at each epoch's end, a progress line per
// epoch.
RunPlan TwoEpochsOfTen() {
  RunPlan plan;
  plan.steps_per_epoch = 10;
  plan.epochs = 2;
  plan.eval_every_steps = 6;
  plan.global_batch = 64;
  plan.progress_per_epoch = 1;
  return plan;
}

// Progress lines: elapsed counts the evaluations, the ETA only training (at this run's mean step
// time). Bounds that sleeps make certain: each step sleeps >= 10 ms, each evaluation >= 200 ms.
class SleepyMode : public ScriptedMode {
 public:
  using ScriptedMode::ScriptedMode;
  void Step() override {
    ScriptedMode::Step();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
};

TEST(RunLoop, ProgressElapsedCountsEvaluationsAndTheEtaTrainingOnly) {
  const RunPlan plan = TwoEpochsOfTen();
  SleepyMode mode(Ramp(20), 0, 0.2);
  Recorder rec;
  train::RunLoop(mode, plan, rec);
  ASSERT_EQ(rec.progress.size(), 2u);
  // Step 15 (epoch 2, 5 of 10), after the evaluations at 6, 10 and 12: 5 steps to go.
  const double running = rec.eta_s[1] * 15 / 5;  // the training time so far, as the loop saw it
  EXPECT_GE(running, 15 * 0.010);
  EXPECT_LE(running, rec.elapsed_s[1] - 3 * 0.2 + 1e-9);
  EXPECT_GE(rec.elapsed_s[1], 15 * 0.010 + 3 * 0.2);
  EXPECT_GE(rec.elapsed_s[1], rec.elapsed_s[0]);
}

TEST(RunLoop, ReportsEveryEvaluationWithItsStepEpochAndLoss) {
  const RunPlan plan = TwoEpochsOfTen();
  ScriptedMode mode(Ramp(20));
  Recorder rec;
  const train::RunOutcome out = train::RunLoop(mode, plan, rec);
  // Every 6 steps, each epoch's end, the last step (20: both).
  std::vector<int64_t> steps;
  for (const Evaluation& e : rec.evaluations) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{6, 10, 12, 18, 20}));
  const std::vector<int> epochs = {1, 1, 2, 2, 2};
  const std::vector<bool> ends = {false, true, false, false, true};
  // Mean loss of the steps since the previous evaluation (the loss of step t is t).
  const std::vector<double> losses = {2.5, 7.5, 10.5, 14.5, 18.5};
  for (size_t i = 0; i < rec.evaluations.size(); ++i) {
    const Evaluation& e = rec.evaluations[i];
    EXPECT_EQ(e.epoch, epochs[i]) << "step " << e.step;
    EXPECT_EQ(e.epoch_end, ends[i]) << "step " << e.step;
    EXPECT_DOUBLE_EQ(e.train_loss, losses[i]) << "step " << e.step;
    EXPECT_DOUBLE_EQ(e.test_accuracy, static_cast<double>(e.step) / 100.0);
    EXPECT_GE(e.wall_s, i == 0 ? 0.0 : rec.evaluations[i - 1].wall_s);
  }
  EXPECT_EQ(rec.epochs, 2);
  // The last evaluation drains (last = true), the others do not.
  ASSERT_EQ(mode.prepared.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(mode.prepared[i].second, i == 4);
  // One progress line per epoch at the middle (5 of 10), not where an evaluation is.
  ASSERT_EQ(rec.progress.size(), 2u);
  EXPECT_EQ(rec.progress[0].done, 5);
  EXPECT_EQ(rec.progress[1].done, 5);
  EXPECT_EQ(out.steps, 20);
  EXPECT_EQ(out.evaluations, 5);
  EXPECT_DOUBLE_EQ(out.final_test_accuracy, 0.20);
  EXPECT_FALSE(out.reached_target);
  EXPECT_EQ(out.steps_to_target, -1);
  EXPECT_EQ(out.time_to_target_s, -1);
  EXPECT_EQ(mode.finished, (std::vector<bool>{false}));
}

TEST(RunLoop, StopsAtTheFirstEvaluationThatReachesTheTarget) {
  RunPlan plan;
  plan.steps_per_epoch = 10;
  plan.epochs = 5;
  plan.eval_every_steps = 3;
  plan.target_accuracy = 0.13;  // first reached after step 13; evaluated at 15
  ScriptedMode mode(Ramp(50));
  Recorder rec;
  const train::RunOutcome out = train::RunLoop(mode, plan, rec);
  ASSERT_FALSE(rec.evaluations.empty());
  EXPECT_EQ(rec.evaluations.back().step, 15);
  EXPECT_TRUE(out.reached_target);
  EXPECT_EQ(out.steps_to_target, 15);
  EXPECT_EQ(out.time_to_target_s, rec.evaluations.back().wall_s);
  EXPECT_EQ(out.steps, 15);
  EXPECT_DOUBLE_EQ(out.final_test_accuracy, 0.15);
  // Stopped before the last step: the mode is told (RING drops the aggregates in flight).
  EXPECT_EQ(mode.finished, (std::vector<bool>{true}));
  EXPECT_FALSE(mode.prepared.back().second);
}

TEST(RunLoop, TargetReachedAtTheLastStepIsAnOrdinaryEnd) {
  RunPlan plan;
  plan.steps_per_epoch = 10;
  plan.epochs = 1;
  plan.target_accuracy = 0.10;
  ScriptedMode mode(Ramp(10));
  Recorder rec;
  const train::RunOutcome out = train::RunLoop(mode, plan, rec);
  EXPECT_TRUE(out.reached_target);
  EXPECT_EQ(out.steps_to_target, 10);
  EXPECT_EQ(mode.finished, (std::vector<bool>{false}));
}

TEST(RunLoop, ResumedAtTheEndEvaluatesOnceAndResumedMidwayCountsFromThere) {
  RunPlan plan;
  plan.steps_per_epoch = 10;
  plan.epochs = 2;
  {
    ScriptedMode mode(Ramp(20), /*start=*/20);
    Recorder rec;
    const train::RunOutcome out = train::RunLoop(mode, plan, rec);
    ASSERT_EQ(rec.evaluations.size(), 1u);
    EXPECT_EQ(rec.evaluations[0].step, 20);
    EXPECT_TRUE(std::isnan(rec.evaluations[0].train_loss));  // no step since
    EXPECT_EQ(out.steps, 20);
  }
  {
    ScriptedMode mode(Ramp(20), /*start=*/7);
    Recorder rec;
    train::RunLoop(mode, plan, rec);
    ASSERT_EQ(rec.evaluations.size(), 2u);
    EXPECT_EQ(rec.evaluations[0].step, 10);
    EXPECT_DOUBLE_EQ(rec.evaluations[0].train_loss, 8.0);  // steps 7, 8, 9
  }
}

TEST(RunLoop, EvaluationTimeIsLeftOutOfWallAndCountedInEvalS) {
  RunPlan plan;
  plan.steps_per_epoch = 5;
  plan.epochs = 3;
  ScriptedMode mode(Ramp(15), 0, /*eval_sleep_s=*/0.1);
  Recorder rec;
  const train::RunOutcome out = train::RunLoop(mode, plan, rec);
  ASSERT_EQ(rec.evaluations.size(), 3u);
  // The steps take microseconds; three evaluations of 0.1 s each do not count as training.
  EXPECT_LT(out.train_s, 0.05);
  EXPECT_GE(out.eval_s, 0.3);
  EXPECT_LT(rec.evaluations.back().wall_s, 0.05);
  EXPECT_GE(rec.evaluations[0].eval_s, 0.1);
  EXPECT_GE(rec.evaluations[2].eval_s, 0.3);
}

TEST(RunLoop, SteadyStepTimeLeavesOutTheWarmUpSteps) {
  RunPlan plan;
  plan.steps_per_epoch = 30;
  plan.warmup_steps = 5;
  {
    // Steps 0-3 sleep 50 ms, inside the 5 warm-up steps; the 25 after them take microseconds.
    ScriptedMode mode(Ramp(30));
    mode.slow_until = 4;
    mode.slow_s = 0.05;
    Recorder rec;
    const train::RunOutcome out = train::RunLoop(mode, plan, rec);
    EXPECT_GE(out.train_s, 0.2);
    EXPECT_EQ(out.steady_steps, 25);
    EXPECT_GT(out.steady_step_s, 0.0);
    EXPECT_LT(out.steady_step_s, 0.002);  // the sleeps are not in it
  }
  {
    // A resumed run counts its warm-up from where it starts: steps 20-24, then 5 steady ones.
    ScriptedMode mode(Ramp(30), /*start=*/20);
    mode.slow_until = 24;
    mode.slow_s = 0.05;
    Recorder rec;
    const train::RunOutcome out = train::RunLoop(mode, plan, rec);
    EXPECT_EQ(out.steady_steps, 5);
    EXPECT_LT(out.steady_step_s, 0.01);
  }
  {
    // No step after the warm-up: no steady time.
    RunPlan short_plan = plan;
    short_plan.steps_per_epoch = 5;
    ScriptedMode mode(Ramp(5));
    Recorder rec;
    const train::RunOutcome out = train::RunLoop(mode, short_plan, rec);
    EXPECT_EQ(out.steady_steps, 0);
    EXPECT_EQ(out.steady_step_s, 0.0);
  }
}

}  // namespace
}  // namespace pipesgd
