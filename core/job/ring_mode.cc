// train.mode RING: the pipelined ring trainer (width 1, 2 or auto), on the CPU or the GPU, with
// checkpoints, codecs or PowerSGD. Its set-up for the job skeleton (job_mode.h) and its
// TrainingMode (ring_mode.h).
#include "core/job/ring_mode.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "core/base/log.h"
#include "core/collective/powersgd.h"
#include "core/collective/ring_allreduce.h"
#include "core/train/checkpoint.h"
#include "core/train/classifier_task.h"
#include "core/train/straggler.h"
#include "core/train/trainer.h"
#ifdef PIPESGD_HAVE_CUDA_BACKEND
#include "core/base/cuda/device.h"
#include "core/cuda/cuda_gradients.h"
#include "core/cuda/cuda_task.h"
#include "layers/device_model.h"
#endif
#include "core/job/auto_values.h"
#include "core/job/config.h"
#include "core/job/job_mode.h"
#include "core/job/model_builder.h"
#include "core/job/worker_detail.h"

namespace pipesgd::job {

train::TrainingMode::Result RingMode::Evaluate(int64_t from) {
  const detail::TestSetResult test = detail::SumTestShards(trainer_, evaluate_shard_());
  Result r;
  r.test_accuracy = test.accuracy;
  r.test_loss = test.loss;
  double loss_sum = 0;
  for (int64_t t = from; t < trainer_.steps(); ++t) loss_sum += trainer_.StepLoss(t);
  r.train_loss = trainer_.steps() > from
                     ? loss_sum / static_cast<double>(trainer_.steps() - from)
                     : std::numeric_limits<double>::quiet_NaN();
  // Bytes this rank put on the wire per gradient AllReduce since the previous evaluation.
  const train::WireTotals wire = trainer_.wire_totals();
  const int64_t wire_steps = std::max<int64_t>(1, wire.steps - wire_before_.steps);
  r.wire_bytes_per_step =
      static_cast<double>(wire.bytes_sent - wire_before_.bytes_sent) / wire_steps;
  r.compression_ratio = detail::CompressionRatio(wire_before_, wire);
  if (wire.saturated > wire_before_.saturated) {
    PSGD_LOG_WARN("rank {}: step {}: {} gradient elements were beyond the codec's range and "
                  "were clamped (comm.compression = {}; fp16 saturates at +-65504)",
                  rank_, trainer_.steps(), wire.saturated - wire_before_.saturated,
                  config::Comm::Compression_Name(comm_.compression()));
  }
  wire_before_ = wire;
  return r;
}


namespace {

using detail::JobModel;

#ifdef PIPESGD_HAVE_CUDA_BACKEND
// model.gpu_index, or the rank's local rank (LOCAL_RANK, SLURM_LOCALID, ...) for -1.
int GpuIndex(const config::Model& spec, const JobEnv& env) {
  return spec.gpu_index() >= 0 ? spec.gpu_index() : env.local_rank;
}

// model.device = CUDA: the same task and optimizer on the GPU (core/cuda/cuda_task.h), the GPU
// twin of the CPU model (the same layers, the same parameter layout).
struct GpuParts {
  std::unique_ptr<layers::Gpu> gpu;
  std::unique_ptr<layers::DeviceModel> model;
  std::unique_ptr<cuda::DeviceParams> params;
  std::unique_ptr<cuda::CudaClassifierTask> task;
};
#endif

class RingJob : public JobMode {
 public:
  explicit RingJob(const config::Job& job) : job_(job) {}

  ModeLayout Layout(const JobEnv& env) const override { return {0, 0, env.world_size, "ranks"}; }

  std::string StartLine(const JobEnv& env) const override {
    const int width = job_.train().pipeline_width();
    return fmt::format("pipesgd worker: world size {}, pipeline width {} ({}), comm.transport {}",
                       env.world_size, width == 0 ? "auto" : std::to_string(width),
                       width == 0   ? "measured at start"
                       : width == 1 ? "synchronous SGD"
                                    : "Pipe-SGD",
                       config::Transport_Name(job_.comm().transport()));
  }

