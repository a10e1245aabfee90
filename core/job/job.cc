// The job skeleton (job_mode.h): every mode's shared steps, once, in order.
#include <memory>
#include <string>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/job/config.h"
#include "core/job/job_mode.h"
#include "core/job/worker_detail.h"

namespace pipesgd::job {

using detail::Clock;

void RunJob(const WorkerArgs& args, const JobEnv& env, Clock::time_point start) {
  const config::Job job = LoadJobConfig(args.config_path, args.overrides);
  const ModeInfo& info = ModeOf(job);
  if (args.resume && !info.support.checkpoints) {
    Throw(ErrorCode::kInvalidArgument,
          "--resume: {} has no checkpoints to resume from (leave out --resume)", info.name);
  }
  if (!args.timeline.empty() && !info.support.timeline) {
    Throw(ErrorCode::kInvalidArgument, "--timeline: {} records no timeline (leave out --timeline)",
          info.name);
  }
  // The context outlives the mode: its recorder outlives the mode's trainer, which records on it.
  JobContext ctx{args, env, job, start};
  const std::unique_ptr<JobMode> mode = info.make(job);
  ctx.layout = mode->Layout(env);
  ctx.lead = env.rank == ctx.layout.lead_rank;
  if (env.rank == ctx.layout.log_rank) {
    PSGD_LOG_INFO("{}", mode->StartLine(env));
    detail::LogEffectiveConfig(args.config_path, job);
  }

  // A bad --out fails at once, before the data loads.
  ctx.out = detail::ClaimOutputDir(ctx.lead, args);
  ctx.data = detail::LoadJobData(job);
  const ModeModel model = mode->Build(ctx);
  detail::CheckStepsPerEpoch(model.steps_per_epoch, job, ctx.layout.replicas,
                             ctx.layout.replica_kind, ctx.data.train.count);
  if (ctx.lead) {
    PSGD_LOG_INFO("model: {}", model.description);
    PSGD_LOG_INFO("data: {}", model.data_line);
  }
  ctx.plan = detail::PlanFromConfig(job, model.steps_per_epoch,
                                    job.train().batch_size() * ctx.layout.replicas);

  mode->Connect(ctx);
  const int64_t first_step = mode->Restore(ctx);
  ctx.recorder = detail::TimelineRecorder(args, env, ctx.plan, first_step);
  if (mode->Serves(env)) {
    mode->Serve(ctx);
    detail::WriteTimeline(ctx.recorder.get(), args, env);
    return;
  }
  train::TrainingMode& training = mode->Start(ctx);
  detail::LeadReporter reporter(ctx.lead, ctx.out.get(), mode->ShowsWire());
  if (ctx.lead && training.steps() >= ctx.plan.total_steps()) {
    PSGD_LOG_INFO("nothing to train: the checkpoint is at step {} of {}", training.steps(),
                  ctx.plan.total_steps());
  }
  train::RunOutcome outcome;
  try {
    outcome = train::RunLoop(training, ctx.plan, reporter);
  } catch (const Error& e) {
    mode->Abandon();
    if (e.code() != ErrorCode::kDeadlineExceeded) throw;
    throw detail::WithTimeoutSetting(e, fmt::format("comm.timeout_s = {} s", job.comm().timeout_s()));
  } catch (...) {
    mode->Abandon();
    throw;
  }
  mode->AfterLoop();
  detail::WriteTimeline(ctx.recorder.get(), args, env);

  if (!ctx.lead) return;
  const double wall_s = detail::Seconds(start);
  detail::LogFinal(outcome, ctx.plan, wall_s);
  ModeReport report = mode->Report(ctx);
  if (!ctx.out) return;
  const detail::SummaryInputs in{report.mode.c_str(),
                                 env.world_size,
                                 report.workers,
                                 job.train().batch_size() * ctx.layout.replicas,
                                 ctx.plan.target_accuracy,
                                 wall_s,
                                 report.transport,
                                 report.wire_bytes};
  ctx.out->WriteSummary(detail::Summary(in, outcome, job, std::move(report.details)));
}

}  // namespace pipesgd::job
