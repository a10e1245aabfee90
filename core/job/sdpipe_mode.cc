// train.mode SDPIPE without pipeline stages: groups chosen by the scheduler on rank 0 average
// their replicas (core/train/sdpipe_trainer.h), for the job skeleton (job_mode.h).
#include "core/job/job_mode.h"
#include "core/job/model_builder.h"

#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/collective/group_allreduce.h"
#include "core/data/dataset.h"
#include "core/train/classifier_task.h"
#include "core/train/sdpipe_service.h"
#include "core/train/sdpipe_trainer.h"
#include "core/train/straggler.h"
#include "core/job/config.h"
#include "core/job/worker_detail.h"

namespace pipesgd::job {
namespace {

using namespace detail;

class ClientGroups : public train::GroupSource {
 public:
  ClientGroups(train::GroupSchedulerClient& client, double timeout_s)
      : client_(client), timeout_s_(timeout_s) {}
  train::GroupDecision Next(int64_t step) override {
    return client_.Request(/*stage=*/0, step, Deadline::After(timeout_s_));
  }

 private:
  train::GroupSchedulerClient& client_;
  double timeout_s_;
};

// SDPIPE for the shared training loop (core/train/run_loop.h): a step is one local round; the
// evaluation points are the scheduler's barriers (the epoch's, and those the plan arms every
// eval_every_steps global steps), after which every rank holds the same parameters.
class SdpipeMode : public train::TrainingMode {
 public:
  SdpipeMode(train::SdpipeTrainer& trainer, train::ClassifierTask& task,
             std::span<const float> params, const data::Dataset& test, int rank, int world_size,
             train::GroupSchedulerClient& client, double timeout_s)
      : trainer_(trainer), task_(task), params_(params), test_(test), rank_(rank),
        world_size_(world_size), client_(client), timeout_s_(timeout_s) {}
  int64_t steps() const override { return trainer_.steps(); }
  void Step() override { last_ = trainer_.Step(); }
  train::RunPoint Point(const train::RunPlan&) const override {
    // A barrier ends exactly at its boundary (the scheduler holds the rounds before it to what
    // leaves the barrier's N updates), so the evaluation points and the last step are exact.
    return {last_.updates / world_size_, last_.evaluate, last_.epoch_end, last_.stop,
            last_.epoch_end ? last_.epoch : last_.epoch + 1};
  }
  double LatestLoss() const override {
    return trainer_.losses().empty() ? std::numeric_limits<double>::quiet_NaN()
                                     : trainer_.losses().back();
  }
  void PrepareEvaluation(bool) override {}
  Result Evaluate(int64_t from) override {
    const layers::EvalResult local = task_.EvaluateShard(params_, test_, rank_, world_size_);
    const auto& losses = trainer_.losses();
    double loss_sum = 0;
    for (size_t i = static_cast<size_t>(from); i < losses.size(); ++i) loss_sum += losses[i];
    std::vector<float> sums = {static_cast<float>(local.loss_sum),
                               static_cast<float>(local.correct),
                               static_cast<float>(local.count), static_cast<float>(loss_sum),
                               static_cast<float>(losses.size() - static_cast<size_t>(from))};
    trainer_.AllReduceAll(sums, collective::ReduceOp::kSum);
    Result r;
    r.test_accuracy = sums[2] > 0 ? sums[1] / sums[2] : 0.0;
    r.test_loss = sums[2] > 0 ? sums[0] / sums[2] : 0.0;
    r.train_loss = sums[4] > 0 ? sums[3] / sums[4] : std::numeric_limits<double>::quiet_NaN();
    const uint64_t wire = trainer_.wire_bytes();
    const double rounds = static_cast<double>(trainer_.steps() - from);
    r.wire_bytes_per_step = rounds > 0 ? static_cast<double>(wire - wire_before_) / rounds : 0;
    wire_before_ = wire;
    return r;
  }
  // Stopped at the target before the job's last round: one last request closes this rank's
  // scheduler connection as expected (its answer is not used). Then a barrier of every rank:
  // rank 0 hosts the scheduler and must not close it while another rank still waits for its
  // answer (seen as "lost the group scheduler" on a loaded machine).
  void Finish(bool at_target) override {
    if (!at_target) return;
    client_.Request(0, trainer_.steps() + 1, Deadline::After(timeout_s_), true,
                    /*leaving=*/true);
    std::vector<float> token = {0};
    trainer_.AllReduceAll(token, collective::ReduceOp::kSum);
  }

