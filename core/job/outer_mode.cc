// train.local_steps H > 1: the outer loop (local SGD, DiLoCo, and its overlapped form), as a mode
// of the job skeleton (job_mode.h). Each rank takes H inner steps alone; the round's
// pseudo-gradient is AllReduced through the ring (with comm's codec, error feedback or PowerSGD)
// and the outer optimizer applies it. The pieces are the pipelined trainer's, one step per round
// (core/train/outer_loop.h); docs/outer_loop.md has the recurrences.
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/base/log.h"
#include "core/collective/powersgd.h"
#include "core/collective/ring_allreduce.h"
#include "core/job/fault.h"
#include "core/job/job_mode.h"
#include "core/job/worker_detail.h"
#include "core/train/checkpoint.h"
#include "core/train/classifier_task.h"
#include "core/train/outer_loop.h"
#include "core/train/straggler.h"
#include "core/train/trainer.h"

namespace pipesgd::job {
namespace {

// The rounds: W rounds of one step (the synchronous warm-up), then rounds of H steps.
struct RoundPlan {
  int64_t h = 1;
  int64_t warmup = 0;  // W
  // The rounds that cover the first `steps` inner steps (the last one possibly cut short).
  int64_t RoundsFor(int64_t steps) const {
    return steps <= warmup ? steps : warmup + (steps - warmup + h - 1) / h;
  }
  // The length of the round that starts at inner step `step`.
  int64_t LengthAt(int64_t step) const { return step < warmup ? 1 : h; }
  // The last inner step of round `round` (a round cut short by the run's end ends sooner).
  int64_t LastStepOf(int64_t round) const {
    return round < warmup ? round : warmup + (round - warmup + 1) * h - 1;
  }
};

// The loop's steps are inner steps; the trainer's are rounds. Evaluations see the synchronised
// weights (the trainer's, the same bits on every rank), never a rank's local ones.
class OuterLoop : public train::TrainingMode {
 public:
  // A resumed run starts at inner step `steps`, between rounds, with the trainer restored.
  OuterLoop(train::Trainer& trainer, train::LocalRounds& rounds, RoundPlan plan, bool reset,
            std::function<layers::EvalResult()> evaluate_shard,
            std::function<void(int64_t)> save_checkpoint, const config::Checkpoint& checkpoint,
            int rank, timeline::Recorder* recorder, int64_t steps)
      : trainer_(trainer), rounds_(rounds), plan_(plan), reset_(reset), round_end_(steps),
        wire_step_(steps), evaluate_shard_(std::move(evaluate_shard)),
        save_checkpoint_(std::move(save_checkpoint)), checkpoint_(checkpoint), rank_(rank),
        recorder_(recorder), saved_at_(steps), steps_(steps), eval_round_(trainer.steps()) {}

