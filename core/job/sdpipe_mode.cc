#include "core/job/sdpipe_worker.h"
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

}  // namespace

void RunSdpipeWorker(const WorkerArgs& args, const JobEnv& env, const config::Job& job,
                     Clock::time_point start) {
  const bool lead = env.rank == 0;
  const auto& train_cfg = job.train();
  const auto& comm_cfg = job.comm();
  const auto& sd = job.sdpipe();
  if (sd.min_group() > env.world_size) {
    Throw(ErrorCode::kInvalidArgument,
          "sdpipe.min_group = {}: expected an integer in [1, world size {}]", sd.min_group(),
          env.world_size);
  }
  if (!job.checkpoint().dir().empty()) {
    Throw(ErrorCode::kInvalidArgument,
          "checkpoint.dir = '{}': checkpoints are not supported with train.mode: SDPIPE (each "
          "rank's model differs between epoch barriers); leave checkpoint.dir empty",
          job.checkpoint().dir());
  }
  if (lead) {
    PSGD_LOG_INFO("pipesgd worker: world size {}, train.mode SDPIPE (P = {}, window {} s in "
                  "[{}, {}]), comm.transport {}",
                  env.world_size, sd.period(), sd.window_init_s(), sd.window_min_s(),
                  sd.window_max_s(), config::Transport_Name(comm_cfg.transport()));
    LogEffectiveConfig(args.config_path, job);
  }
  std::unique_ptr<OutputDir> out = ClaimOutputDir(lead, args);
  const auto& data_cfg = job.data();
  const detail::JobData sets = detail::LoadJobData(job);
  const data::Dataset& train_set = sets.train;
  const data::Dataset& test_set = sets.test;
  const size_t batch = static_cast<size_t>(train_cfg.batch_size());
  JobModel built = BuildJobModel(job, 2);
  const std::unique_ptr<layers::Model> model = std::move(built.model);
  std::vector<float>& params = built.params;
  train::ClassifierTask task(*model, train_set, batch, env.rank, env.world_size,
                             train_cfg.seed(), {data_cfg.input_mean(), data_cfg.input_std()});
  train::StragglerObjective objective(task, StragglerFromConfig(job, env.world_size), env.rank);
  const int64_t steps_per_epoch = static_cast<int64_t>(task.steps_per_epoch());
  CheckStepsPerEpoch(steps_per_epoch, job, env.world_size, "ranks", train_set.count);
  const int64_t n = env.world_size;
  if (lead) {
    PSGD_LOG_INFO("model: {}", model->Describe());
    PSGD_LOG_INFO("data: {} training samples ({} steps per epoch of {} samples per rank, {} "
                  "local steps in all ranks per epoch), {} test samples",
                  train_set.count, steps_per_epoch, batch, steps_per_epoch * n, test_set.count);
  }

  // Every rank may end up in a group with every other: the transport is made for all of them
  // (ibverbs needs its peers up front); connections are made on first use.
  const Deadline start_deadline = Deadline::After(comm_cfg.start_timeout_s());
  ConnectedTransport connected = TransportForEveryone(env, job, start_deadline);
  collective::GroupCommunicator comm(std::move(connected.transport), env.world_size,
                                     std::move(connected.addresses),
                                     CommunicatorOptionsFromConfig(job));

  // The scheduler lives in rank 0.
  train::GroupSchedulerOptions sopt = SchedulerOptionsFromConfig(sd, env.world_size);
  const train::RunPlan plan = PlanFromConfig(job, steps_per_epoch,
                                             static_cast<int64_t>(batch) * env.world_size);
  sopt.epoch_updates = steps_per_epoch * n;
  sopt.total_updates = plan.total_steps() * n;
  sopt.eval_updates = plan.eval_every_steps * n;
  const SchedulerEndpoint scheduler = StartScheduler(comm, env, sopt, 1, start_deadline);
  train::GroupSchedulerClient client(scheduler.host, scheduler.port, env.rank, env.world_size,
                                     env.job_token, start_deadline);
  if (lead) {
    PSGD_LOG_INFO("group scheduler at {}:{}; {} ranks over {}", scheduler.host, scheduler.port,
                  env.world_size, comm.transport().Describe());
  }
  ClientGroups groups(client, comm_cfg.timeout_s());

  train::SgdOptimizer sgd({train_cfg.learning_rate(), train_cfg.momentum(),
                           train_cfg.weight_decay()},
                          params.size());
  // Outlives the trainer, which records on it. Its steps are this rank's local steps.
  const std::unique_ptr<timeline::Recorder> recorder = TimelineRecorder(args, env, plan, 0);
  task.set_timeline(recorder.get());
  train::SdpipeTrainer trainer(comm, objective, sgd, params, groups,
                               {comm_cfg.timeout_s(), comm_cfg.warmup_steps()});
  trainer.set_timeline(recorder.get());

  SdpipeMode mode(trainer, task, params, test_set, env.rank, env.world_size, client,
                  comm_cfg.timeout_s());
  LeadReporter reporter(lead, out.get(), /*show_wire=*/false);
  const train::RunOutcome outcome = train::RunLoop(mode, plan, reporter);
  WriteTimeline(recorder.get(), args, env);

  const double wall_s = Seconds(start);
  if (lead) {
    const std::vector<train::GroupDecision> decisions = scheduler.service->decisions();
    std::map<int, int64_t> sizes;
    std::map<std::string, int64_t> kinds;
    for (const auto& d : decisions) {
      sizes[static_cast<int>(d.members.size())] += 1;
      kinds[train::RoundKindName(d.kind)] += 1;
    }
    nlohmann::json size_hist = nlohmann::json::object();
    for (const auto& [size, count] : sizes) size_hist[std::to_string(size)] = count;
    LogFinal(outcome, plan, wall_s);
    PSGD_LOG_INFO("SDPIPE: {} local steps in all ranks, {} rounds; group sizes {}",
                  decisions.empty() ? 0 : decisions.back().updates, decisions.size(),
                  size_hist.dump());
    if (out) {
      SummaryInputs in{"SDPIPE", env.world_size, env.world_size,
                       static_cast<int64_t>(batch) * env.world_size, plan.target_accuracy,
                       wall_s, comm.transport().name(), trainer.wire_bytes()};
      out->WriteSummary(Summary(
          in, outcome, job,
          {{"local_steps_all_ranks", decisions.empty() ? 0 : decisions.back().updates},
           {"rounds", decisions.size()},
           {"rounds_by_kind", kinds},
           {"group_sizes", size_hist},
           {"rank0_rounds_alone", trainer.skipped()}}));
    }
  }
}

}  // namespace pipesgd::job
