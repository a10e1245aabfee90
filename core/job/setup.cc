// The set-up and tear-down that every training mode shares (core/job/worker_detail.h): data,
// model, the output directory, the group scheduler, the timeline file.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/collective/powersgd.h"
#include "core/job/auto_values.h"
#include "core/job/model_builder.h"
#include "core/job/worker.h"
#include "core/job/worker_detail.h"

namespace pipesgd::job::detail {

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}


// Refuses a model whose buffers (parameters, momentum, one gradient per pipeline slot, and the
// activations, their gradients and the layers' workspaces at `max_batch`) cannot fit in this
// machine's memory, before allocating any of it.
void CheckModelFitsInMemory(const std::vector<std::unique_ptr<layers::Layer>>& stack,
                            size_t max_batch, int width) {
  double params = 0;
  double scratch = 0;
  for (const auto& layer : stack) {
    params += static_cast<double>(layer->num_params());
    scratch += 2.0 * static_cast<double>(max_batch) * static_cast<double>(layer->out_features()) *
                   sizeof(float) +
               static_cast<double>(layer->workspace_bytes(max_batch));
  }
  const double bytes = params * sizeof(float) * (width + 2) + scratch;
  const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  if (bytes > memory) {
    Throw(ErrorCode::kInvalidArgument,
          "the model has {:.0f} parameters: its parameters, momentum and {} gradient buffers, "
          "and activations for batches of {}, need {:.1f} GiB, more than this machine's {:.1f} "
          "GiB of memory",
          params, width, max_batch, bytes / (1 << 30), memory / (1 << 30));
  }
}

int NumClasses(const config::Model& spec) {
  for (int i = spec.layers_size() - 1; i >= 0; --i) {
    if (spec.layers(i).has_linear()) return spec.layers(i).linear().out_features();
  }
  return 0;  // the config loader rejects models without a linear layer
}

JobData LoadJobData(const config::Job& job) {
  const int num_classes = NumClasses(job.model());
  const auto& cfg = job.data();
  JobData sets{
      data::LoadDataset(cfg.train_images(), cfg.train_labels(), num_classes, cfg.train_limit()),
      data::LoadDataset(cfg.test_images(), cfg.test_labels(), num_classes, cfg.test_limit())};
  data::CheckSameShape(sets.train, cfg.train_images(), sets.test, cfg.test_images());
  const layers::Shape input = InputShape(job.model());
  if (sets.train.rows != input.height || sets.train.cols != input.width || input.channels != 1) {
    Throw(ErrorCode::kInvalidArgument,
          "model.input_channels x input_height x input_width = {}: expected 1x{}x{}, the "
          "images of {} (IDX images have one channel)",
          layers::ToString(input), sets.train.rows, sets.train.cols, cfg.train_images());
  }
  return sets;
}

ConnectedTransport TransportForEveryone(const JobEnv& env, const config::Job& job,
                                        Deadline start_deadline) {
  const auto& comm_cfg = job.comm();
  std::vector<int> peers;
  for (int r = 0; r < env.world_size; ++r) {
    if (r != env.rank) peers.push_back(r);
  }
  return ConnectTransport(env, JobDescription(job), std::max(1, comm_cfg.streams()), comm_cfg, peers,
                          start_deadline, fmt::format("comm.start_timeout_s = {} s", comm_cfg.start_timeout_s()));
}

train::StalenessCompensation CompensationFromConfig(config::StalenessCompensation c) {
  switch (c) {
    case config::NONE:
      return train::StalenessCompensation::kNone;
    case config::MOMENTUM:
      return train::StalenessCompensation::kMomentum;
    case config::LOCAL_GRADIENT:
      return train::StalenessCompensation::kLocalGradient;
  }
  Throw(ErrorCode::kInvalidArgument, "train.staleness_compensation = {}: unknown",
        static_cast<int>(c));
}

std::unique_ptr<collective::Communicator> ConnectJobRing(const config::Job& job, const JobEnv& env,
                                                         bool lead) {
  const auto& comm_cfg = job.comm();
  auto comm = ConnectRing(env, JobDescription(job), RingConnectOptions(job), comm_cfg,
                          Deadline::After(comm_cfg.start_timeout_s()),
                          fmt::format("comm.start_timeout_s = {} s", comm_cfg.start_timeout_s()));
  if (lead) {
    PSGD_LOG_INFO("ring connected: {} ranks over {}", env.world_size, comm->transport().Describe());
  }
  return comm;
}

TestSetResult SumTestShards(train::Trainer& trainer, const layers::EvalResult& local) {
  std::vector<float> sums = {static_cast<float>(local.loss_sum), static_cast<float>(local.correct),
                             static_cast<float>(local.count)};
  trainer.AllReduce(sums, collective::ReduceOp::kSum);
  if (sums[2] <= 0) return {};
  return {sums[1] / sums[2], sums[0] / sums[2]};
}

