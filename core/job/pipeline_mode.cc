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
#include "core/job/job_mode.h"

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

class PipelineJob : public JobMode {
 public:
  explicit PipelineJob(const config::Job& job)
      : job_(job),
        M_(job.pipeline().stages()),
        m_(job.pipeline().micro_batches()),
        // config validation: the batch is a multiple of the micro-batches.
        rows_(static_cast<size_t>(job.train().batch_size() / job.pipeline().micro_batches())) {}

  ModeLayout Layout(const JobEnv& env) const override {
    if (env.world_size % M_ != 0) {
      Throw(ErrorCode::kInvalidArgument,
            "pipeline.stages = {}: the world size {} is not a multiple of it (each pipeline "
            "needs one rank per stage)",
            M_, env.world_size);
    }
    const int N = env.world_size / M_;
    if (job_.sdpipe().min_group() > N) {
      Throw(ErrorCode::kInvalidArgument,
            "sdpipe.min_group = {}: expected an integer in [1, pipelines = world size {} / "
            "pipeline.stages {} = {}]",
            job_.sdpipe().min_group(), env.world_size, M_, N);
    }
    return {0, 0, N, "pipelines"};
  }

  std::string StartLine(const JobEnv& env) const override {
    return fmt::format("pipesgd worker: world size {}, train.mode SDPIPE with {} pipeline stages "
                       "x {} pipelines, {} micro-batches of {} samples per step and pipeline, "
                       "every replica averaged every {} steps (sdpipe.period), comm.transport {}",
                       env.world_size, M_, env.world_size / M_, m_, rows_,
                       job_.sdpipe().period(), config::Transport_Name(job_.comm().transport()));
  }

  // The full model gives the initial weights (the stages take their slices, so a split run
  // starts where the unsplit one does) and evaluates the assembled weights; the stage trains
  // layers of its own, built a second time, as a layer keeps its activations.
  ModeModel Build(JobContext& ctx) override {
    const JobEnv& env = ctx.env;
    const auto& train_cfg = job_.train();
    const auto& pl = job_.pipeline();
    layout_ = train::PipelineLayout{M_, env.world_size / M_};
    stage_ = layout_.stage_of(env.rank);
    pipeline_ = layout_.pipeline_of(env.rank);
    const size_t batch = static_cast<size_t>(train_cfg.batch_size());
    auto stack = BuildLayers(job_.model());
    CheckModelFitsInMemory(stack, std::max(kEvalBatch, batch), 2);
    for (const auto& layer : stack) layer_params_.push_back(layer->num_params());
    full_ = std::make_unique<layers::Model>(std::move(stack), kEvalBatch);
    full_params_.resize(full_->num_params());
    full_->Init(full_params_, train_cfg.seed());
    boundaries_.assign(pl.boundaries().begin(), pl.boundaries().end());
    if (boundaries_.empty()) boundaries_ = train::BalancedBoundaries(layer_params_, M_);
    train::CheckBoundaries(boundaries_, layer_params_.size());
    const train::StageSlice slice = train::StageSliceOf(layer_params_, boundaries_, stage_);
    offset_ = slice.param_offset;
    auto all_layers = BuildLayers(job_.model());
    std::vector<std::unique_ptr<layers::Layer>> part;
    for (size_t i = slice.first_layer; i < slice.end_layer; ++i) {
      part.push_back(std::move(all_layers[i]));
    }
    stage_model_ = std::make_unique<train::PipelineStage>(
        std::move(part), slice.first_layer, stage_ == M_ - 1, rows_,
        train::MaxInFlight(M_, stage_, m_),
        std::span<const float>(full_params_).subspan(offset_, slice.param_count));
    scaling_ = {job_.data().input_mean(), job_.data().input_std()};
    data_ = std::make_unique<train::DatasetMicroBatches>(ctx.data.train, batch, rows_, pipeline_,
                                                         layout_.pipelines, train_cfg.seed(),
                                                         scaling_);
    PSGD_LOG_INFO("rank {}: stage {} of pipeline {}: {}", env.rank, stage_, pipeline_,
                  stage_model_->Describe());
    const auto steps = static_cast<int64_t>(data_->steps_per_epoch());
    return {full_->Describe(),
            fmt::format("{} training samples ({} steps per epoch of {} samples per pipeline), "
                        "{} test samples",
                        ctx.data.train.count, steps, batch, ctx.data.test.count),
            steps};
  }

