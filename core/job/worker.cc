#include "core/job/worker.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "core/collective/powersgd.h"
#include "core/collective/ring_allreduce.h"
#include "core/data/dataset.h"
#include "core/train/checkpoint.h"
#include "core/train/classifier_task.h"
#include "core/base/timeline.h"
#include "core/train/trainer.h"
#ifdef PIPESGD_HAVE_CUDA_BACKEND
#include "core/cuda/cuda_gradients.h"
#include "core/cuda/cuda_task.h"
#include "layers/cuda/cuda_model.h"
#include "layers/cuda/device.h"
#endif
#include "core/job/auto_values.h"
#include "core/job/config.h"
#include "core/job/model_builder.h"
#include "core/job/pipeline_worker.h"
#include "core/job/ring_mode.h"
#include "core/job/sdpipe_worker.h"
#include "core/job/worker_detail.h"
#include "layers/model.h"

namespace pipesgd::job {

using namespace detail;

namespace {
#ifdef PIPESGD_HAVE_CUDA_BACKEND
// The GPU twin of the CPU model: the same layers (BuildCudaLayers), the same parameter layout.
std::unique_ptr<cuda::CudaModel> BuildCudaModel(cuda::Context& ctx, const config::Model& spec,
                                                size_t max_batch) {
  return std::make_unique<cuda::CudaModel>(ctx, BuildCudaLayers(spec), max_batch);
}

// model.gpu_index, or the rank's local rank (LOCAL_RANK, SLURM_LOCALID, ...) for -1.
int GpuIndex(const config::Model& spec, const JobEnv& env) {
  return spec.gpu_index() >= 0 ? spec.gpu_index() : env.local_rank;
}
#endif
}  // namespace

namespace {

// An AllReduce that no codec may round: counts, steps, flags.

}  // namespace

void CheckLocalGpus(const config::Job& job, int local_ranks) {
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  if (job.model().device() != config::Model::CUDA) return;
  std::string why;
  const int count = cuda::CudaDeviceCount(&why);
  if (count == 0) {
    Throw(ErrorCode::kInvalidArgument,
          "model.device = CUDA: this machine has no CUDA device ({}); no rank was started; use "
          "model.device: CPU or run on a machine with a GPU",
          why);
  }
  const int gpu_index = job.model().gpu_index();
  const int highest = gpu_index >= 0 ? gpu_index : local_ranks - 1;
  if (highest >= count) {
    Throw(ErrorCode::kInvalidArgument,
          "model.device = CUDA: {} needs GPU {}, but this machine has {} CUDA device(s) "
          "(0..{}); no rank was started",
          gpu_index >= 0 ? "model.gpu_index" : fmt::format("local rank {}", highest), highest,
          count, count - 1);
  }
#else
  (void)job;
  (void)local_ranks;
#endif
}

namespace {
void RunWorkerJob(const WorkerArgs& args, const JobEnv& env, Clock::time_point start);
}  // namespace

void RunWorker(const WorkerArgs& args) {
  const auto start = Clock::now();
  const JobEnv env = ReadJobEnv();
  try {
    RunWorkerJob(args, env, start);
  } catch (const Error& e) {
    if (!env.relay) throw;
    // Every rank names the same failed rank: rank 0 decides (transport/failure_relay.h).
    throw transport::FailureRelay::Explain(e, env.rank, env.relay->Report(e));
  } catch (const std::bad_alloc&) {
    if (env.relay) env.relay->Report(Error(ErrorCode::kInternal, fmt::format("rank {}: out of memory", env.rank)));
    throw;
  } catch (const std::exception& e) {
    if (!env.relay) throw;
    const Error error(ErrorCode::kInternal, fmt::format("rank {}: unexpected failure: {}", env.rank, e.what()));
    throw transport::FailureRelay::Explain(error, env.rank, env.relay->Report(error));
  }
  if (env.relay) env.relay->Goodbye();
}

namespace {

void RunWorkerJob(const WorkerArgs& args, const JobEnv& env, Clock::time_point start) {
  const bool lead = env.rank == 0;
  const config::Job job = LoadJobConfig(args.config_path, args.overrides);
  const auto& train_cfg = job.train();
  const auto& comm_cfg = job.comm();
  if (train_cfg.mode() == config::SDPIPE) {
    if (job.pipeline().stages() > 1) {
      RunPipelineWorker(args, env, job, start);  // pipeline-parallel stages
    } else {
      RunSdpipeWorker(args, env, job, start);
    }
    return;
  }
  if (train_cfg.mode() != config::RING) {
    // The parameter-server baselines live in their own file.
    RunPsWorker(args, env, job);
    return;
  }
  if (lead) {
    const int width = train_cfg.pipeline_width();
    PSGD_LOG_INFO("pipesgd worker: world size {}, pipeline width {} ({}), comm.transport {}",
                  env.world_size, width == 0 ? "auto" : std::to_string(width),
                  width == 0 ? "measured at start" : width == 1 ? "synchronous SGD" : "Pipe-SGD",
                  config::Transport_Name(comm_cfg.transport()));
    LogEffectiveConfig(args.config_path, job);
  }

  // Data and model. Every rank loads the same files and initialises the same parameters from
  // the seed, so no broadcast is needed.
  std::unique_ptr<OutputDir> out = ClaimOutputDir(lead, args);
  const auto& data_cfg = job.data();
  const JobData sets = LoadJobData(job);
  const data::Dataset& train_set = sets.train;
  const data::Dataset& test_set = sets.test;
  const size_t batch = static_cast<size_t>(train_cfg.batch_size());
  // An auto width is at most 2 (core/train/autotune.h): room for 2 gradients in flight.
  JobModel built = BuildJobModel(job, train_cfg.pipeline_width() == 0 ? 2
                                                                      : train_cfg.pipeline_width());
  const std::unique_ptr<layers::Model> model = std::move(built.model);
  std::vector<float>& params = built.params;
  [[maybe_unused]] const size_t max_batch = built.max_batch;  // the CUDA task's
  train::ClassifierTask task(*model, train_set, batch, env.rank, env.world_size,
                             train_cfg.seed(), {data_cfg.input_mean(), data_cfg.input_std()});
  // model.device = CUDA: the same task and optimizer on the GPU (core/cuda/cuda_task.h); the
  // CPU task above still provides the sampler's steps per epoch.
  train::Objective* inner = &task;
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  std::unique_ptr<cuda::Context> gpu;
  std::unique_ptr<cuda::CudaModel> gpu_model;
  std::unique_ptr<cuda::DeviceParams> gpu_params;
  std::unique_ptr<cuda::CudaClassifierTask> gpu_task;
  if (job.model().device() == config::Model::CUDA) {
    const int index = GpuIndex(job.model(), env);
    try {
      gpu = std::make_unique<cuda::Context>(index);
    } catch (const Error& e) {
      throw e.Wrap(fmt::format("rank {}: model.device = CUDA (GPU index {} from {})", env.rank,
                               index, job.model().gpu_index() >= 0 ? "model.gpu_index"
                                                                   : "the local rank"));
    }
    gpu_model = BuildCudaModel(*gpu, job.model(), max_batch);
    gpu_params = std::make_unique<cuda::DeviceParams>(*gpu, model->num_params());
    gpu_task = std::make_unique<cuda::CudaClassifierTask>(
        *gpu, *gpu_model, *gpu_params, train_set, batch, max_batch, env.rank, env.world_size,
        train_cfg.seed(), data::InputScaling{data_cfg.input_mean(), data_cfg.input_std()});
    inner = gpu_task.get();
    PSGD_LOG_INFO("rank {}: model on {}", env.rank, gpu->description());
  }
#endif
  // Stragglers (job.straggler) sleep before some steps, for experiments; a no-op otherwise.
  train::StragglerObjective straggler(*inner, StragglerFromConfig(job, env.world_size), env.rank);
  train::Objective* objective = &straggler;
  const size_t steps_per_epoch = task.steps_per_epoch();
  CheckStepsPerEpoch(static_cast<int64_t>(steps_per_epoch), job, env.world_size, "ranks",
                     train_set.count);
  if (lead) {
    PSGD_LOG_INFO("model: {}", model->Describe());
    PSGD_LOG_INFO("data: {} training samples ({} steps per epoch of global batch {}), {} test "
                  "samples",
                  train_set.count, steps_per_epoch, batch * env.world_size, test_set.count);
  }

  // Network: publish our endpoint, meet the others, connect the ring.
  const collective::CommunicatorOptions comm_options = RingConnectOptions(job);
  auto comm = ConnectRing(env, JobDescription(job), comm_options, comm_cfg,
                          Deadline::After(comm_cfg.start_timeout_s()),
                          fmt::format("comm.start_timeout_s = {} s", comm_cfg.start_timeout_s()));
  const std::string transport_name = comm->transport().name();
  if (lead) {
    PSGD_LOG_INFO("ring connected: {} ranks over {}", env.world_size, comm->transport().Describe());
  }

  const layers::SgdOptions sgd_options{train_cfg.learning_rate(), train_cfg.momentum(),
                                       train_cfg.weight_decay()};
  std::unique_ptr<train::Optimizer> optimizer;
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  if (gpu) optimizer = std::make_unique<cuda::CudaSgdOptimizer>(*gpu, *gpu_params, sgd_options);
#endif
  if (!optimizer) optimizer = std::make_unique<train::SgdOptimizer>(sgd_options, params.size());
  train::Optimizer& sgd = *optimizer;
  // A checkpoint belongs to the job, not to where it is kept: its directory is left out of the
  // identity, so that a copied or moved directory resumes (checkpoint.dir = the new place).
  config::Job ckpt_identity = job;
  ckpt_identity.mutable_checkpoint()->clear_dir();
  const std::string ckpt_job_text = JobDescription(ckpt_identity);
  const auto& ckpt_cfg = job.checkpoint();
  const std::filesystem::path ckpt_dir = ckpt_cfg.dir();
  std::optional<checkpoint::Checkpoint> resumed;
  if (args.resume) {
    if (ckpt_cfg.dir().empty()) {
      Throw(ErrorCode::kInvalidArgument,
            "--resume: checkpoint.dir is not set in the config (nothing to resume from)");
    }
    resumed = train::AgreeOnCheckpoint(*comm, ckpt_dir, comm_cfg.timeout_s());
    train::CheckCheckpointFitsJob(*resumed, ckpt_cfg.dir(), ckpt_job_text, env.world_size,
                                  params.size());
    std::copy(resumed->params().begin(), resumed->params().end(), params.begin());
    sgd.LoadState({resumed->optimizer_state().data(),
                   static_cast<size_t>(resumed->optimizer_state_size())});
    comm->RestoreResidual({resumed->residual().data(), static_cast<size_t>(resumed->residual_size())});
    comm->RestoreSequence(resumed->collective_sequence());
  }
  train::TrainerOptions trainer_options{train_cfg.pipeline_width(), comm_cfg.timeout_s(),
                                        comm_cfg.warmup_steps()};
  trainer_options.compensation = CompensationFromConfig(train_cfg.staleness_compensation());
  trainer_options.sync_warmup_steps = train_cfg.sync_warmup_steps();
  // The auto values (0 in the config), before anything records a timeline or trains.
  const RingSettings settings = ResolveRingSettings(
      job, *comm, *objective, params, trainer_options,
      [&] { return std::make_unique<train::SgdOptimizer>(sgd_options, params.size()); },
      resumed ? &*resumed : nullptr, lead);
  const int width = settings.pipeline_width;
  trainer_options.pipeline_width = width;
  const train::RunPlan plan =
      PlanFromConfig(job, static_cast<int64_t>(steps_per_epoch),
                     static_cast<int64_t>(batch) * env.world_size);
  // Outlives the trainer, which records on it.
  const std::unique_ptr<timeline::Recorder> recorder =
      TimelineRecorder(args, env, plan, resumed ? resumed->steps() : 0);
  comm->set_timeline(recorder.get());
  task.set_timeline(recorder.get());
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  // GPU gradients stay in device slots, AllReduced staged through pinned host lanes
  // (core/cuda/cuda_gradients.h); error feedback keeps a per-call residual that segments would
  // reset, so with it the gradients go through host slots instead.
  std::unique_ptr<cuda::CudaDeviceGradients> device_gradients;
  if (gpu) {
    if (comm_cfg.error_feedback()) {
      PSGD_LOG_INFO("rank {}: gradients reduced in host slots (comm.error_feedback is not "
                    "supported on device slots)", env.rank);
    } else {
      collective::StagingOptions staging;
      device_gradients = std::make_unique<cuda::CudaDeviceGradients>(*gpu, *comm, width,
                                                                     params.size() + 1, staging);
      trainer_options.device_gradients = device_gradients.get();
      if (lead) {
        PSGD_LOG_INFO("gradients stay on the GPU: {} device slots, staged through {} pinned "
                      "host lanes of {} KiB",
                      width, staging.lanes,
                      std::min<uint64_t>(staging.segment_bytes, (params.size() + 1) * 4) / 1024);
      }
    }
  }
#endif
  // PowerSGD in place of the ring's codec (comm.powersgd_rank; the config checks rule out the
  // GPU, checkpoints and the other modes).
  std::unique_ptr<collective::PowerSgd> powersgd;
  if (comm_cfg.powersgd_rank() > 0) {
    std::vector<collective::PowerSgd::Matrix> matrices;
    for (const auto& m : model->WeightMatrices()) matrices.push_back({m.offset, m.rows, m.cols});
    collective::PowerSgdOptions po;
    po.rank = comm_cfg.powersgd_rank();
    po.seed = static_cast<uint64_t>(train_cfg.seed());
    powersgd = std::make_unique<collective::PowerSgd>(*comm, params.size() + 1, matrices, po);
    trainer_options.reducer = powersgd.get();
    if (lead) {
      PSGD_LOG_INFO("PowerSGD rank {}: {} of {} weight matrices travel as low-rank factors",
                    po.rank, powersgd->compressed().size(), matrices.size());
    }
  }
  train::Trainer trainer(*comm, *objective, sgd, params, trainer_options);
  trainer.set_timeline(recorder.get());
  if (resumed) {
    const train::TrainerSnapshot snapshot = train::SnapshotFromCheckpoint(*resumed);
    trainer.Restore(snapshot);
    if (lead) {
      PSGD_LOG_INFO("resumed from {} at step {} ({} updates applied, {} pending)",
                    train::CheckpointPath(ckpt_dir, resumed->steps(), env.rank).string(),
                    snapshot.steps, snapshot.applied, snapshot.pending.size());
    }
  }

  // Every rank writes its own file (the error-feedback residual is per rank); the state is
  // taken between steps with the in-flight AllReduces finished, and never when it holds a
  // non-finite value.
  int64_t saved_step = resumed ? resumed->steps() : -1;
  auto save_checkpoint = [&] {
    if (ckpt_cfg.dir().empty() || trainer.steps() == saved_step) return;
    const train::TrainerSnapshot snapshot = trainer.Snapshot();
    const std::vector<float> opt = sgd.SaveState();
    // The round's agreement below is one more collective: the checkpoint records the sequence
    // after it, where this run goes on and a resumed one must start (it keys the codecs'
    // stochastic rounding).
    const checkpoint::Checkpoint c = train::CaptureCheckpoint(
        {ckpt_job_text, env.rank, env.world_size, comm->sequence() + 1, params, opt,
         comm->residual(), width, comm->options().chunk_bytes, comm->options().streams},
        snapshot);
    // A rank deletes its older checkpoints only once every rank has written this step (a full
    // disk on one rank must leave a step all can resume from): one AllReduce of a one-hot
    // failure flag, on the trainer's communication thread after the steps (Snapshot drained
    // them). It costs a few bytes per round, beside a write of the whole model; learning the
    // same from the next round's gradients instead would keep two rounds of files and could
    // not confirm the last round before the job ends.
    train::WriteCheckpointRound(ckpt_dir, c, ckpt_cfg.keep(), [&](float failed) {
      std::vector<float> all(static_cast<size_t>(env.world_size), 0.0f);
      all[static_cast<size_t>(env.rank)] = failed;
      trainer.AllReduce(all, collective::ReduceOp::kSum);
      return all;
    });
    saved_step = snapshot.steps;
    if (lead) {
      PSGD_LOG_INFO("checkpoint: step {} written to {}", snapshot.steps,
                    train::CheckpointPath(ckpt_dir, snapshot.steps, env.rank).string());
    }
  };

  auto evaluate_shard = [&]() -> layers::EvalResult {
#ifdef PIPESGD_HAVE_CUDA_BACKEND
    if (gpu_task) return gpu_task->EvaluateShard(params, test_set, env.rank, env.world_size);
#endif
    return task.EvaluateShard(params, test_set, env.rank, env.world_size);
  };
  RingMode mode(trainer, evaluate_shard, save_checkpoint, ckpt_cfg, env.rank, comm_cfg);
  LeadReporter reporter(lead, out.get(), /*show_wire=*/true);
  if (lead && trainer.steps() >= plan.total_steps()) {
    PSGD_LOG_INFO("nothing to train: the checkpoint is at step {} of {}", trainer.steps(),
                  plan.total_steps());
  }
  train::RunOutcome outcome;
  try {
    outcome = train::RunLoop(mode, plan, reporter);
  } catch (const Error& e) {
    try {
      trainer.Drain(false);
    } catch (...) {
    }
    if (e.code() != ErrorCode::kDeadlineExceeded) throw;
    throw WithTimeoutSetting(e, fmt::format("comm.timeout_s = {} s", comm_cfg.timeout_s()));
  } catch (...) {
    // Let in-flight collectives finish on every rank before the trainer goes away, so this
    // rank's failure does not turn into a confusing connection error on its peers.
    try {
      trainer.Drain(false);
    } catch (...) {
    }
    throw;
  }

  WriteTimeline(recorder.get(), args, env);

  const double wall_s = Seconds(start);
  if (lead) {
    LogFinal(outcome, plan, wall_s);
    if (out) {
      const train::WireTotals wire = trainer.wire_totals();
      SummaryInputs in{"RING", env.world_size, env.world_size,
                       static_cast<int64_t>(batch) * env.world_size, plan.target_accuracy,
                       wall_s, transport_name, wire.bytes_sent};
      out->WriteSummary(Summary(in, outcome, job,
                                {{"pipeline_width", width},
                                 {"chunk_bytes", comm->options().chunk_bytes},
                                 {"streams", comm->options().streams},
                                 {"auto", settings.report},
                                 {"staleness_compensation",
                                  config::StalenessCompensation_Name(
                                      train_cfg.staleness_compensation())},
                                 {"compressed_steps", wire.compressed_steps},
                                 {"saturated_elements", wire.saturated}}));
    }
  }
}

}  // namespace

}  // namespace pipesgd::job
