// The pipeline-parallel SDPipe job: M stages x N pipelines (rank = pipeline * M + stage).
//
// Full synchronizations are fixed by step count: at every P-th step (sdpipe.period), at every
// evaluation point (the last step of each epoch, every train.eval_every_steps steps, the job's
// last step), each stage averages over ALL its replicas without asking the scheduler; the other
// steps take the scheduler's windowed (normal) rounds.
// Every rank knows these steps, so every stage of every pipeline synchronizes and evaluates at
// the same step. The scheduler's own connect rounds and barriers are not used here: they wait
// for arrivals, and a replica that has moved on to a full synchronization (waiting for this
// rank) would never arrive, while barriers counted in worker-updates could fall on different
// steps in different stages and leave a stage waiting for its neighbour. A full average every P
// steps is a stronger form of the connectivity the connect rounds guarantee (every P rounds the
// groups connect all replicas). The last request says so, and each rank then closes its
// scheduler connection without failing the job.
#include "core/job/pipeline_worker.h"

#include <limits>
#include <map>
#include <numeric>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/collective/group_allreduce.h"
#include "core/data/dataset.h"
#include "core/train/classifier_task.h"
#include "core/train/pipeline_trainer.h"
#include "core/train/sdpipe_service.h"
#include "core/job/config.h"
#include "core/job/model_builder.h"
#include "core/job/worker_detail.h"

namespace pipesgd::job {
namespace {

using namespace detail;

// Groups from this stage's scheduler state (normal rounds only); all replicas at the steps
// FullSync names (see the top of this file).
class StageGroups : public train::GroupSource {
 public:
  StageGroups(train::GroupSchedulerClient& client, int stage, int pipelines, int period,
              const train::RunPlan& plan, double timeout_s)
      : client_(client), stage_(stage), sync_(period, plan, pipelines), timeout_s_(timeout_s) {}
  train::GroupDecision Next(int64_t step) override {
    if (sync_.FullSync(step)) return sync_.Decision(step);
    sent_last_ = step == sync_.last_request();
    return client_.Request(stage_, step, Deadline::After(timeout_s_), sent_last_);
  }
  // Stopped early (at the target): one last request, after `step`, so that the scheduler
  // expects this rank's connection to close. Nothing to do once the last one was sent.
  void Goodbye(int64_t step) {
    if (!sent_last_ && sync_.last_request() > step) {
      client_.Request(stage_, step + 1, Deadline::After(timeout_s_), true);
      sent_last_ = true;
    }
  }

