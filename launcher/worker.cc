#include "launcher/worker.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
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
#include "launcher/config.h"
#include "launcher/model_builder.h"
#include "launcher/pipeline_worker.h"
#include "launcher/process.h"
#include "launcher/fault.h"
#include "launcher/ring_mode.h"
#include "launcher/sdpipe_worker.h"
#include "launcher/worker_detail.h"
#include "layers/model.h"
#include "transport/factory.h"
#include "transport/launch_env.h"
#include "transport/ifname.h"
#include "transport/message_io.h"
#include "transport/rendezvous.h"

namespace pipesgd::launcher {
namespace detail {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

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

collective::CommunicatorOptions CommunicatorOptionsFromConfig(const config::Job& job) {
  static_assert(static_cast<int>(CodecKind::kTrunc16) == config::Comm::trunc16 &&
                static_cast<int>(CodecKind::kFp16) == config::Comm::fp16 &&
                static_cast<int>(CodecKind::kQ8) == config::Comm::q8 &&
                static_cast<int>(CodecKind::kQ4) == config::Comm::q4 &&
                static_cast<int>(CodecKind::kSign1) == config::Comm::sign1 &&
                static_cast<int>(CodecKind::kNone) == config::Comm::none);
  const auto& comm_cfg = job.comm();
  collective::CommunicatorOptions o;
  o.chunk_bytes = static_cast<uint64_t>(comm_cfg.chunk_bytes());
  o.streams = comm_cfg.streams();
  o.codec.kind = static_cast<CodecKind>(comm_cfg.compression());
  o.codec.round_to_nearest_even = comm_cfg.round_to_nearest_even();
  o.codec.stochastic_rounding = comm_cfg.stochastic_rounding();
  o.codec.seed = job.train().seed();
  o.compression_min_bytes = static_cast<uint64_t>(comm_cfg.min_bytes());
  o.error_feedback = comm_cfg.error_feedback();
  return o;
}

ConnectedTransport TransportForEveryone(const JobEnv& env, const config::Job& job,
                                        Deadline start_deadline) {
  const auto& comm_cfg = job.comm();
  std::vector<int> peers;
  for (int r = 0; r < env.world_size; ++r) {
    if (r != env.rank) peers.push_back(r);
  }
  return ConnectTransport(env, JobDescription(job), comm_cfg.streams(), comm_cfg, peers,
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

}  // namespace detail

using namespace detail;

std::string JobDescription(const config::Job& job) {
  config::Job copy = job;
  // FormatConfig puts back the schema defaults, the same on every rank.
  copy.mutable_data()->clear_train_images();
  copy.mutable_data()->clear_train_labels();
  copy.mutable_data()->clear_test_images();
  copy.mutable_data()->clear_test_labels();
  // Machine-local: interface and RDMA device names may differ from host to host.
  copy.mutable_comm()->clear_network_interface();
  copy.mutable_comm()->clear_ib_device();
  copy.mutable_comm()->clear_ib_port();
  copy.mutable_comm()->clear_gid_index();
  return "pipesgd " PIPESGD_VERSION "\n" + FormatConfig(copy);
}

transport::TransportKind ResolveTransport(const config::Comm& comm, int rank) {
  switch (comm.transport()) {
    case config::TCP:
      return transport::TransportKind::kTcp;
    case config::UCX:
      return transport::TransportKind::kUcx;
    case config::IBVERBS:
      return transport::TransportKind::kIbverbs;
    case config::AUTO: {
      const transport::AutoChoice choice = transport::ChooseAutoTransport();
      PSGD_LOG_INFO("rank {}: comm.transport = AUTO chose {}: {}", rank,
                    transport::TransportKindName(choice.kind), choice.reason);
      return choice.kind;
    }
  }
  Throw(ErrorCode::kInvalidArgument, "comm.transport = {}: unknown", static_cast<int>(comm.transport()));
}

namespace {

// A deadline error with the setting that bounds it appended (same code and culprit).
Error WithTimeoutSetting(const Error& e, const std::string& timeout_setting) {
  Error out(e.code(), fmt::format("{} ({})", e.what(), timeout_setting));
  return out.set_culprit(e.culprit());
}

}  // namespace

ConnectedTransport ConnectTransport(const JobEnv& env, const std::string& job, int streams,
                                    const config::Comm& comm, const std::vector<int>& peers,
                                    Deadline deadline, const std::string& timeout_setting) {
  transport::TransportOptions topt;
  topt.kind = ResolveTransport(comm, env.rank);
  topt.rank = env.rank;
  topt.world_size = env.world_size;
  const std::string_view kind_name = transport::TransportKindName(topt.kind);

  // The interface filter: the config field, else the environment variable.
  std::optional<transport::IfnameFilter> filter;
  std::string source;
  if (!comm.network_interface().empty()) {
    source = "comm.network_interface";
    filter = transport::ParseIfnameFilter(comm.network_interface(), source);
  } else if (const char* v = std::getenv("PIPESGD_SOCKET_IFNAME"); v && *v) {
    source = "PIPESGD_SOCKET_IFNAME";
    filter = transport::ParseIfnameFilter(v, source);
  }
  std::string iface_name = env.world_size == 1 ? "lo" : "";
  std::string iface_address = env.world_size == 1 ? "127.0.0.1" : "";
  const bool tcp = topt.kind == transport::TransportKind::kTcp;
  const bool ucx_devices = topt.kind == transport::TransportKind::kUcx && filter &&
                           !std::getenv("UCX_NET_DEVICES");
  if (env.world_size > 1 && (tcp || ucx_devices)) {
    const transport::InterfaceChoice choice =
        transport::ChooseLocalInterface(filter, source, env.master_addr, env.master_port);
    iface_name = choice.iface.name;
    iface_address = choice.iface.ip;
    // Why this interface: -v (the "rank R on HOST" line below names it on every console).
    if (tcp) {
      topt.bind_host = choice.iface.ip;
      PSGD_LOG_DEBUG("rank {}: tcp on {} {} ({})", env.rank, choice.iface.name, choice.iface.ip,
                     choice.reason);
    } else {
      topt.ucx_net_devices = choice.iface.name;
      PSGD_LOG_DEBUG("rank {}: ucx NET_DEVICES={} ({}; set UCX_NET_DEVICES to override)",
                     env.rank, choice.iface.name, choice.reason);
    }
  }
  // One line per rank naming host, transport and interface (the ssh launcher's tests read it).
  PSGD_LOG_INFO("rank {} on {}: transport {}{}{}", env.rank, env.host, kind_name,
                iface_name.empty()
                    ? ""
                    : fmt::format(", interface {}, address {}", iface_name, iface_address),
                source.empty() ? "" : fmt::format(" ({} = {})", source, filter->ToString()));
  topt.peers = peers;
  topt.streams = streams;
  topt.ib_device = comm.ib_device();
  topt.ib_port = comm.ib_port();
  topt.gid_index = comm.gid_index();
  topt.ib_ack_timeout = comm.ib_timeout();
  topt.ib_retry_count = comm.ib_retry_count();
  auto transport = transport::CreateTransport(topt);
  // The resolved transport is part of the job: ranks whose `auto` resolved differently (one host
  // with RDMA, one without) are rejected at rendezvous by name.
  transport::RendezvousOptions rdv{env.master_addr, env.master_port, env.rank, env.world_size,
                                   fmt::format("{}resolved transport: {}\n", job, kind_name),
                                   env.job_token};
  rdv.data_host = iface_address;
  rdv.relay = env.relay.get();
  MaybeInjectFault(env.rank, "rendezvous");
  try {
    auto addresses = transport::RendezvousAllGather(rdv, transport->LocalAddress(), deadline);
    return {std::move(transport), std::move(addresses), topt.bind_host};
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kDeadlineExceeded) throw;
    throw WithTimeoutSetting(e, timeout_setting);
  }
}

std::unique_ptr<collective::Communicator> ConnectRing(const JobEnv& env, const std::string& job,
                                                      const collective::CommunicatorOptions& options,
                                                      const config::Comm& comm, Deadline deadline,
                                                      const std::string& timeout_setting) {
  ConnectedTransport t =
      ConnectTransport(env, job, options.streams, comm,
                       collective::Communicator::RingPeers(env.rank, env.world_size), deadline,
                       timeout_setting);
  MaybeInjectFault(env.rank, "ring_setup");
  try {
    return collective::Communicator::Create(std::move(t.transport), env.world_size, t.addresses,
                                            options, deadline);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kDeadlineExceeded) throw;
    throw WithTimeoutSetting(e, timeout_setting);
  }
}

PeerLinks ConnectPeers(const JobEnv& env, const std::string& job, const std::vector<int>& peers,
                       const config::Comm& comm, Deadline deadline,
                       const std::string& timeout_setting) {
  PeerLinks links;
  auto [transport, addresses, bind_host] = ConnectTransport(env, job, 1, comm, peers, deadline, timeout_setting);
  std::vector<std::pair<int, std::string>> targets;
  for (int p : peers) targets.emplace_back(p, addresses.at(p));
  try {
    links.connections = transport->Connect(targets, deadline, 1);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kDeadlineExceeded) throw;
    throw WithTimeoutSetting(e, timeout_setting);
  }
  links.transport = std::move(transport);
  return links;
}

