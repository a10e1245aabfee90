// train.mode PS_SYNC and PS_ASYNC: the parameter-server baselines (core/train/ps_trainer.h) for
// the job skeleton (job_mode.h). Rank 0 is the server; ranks 1..W train on shards 0..W-1.
#include <limits>
#include <memory>
#include <string>
#include <vector>

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
#include "core/job/job_mode.h"
#include "core/job/worker.h"
#include "core/job/worker_detail.h"
#include "layers/model.h"

namespace pipesgd::job {
namespace {

using detail::Seconds;

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

class PsJob : public JobMode {
 public:
  PsJob(const config::Job& job, bool sync) : job_(job), sync_(sync) {}

  // Rank 0 is the server; the first worker (rank 1) reports and writes the outputs.
  ModeLayout Layout(const JobEnv& env) const override {
    if (env.world_size < 2) {
      Throw(ErrorCode::kInvalidArgument,
            "train.mode = {} needs at least 2 ranks (rank 0 is the parameter server, the others "
            "train); world size is {}",
            name(), env.world_size);
    }
    return {1, 0, env.world_size - 1, "workers"};
  }

  std::string StartLine(const JobEnv& env) const override {
    return fmt::format("pipesgd worker: world size {}: {} parameter server on rank 0, {} "
                       "workers, comm.transport {}",
                       env.world_size, sync_ ? "synchronous" : "asynchronous",
                       env.world_size - 1, config::Transport_Name(job_.comm().transport()));
  }

  ModeModel Build(JobContext& ctx) override {
    const JobEnv& env = ctx.env;
    workers_ = env.world_size - 1;
    shard_ = env.rank == 0 ? 0 : env.rank - 1;
    const size_t batch = static_cast<size_t>(job_.train().batch_size());
    // The server keeps one update's buffers, a worker one gradient in flight.
    built_ = detail::BuildJobModel(job_, 1);
    task_ = std::make_unique<train::ClassifierTask>(
        *built_.model, ctx.data.train, batch, shard_, workers_, job_.train().seed(),
        data::InputScaling{job_.data().input_mean(), job_.data().input_std()});
    const auto steps = static_cast<int64_t>(task_->steps_per_epoch());
    return {built_.model->Describe(),
            fmt::format("{} training samples ({} steps per epoch of global batch {}), {} test "
                        "samples",
                        ctx.data.train.count, steps, batch * workers_, ctx.data.test.count),
            steps};
  }

  // A star: the server to every worker.
  void Connect(JobContext& ctx) override {
    const JobEnv& env = ctx.env;
    const auto& comm_cfg = job_.comm();
    std::vector<int> peers;
    if (env.rank == 0) {
      for (int r = 1; r < env.world_size; ++r) peers.push_back(r);
    } else {
      peers.push_back(0);
    }
    links_ = ConnectPeers(env, JobDescription(job_), peers, comm_cfg,
                          Deadline::After(comm_cfg.start_timeout_s()),
                          fmt::format("comm.start_timeout_s = {} s", comm_cfg.start_timeout_s()));
    options_ = {sync_ ? train::PsMode::kSync : train::PsMode::kAsync, comm_cfg.timeout_s()};
  }

  bool Serves(const JobEnv& env) const override { return env.rank == 0; }

  void Serve(JobContext& ctx) override {
    PSGD_LOG_INFO("parameter server: {} workers connected over {}", workers_,
                  links_.transport->Describe());
    const auto& train_cfg = job_.train();
    train::SgdOptimizer sgd({train_cfg.learning_rate(), train_cfg.momentum(),
                             train_cfg.weight_decay()},
                            built_.params.size());
    std::vector<transport::Connection*> conns;
    for (auto& c : links_.connections) conns.push_back(c.get());
    train::PsServer ps(*links_.transport, conns, sgd, built_.params, options_);
    // Rank 0's timeline too: a local run merges every rank's, and a missing one failed the job.
    ps.set_timeline(ctx.recorder.get());
    ps.Run();
    PSGD_LOG_INFO("parameter server: {} updates applied, largest staleness {} updates, {:.1f} s",
                  ps.updates(), ps.max_staleness(), Seconds(ctx.start));
  }

  train::TrainingMode& Start(JobContext& ctx) override {
    task_->set_timeline(ctx.recorder.get());
    worker_ = std::make_unique<train::PsWorker>(*links_.transport, *links_.connections[0], *task_,
                                                built_.params, ctx.env.rank, options_);
    worker_->set_timeline(ctx.recorder.get());
    mode_ = std::make_unique<PsWorkerMode>(*worker_, *task_, built_.params, ctx.data.test, shard_,
                                           workers_);
    return *mode_;
  }

  void AfterLoop() override { worker_->Bye(); }

  ModeReport Report(const JobContext& /*ctx*/) override {
    return {name(), workers_, links_.transport->name(), worker_->bytes_sent(), {{"server_rank", 0}}};
  }

 private:
  const char* name() const { return sync_ ? "PS_SYNC" : "PS_ASYNC"; }

  const config::Job& job_;
  bool sync_;
  int workers_ = 0;
  int shard_ = 0;
  detail::JobModel built_;
  std::unique_ptr<train::ClassifierTask> task_;
  PeerLinks links_;
  train::PsOptions options_;
  std::unique_ptr<train::PsWorker> worker_;
  std::unique_ptr<PsWorkerMode> mode_;
};

// Compression, checkpoints and the GPU are the ring's: the baselines send float32 gradients
// from the CPU, and the server's state is not saved.
constexpr ModeSupport kPsSupports{.timeline = true};

}  // namespace

extern const ModeInfo kPsSyncMode;
const ModeInfo kPsSyncMode{
    "train.mode = PS_SYNC", kPsSupports,
    [](const config::Job& job) { return job.train().mode() == config::PS_SYNC; },
    [](const config::Job& job) -> std::unique_ptr<JobMode> {
      return std::make_unique<PsJob>(job, true);
    }};
extern const ModeInfo kPsAsyncMode;
const ModeInfo kPsAsyncMode{
    "train.mode = PS_ASYNC", kPsSupports,
    [](const config::Job& job) { return job.train().mode() == config::PS_ASYNC; },
    [](const config::Job& job) -> std::unique_ptr<JobMode> {
      return std::make_unique<PsJob>(job, false);
    }};

}  // namespace pipesgd::job