 private:
  train::GroupSchedulerClient& client_;
  int stage_;
  train::FullSyncPlan sync_;
  double timeout_s_;
  bool sent_last_ = false;
};

// The pipeline stages for the shared training loop (core/train/run_loop.h): a step is one
// global step of every stage; at the evaluation points every stage's replicas were just averaged
// over all of them (StageGroups::FullSync), so pipeline 0's stages assemble the whole model.
class PipelineMode : public train::TrainingMode {
 public:
  PipelineMode(train::PipelineTrainer& trainer, StageGroups& groups,
               collective::GroupCommunicator& comm, const train::PipelineStage& model,
               layers::Model& full, const data::Dataset& test, const data::InputScaling& scaling,
               size_t offset, int stage, int stages, int pipeline, int rank, int world_size,
               size_t eval_batch, double timeout_s)
      : trainer_(trainer), groups_(groups), comm_(comm), model_(model), full_(full),
        test_(test), scaling_(scaling), offset_(offset), stage_(stage), stages_(stages),
        pipeline_(pipeline), rank_(rank), world_size_(world_size), eval_batch_(eval_batch),
        timeout_s_(timeout_s), everyone_(world_size), assembled_(full.num_params()),
        x_(eval_batch * test.features), labels_(eval_batch) {
    std::iota(everyone_.begin(), everyone_.end(), 0);
    exact_.compress = false;
  }
  int64_t steps() const override { return trainer_.steps(); }
  void Step() override { trainer_.Step(); }
  double LatestLoss() const override {
    const auto& losses = trainer_.losses();
    return losses.empty() ? std::numeric_limits<double>::quiet_NaN() : losses.back();
  }
  void PrepareEvaluation(bool) override {}
  Result Evaluate(int64_t from) override {
    // Pipeline 0's stages contribute their slices (the others add zeros: the sum is exact).
    std::fill(assembled_.begin(), assembled_.end(), 0.0f);
    if (pipeline_ == 0) {
      std::copy(model_.params().begin(), model_.params().end(), assembled_.begin() + offset_);
    }
    comm_.AllReduce(assembled_, collective::ReduceOp::kSum, everyone_,
                    Deadline::After(timeout_s_), nullptr, exact_);
    const size_t begin = test_.count * rank_ / world_size_;
    const size_t end = test_.count * (rank_ + 1) / world_size_;
    layers::EvalResult local;
    std::vector<uint32_t> indices;
    for (size_t at = begin; at < end; at += eval_batch_) {
      const size_t n = std::min(eval_batch_, end - at);
      indices.resize(n);
      std::iota(indices.begin(), indices.end(), static_cast<uint32_t>(at));
      data::GatherBatch(test_, indices, x_.data(), labels_.data(), scaling_);
      const layers::EvalResult r = full_.Evaluate(assembled_, x_.data(), labels_.data(), n);
      local.loss_sum += r.loss_sum;
      local.correct += r.correct;
      local.count += r.count;
    }
    // The training loss lives in the last stages: the mean of their (group-averaged) step
    // losses since the previous evaluation.
    double train_loss_sum = 0, train_loss_count = 0;
    if (stage_ == stages_ - 1) {
      const auto& losses = trainer_.losses();
      for (size_t i = static_cast<size_t>(from); i < losses.size(); ++i) {
        train_loss_sum += losses[i];
        train_loss_count += 1;
      }
    }
    std::vector<float> sums = {static_cast<float>(local.loss_sum),
                               static_cast<float>(local.correct),
                               static_cast<float>(local.count),
                               static_cast<float>(train_loss_sum),
                               static_cast<float>(train_loss_count)};
    comm_.AllReduce(sums, collective::ReduceOp::kSum, everyone_, Deadline::After(timeout_s_),
                    nullptr, exact_);
    Result r;
    r.test_accuracy = sums[2] > 0 ? sums[1] / sums[2] : 0.0;
    r.test_loss = sums[2] > 0 ? sums[0] / sums[2] : 0.0;
    r.train_loss = sums[4] > 0 ? sums[3] / sums[4] : std::numeric_limits<double>::quiet_NaN();
    return r;
  }
  // After the goodbye, a barrier of every rank: rank 0 hosts the scheduler of every stage and
  // must not close it while a rank of another stage still waits for its answer (seen as "lost
  // the group scheduler" on a loaded machine).
  void Finish(bool at_target) override {
    if (!at_target) return;
    groups_.Goodbye(trainer_.steps());
    std::vector<float> token = {0};
    comm_.AllReduce(token, collective::ReduceOp::kSum, everyone_, Deadline::After(timeout_s_),
                    nullptr, exact_);
  }