double CompressionRatio(const train::WireTotals& before, const train::WireTotals& now) {
  const uint64_t payload = now.payload_bytes - before.payload_bytes;
  return payload == 0 ? 1.0
                      : static_cast<double>(now.raw_payload_bytes - before.raw_payload_bytes) /
                            static_cast<double>(payload);
}

void DrainQuietly(train::Trainer* trainer) {
  if (!trainer) return;
  try {
    trainer->Drain(false);
  } catch (...) {
  }
}

std::unique_ptr<collective::PowerSgd> MakePowerSgd(const config::Job& job,
                                                   const layers::Model& model,
                                                   collective::Communicator& comm, bool lead) {
  std::vector<collective::PowerSgd::Matrix> matrices;
  for (const auto& m : model.WeightMatrices()) matrices.push_back({m.offset, m.rows, m.cols});
  collective::PowerSgdOptions po;
  po.rank = job.comm().powersgd_rank();
  po.seed = static_cast<uint64_t>(job.train().seed());
  auto powersgd =
      std::make_unique<collective::PowerSgd>(comm, model.num_params() + 1, matrices, po);
  if (lead) {
    PSGD_LOG_INFO("PowerSGD rank {}: {} of {} weight matrices travel as low-rank factors",
                  po.rank, powersgd->compressed().size(), matrices.size());
  }
  return powersgd;
}

train::StragglerOptions StragglerFromConfig(const config::Job& job, int world_size) {
  train::StragglerOptions o;
  const config::Straggler& st = job.straggler();
  for (int r : st.ranks()) {
    if (r < 0 || r >= world_size) {
      Throw(ErrorCode::kInvalidArgument,
            "straggler.ranks has rank {}: expected ranks in [0, world size {})", r, world_size);
    }
    o.ranks.push_back(r);
  }
  o.sleep_s = st.sleep_s();
  o.probability = st.probability();
  o.seed = st.seed();
  return o;
}

std::unique_ptr<OutputDir> ClaimOutputDir(bool lead, const WorkerArgs& args) {
  if (!lead || args.out_dir.empty()) return nullptr;
  return std::make_unique<OutputDir>(args.out_dir, args.overwrite || args.resume);
}

JobModel BuildJobModel(const config::Job& job, int gradient_buffers) {
  auto stack = BuildLayers(job.model());
  // Evaluation runs in batches of up to 500 (fewer calls), but not beyond ~64 MiB of
  // activations per rank: a CNN's feature maps are far larger than an MLP's.
  size_t floats_per_sample = 0;
  for (const auto& layer : stack) floats_per_sample += 2 * layer->out_features();
  JobModel m;
  m.eval_batch = std::clamp<size_t>((size_t{64} << 20) / sizeof(float) /
                                        std::max<size_t>(floats_per_sample, 1),
                                    1, 500);
  m.max_batch = std::max(static_cast<size_t>(job.train().batch_size()), m.eval_batch);
  CheckModelFitsInMemory(stack, m.max_batch, gradient_buffers);
  m.model = std::make_unique<layers::Model>(std::move(stack), m.max_batch);
  m.params.resize(m.model->num_params());
  m.model->Init(m.params, job.train().seed());
  return m;
}

void CheckStepsPerEpoch(int64_t steps_per_epoch, const config::Job& job, int64_t replicas,
                        const char* replica_kind, uint64_t train_samples) {
  if (steps_per_epoch > 0) return;
  const int64_t batch = job.train().batch_size();
  Throw(ErrorCode::kInvalidArgument,
        "train.batch_size = {} x {} {} = {} samples per step, but the training set ({}) has "
        "only {} samples",
        batch, replicas, replica_kind, batch * replicas, job.data().train_images(),
        train_samples);
}

train::GroupSchedulerOptions SchedulerOptionsFromConfig(const config::Sdpipe& sd,
                                                        int world_size) {
  train::GroupSchedulerOptions o;
  o.world_size = world_size;
  o.period = sd.period();
  o.window_init_s = sd.window_init_s();
  o.window_min_s = sd.window_min_s();
  o.window_max_s = sd.window_max_s();
  o.window_grow = sd.window_grow();
  o.window_shrink = sd.window_shrink();
  o.min_group = sd.min_group();
  return o;
}

