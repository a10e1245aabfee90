// `pipesgd worker` for train.mode PS_SYNC and PS_ASYNC: the parameter-server baselines
// (core/train/ps_trainer.h). Rank 0 is the server; ranks 1..W train on shards 0..W-1.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "core/base/timeline.h"
#include "core/data/dataset.h"
#include "core/train/classifier_task.h"
#include "core/train/ps_trainer.h"
#include "core/job/model_builder.h"
#include "core/job/config.h"
#include "core/job/worker.h"
#include "core/job/worker_detail.h"
#include "layers/model.h"

namespace pipesgd::job {
namespace {

using detail::Clock;
using detail::LeadReporter;
using detail::LogEffectiveConfig;
using detail::LogFinal;
using detail::PlanFromConfig;
using detail::Seconds;
using detail::Summary;
using detail::SummaryInputs;

// A parameter-server worker for the shared training loop (core/train/run_loop.h). Every worker
// evaluates its shard of the test set with the weights it holds (PS_SYNC: the same on every
// worker; PS_ASYNC: each worker's latest pull) and the sums go through the server.
class PsWorkerMode : public train::TrainingMode {
 public:
  PsWorkerMode(train::PsWorker& worker, train::ClassifierTask& task, std::span<const float> params,
               const data::Dataset& test, int shard, int workers)
      : worker_(worker), task_(task), params_(params), test_(test), shard_(shard),
        workers_(workers) {}
  int64_t steps() const override { return worker_.steps(); }
  void Step() override { worker_.Step(); }
  double LatestLoss() const override { return worker_.StepLoss(worker_.steps() - 1); }
  void PrepareEvaluation(bool) override {}
  Result Evaluate(int64_t from) override {
    double loss_sum = 0;
    for (int64_t t = from; t < worker_.steps(); ++t) loss_sum += worker_.StepLoss(t);
    const layers::EvalResult local = task_.EvaluateShard(params_, test_, shard_, workers_);
    std::vector<float> sums = {static_cast<float>(loss_sum), static_cast<float>(local.loss_sum),
                               static_cast<float>(local.correct), static_cast<float>(local.count)};
    worker_.SumOverWorkers(sums);
    Result r;
    const int64_t steps = worker_.steps() - from;
    r.train_loss = steps > 0 ? sums[0] / (workers_ * static_cast<double>(steps))
                             : std::numeric_limits<double>::quiet_NaN();
    r.test_accuracy = sums[3] > 0 ? sums[2] / sums[3] : 0.0;
    r.test_loss = sums[3] > 0 ? sums[1] / sums[3] : 0.0;
    // What this worker sent per step since the previous evaluation (push: header + gradient).
    const uint64_t sent = worker_.bytes_sent();
    r.wire_bytes_per_step = steps > 0 ? static_cast<double>(sent - sent_before_) / steps : 0;
    sent_before_ = sent;
    return r;
  }