 private:
  train::PipelineTrainer& trainer_;
  StageGroups& groups_;
  collective::GroupCommunicator& comm_;
  const train::PipelineStage& model_;
  layers::Model& full_;
  const data::Dataset& test_;
  data::InputScaling scaling_;
  size_t offset_;
  int stage_, stages_, pipeline_, rank_, world_size_;
  size_t eval_batch_;
  double timeout_s_;
  std::vector<int> everyone_;
  collective::AllReduceOptions exact_;
  std::vector<float> assembled_;
  std::vector<float> x_;
  std::vector<uint8_t> labels_;
};

}  // namespace

void RunPipelineWorker(const WorkerArgs& args, const JobEnv& env, const config::Job& job,
                       Clock::time_point start) {
  const bool lead = env.rank == 0;
  const auto& train_cfg = job.train();
  const auto& comm_cfg = job.comm();
  const auto& sd = job.sdpipe();
  const auto& pl = job.pipeline();
  const int M = pl.stages();
  if (env.world_size % M != 0) {
    Throw(ErrorCode::kInvalidArgument,
          "pipeline.stages = {}: the world size {} is not a multiple of it (each pipeline needs "
          "one rank per stage)",
          M, env.world_size);
  }
  const int N = env.world_size / M;
  const train::PipelineLayout layout{M, N};
  const int stage = layout.stage_of(env.rank);
  const int pipeline = layout.pipeline_of(env.rank);
  if (sd.min_group() > N) {
    Throw(ErrorCode::kInvalidArgument,
          "sdpipe.min_group = {}: expected an integer in [1, pipelines = world size {} / "
          "pipeline.stages {} = {}]",
          sd.min_group(), env.world_size, M, N);
  }
  if (!job.checkpoint().dir().empty()) {
    Throw(ErrorCode::kInvalidArgument,
          "checkpoint.dir = '{}': checkpoints are not supported with train.mode: SDPIPE; leave "
          "checkpoint.dir empty",
          job.checkpoint().dir());
  }
  const int m = pl.micro_batches();
  const size_t batch = static_cast<size_t>(train_cfg.batch_size());
  const size_t rows = batch / static_cast<size_t>(m);  // config validation: a multiple

  const auto& data_cfg = job.data();
  const detail::JobData sets = detail::LoadJobData(job);
  const data::Dataset& train_set = sets.train;
  const data::Dataset& test_set = sets.test;
  const data::InputScaling scaling{data_cfg.input_mean(), data_cfg.input_std()};

  // The full model: its initial weights (the stages take their slices, so a split run starts
  // where the unsplit one does) and the evaluation of the assembled weights.
  const size_t eval_batch = 500;
  auto stack = BuildLayers(job.model());
  CheckModelFitsInMemory(stack, std::max(eval_batch, batch), 2);
  std::vector<size_t> layer_params;
  for (const auto& layer : stack) layer_params.push_back(layer->num_params());
  layers::Model full(std::move(stack), eval_batch);
  std::vector<float> full_params(full.num_params());
  full.Init(full_params, train_cfg.seed());
  std::vector<size_t> boundaries(pl.boundaries().begin(), pl.boundaries().end());
  if (boundaries.empty()) boundaries = train::BalancedBoundaries(layer_params, M);
  train::CheckBoundaries(boundaries, layer_params.size());
  const train::StageSlice slice = train::StageSliceOf(layer_params, boundaries, stage);
  const size_t offset = slice.param_offset;
  auto all_layers = BuildLayers(job.model());
  std::vector<std::unique_ptr<layers::Layer>> part;
  for (size_t i = slice.first_layer; i < slice.end_layer; ++i) {
    part.push_back(std::move(all_layers[i]));
  }
  train::PipelineStage model(std::move(part), slice.first_layer, stage == M - 1, rows,
                             train::MaxInFlight(M, stage, m),
                             std::span<const float>(full_params).subspan(offset, slice.param_count));

  train::DatasetMicroBatches data(train_set, batch, rows, pipeline, N, train_cfg.seed(), scaling);
  const auto steps_per_epoch = static_cast<int64_t>(data.steps_per_epoch());
  CheckStepsPerEpoch(steps_per_epoch, job, N, "pipelines", train_set.count);
  const train::RunPlan plan =
      PlanFromConfig(job, steps_per_epoch, static_cast<int64_t>(batch) * N);
  if (lead) {
    PSGD_LOG_INFO("pipesgd worker: world size {}, train.mode SDPIPE with {} pipeline stages x {} "
                  "pipelines, {} micro-batches of {} samples per step and pipeline, every "
                  "replica averaged every {} steps (sdpipe.period), comm.transport {}",
                  env.world_size, M, N, m, rows, sd.period(),
                  config::Transport_Name(comm_cfg.transport()));
    LogEffectiveConfig(args.config_path, job);
    PSGD_LOG_INFO("model: {}", full.Describe());
    PSGD_LOG_INFO("data: {} training samples ({} steps per epoch of {} samples per pipeline), {} "
                  "test samples",
                  train_set.count, steps_per_epoch, batch, test_set.count);
  }
  PSGD_LOG_INFO("rank {}: stage {} of pipeline {}: {}", env.rank, stage, pipeline,
                model.Describe());
  std::unique_ptr<OutputDir> out = ClaimOutputDir(lead, args);

  const Deadline start_deadline = Deadline::After(comm_cfg.start_timeout_s());
  ConnectedTransport connected = TransportForEveryone(env, job, start_deadline);
  collective::GroupCommunicator comm(std::move(connected.transport), env.world_size,
                                     std::move(connected.addresses),
                                     CommunicatorOptionsFromConfig(job));

  // One scheduler state per stage, each over the stage's N replicas; no connect rounds, no
  // epochs and no end of its own (see the top of this file).
  train::GroupSchedulerOptions sopt = SchedulerOptionsFromConfig(sd, N);
  // Never a connect round of its own: FullSync steps replace them (see the top of this file).
  sopt.period = std::numeric_limits<int>::max();
  const SchedulerEndpoint scheduler = StartScheduler(comm, env, sopt, M, start_deadline);
  train::GroupSchedulerClient client(scheduler.host, scheduler.port, pipeline, N, env.job_token,
                                     start_deadline);
  StageGroups groups(client, stage, N, sd.period(), plan, comm_cfg.timeout_s());

  train::SgdOptimizer sgd({train_cfg.learning_rate(), train_cfg.momentum(),
                           train_cfg.weight_decay()},
                          model.num_params());
  train::PipelineTrainerOptions topt;
  topt.micro_batches = m;
  topt.micro_batch_rows = rows;
  topt.seed = train_cfg.seed();
  topt.timeout_s = comm_cfg.timeout_s();
  topt.compression_warmup_steps = comm_cfg.warmup_steps();
  // Outlives the trainer, which records on it.
  const std::unique_ptr<timeline::Recorder> recorder = TimelineRecorder(args, env, plan, 0);
  train::PipelineTrainer trainer(comm, layout, model, sgd, data, groups, topt);
  trainer.set_timeline(recorder.get());

  PipelineMode mode(trainer, groups, comm, model, full, test_set, scaling, offset, stage, M,
                    pipeline, env.rank, env.world_size, eval_batch, comm_cfg.timeout_s());
  LeadReporter reporter(lead, out.get(), /*show_wire=*/false);
  const train::RunOutcome outcome = train::RunLoop(mode, plan, reporter);
  WriteTimeline(recorder.get(), args, env);

  const double wall_s = Seconds(start);
  if (lead) {
    nlohmann::json stages_json = nlohmann::json::array();
    std::vector<train::StageSlice> stage_slices;
    for (int s = 0; s < M; ++s) stage_slices.push_back(train::StageSliceOf(layer_params, boundaries, s));
    for (int s = 0; s < M; ++s) {
      std::map<int, int64_t> sizes;
      const auto decisions = scheduler.service->decisions(s);
      for (const auto& d : decisions) sizes[static_cast<int>(d.members.size())] += 1;
      nlohmann::json hist = nlohmann::json::object();
      for (const auto& [size, count] : sizes) hist[std::to_string(size)] = count;
      stages_json.push_back({{"stage", s},
                             {"layers", fmt::format("{}..{}", stage_slices[s].first_layer,
                                                    stage_slices[s].end_layer - 1)},
                             {"scheduler_rounds", decisions.size()},
                             {"scheduler_group_sizes", hist}});
    }
    LogFinal(outcome, plan, wall_s);
    PSGD_LOG_INFO("per stage: {}", stages_json.dump());
    if (out) {
      SummaryInputs in{"SDPIPE", env.world_size, env.world_size,
                       static_cast<int64_t>(batch) * N, plan.target_accuracy, wall_s,
                       comm.transport().name(), trainer.p2p_bytes_sent() + trainer.sync_wire_bytes()};
      out->WriteSummary(Summary(in, outcome, job,
                                {{"pipeline_stages", M},
                                 {"pipelines", N},
                                 {"micro_batches", m},
                                 {"stages", stages_json},
                                 {"rank0_rounds_alone", trainer.skipped()},
                                 {"rank0_p2p_bytes", trainer.p2p_bytes_sent()},
                                 {"rank0_sync_wire_bytes", trainer.sync_wire_bytes()}}));
    }
  }
}

}  // namespace pipesgd::job