  // Every rank loads the same files and initialises the same parameters from the seed, so no
  // broadcast is needed.
  ModeModel Build(JobContext& ctx) override {
    const auto& train_cfg = job_.train();
    const JobEnv& env = ctx.env;
    const size_t batch = static_cast<size_t>(train_cfg.batch_size());
    // An auto width is at most 2 (core/train/autotune.h): room for 2 gradients in flight.
    built_ = detail::BuildJobModel(job_, train_cfg.pipeline_width() == 0
                                             ? 2
                                             : train_cfg.pipeline_width());
    task_ = std::make_unique<train::ClassifierTask>(
        *built_.model, ctx.data.train, batch, env.rank, env.world_size, train_cfg.seed(),
        data::InputScaling{job_.data().input_mean(), job_.data().input_std()});
    // The CPU task still provides the sampler's steps per epoch on the GPU.
    train::Objective* inner = task_.get();
#ifdef PIPESGD_HAVE_CUDA_BACKEND
    if (job_.model().device() == config::Model::CUDA) inner = BuildGpu(ctx);
#endif
    // Stragglers (job.straggler) sleep before some steps, for experiments; a no-op otherwise.
    straggler_ = std::make_unique<train::StragglerObjective>(
        *inner, detail::StragglerFromConfig(job_, env.world_size), env.rank);
    const auto steps = static_cast<int64_t>(task_->steps_per_epoch());
    return {built_.model->Describe(),
            fmt::format("{} training samples ({} steps per epoch of global batch {}), {} test "
                        "samples",
                        ctx.data.train.count, steps, batch * env.world_size, ctx.data.test.count),
            steps};
  }

  void Connect(JobContext& ctx) override {
    comm_ = detail::ConnectJobRing(job_, ctx.env, ctx.lead);
  }

  // --resume, then the auto values (0 in the config), before anything records or trains.
  int64_t Restore(JobContext& ctx) override {
    const auto& train_cfg = job_.train();
    const auto& comm_cfg = job_.comm();
    std::vector<float>& params = built_.params;
    sgd_options_ = {train_cfg.learning_rate(), train_cfg.momentum(), train_cfg.weight_decay()};
#ifdef PIPESGD_HAVE_CUDA_BACKEND
    if (gpu_.gpu) {
      optimizer_ = std::make_unique<cuda::CudaSgdOptimizer>(
          gpu_.gpu->context(), *gpu_.params, gpu_.gpu->MakeSgd(sgd_options_, params.size()));
    }
#endif
    if (!optimizer_) optimizer_ = std::make_unique<train::SgdOptimizer>(sgd_options_, params.size());
    ckpt_job_text_ = detail::CheckpointIdentity(job_);
    resumed_ =
        detail::ResumeRingJob(job_, ckpt_job_text_, *comm_, ctx.env, ctx.args.resume, params);
    if (resumed_) {
      optimizer_->LoadState({resumed_->optimizer_state().data(),
                             static_cast<size_t>(resumed_->optimizer_state_size())});
      saved_step_ = resumed_->steps();
    }
    options_ = {train_cfg.pipeline_width(), comm_cfg.timeout_s(), comm_cfg.warmup_steps()};
    options_.compensation = detail::CompensationFromConfig(train_cfg.staleness_compensation());
    options_.sync_warmup_steps = train_cfg.sync_warmup_steps();
    settings_ = ResolveRingSettings(
        job_, *comm_, *straggler_, params, options_,
        [&] { return std::make_unique<train::SgdOptimizer>(sgd_options_, params.size()); },
        resumed_ ? &*resumed_ : nullptr, ctx.lead);
    options_.pipeline_width = settings_.pipeline_width;
    return resumed_ ? resumed_->steps() : 0;
  }