  int64_t steps() const override { return steps_; }
  void Step() override {
    MaybeInjectFault(rank_, "step", steps_ + 1);
    if (!in_round_) {
      // The warm-up's rounds of one step keep the momentum: averaged, they are synchronous SGD.
      rounds_.Begin(trainer_.NextGradientPoint(), reset_ && steps_ >= plan_.warmup);
      in_round_ = true;
      round_length_ = plan_.LengthAt(steps_);
    }
    // The --timeline window counts inner steps: each one's forward and backward under its own,
    // inside an "inner_step" span with the inner update (the step's compute without any
    // communication: the zero-communication bound).
    if (recorder_) recorder_->SetStep(timeline::kCompute, steps_);
    {
      timeline::Span span(recorder_, timeline::kCompute, "inner_step");
      last_loss_ = rounds_.InnerStep(steps_);
    }
    ++steps_;
    if (rounds_.inner_steps() == round_length_) EndRound();
  }
  // A checkpoint holds no round in progress (the local weights, the inner steps so far): it is
  // taken at the first round end at or after each multiple of checkpoint.every_steps, or after
  // an epoch's end with checkpoint.every_epochs.
  void AfterStep() override {
    const int64_t every = checkpoint_.every_steps();
    if (every > 0 && steps_ / every > saved_at_ / every) checkpoint_due_ = true;
    MaybeCheckpoint();
  }
  void AfterEvaluation(const train::Evaluation& e) override {
    const int every = checkpoint_.every_epochs();
    if (e.epoch_end && every > 0 && e.epoch % every == 0) checkpoint_due_ = true;
    MaybeCheckpoint();
  }
  double LatestLoss() const override { return last_loss_; }
  // The last evaluation ends a round cut short by the run's end, so no inner step is lost.
  void PrepareEvaluation(bool last) override {
    if (!last) {
      trainer_.Sync();
      return;
    }
    if (in_round_) EndRound();
    trainer_.Drain(true);
  }
  Result Evaluate(int64_t /*from*/) override {
    const detail::TestSetResult test = detail::SumTestShards(trainer_, evaluate_shard_());
    Result r;
    r.test_accuracy = test.accuracy;
    r.test_loss = test.loss;
    // The rounds finished since the last evaluation (each one's inner losses, averaged over
    // its steps and the ranks).
    double loss_sum = 0;
    int64_t known = 0;
    for (int64_t round = eval_round_; round < trainer_.steps(); ++round) {
      const float loss = trainer_.StepLoss(round);
      if (loss == loss) {
        loss_sum += loss;
        ++known;
      }
    }
    r.train_loss = known > 0 ? loss_sum / static_cast<double>(known)
                             : std::numeric_limits<double>::quiet_NaN();
    eval_round_ = trainer_.steps();
    // Per inner step (the rounds' AllReduces over the steps they cover): what the outer loop
    // saves against averaging every step. Sync (or Drain) finished every round submitted.
    const train::WireTotals wire = trainer_.wire_totals();
    if (round_end_ > wire_step_) {
      wire_per_step_ = static_cast<double>(wire.bytes_sent - wire_.bytes_sent) /
                       static_cast<double>(round_end_ - wire_step_);
    }
    wire_step_ = round_end_;
    r.wire_bytes_per_step = wire_per_step_;
    r.compression_ratio = detail::CompressionRatio(wire_, wire);
    wire_ = wire;
    return r;
  }
  // Stopped at the target: the rounds in flight are dropped, so the weights kept are the ones
  // that reached it. The final state is checkpointed where it is one: between rounds, none
  // dropped.
  void Finish(bool at_target) override {
    if (at_target) trainer_.Drain(false);
    if (!in_round_ && trainer_.applied() == trainer_.steps()) {
      checkpoint_due_ = true;
      MaybeCheckpoint();
    }
  }

 private:
  void MaybeCheckpoint() {
    if (!checkpoint_due_ || in_round_) return;
    save_checkpoint_(steps_);
    checkpoint_due_ = false;
    saved_at_ = steps_;
  }

  void EndRound() {
    trainer_.Step();
    in_round_ = false;
    round_end_ = steps_;
  }

  train::Trainer& trainer_;
  train::LocalRounds& rounds_;
  RoundPlan plan_;
  bool reset_;  // train.reset_inner_momentum
  int64_t round_length_ = 0;
  int64_t round_end_;  // the inner step the last submitted round ended at
  int64_t wire_step_;  // round_end_ at the last evaluation
  std::function<layers::EvalResult()> evaluate_shard_;
  std::function<void(int64_t)> save_checkpoint_;  // of the state at this inner step
  const config::Checkpoint& checkpoint_;
  int rank_;
  timeline::Recorder* recorder_;  // null without --timeline
  int64_t saved_at_;              // the inner step of the last checkpoint (or the start)
  bool checkpoint_due_ = false;
  int64_t steps_ = 0;
  bool in_round_ = false;
  double last_loss_ = std::numeric_limits<double>::quiet_NaN();
  int64_t eval_round_;
  train::WireTotals wire_;
  double wire_per_step_ = 0;
};

class OuterJob : public JobMode {
 public:
  explicit OuterJob(const config::Job& job)
      : job_(job), plan_{job.train().local_steps(), job.train().sync_warmup_steps()} {}

  ModeLayout Layout(const JobEnv& env) const override { return {0, 0, env.world_size, "ranks"}; }

  std::string StartLine(const JobEnv& env) const override {
    const auto& t = job_.train();
    return fmt::format(
        "pipesgd worker: world size {}, outer loop every {} steps after {} synchronous ones "
        "({}{}, {}), comm.transport {}",
        env.world_size, plan_.h, plan_.warmup, config::OuterOptimizer_Name(t.outer_optimizer()),
        t.outer_optimizer() == config::NESTEROV
            ? fmt::format(" lr {} momentum {}", t.outer_learning_rate(), t.outer_momentum())
            : "",
        t.outer_overlap() ? "overlapped, one round late" : "blocking",
        config::Transport_Name(job_.comm().transport()));
  }