  // One scheduler state per stage, each over the stage's N replicas, with no connect rounds,
  // epochs or end of its own (see the top of this file).
  void Connect(JobContext& ctx) override {
    const JobEnv& env = ctx.env;
    const auto& comm_cfg = job_.comm();
    const Deadline start_deadline = Deadline::After(comm_cfg.start_timeout_s());
    ConnectedTransport connected = TransportForEveryone(env, job_, start_deadline);
    comm_ = std::make_unique<collective::GroupCommunicator>(
        std::move(connected.transport), env.world_size, std::move(connected.addresses),
        CommunicatorOptionsFromConfig(job_));
    const int N = layout_.pipelines;
    train::GroupSchedulerOptions sopt = SchedulerOptionsFromConfig(job_.sdpipe(), N);
    sopt.period = std::numeric_limits<int>::max();  // FullSync steps replace connect rounds
    scheduler_ = StartScheduler(*comm_, env, sopt, M_, start_deadline);
    client_ = std::make_unique<train::GroupSchedulerClient>(
        scheduler_.host, scheduler_.port, pipeline_, N, env.job_token, start_deadline);
    groups_ = std::make_unique<StageGroups>(*client_, stage_, N, job_.sdpipe().period(),
                                            ctx.plan, comm_cfg.timeout_s());
  }

  train::TrainingMode& Start(JobContext& ctx) override {
    const auto& train_cfg = job_.train();
    const auto& comm_cfg = job_.comm();
    sgd_ = std::make_unique<train::SgdOptimizer>(
        layers::SgdOptions{train_cfg.learning_rate(), train_cfg.momentum(),
                           train_cfg.weight_decay()},
        stage_model_->num_params());
    train::PipelineTrainerOptions topt;
    topt.micro_batches = m_;
    topt.micro_batch_rows = rows_;
    topt.seed = train_cfg.seed();
    topt.timeout_s = comm_cfg.timeout_s();
    topt.compression_warmup_steps = comm_cfg.warmup_steps();
    trainer_ = std::make_unique<train::PipelineTrainer>(*comm_, layout_, *stage_model_, *sgd_,
                                                        *data_, *groups_, topt);
    trainer_->set_timeline(ctx.recorder.get());
    mode_ = std::make_unique<PipelineMode>(
        *trainer_, *groups_, *comm_, *stage_model_, *full_, ctx.data.test, scaling_, offset_,
        stage_, M_, pipeline_, ctx.env.rank, ctx.env.world_size, kEvalBatch,
        comm_cfg.timeout_s());
    return *mode_;
  }

  ModeReport Report(const JobContext& ctx) override {
    nlohmann::json stages_json = nlohmann::json::array();
    for (int s = 0; s < M_; ++s) {
      const train::StageSlice slice = train::StageSliceOf(layer_params_, boundaries_, s);
      std::map<int, int64_t> sizes;
      const auto decisions = scheduler_.service->decisions(s);
      for (const auto& d : decisions) sizes[static_cast<int>(d.members.size())] += 1;
      nlohmann::json hist = nlohmann::json::object();
      for (const auto& [size, count] : sizes) hist[std::to_string(size)] = count;
      stages_json.push_back({{"stage", s},
                             {"layers", fmt::format("{}..{}", slice.first_layer,
                                                    slice.end_layer - 1)},
                             {"scheduler_rounds", decisions.size()},
                             {"scheduler_group_sizes", hist}});
    }
    PSGD_LOG_INFO("per stage: {}", stages_json.dump());
    return {"SDPIPE",
            ctx.env.world_size,
            comm_->transport().name(),
            trainer_->p2p_bytes_sent() + trainer_->sync_wire_bytes(),
            {{"pipeline_stages", M_},
             {"pipelines", layout_.pipelines},
             {"micro_batches", m_},
             {"stages", stages_json},
             {"rank0_rounds_alone", trainer_->skipped()},
             {"rank0_p2p_bytes", trainer_->p2p_bytes_sent()},
             {"rank0_sync_wire_bytes", trainer_->sync_wire_bytes()}}};
  }

 private:
  static constexpr size_t kEvalBatch = 500;
  const config::Job& job_;
  const int M_;  // stages
  const int m_;  // micro-batches per step
  const size_t rows_;
  train::PipelineLayout layout_{1, 1};
  int stage_ = 0;
  int pipeline_ = 0;
  std::vector<size_t> layer_params_;
  std::vector<size_t> boundaries_;
  std::unique_ptr<layers::Model> full_;
  std::vector<float> full_params_;
  size_t offset_ = 0;
  std::unique_ptr<train::PipelineStage> stage_model_;
  data::InputScaling scaling_;
  std::unique_ptr<train::DatasetMicroBatches> data_;
  std::unique_ptr<collective::GroupCommunicator> comm_;
  SchedulerEndpoint scheduler_;
  std::unique_ptr<train::GroupSchedulerClient> client_;
  std::unique_ptr<StageGroups> groups_;
  std::unique_ptr<train::SgdOptimizer> sgd_;
  std::unique_ptr<train::PipelineTrainer> trainer_;
  std::unique_ptr<PipelineMode> mode_;
};

}  // namespace

extern const ModeInfo kPipelineMode;
const ModeInfo kPipelineMode{
    "pipeline stages (train.mode = SDPIPE with pipeline.stages > 1)",
    {.timeline = true, .compression = true},
    [](const config::Job& job) {
      return job.train().mode() == config::SDPIPE && job.pipeline().stages() > 1;
    },
    [](const config::Job& job) -> std::unique_ptr<JobMode> {
      return std::make_unique<PipelineJob>(job);
    }};

}  // namespace pipesgd::job
