#include "core/train/run_loop.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/base/check.h"

namespace pipesgd::train {

int64_t RunPlan::total_steps() const {
  const int64_t all = static_cast<int64_t>(epochs) * steps_per_epoch;
  return max_steps > 0 ? std::min(max_steps, all) : all;  // max_steps caps the epochs
}

int RunPlan::epochs_to_run() const {
  return static_cast<int>((total_steps() + steps_per_epoch - 1) / steps_per_epoch);
}

bool RunPlan::EpochEndAt(int64_t done) const {
  return done % steps_per_epoch == 0 || done == total_steps();
}

bool RunPlan::EvaluatesAfter(int64_t done) const {
  return EpochEndAt(done) || (eval_every_steps > 0 && done % eval_every_steps == 0);
}

int RunPlan::EpochOf(int64_t done) const {
  return static_cast<int>((std::max<int64_t>(done, 1) - 1) / steps_per_epoch) + 1;
}

void PausableClock::Pause() {
  PSGD_CHECK(!paused_);
  paused_ = true;
  paused_at_ = Clock::now();
}

void PausableClock::Resume() {
  PSGD_CHECK(paused_);
  paused_ = false;
  paused_total_s_ += std::chrono::duration<double>(Clock::now() - paused_at_).count();
}

double PausableClock::running_s() const {
  const auto now = paused_ ? paused_at_ : Clock::now();
  return std::chrono::duration<double>(now - start_).count() - paused_total_s_;
}

double PausableClock::paused_s() const { return paused_total_s_; }

RunPoint TrainingMode::Point(const RunPlan& plan) const {
  const int64_t t = steps();
  return {t, plan.EvaluatesAfter(t), plan.EpochEndAt(t), t >= plan.total_steps(), 0};
}

RunOutcome RunLoop(TrainingMode& mode, const RunPlan& plan, Reporter& reporter) {
  PSGD_CHECK_GE(plan.steps_per_epoch, 1);
  PSGD_CHECK_GE(plan.epochs, 1);
  const int64_t total = plan.total_steps();
  const int epochs = plan.epochs_to_run();
  RunOutcome out;
  PausableClock clock;
  int64_t eval_from = mode.steps();       // mode.steps() at the previous evaluation
  int64_t eval_from_step = eval_from;     // its global step
  double eval_from_wall = 0;

  // Evaluates the state at `p`; true when it reaches the target.
  auto evaluate = [&](const RunPoint& p) {
    mode.PrepareEvaluation(p.last);
    const double wall = clock.running_s();
    clock.Pause();
    const TrainingMode::Result r = mode.Evaluate(eval_from);
    clock.Resume();
    Evaluation e;
    e.step = p.step;
    e.epoch = p.epoch > 0 ? p.epoch : plan.EpochOf(p.step);
    e.epoch_end = p.epoch_end;
    e.wall_s = wall;
    e.eval_s = clock.paused_s();
    e.train_loss = r.train_loss;
    e.test_loss = r.test_loss;
    e.test_accuracy = r.test_accuracy;
    const double span_s = wall - eval_from_wall;
    e.samples_per_s =
        span_s > 0 ? static_cast<double>((p.step - eval_from_step) * plan.global_batch) / span_s : 0;
    e.wire_bytes_per_step = r.wire_bytes_per_step;
    e.compression_ratio = r.compression_ratio;
    reporter.Evaluated(e, epochs);
    mode.AfterEvaluation(e);
    out.evaluations += 1;
    out.final_test_accuracy = r.test_accuracy;
    out.final_test_loss = r.test_loss;
    eval_from = mode.steps();
    eval_from_step = p.step;
    eval_from_wall = wall;
    if (plan.target_accuracy > 0 && !out.reached_target && r.test_accuracy >= plan.target_accuracy) {
      out.reached_target = true;
      out.steps_to_target = p.step;
      out.time_to_target_s = wall;
      return true;
    }
    return false;
  };

  int64_t t = mode.steps();
  const int64_t first_step = t;  // a resumed run's ETA counts only its own steps
  int64_t global_steps = t;      // the latest point's step: SDPIPE's t counts local steps
  double steady_from_s = 0;      // the running clock when the warm-up steps are done
  bool steady = plan.warmup_steps == 0;
  bool at_target = false;
  bool last = false;
  if (t >= total) {
    evaluate({t, true, plan.EpochEndAt(t), true, 0});  // resumed at the end: report where it stands
    last = true;
  } else {
    int64_t epoch_start_step = t;
    double epoch_start_wall = 0;
    const int progress = plan.progress_per_epoch;
    while (!last) {
      mode.Step();
      mode.AfterStep();
      PSGD_CHECK_EQ(mode.steps(), t + 1);
      t += 1;
      const RunPoint p = mode.Point(plan);
      last = p.last;
      global_steps = p.step;
      if (!steady && global_steps - first_step >= plan.warmup_steps) {
        steady = true;
        steady_from_s = clock.running_s();
      }
      const int epoch = plan.EpochOf(t);
      const int64_t epoch_first = static_cast<int64_t>(epoch - 1) * plan.steps_per_epoch;
      const int64_t epoch_total = std::min(epoch_first + plan.steps_per_epoch, total) - epoch_first;
      const int64_t done = t - epoch_first;
      // `progress` lines, evenly spaced, none at the very end (the epoch's evaluation follows).
      if (progress > 0 && !p.evaluate && done < epoch_total &&
          done * (progress + 1) / epoch_total != (done - 1) * (progress + 1) / epoch_total) {
        const double running = clock.running_s();
        const double s = running - epoch_start_wall;
        Progress line;
        line.epoch = epoch;
        line.epochs = epochs;
        line.done = done;
        line.total = epoch_total;
        line.loss = mode.LatestLoss();
        line.samples_per_s =
            s > 0 ? static_cast<double>((t - epoch_start_step) * plan.global_batch) / s : 0;
        line.elapsed_s = running + clock.paused_s();
        line.eta_s = running / static_cast<double>(t - first_step) * static_cast<double>(total - t);
        reporter.Progress(line);
      }
      if (p.evaluate) {
        at_target = evaluate(p);
        if (at_target) break;
      }
      if (p.epoch_end) {
        epoch_start_step = t;
        epoch_start_wall = clock.running_s();
      }
    }
  }
  out.steps = global_steps;
  out.train_s = clock.running_s();
  out.eval_s = clock.paused_s();
  if (out.steps - first_step > plan.warmup_steps) {
    out.steady_steps = out.steps - first_step - plan.warmup_steps;
    out.steady_step_s = (out.train_s - steady_from_s) / static_cast<double>(out.steady_steps);
  }
  mode.Finish(at_target && !last);
  return out;
}

}  // namespace pipesgd::train
