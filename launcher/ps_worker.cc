// `pipesgd worker` for train.mode PS_SYNC and PS_ASYNC: the parameter-server baselines
// (core/train/ps_trainer.h). Rank 0 is the server; ranks 1..W train on shards 0..W-1.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "core/base/timeline.h"
#include "core/data/dataset.h"
#include "core/train/classifier_task.h"
#include "core/train/ps_trainer.h"
#include "launcher/model_builder.h"
#include "launcher/config.h"
#include "launcher/worker.h"
#include "launcher/worker_detail.h"
#include "layers/model.h"

namespace pipesgd::launcher {
namespace {

using detail::Clock;
using detail::Seconds;

void WriteText(const std::filesystem::path& path, const std::string& text, bool append) {
  std::ofstream out(path, append ? std::ios::app : std::ios::trunc);
  out << text;
  out.flush();
  if (!out) Throw(ErrorCode::kIo, "cannot write {}", path.string());
}

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
    PSGD_LOG_INFO("effective config ({}): {}", args.config_path, FormatConfig(job, true));
    if (comm_cfg.compression() != config::Comm::none) {
      PSGD_LOG_WARN("comm.compression = {} is ignored by train.mode = {} (float32 on the wire)",
                    config::Comm::Compression_Name(comm_cfg.compression()), mode_name);
    }
  }
  std::filesystem::path out_dir;
  if (lead && !args.out_dir.empty()) {
    out_dir = args.out_dir;
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    if (ec) Throw(ErrorCode::kIo, "--out {}: cannot create the directory: {}", args.out_dir, ec.message());
    WriteText(out_dir / "metrics.jsonl", "", false);
  }

  const detail::JobData sets = detail::LoadJobData(job);
  const data::Dataset& train_set = sets.train;
  const data::Dataset& test_set = sets.test;
  const size_t batch = static_cast<size_t>(train_cfg.batch_size());
  auto model = std::make_unique<layers::Model>(BuildLayers(job.model()), std::max<size_t>(batch, 500));
  std::vector<float> params(model->num_params());
  model->Init(params, train_cfg.seed());
  const int shard = server ? 0 : env.rank - 1;
  train::ClassifierTask task(*model, train_set, batch, shard, workers, train_cfg.seed(),
                             {data_cfg.input_mean(), data_cfg.input_std()});
  const size_t steps_per_epoch = task.steps_per_epoch();
  if (steps_per_epoch == 0) {
    Throw(ErrorCode::kInvalidArgument,
          "train.batch_size = {} x {} workers = {} samples per step, but the training set ({}) "
          "has only {} samples",
          batch, workers, batch * workers, data_cfg.train_images(), train_set.count);
  }
  const int64_t max_steps = train_cfg.max_steps() > 0
                                ? train_cfg.max_steps()
                                : static_cast<int64_t>(train_cfg.epochs()) * steps_per_epoch;
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

  if (server) {
    PSGD_LOG_INFO("parameter server: {} workers connected over {}", workers,
                  links.transport->Describe());
    train::SgdOptimizer sgd({train_cfg.learning_rate(), train_cfg.momentum(),
                             train_cfg.weight_decay()},
                            params.size());
    std::vector<transport::Connection*> conns;
    for (auto& c : links.connections) conns.push_back(c.get());
    train::PsServer ps(*links.transport, conns, sgd, params, options);
    ps.Run();
    PSGD_LOG_INFO("parameter server: {} updates applied, largest staleness {} updates, {:.1f} s",
                  ps.updates(), ps.max_staleness(), Seconds(start));
    return;
  }

  std::unique_ptr<timeline::Recorder> recorder;
  if (!args.timeline.empty()) {
    recorder = std::make_unique<timeline::Recorder>(env.rank, args.timeline_first_step,
                                                    args.timeline_steps);
    task.set_timeline(recorder.get());
  }
  train::PsWorker worker(*links.transport, *links.connections[0], task, params, env.rank, options);
  worker.set_timeline(recorder.get());
  const auto train_start = Clock::now();
  float final_accuracy = 0;
  const int epochs = train_cfg.epochs();
  for (int epoch = 0; epoch < epochs && worker.steps() < max_steps; ++epoch) {
    const auto epoch_start = Clock::now();
    const int64_t first = worker.steps();
    const int64_t last = std::min<int64_t>(first + steps_per_epoch, max_steps);
    for (int64_t t = first; t < last; ++t) worker.Step();
    const double train_s = Seconds(epoch_start);
    double loss_sum = 0;
    for (int64_t t = first; t < last; ++t) loss_sum += worker.StepLoss(t);
    const layers::EvalResult local = task.EvaluateShard(params, test_set, shard, workers);
    std::vector<float> sums = {static_cast<float>(loss_sum), static_cast<float>(local.loss_sum),
                               static_cast<float>(local.correct), static_cast<float>(local.count)};
    worker.SumOverWorkers(sums);
    const double train_loss = sums[0] / (workers * static_cast<double>(last - first));
    const double accuracy = sums[3] > 0 ? sums[2] / sums[3] : 0.0;
    const double test_loss = sums[3] > 0 ? sums[1] / sums[3] : 0.0;
    final_accuracy = static_cast<float>(accuracy);
    const double samples_per_s = (last - first) * batch * workers / train_s;
    const double wall_s = Seconds(train_start);
    if (lead) {
      PSGD_LOG_INFO("epoch {}/{}: train_loss {:.4f}  test_loss {:.4f}  test_accuracy {:.4f}  "
                    "{:.0f} samples/s  wall {:.1f} s",
                    epoch + 1, epochs, train_loss, test_loss, accuracy, samples_per_s, wall_s);
      if (!out_dir.empty()) {
        nlohmann::json line = {{"epoch", epoch + 1},          {"steps", last},
                               {"train_loss", train_loss},    {"test_loss", test_loss},
                               {"test_accuracy", accuracy},   {"samples_per_s", samples_per_s},
                               {"wall_s", wall_s},            {"wire_bytes_per_step", 8.0 * params.size() + 2 * 4 + 64},
                               {"compression_ratio", 1.0}};
        WriteText(out_dir / "metrics.jsonl", line.dump() + "\n", true);
      }
    }
  }
  worker.Bye();
  if (recorder) {
    const std::string file = timeline::RankFile(args.timeline, env.rank, env.world_size);
    recorder->WriteFile(file);
    PSGD_LOG_INFO("rank {}: timeline: {} spans written to {}", env.rank, recorder->size(), file);
  }
  if (lead) {
    PSGD_LOG_INFO("final test accuracy: {:.4f} ({} steps, {:.1f} s)", final_accuracy,
                  worker.steps(), Seconds(start));
    if (!out_dir.empty()) {
      nlohmann::json summary = {{"final_test_accuracy", final_accuracy},
                                {"wall_s", Seconds(start)},
                                {"train_wall_s", Seconds(train_start)},
                                {"steps", worker.steps()},
                                {"world_size", env.world_size},
                                {"workers", workers},
                                {"mode", mode_name},
                                {"transport", links.transport->name()}};
      WriteText(out_dir / "summary.json", summary.dump(2) + "\n", false);
    }
  }
}

}  // namespace pipesgd::launcher