 private:
  train::PsWorker& worker_;
  train::ClassifierTask& task_;
  std::span<const float> params_;
  const data::Dataset& test_;
  int shard_;
  int workers_;
  uint64_t sent_before_ = 0;
};

}  // namespace

void RunPsWorker(const WorkerArgs& args, const JobEnv& env, const config::Job& job) {
  const auto start = Clock::now();
  const auto& train_cfg = job.train();
  const auto& comm_cfg = job.comm();
  const auto& data_cfg = job.data();
  PSGD_CHECK(train_cfg.mode() == config::PS_SYNC || train_cfg.mode() == config::PS_ASYNC);
  const bool sync = train_cfg.mode() == config::PS_SYNC;
  const char* mode_name = sync ? "PS_SYNC" : "PS_ASYNC";
  if (env.world_size < 2) {
    Throw(ErrorCode::kInvalidArgument,
          "train.mode = {} needs at least 2 ranks (rank 0 is the parameter server, the others "
          "train); world size is {}",
          mode_name, env.world_size);
  }
  if (!job.checkpoint().dir().empty() || args.resume) {
    Throw(ErrorCode::kInvalidArgument,
          "train.mode = {}: checkpoints are not supported by the parameter-server baselines "
          "(unset checkpoint.dir, drop --resume)",
          mode_name);
  }
  const int workers = env.world_size - 1;
  const bool server = env.rank == 0;
  const bool lead = env.rank == 1;  // the first worker reports and writes the outputs
  if (server) {
    PSGD_LOG_INFO("pipesgd worker: world size {}: {} parameter server on rank 0, {} workers, "
                  "comm.transport {}",
                  env.world_size, sync ? "synchronous" : "asynchronous", workers,
                  config::Transport_Name(comm_cfg.transport()));
    LogEffectiveConfig(args.config_path, job);
    if (comm_cfg.compression() != config::Comm::none) {
      PSGD_LOG_WARN("comm.compression = {} is ignored by train.mode = {} (float32 on the wire)",
                    config::Comm::Compression_Name(comm_cfg.compression()), mode_name);
    }
  }
  // The lead worker claims the output directory.
  std::unique_ptr<detail::OutputDir> out = detail::ClaimOutputDir(lead, args);
  const detail::JobData sets = detail::LoadJobData(job);
  const data::Dataset& train_set = sets.train;
  const data::Dataset& test_set = sets.test;
  const size_t batch = static_cast<size_t>(train_cfg.batch_size());
  // The server keeps one update's buffers, a worker one gradient in flight.
  detail::JobModel built = detail::BuildJobModel(job, 1);
  const std::unique_ptr<layers::Model> model = std::move(built.model);
  std::vector<float>& params = built.params;
  const int shard = server ? 0 : env.rank - 1;
  train::ClassifierTask task(*model, train_set, batch, shard, workers, train_cfg.seed(),
                             {data_cfg.input_mean(), data_cfg.input_std()});
  const size_t steps_per_epoch = task.steps_per_epoch();
  detail::CheckStepsPerEpoch(static_cast<int64_t>(steps_per_epoch), job, workers, "workers",
                             train_set.count);
  if (lead) {
    PSGD_LOG_INFO("model: {}", model->Describe());
    PSGD_LOG_INFO("data: {} training samples ({} steps per epoch of global batch {}), {} test "
                  "samples",
                  train_set.count, steps_per_epoch, batch * workers, test_set.count);
  }

  std::vector<int> peers;
  if (server) {
    for (int r = 1; r < env.world_size; ++r) peers.push_back(r);
  } else {
    peers.push_back(0);
  }
  PeerLinks links = ConnectPeers(env, JobDescription(job), peers, comm_cfg,
                                 Deadline::After(comm_cfg.start_timeout_s()),
                                 fmt::format("comm.start_timeout_s = {} s", comm_cfg.start_timeout_s()));
  const train::PsOptions options{sync ? train::PsMode::kSync : train::PsMode::kAsync,
                                 comm_cfg.timeout_s()};
  const int64_t global_batch = static_cast<int64_t>(batch) * workers;
  const train::RunPlan plan =
      PlanFromConfig(job, static_cast<int64_t>(steps_per_epoch), global_batch);

  if (server) {
    PSGD_LOG_INFO("parameter server: {} workers connected over {}", workers,
                  links.transport->Describe());
    train::SgdOptimizer sgd({train_cfg.learning_rate(), train_cfg.momentum(),
                             train_cfg.weight_decay()},
                            params.size());
    std::vector<transport::Connection*> conns;
    for (auto& c : links.connections) conns.push_back(c.get());
    train::PsServer ps(*links.transport, conns, sgd, params, options);
    // Rank 0's file too: a local run merges every rank's, and a missing one failed the job.
    const std::unique_ptr<timeline::Recorder> recorder =
        detail::TimelineRecorder(args, env, plan, 0);
    ps.set_timeline(recorder.get());
    ps.Run();
    detail::WriteTimeline(recorder.get(), args, env);
    PSGD_LOG_INFO("parameter server: {} updates applied, largest staleness {} updates, {:.1f} s",
                  ps.updates(), ps.max_staleness(), Seconds(start));
    return;
  }

  const std::unique_ptr<timeline::Recorder> recorder =
      detail::TimelineRecorder(args, env, plan, 0);
  task.set_timeline(recorder.get());
  train::PsWorker worker(*links.transport, *links.connections[0], task, params, env.rank, options);
  worker.set_timeline(recorder.get());
  PsWorkerMode mode(worker, task, params, test_set, shard, workers);
  LeadReporter reporter(lead, out.get(), /*show_wire=*/false);
  const train::RunOutcome outcome = train::RunLoop(mode, plan, reporter);
  worker.Bye();
  detail::WriteTimeline(recorder.get(), args, env);
  if (lead) {
    const double wall_s = Seconds(start);
    LogFinal(outcome, plan, wall_s);
    if (out) {
      SummaryInputs in{mode_name, env.world_size, workers, global_batch, plan.target_accuracy,
                       wall_s, links.transport->name(), worker.bytes_sent()};
      out->WriteSummary(Summary(in, outcome, job, {{"server_rank", 0}}));
    }
  }
}

}  // namespace pipesgd::job