JobEnv ReadJobEnv() {
  JobEnv env;
  if (const char* token = std::getenv("PIPESGD_JOB_TOKEN"); token) env.job_token = token;
  env.host = RankHost();
  const transport::LaunchEnv launch = transport::ReadLaunchEnv();
  if (launch.launcher == transport::Launcher::kNone) return env;  // a single process
  env.launcher = launch.launcher;
  env.rank = launch.rank;
  env.world_size = launch.world_size;
  env.local_rank = launch.local_rank;
  env.master_addr = launch.master_addr;
  env.master_port = launch.master_port;
  if (launch.launcher != transport::Launcher::kEnv && env.rank == 0) {
    PSGD_LOG_INFO("rank {} of {} from {}'s environment; rendezvous {}:{} ({})",
                  env.rank, env.world_size, transport::ToString(launch.launcher),
                  env.master_addr, env.master_port, launch.master_from);
  }
  if (env.world_size > 1) {
    env.relay = std::make_shared<transport::FailureRelay>(transport::RendezvousOptions{
        env.master_addr, env.master_port, env.rank, env.world_size, "", env.job_token});
  }
  return env;
}

namespace {

// An AllReduce that no codec may round: counts, steps, flags.
collective::AllReduceOptions Exact() {
  collective::AllReduceOptions exact;
  exact.compress = false;
  return exact;
}

// Every rank's value of `mine` (exact below 2^24), through one AllReduce.
std::vector<int64_t> GatherSmallInts(collective::Communicator& comm, int64_t mine,
                                     double timeout_s) {
  PSGD_CHECK(mine >= 0 && mine < (int64_t{1} << 24));
  std::vector<float> all(comm.world_size(), 0.0f);
  all[comm.rank()] = static_cast<float>(mine);
  comm.AllReduce(all, collective::ReduceOp::kSum, Deadline::After(timeout_s), nullptr, Exact());
  return std::vector<int64_t>(all.begin(), all.end());
}

// The checkpoint every rank resumes from: the newest step that each rank has a verified file
// for. Every rank takes the same decision from the same gathered numbers, so all fail or none.
checkpoint::Checkpoint AgreeOnCheckpoint(collective::Communicator& comm,
                                         const std::filesystem::path& dir, double timeout_s) {
  const int rank = comm.rank();
  std::optional<checkpoint::Checkpoint> mine = train::LoadLatestCheckpoint(dir, rank);
  if (mine && mine->steps() >= (int64_t{1} << 24) - 1) {
    Throw(ErrorCode::kInvalidArgument, "--resume: checkpoint step {} is beyond 2^24 - 2",
          mine->steps());
  }
  // 0: none; s + 1: newest verified step s.
  const std::vector<int64_t> newest = GatherSmallInts(comm, mine ? mine->steps() + 1 : 0, timeout_s);
  std::vector<int> without;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (newest[r] == 0) without.push_back(r);
  }
  if (!without.empty()) {
    Throw(ErrorCode::kNotFound, "--resume: rank(s) {} have no valid checkpoint in {}",
          fmt::join(without, ", "), dir.string());
  }
  const int64_t step = *std::min_element(newest.begin(), newest.end()) - 1;
  if (mine->steps() != step) mine = train::LoadLatestCheckpoint(dir, rank, step);
  const std::vector<int64_t> have = GatherSmallInts(comm, mine ? 1 : 0, timeout_s);
  without.clear();
  for (int r = 0; r < comm.world_size(); ++r) {
    if (have[r] == 0) without.push_back(r);
  }
  if (!without.empty()) {
    Throw(ErrorCode::kNotFound,
          "--resume: the newest step every rank has is {}, but rank(s) {} have no valid "
          "checkpoint of step {} in {}",
          step, fmt::join(without, ", "), step, dir.string());
  }
  return *std::move(mine);
}

}  // namespace

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
  const int width = train_cfg.pipeline_width();
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
    PSGD_LOG_INFO("pipesgd worker: world size {}, pipeline width {} ({}), comm.transport {}",
                  env.world_size, width, width == 1 ? "synchronous SGD" : "Pipe-SGD",
                  config::Transport_Name(comm_cfg.transport()));
    LogEffectiveConfig(args.config_path, job);
  }

  // Data and model. Every rank loads the same files and initialises the same parameters from
  // the seed, so no broadcast is needed.
  // Rank 0 claims the output directory before anything slow, so a bad --out fails at once.
  std::unique_ptr<OutputDir> out;
  if (lead && !args.out_dir.empty()) out = std::make_unique<OutputDir>(args.out_dir, args.overwrite || args.resume);

  const auto& data_cfg = job.data();
  const JobData sets = LoadJobData(job);
  const data::Dataset& train_set = sets.train;
  const data::Dataset& test_set = sets.test;
  const size_t batch = static_cast<size_t>(train_cfg.batch_size());
  // Evaluation runs in batches of up to 500 (fewer calls), but not beyond ~64 MiB of
  // activations per rank: a CNN's feature maps are far larger than an MLP's.
  auto stack = BuildLayers(job.model());
  size_t floats_per_sample = 0;
  for (const auto& layer : stack) floats_per_sample += 2 * layer->out_features();
  const size_t eval_batch = std::clamp<size_t>((size_t{64} << 20) / sizeof(float) /
                                                   std::max<size_t>(floats_per_sample, 1),
                                               1, 500);
  const size_t max_batch = std::max(batch, eval_batch);
  CheckModelFitsInMemory(stack, max_batch, width);
  auto model = std::make_unique<layers::Model>(std::move(stack), max_batch);
  std::vector<float> params(model->num_params());
  model->Init(params, train_cfg.seed());
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
  if (steps_per_epoch == 0) {
    Throw(ErrorCode::kInvalidArgument,
          "train.batch_size = {} x world size {} = {} samples per step, but the training set "
          "({}) has only {} samples",
          batch, env.world_size, batch * env.world_size, data_cfg.train_images(),
          train_set.count);
  }
  if (lead) {
    PSGD_LOG_INFO("model: {}", model->Describe());
    PSGD_LOG_INFO("data: {} training samples ({} steps per epoch of global batch {}), {} test "
                  "samples",
                  train_set.count, steps_per_epoch, batch * env.world_size, test_set.count);
  }

  // Network: publish our endpoint, meet the others, connect the ring.
  const collective::CommunicatorOptions comm_options = CommunicatorOptionsFromConfig(job);
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
  const std::string job_text = JobDescription(job);
  const auto& ckpt_cfg = job.checkpoint();
  const std::filesystem::path ckpt_dir = ckpt_cfg.dir();
  std::optional<checkpoint::Checkpoint> resumed;
  if (args.resume) {
    if (ckpt_cfg.dir().empty()) {
      Throw(ErrorCode::kInvalidArgument,
            "--resume: checkpoint.dir is not set in the config (nothing to resume from)");
    }
    resumed = AgreeOnCheckpoint(*comm, ckpt_dir, comm_cfg.timeout_s());
    if (resumed->job() != job_text) {
      Throw(ErrorCode::kInvalidArgument,
            "--resume: the checkpoint of step {} in {} was written by another job: {}",
            resumed->steps(), ckpt_cfg.dir(),
            transport::DescribeJobDifference(resumed->job(), "the checkpoint", job_text,
                                             "this job"));
    }
    if (resumed->world_size() != env.world_size ||
        resumed->params_size() != static_cast<int>(params.size())) {
      Throw(ErrorCode::kDataLoss,
            "--resume: checkpoint of step {} has world size {} and {} parameters, the job has "
            "{} and {}",
            resumed->steps(), resumed->world_size(), resumed->params_size(), env.world_size,
            params.size());
    }
    std::copy(resumed->params().begin(), resumed->params().end(), params.begin());
    sgd.LoadState({resumed->optimizer_state().data(),
                   static_cast<size_t>(resumed->optimizer_state_size())});
    comm->RestoreResidual({resumed->residual().data(), static_cast<size_t>(resumed->residual_size())});
    comm->RestoreSequence(resumed->collective_sequence());
  }
  std::unique_ptr<timeline::Recorder> recorder;  // outlives the trainer, which records on it
  if (!args.timeline.empty()) {
    recorder = std::make_unique<timeline::Recorder>(env.rank, args.timeline_first_step,
                                                    args.timeline_steps);
    comm->set_timeline(recorder.get());
    task.set_timeline(recorder.get());
  }
  train::TrainerOptions trainer_options{width, comm_cfg.timeout_s(), comm_cfg.warmup_steps()};
  trainer_options.compensation = CompensationFromConfig(train_cfg.staleness_compensation());
  trainer_options.sync_warmup_steps = train_cfg.sync_warmup_steps();
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
    train::TrainerSnapshot snapshot;
    snapshot.steps = resumed->steps();
    snapshot.applied = resumed->applied();
    snapshot.losses.assign(resumed->losses().begin(), resumed->losses().end());
    for (const auto& p : resumed->pending()) {
      snapshot.pending.push_back({p.step(),
                                  {p.aggregate().begin(), p.aggregate().end()},
                                  {p.local().begin(), p.local().end()}});
    }
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
    train::TrainerSnapshot snapshot = trainer.Snapshot();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!std::isfinite(params[i])) {
        Throw(ErrorCode::kNumerical,
              "rank {}: step {}: parameter {} is {}; not writing a checkpoint of this state",
              env.rank, snapshot.steps, i, params[i]);
      }
    }
    checkpoint::Checkpoint c;
    c.set_format_version(1);
    c.set_job(job_text);
    c.set_rank(env.rank);
    c.set_world_size(env.world_size);
    c.set_steps(snapshot.steps);
    c.set_applied(snapshot.applied);
    c.set_collective_sequence(comm->sequence());
    c.mutable_params()->Add(params.begin(), params.end());
    const std::vector<float> opt = sgd.SaveState();
    c.mutable_optimizer_state()->Add(opt.begin(), opt.end());
    c.mutable_residual()->Add(comm->residual().begin(), comm->residual().end());
    c.mutable_losses()->Add(snapshot.losses.begin(), snapshot.losses.end());
    for (const auto& p : snapshot.pending) {
      auto* pending = c.add_pending();
      pending->set_step(p.step);
      pending->mutable_aggregate()->Add(p.aggregate.begin(), p.aggregate.end());
      pending->mutable_local()->Add(p.local.begin(), p.local.end());
    }
    train::WriteCheckpoint(ckpt_dir, c, ckpt_cfg.keep());
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
  const train::RunPlan plan =
      PlanFromConfig(job, static_cast<int64_t>(steps_per_epoch),
                     static_cast<int64_t>(batch) * env.world_size);
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

  if (recorder) {
    const std::string file = timeline::RankFile(args.timeline, env.rank, env.world_size);
    recorder->WriteFile(file);
    PSGD_LOG_INFO("rank {}: timeline of steps [{}, {}): {} spans written to {}{}", env.rank,
                  args.timeline_first_step, args.timeline_first_step + args.timeline_steps,
                  recorder->size(), file,
                  recorder->dropped() ? fmt::format(" ({} dropped: buffer full)", recorder->dropped()) : "");
  }
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
                                 {"staleness_compensation",
                                  config::StalenessCompensation_Name(
                                      train_cfg.staleness_compensation())},
                                 {"compressed_steps", wire.compressed_steps},
                                 {"saturated_elements", wire.saturated}}));
    }
  }
}

}  // namespace

}  // namespace pipesgd::launcher
