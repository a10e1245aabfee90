// train.mode RING for the shared training loop (core/train/run_loop.h): the pipelined trainer,
// its checkpoints, and the evaluation of this rank's test shard summed over the ring. Internal to
// the job skeleton (job_mode.h; its set-up is in ring_mode.cc).
#pragma once

#include <functional>

#include "configs/pipesgd.pb.h"
#include "core/train/run_loop.h"
#include "core/train/trainer.h"
#include "core/job/fault.h"
#include "layers/model.h"

namespace pipesgd::job {

class RingMode : public train::TrainingMode {
 public:
  RingMode(train::Trainer& trainer, std::function<layers::EvalResult()> evaluate_shard,
           std::function<void()> save_checkpoint, const config::Checkpoint& checkpoint,
           int rank, const config::Comm& comm)
      : trainer_(trainer),
        evaluate_shard_(std::move(evaluate_shard)),
        save_checkpoint_(std::move(save_checkpoint)),
        checkpoint_(checkpoint),
        rank_(rank),
        comm_(comm) {}

  int64_t steps() const override { return trainer_.steps(); }
  void Step() override {
    MaybeInjectFault(rank_, "step", trainer_.steps() + 1);
    trainer_.Step();
  }
  void AfterStep() override {
    if (checkpoint_.every_steps() > 0 && trainer_.steps() % checkpoint_.every_steps() == 0) {
      save_checkpoint_();
    }
  }
  double LatestLoss() const override { return trainer_.StepLoss(trainer_.applied() - 1); }
  // At the end the pending aggregates are applied so no computed gradient is lost; in between,
  // the pipeline keeps flowing across the evaluation.
  void PrepareEvaluation(bool last) override {
    if (last) {
      trainer_.Drain(true);
    } else {
      trainer_.Sync();
    }
  }
  // Sums every rank's test shard; the train loss and the wire bytes since `from`.
  Result Evaluate(int64_t from) override;
  void AfterEvaluation(const train::Evaluation& e) override {
    if (e.epoch_end && checkpoint_.every_epochs() > 0 && e.epoch % checkpoint_.every_epochs() == 0) {
      save_checkpoint_();
    }
  }
  // Stopped at the target: the aggregates in flight are dropped, so the weights kept (and
  // checkpointed) are the ones that reached it.
  void Finish(bool at_target) override {
    if (at_target) trainer_.Drain(false);
    save_checkpoint_();  // the final state, when checkpoints are on
  }

 private:
  train::Trainer& trainer_;
  std::function<layers::EvalResult()> evaluate_shard_;
  std::function<void()> save_checkpoint_;
  const config::Checkpoint& checkpoint_;
  int rank_;
  const config::Comm& comm_;
  train::WireTotals wire_before_;  // at the previous evaluation
};

}  // namespace pipesgd::job