  ModeModel Build(JobContext& ctx) override {
    const auto& t = job_.train();
    const JobEnv& env = ctx.env;
    const size_t batch = static_cast<size_t>(t.batch_size());
    built_ = detail::BuildJobModel(job_, 1 + t.outer_overlap());
    task_ = std::make_unique<train::ClassifierTask>(
        *built_.model, ctx.data.train, batch, env.rank, env.world_size, t.seed(),
        data::InputScaling{job_.data().input_mean(), job_.data().input_std()});
    straggler_ = std::make_unique<train::StragglerObjective>(
        *task_, detail::StragglerFromConfig(job_, env.world_size), env.rank);
    const auto steps = static_cast<int64_t>(task_->steps_per_epoch());
    return {built_.model->Describe(),
            fmt::format("{} training samples ({} steps per epoch of global batch {}), {} test "
                        "samples",
                        ctx.data.train.count, steps, batch * env.world_size, ctx.data.test.count),
            steps};
  }

  void Connect(JobContext& ctx) override { comm_ = detail::ConnectJobRing(job_, ctx.env, ctx.lead); }

  // --resume: the trainer's state (rounds), the outer and the inner optimizer, the residual.
  int64_t Restore(JobContext& ctx) override {
    const auto& t = job_.train();
    const size_t n = built_.params.size();
    inner_ = std::make_unique<train::SgdOptimizer>(
        layers::SgdOptions{t.learning_rate(), t.momentum(), t.weight_decay()}, n);
    // The warm-up's rounds of one step average (synchronous SGD), whatever the outer step.
    outer_ = std::make_unique<train::OuterOptimizer>(
        t.outer_optimizer() == config::NESTEROV ? train::OuterKind::kNesterov
                                                : train::OuterKind::kAverage,
        t.outer_learning_rate(), t.outer_momentum(), n, plan_.warmup);
    rounds_ = std::make_unique<train::LocalRounds>(*straggler_, *inner_);
    ckpt_job_text_ = detail::CheckpointIdentity(job_);
    resumed_ = detail::ResumeRingJob(job_, ckpt_job_text_, *comm_, ctx.env, ctx.args.resume,
                                     built_.params);
    if (resumed_) {
      // After LocalRounds took the inner optimizer's fresh state (train.reset_inner_momentum).
      outer_->LoadState({resumed_->optimizer_state().data(),
                         static_cast<size_t>(resumed_->optimizer_state_size())});
      inner_->LoadState({resumed_->inner_optimizer_state().data(),
                         static_cast<size_t>(resumed_->inner_optimizer_state_size())});
      saved_step_ = resumed_->steps();
    }
    options_.pipeline_width = 1 + t.outer_overlap();
    options_.timeout_s = job_.comm().timeout_s();
    options_.compression_warmup_steps = plan_.RoundsFor(job_.comm().warmup_steps());
    if (t.outer_overlap()) {
      options_.compensation = train::StalenessCompensation::kLocalGradient;
      options_.sync_warmup_steps = plan_.warmup;
    }
    return resumed_ ? resumed_->steps() : 0;
  }

  train::TrainingMode& Start(JobContext& ctx) override {
    comm_->set_timeline(ctx.recorder.get());
    task_->set_timeline(ctx.recorder.get());
    if (job_.comm().powersgd_rank() > 0) {
      powersgd_ = detail::MakePowerSgd(job_, *built_.model, *comm_, ctx.lead);
      options_.reducer = powersgd_.get();
    }
    trainer_ = std::make_unique<train::Trainer>(*comm_, *rounds_, *outer_, built_.params,
                                                options_);
    // A round's spans (its AllReduce, the outer update) under its last inner step.
    trainer_->set_timeline(ctx.recorder.get(),
                           [plan = plan_](int64_t round) { return plan.LastStepOf(round); });
    if (resumed_) {
      train::TrainerSnapshot snapshot = train::SnapshotFromCheckpoint(*resumed_);
      snapshot.steps = resumed_->rounds();
      trainer_->Restore(snapshot);
      if (ctx.lead) {
        PSGD_LOG_INFO("resumed from {} at step {} (round {}, {} pending)",
                      train::CheckpointPath(job_.checkpoint().dir(), resumed_->steps(),
                                            ctx.env.rank).string(),
                      resumed_->steps(), snapshot.steps, snapshot.pending.size());
      }
    }
    const JobEnv& env = ctx.env;
    loop_ = std::make_unique<OuterLoop>(
        *trainer_, *rounds_, plan_, job_.train().reset_inner_momentum(),
        [this, &env, &test = ctx.data.test] {
          return task_->EvaluateShard(built_.params, test, env.rank, env.world_size);
        },
        [this, &ctx](int64_t steps) { SaveCheckpoint(ctx, steps); }, job_.checkpoint(), env.rank,
        ctx.recorder.get(), resumed_ ? resumed_->steps() : 0);
    return *loop_;
  }