 private:
  train::SdpipeTrainer& trainer_;
  train::ClassifierTask& task_;
  std::span<const float> params_;
  const data::Dataset& test_;
  int rank_;
  int world_size_;
  train::GroupSchedulerClient& client_;
  double timeout_s_;
  train::GroupDecision last_;
  uint64_t wire_before_ = 0;
};

class SdpipeJob : public JobMode {
 public:
  explicit SdpipeJob(const config::Job& job) : job_(job) {}

  ModeLayout Layout(const JobEnv& env) const override {
    const auto& sd = job_.sdpipe();
    if (sd.min_group() > env.world_size) {
      Throw(ErrorCode::kInvalidArgument,
            "sdpipe.min_group = {}: expected an integer in [1, world size {}]", sd.min_group(),
            env.world_size);
    }
    return {0, 0, env.world_size, "ranks"};
  }

  std::string StartLine(const JobEnv& env) const override {
    const auto& sd = job_.sdpipe();
    return fmt::format("pipesgd worker: world size {}, train.mode SDPIPE (P = {}, window {} s in "
                       "[{}, {}]), comm.transport {}",
                       env.world_size, sd.period(), sd.window_init_s(), sd.window_min_s(),
                       sd.window_max_s(), config::Transport_Name(job_.comm().transport()));
  }

  ModeModel Build(JobContext& ctx) override {
    const JobEnv& env = ctx.env;
    world_size_ = env.world_size;
    const auto& train_cfg = job_.train();
    const size_t batch = static_cast<size_t>(train_cfg.batch_size());
    built_ = BuildJobModel(job_, 2);
    task_ = std::make_unique<train::ClassifierTask>(
        *built_.model, ctx.data.train, batch, env.rank, env.world_size, train_cfg.seed(),
        data::InputScaling{job_.data().input_mean(), job_.data().input_std()});
    objective_ = std::make_unique<train::StragglerObjective>(
        *task_, StragglerFromConfig(job_, env.world_size), env.rank);
    const auto steps = static_cast<int64_t>(task_->steps_per_epoch());
    return {built_.model->Describe(),
            fmt::format("{} training samples ({} steps per epoch of {} samples per rank, {} "
                        "local steps in all ranks per epoch), {} test samples",
                        ctx.data.train.count, steps, batch, steps * env.world_size,
                        ctx.data.test.count),
            steps};
  }

  // Every rank may end up in a group with every other: the transport is made for all of them
  // (ibverbs needs its peers up front); connections are made on first use. The scheduler
  // lives in rank 0.
  void Connect(JobContext& ctx) override {
    const JobEnv& env = ctx.env;
    const auto& comm_cfg = job_.comm();
    const Deadline start_deadline = Deadline::After(comm_cfg.start_timeout_s());
    ConnectedTransport connected = TransportForEveryone(env, job_, start_deadline);
    comm_ = std::make_unique<collective::GroupCommunicator>(
        std::move(connected.transport), env.world_size, std::move(connected.addresses),
        CommunicatorOptionsFromConfig(job_));
    const int64_t n = env.world_size;
    train::GroupSchedulerOptions sopt = SchedulerOptionsFromConfig(job_.sdpipe(), env.world_size);
    sopt.epoch_updates = ctx.plan.steps_per_epoch * n;
    sopt.total_updates = ctx.plan.total_steps() * n;
    sopt.eval_updates = ctx.plan.eval_every_steps * n;
    scheduler_ = StartScheduler(*comm_, env, sopt, 1, start_deadline);
    client_ = std::make_unique<train::GroupSchedulerClient>(
        scheduler_.host, scheduler_.port, env.rank, env.world_size, env.job_token, start_deadline);
    if (ctx.lead) {
      PSGD_LOG_INFO("group scheduler at {}:{}; {} ranks over {}", scheduler_.host,
                    scheduler_.port, env.world_size, comm_->transport().Describe());
    }
    groups_ = std::make_unique<ClientGroups>(*client_, comm_cfg.timeout_s());
  }