  train::TrainingMode& Start(JobContext& ctx) override {
    comm_->set_timeline(ctx.recorder.get());
    task_->set_timeline(ctx.recorder.get());
#ifdef PIPESGD_HAVE_CUDA_BACKEND
    if (gpu_.gpu) KeepGradientsOnGpu(ctx);
#endif
    if (job_.comm().powersgd_rank() > 0) StartPowerSgd(ctx);
    trainer_ = std::make_unique<train::Trainer>(*comm_, *straggler_, *optimizer_, built_.params,
                                                options_);
    trainer_->set_timeline(ctx.recorder.get());
    if (resumed_) {
      const train::TrainerSnapshot snapshot = train::SnapshotFromCheckpoint(*resumed_);
      trainer_->Restore(snapshot);
      if (ctx.lead) {
        PSGD_LOG_INFO("resumed from {} at step {} ({} updates applied, {} pending)",
                      train::CheckpointPath(job_.checkpoint().dir(), resumed_->steps(),
                                            ctx.env.rank).string(),
                      snapshot.steps, snapshot.applied, snapshot.pending.size());
      }
    }
    const JobEnv& env = ctx.env;
    auto evaluate_shard = [this, &env, &test = ctx.data.test]() -> layers::EvalResult {
#ifdef PIPESGD_HAVE_CUDA_BACKEND
      if (gpu_.task) return gpu_.task->EvaluateShard(built_.params, test, env.rank, env.world_size);
#endif
      return task_->EvaluateShard(built_.params, test, env.rank, env.world_size);
    };
    mode_ = std::make_unique<RingMode>(*trainer_, evaluate_shard,
                                       [this, &ctx] { SaveCheckpoint(ctx); },
                                       job_.checkpoint(), env.rank, job_.comm());
    return *mode_;
  }

  void Abandon() override { detail::DrainQuietly(trainer_.get()); }

  bool ShowsWire() const override { return true; }

  ModeReport Report(const JobContext& ctx) override {
    const train::WireTotals wire = trainer_->wire_totals();
    return {"RING",
            ctx.env.world_size,
            comm_->transport().name(),
            wire.bytes_sent,
            {{"pipeline_width", settings_.pipeline_width},
             {"chunk_bytes", comm_->options().chunk_bytes},
             {"streams", comm_->options().streams},
             {"auto", settings_.report},
             {"staleness_compensation",
              config::StalenessCompensation_Name(job_.train().staleness_compensation())},
             {"compressed_steps", wire.compressed_steps},
             {"saturated_elements", wire.saturated}}};
  }

 private:
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  train::Objective* BuildGpu(JobContext& ctx) {
    const JobEnv& env = ctx.env;
    const int index = GpuIndex(job_.model(), env);
    try {
      gpu_.gpu = layers::OpenGpu(index);
    } catch (const Error& e) {
      throw e.Wrap(fmt::format("rank {}: model.device = CUDA (GPU index {} from {})", env.rank,
                               index, job_.model().gpu_index() >= 0 ? "model.gpu_index"
                                                                    : "the local rank"));
    }
    cuda::DeviceContext& device = gpu_.gpu->context();
    gpu_.model = BuildGpuModel(*gpu_.gpu, job_.model(), built_.max_batch);
    gpu_.params = std::make_unique<cuda::DeviceParams>(device, built_.model->num_params());
    gpu_.task = std::make_unique<cuda::CudaClassifierTask>(
        device, *gpu_.model, *gpu_.params, ctx.data.train,
        static_cast<size_t>(job_.train().batch_size()), built_.max_batch, env.rank,
        env.world_size, job_.train().seed(),
        data::InputScaling{job_.data().input_mean(), job_.data().input_std()});
    PSGD_LOG_INFO("rank {}: model on {}", env.rank, device.description());
    return gpu_.task.get();
  }