  void Abandon() override { detail::DrainQuietly(trainer_.get()); }

  bool ShowsWire() const override { return true; }

  ModeReport Report(const JobContext& ctx) override {
    const auto& t = job_.train();
    const train::WireTotals wire = trainer_->wire_totals();
    return {"RING",
            ctx.env.world_size,
            comm_->transport().name(),
            wire.bytes_sent,
            {{"local_steps", plan_.h},
             {"sync_warmup_steps", plan_.warmup},
             {"reset_inner_momentum", t.reset_inner_momentum()},
             {"outer_optimizer", config::OuterOptimizer_Name(t.outer_optimizer())},
             {"outer_learning_rate", t.outer_learning_rate()},
             {"outer_momentum", t.outer_momentum()},
             {"outer_overlap", t.outer_overlap()},
             {"rounds", trainer_->steps()},
             {"chunk_bytes", comm_->options().chunk_bytes},
             {"streams", comm_->options().streams},
             {"compressed_steps", wire.compressed_steps},
             {"saturated_elements", wire.saturated}}};
  }

 private:
  // Between rounds (OuterLoop decides when): the trainer's snapshot in rounds, under the job's
  // inner step; every rank its own file (the residual is per rank).
  void SaveCheckpoint(const JobContext& ctx, int64_t inner_steps) {
    const auto& cfg = job_.checkpoint();
    if (cfg.dir().empty() || inner_steps == saved_step_) return;
    const JobEnv& env = ctx.env;
    const train::TrainerSnapshot snapshot = trainer_->Snapshot();
    const std::vector<float> outer = outer_->SaveState();
    // The sequence after the write's own agreement, as RING's (ring_mode.cc).
    checkpoint::Checkpoint c = train::CaptureCheckpoint(
        {ckpt_job_text_, env.rank, env.world_size, comm_->sequence() + 1, built_.params, outer,
         comm_->residual(), options_.pipeline_width, comm_->options().chunk_bytes,
         comm_->options().streams},
        snapshot);
    c.set_steps(inner_steps);
    c.set_rounds(snapshot.steps);
    const std::vector<float> inner = inner_->SaveState();
    c.mutable_inner_optimizer_state()->Add(inner.begin(), inner.end());
    detail::WriteRingCheckpoint(*trainer_, cfg, c, env, ctx.lead);
    saved_step_ = inner_steps;
  }

  const config::Job& job_;
  const RoundPlan plan_;
  // Declared in the order they are made, so each goes before what it uses.
  detail::JobModel built_;
  std::unique_ptr<train::ClassifierTask> task_;
  std::unique_ptr<train::StragglerObjective> straggler_;
  std::unique_ptr<collective::Communicator> comm_;
  std::unique_ptr<train::SgdOptimizer> inner_;
  std::unique_ptr<train::OuterOptimizer> outer_;
  std::unique_ptr<train::LocalRounds> rounds_;
  std::string ckpt_job_text_;
  std::optional<checkpoint::Checkpoint> resumed_;
  int64_t saved_step_ = -1;
  train::TrainerOptions options_;
  std::unique_ptr<collective::PowerSgd> powersgd_;
  std::unique_ptr<train::Trainer> trainer_;
  std::unique_ptr<OuterLoop> loop_;
};

}  // namespace

extern const ModeInfo kOuterMode;
const ModeInfo kOuterMode{
    "train.local_steps > 1 (the outer loop)",
    {.checkpoints = true, .cuda = false, .timeline = true, .compression = true, .powersgd = true},
    [](const config::Job& job) {
      return job.train().mode() == config::RING && job.train().local_steps() > 1;
    },
    [](const config::Job& job) -> std::unique_ptr<JobMode> { return std::make_unique<OuterJob>(job); }};

}  // namespace pipesgd::job