  // The timeline's steps are this rank's local steps.
  train::TrainingMode& Start(JobContext& ctx) override {
    const auto& train_cfg = job_.train();
    const auto& comm_cfg = job_.comm();
    sgd_ = std::make_unique<train::SgdOptimizer>(
        layers::SgdOptions{train_cfg.learning_rate(), train_cfg.momentum(),
                           train_cfg.weight_decay()},
        built_.params.size());
    task_->set_timeline(ctx.recorder.get());
    trainer_ = std::make_unique<train::SdpipeTrainer>(
        *comm_, *objective_, *sgd_, built_.params, *groups_,
        train::SdpipeOptions{comm_cfg.timeout_s(), comm_cfg.warmup_steps()});
    trainer_->set_timeline(ctx.recorder.get());
    mode_ = std::make_unique<SdpipeMode>(*trainer_, *task_, built_.params, ctx.data.test,
                                         ctx.env.rank, ctx.env.world_size, *client_,
                                         comm_cfg.timeout_s());
    return *mode_;
  }

  ModeReport Report(const JobContext& /*ctx*/) override {
    const std::vector<train::GroupDecision> decisions = scheduler_.service->decisions();
    std::map<int, int64_t> sizes;
    std::map<std::string, int64_t> kinds;
    for (const auto& d : decisions) {
      sizes[static_cast<int>(d.members.size())] += 1;
      kinds[train::RoundKindName(d.kind)] += 1;
    }
    nlohmann::json size_hist = nlohmann::json::object();
    for (const auto& [size, count] : sizes) size_hist[std::to_string(size)] = count;
    const int64_t local_steps = decisions.empty() ? 0 : decisions.back().updates;
    PSGD_LOG_INFO("SDPIPE: {} local steps in all ranks, {} rounds; group sizes {}", local_steps,
                  decisions.size(), size_hist.dump());
    return {"SDPIPE",
            world_size_,
            comm_->transport().name(),
            trainer_->wire_bytes(),
            {{"local_steps_all_ranks", local_steps},
             {"rounds", decisions.size()},
             {"rounds_by_kind", kinds},
             {"group_sizes", size_hist},
             {"rank0_rounds_alone", trainer_->skipped()}}};
  }

 private:
  const config::Job& job_;
  int world_size_ = 0;
  JobModel built_;
  std::unique_ptr<train::ClassifierTask> task_;
  std::unique_ptr<train::StragglerObjective> objective_;
  std::unique_ptr<collective::GroupCommunicator> comm_;
  SchedulerEndpoint scheduler_;
  std::unique_ptr<train::GroupSchedulerClient> client_;
  std::unique_ptr<ClientGroups> groups_;
  std::unique_ptr<train::SgdOptimizer> sgd_;
  std::unique_ptr<train::SdpipeTrainer> trainer_;
  std::unique_ptr<SdpipeMode> mode_;
};

}  // namespace

extern const ModeInfo kSdpipeMode;
const ModeInfo kSdpipeMode{
    "train.mode = SDPIPE",
    {.timeline = true, .compression = true},
    [](const config::Job& job) {
      return job.train().mode() == config::SDPIPE && job.pipeline().stages() <= 1;
    },
    [](const config::Job& job) -> std::unique_ptr<JobMode> {
      return std::make_unique<SdpipeJob>(job);
    }};

}  // namespace pipesgd::job