  // GPU gradients stay in device slots, AllReduced staged through pinned host lanes
  // (core/cuda/cuda_gradients.h); error feedback keeps a per-call residual that segments would
  // reset, so with it the gradients go through host slots instead.
  void KeepGradientsOnGpu(JobContext& ctx) {
    if (job_.comm().error_feedback()) {
      PSGD_LOG_INFO("rank {}: gradients reduced in host slots (comm.error_feedback is not "
                    "supported on device slots)", ctx.env.rank);
      return;
    }
    const int width = settings_.pipeline_width;
    const size_t n = built_.params.size();
    collective::StagingOptions staging;
    device_gradients_ = std::make_unique<cuda::CudaDeviceGradients>(gpu_.gpu->context(), *comm_,
                                                                    width, n + 1, staging);
    options_.gradient_slots = device_gradients_.get();
    if (ctx.lead) {
      PSGD_LOG_INFO("gradients stay on the GPU: {} device slots, staged through {} pinned "
                    "host lanes of {} KiB",
                    width, staging.lanes,
                    std::min<uint64_t>(staging.segment_bytes, (n + 1) * 4) / 1024);
    }
  }
#endif

  // PowerSGD in place of the ring's codec (comm.powersgd_rank; the config checks rule out the
  // GPU, checkpoints and the other modes).
  void StartPowerSgd(JobContext& ctx) {
    powersgd_ = detail::MakePowerSgd(job_, *built_.model, *comm_, ctx.lead);
    options_.reducer = powersgd_.get();
  }

  // Every rank writes its own file (the error-feedback residual is per rank); the state is
  // taken between steps with the in-flight AllReduces finished, and never when it holds a
  // non-finite value.
  void SaveCheckpoint(const JobContext& ctx) {
    const auto& ckpt_cfg = job_.checkpoint();
    if (ckpt_cfg.dir().empty() || trainer_->steps() == saved_step_) return;
    const JobEnv& env = ctx.env;
    const train::TrainerSnapshot snapshot = trainer_->Snapshot();
    const std::vector<float> opt = optimizer_->SaveState();
    // The round's agreement below is one more collective: the checkpoint records the sequence
    // after it, where this run goes on and a resumed one must start (it keys the codecs'
    // stochastic rounding).
    const checkpoint::Checkpoint c = train::CaptureCheckpoint(
        {ckpt_job_text_, env.rank, env.world_size, comm_->sequence() + 1, built_.params, opt,
         comm_->residual(), settings_.pipeline_width, comm_->options().chunk_bytes,
         comm_->options().streams},
        snapshot);
    detail::WriteRingCheckpoint(*trainer_, ckpt_cfg, c, env, ctx.lead);
    saved_step_ = snapshot.steps;
  }

  const config::Job& job_;
  // Declared in the order they are made, so each goes before what it uses.
  JobModel built_;
  std::unique_ptr<train::ClassifierTask> task_;
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  GpuParts gpu_;
#endif
  std::unique_ptr<train::StragglerObjective> straggler_;
  std::unique_ptr<collective::Communicator> comm_;
  layers::SgdOptions sgd_options_;
  std::unique_ptr<train::Optimizer> optimizer_;
  std::string ckpt_job_text_;
  std::optional<checkpoint::Checkpoint> resumed_;
  int64_t saved_step_ = -1;
  train::TrainerOptions options_;
  RingSettings settings_;
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  std::unique_ptr<cuda::CudaDeviceGradients> device_gradients_;
#endif
  std::unique_ptr<collective::PowerSgd> powersgd_;
  std::unique_ptr<train::Trainer> trainer_;
  std::unique_ptr<RingMode> mode_;
};

}  // namespace

extern const ModeInfo kRingMode;
const ModeInfo kRingMode{
    "train.mode = RING",
    {.checkpoints = true, .cuda = true, .timeline = true, .compression = true, .powersgd = true},
    // With pipeline stages too: the validator refuses those (they need SDPIPE), by name.
    [](const config::Job& job) {
      return job.train().mode() == config::RING && job.train().local_steps() <= 1;
    },
    [](const config::Job& job) -> std::unique_ptr<JobMode> { return std::make_unique<RingJob>(job); }};

}  // namespace pipesgd::job
