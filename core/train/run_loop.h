// The training loop of every mode (RING, PS_SYNC, PS_ASYNC, SDPIPE and its pipeline stages), in
// one place:
//
//   for each step:   mode.Step();  mode.AfterStep()                   (checkpoints)
//     at an evaluation point (each epoch's end, every eval_every_steps global steps, the last
//     step; SDPIPE: its scheduler's barriers, which the plan arms at those points):
//       mode.PrepareEvaluation(last)   (RING: wait for the AllReduces in flight; drain at the end)
//       mode.Evaluate(...)             (collective: every rank gets the same numbers)
//       reporter.Evaluated(e)          (console line, metrics.jsonl)
//       stop when e.test_accuracy >= target_accuracy
//
// It keeps the step accounting (epochs, max_steps, resume), the wall-clock time of training
// with the evaluations left out (`wall_s`; their own time is `eval_s`), and the time to the
// target accuracy. The mode is a strategy; the loop knows nothing of rings or servers.
#pragma once

#include <chrono>
#include <cstdint>

namespace pipesgd::train {

struct RunPlan {
  int64_t steps_per_epoch = 1;   // >= 1
  int epochs = 1;                // >= 1
  int64_t max_steps = 0;         // a cap on epochs * steps_per_epoch; 0: none
  int64_t eval_every_steps = 0;  // 0: at epoch ends only
  double target_accuracy = 0;    // 0: never stop early
  int64_t global_batch = 1;      // samples per global step, for samples_per_s
  int progress_per_epoch = 0;    // progress calls per epoch, evenly spaced
  // Steps at the start of a run (or of a resumed run) that RunOutcome::steady_step_s leaves out:
  // fresh connections in TCP slow start, first-touch allocations, a synchronous warm-up.
  int64_t warmup_steps = 0;

  // Steps the run takes unless it stops at the target.
  int64_t total_steps() const;
  // Epochs the run touches (the last may be partial with max_steps).
  int epochs_to_run() const;
  // Whether the state after `done` global steps (1 <= done <= total_steps()) is evaluated.
  bool EvaluatesAfter(int64_t done) const;
  bool EpochEndAt(int64_t done) const;
  // The 1-based epoch that global step number `done` (1-based) belongs to.
  int EpochOf(int64_t done) const;
};

// One evaluation: one line of metrics.jsonl.
struct Evaluation {
  int64_t step = 0;       // global steps done
  int epoch = 0;          // 1-based: the epoch in progress, or the one this evaluation ends
  bool epoch_end = false;
  double wall_s = 0;      // training time since the run started, evaluations left out
  double eval_s = 0;      // time in evaluations so far, this one included
  double train_loss = 0;  // mean over the steps since the previous evaluation
  double test_loss = 0;
  double test_accuracy = 0;
  double samples_per_s = 0;  // since the previous evaluation, over training time
  // Bytes this rank sent per gradient step since the previous evaluation and the codec's
  // ratio (raw float32 / payload); 0 and 1 where a mode does not count them.
  double wire_bytes_per_step = 0;
  double compression_ratio = 1;
};

struct RunOutcome {
  // Global steps done: the last point's (SDPIPE: the scheduler's worker-updates / N, not the
  // local steps of the reporting rank, which differ from rank to rank).
  int64_t steps = 0;
  int evaluations = 0;
  double final_test_accuracy = 0;
  double final_test_loss = 0;
  double train_s = 0;  // training time, evaluations left out
  double eval_s = 0;
  // Training time per step after the plan's warm-up steps (what a timing model predicts: a
  // 60-step job on the 100 Mbit/s lab took 16% longer per step than a 300-step one), and the
  // steps it is the mean of; 0 and 0 where the run took no step after them.
  double steady_step_s = 0;
  int64_t steady_steps = 0;
  bool reached_target = false;  // false when no target was set
  int64_t steps_to_target = -1;
  double time_to_target_s = -1;  // training time, evaluations left out
};

// Where a run stands after a step.
struct RunPoint {
  int64_t step = 0;      // global steps done
  bool evaluate = false;  // evaluate the state now
  bool epoch_end = false;
  bool last = false;      // the run's last step
  int epoch = 0;          // 1-based epoch of the point; 0: the plan's EpochOf(step)
};

// A training mode, as the loop drives it. Every rank runs the same calls in the same order.
class TrainingMode {
 public:
  virtual ~TrainingMode() = default;
  // Steps done so far (after a resume, where the loop starts). Global steps, except in SDPIPE
  // where it counts this rank's local steps.
  virtual int64_t steps() const = 0;
  // One step.
  virtual void Step() = 0;
  // Where the run stands after the last Step: by default from the plan and steps() (global
  // steps); SDPIPE from its scheduler's decision.
  virtual RunPoint Point(const RunPlan& plan) const;
  // After every step (checkpoints every N steps).
  virtual void AfterStep() {}
  // The most recent known training loss, for progress lines (NaN: none yet).
  virtual double LatestLoss() const = 0;
  // Before the evaluation of the state after steps(); `last`: the run ends after it.
  virtual void PrepareEvaluation(bool last) = 0;
  struct Result {
    double test_accuracy = 0;
    double test_loss = 0;
    double train_loss = 0;  // mean over steps [from, steps())
    double wire_bytes_per_step = 0;
    double compression_ratio = 1;
  };
  // The test set at the current weights and the training loss of steps [from, steps()),
  // the same numbers on every rank (collective).
  virtual Result Evaluate(int64_t from) = 0;
  // After each evaluation has been reported (checkpoints every N epochs).
  virtual void AfterEvaluation(const Evaluation&) {}
  // The run is over: at_target = it stopped early at the target accuracy (RING drops the
  // aggregates still in flight, so the model kept is the one evaluated).
  virtual void Finish(bool at_target) {}
};

// A progress line's numbers: `done` of `total` steps of epoch `epoch` (1-based).
struct Progress {
  int epoch = 1;
  int epochs = 1;
  int64_t done = 0;
  int64_t total = 0;
  double loss = 0;           // the latest step's
  double samples_per_s = 0;  // since the epoch began
  double elapsed_s = 0;      // since this run began, evaluations included
  // Training time left at this run's mean step time so far (evaluations not counted).
  double eta_s = 0;
};

class Reporter {
 public:
  virtual ~Reporter() = default;
  // progress_per_epoch times per epoch.
  virtual void Progress(const train::Progress& p) {}
  virtual void Evaluated(const Evaluation& e, int epochs) = 0;
};

// Runs `mode` from mode.steps() to plan.total_steps() or the target. A run resumed at or past
// the end evaluates once and returns. Throws what the mode throws.
RunOutcome RunLoop(TrainingMode& mode, const RunPlan& plan, Reporter& reporter);

// Wall-clock time that leaves the paused spans out.
class PausableClock {
 public:
  using Clock = std::chrono::steady_clock;
  PausableClock() : start_(Clock::now()) {}
  void Pause();
  void Resume();
  double running_s() const;  // since construction, paused spans left out
  double paused_s() const;

 private:
  Clock::time_point start_;
  Clock::time_point paused_at_{};
  bool paused_ = false;
  double paused_total_s_ = 0;
};

}  // namespace pipesgd::train