SchedulerEndpoint StartScheduler(collective::GroupCommunicator& comm, const JobEnv& env,
                                 const train::GroupSchedulerOptions& options, int states,
                                 Deadline deadline) {
  SchedulerEndpoint s;
  std::vector<float> port = {0.0f};
  if (env.rank == 0) {
    s.service = std::make_unique<train::GroupSchedulerService>(options, states, "0.0.0.0",
                                                               env.job_token);
    port[0] = static_cast<float>(s.service->port());
  }
  std::vector<int> everyone(env.world_size);
  std::iota(everyone.begin(), everyone.end(), 0);
  collective::AllReduceOptions exact;
  exact.compress = false;
  comm.AllReduce(port, collective::ReduceOp::kSum, everyone, deadline, nullptr, exact);
  s.host = env.world_size == 1 ? "127.0.0.1" : env.master_addr;
  s.port = static_cast<uint16_t>(port[0]);
  return s;
}

int64_t TimelineFirstStep(const WorkerArgs& args, const train::RunPlan& plan,
                          int64_t start_step) {
  if (args.timeline_first_step != kTimelineFirstStepAuto) return args.timeline_first_step;
  // The run's first steady step: past the synchronous warm-up (train.sync_warmup_steps, which
  // plan.warmup_steps covers), where a Pipe-SGD trace shows its overlap; the auto values' trial
  // steps run before step 0 on scratch copies and take none of the run's steps. A shorter run
  // records its last steps rather than nothing.
  const int64_t steady = start_step + plan.warmup_steps;
  const int64_t last_window = std::max(start_step, plan.total_steps() - args.timeline_steps);
  return std::min(steady, last_window);
}

std::string CheckpointIdentity(const config::Job& job) {
  config::Job identity = job;
  identity.mutable_checkpoint()->clear_dir();
  return JobDescription(identity);
}

std::optional<checkpoint::Checkpoint> ResumeRingJob(const config::Job& job,
                                                    const std::string& identity,
                                                    collective::Communicator& comm,
                                                    const JobEnv& env, bool resume,
                                                    std::span<float> params) {
  if (!resume) return std::nullopt;
  const std::string& dir = job.checkpoint().dir();
  if (dir.empty()) {
    Throw(ErrorCode::kInvalidArgument,
          "--resume: checkpoint.dir is not set in the config (nothing to resume from)");
  }
  checkpoint::Checkpoint c = train::AgreeOnCheckpoint(comm, dir, job.comm().timeout_s());
  train::CheckCheckpointFitsJob(c, dir, identity, env.world_size, params.size());
  std::copy(c.params().begin(), c.params().end(), params.begin());
  comm.RestoreResidual({c.residual().data(), static_cast<size_t>(c.residual_size())});
  comm.RestoreSequence(c.collective_sequence());
  return c;
}

void WriteRingCheckpoint(train::Trainer& trainer, const config::Checkpoint& cfg,
                         const checkpoint::Checkpoint& c, const JobEnv& env, bool lead) {
  // A rank deletes its older checkpoints only once every rank has written this step (a full
  // disk on one rank must leave a step all can resume from): one AllReduce of a one-hot
  // failure flag, on the trainer's communication thread after the steps (the caller's
  // Snapshot drained them). It costs a few bytes per round, beside a write of the whole model;
  // learning the same from the next round's gradients instead would keep two rounds of files
  // and could not confirm the last round before the job ends.
  const std::filesystem::path dir = cfg.dir();
  train::WriteCheckpointRound(dir, c, cfg.keep(), [&](float failed) {
    std::vector<float> all(static_cast<size_t>(env.world_size), 0.0f);
    all[static_cast<size_t>(env.rank)] = failed;
    trainer.AllReduce(all, collective::ReduceOp::kSum);
    return all;
  });
  if (lead) {
    PSGD_LOG_INFO("checkpoint: step {} written to {}", c.steps(),
                  train::CheckpointPath(dir, c.steps(), env.rank).string());
  }
}

std::unique_ptr<timeline::Recorder> TimelineRecorder(const WorkerArgs& args, const JobEnv& env,
                                                     const train::RunPlan& plan,
                                                     int64_t start_step) {
  if (args.timeline.empty()) return nullptr;
  const int64_t first = TimelineFirstStep(args, plan, start_step);
  PSGD_LOG_INFO("rank {}: --timeline records steps [{}, {}){}", env.rank, first,
                first + args.timeline_steps,
                args.timeline_first_step == kTimelineFirstStepAuto
                    ? " (--timeline-first-step auto: the first steady step)"
                    : "");
  return std::make_unique<timeline::Recorder>(env.rank, first, args.timeline_steps);
}

void WriteTimeline(const timeline::Recorder* recorder, const WorkerArgs& args,
                   const JobEnv& env) {
  if (recorder == nullptr) return;
  const std::string file = timeline::RankFile(args.timeline, env.rank, env.world_size);
  recorder->WriteFile(file);
  PSGD_LOG_INFO("rank {}: timeline: {} spans written to {}{}", env.rank, recorder->size(), file,
                recorder->dropped()
                    ? fmt::format(" ({} dropped: buffer full)", recorder->dropped())
                    : "");
}

}  // namespace pipesgd::job::detail
