#include "launcher/sdpipe_worker.h"
#include "launcher/model_builder.h"

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
#include "launcher/config.h"
#include "launcher/worker_detail.h"

namespace pipesgd::launcher {
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
    PSGD_LOG_INFO("effective config ({}): {}", args.config_path, FormatConfig(job, true));
  }
  std::unique_ptr<OutputDir> out;
  if (lead && !args.out_dir.empty()) out = std::make_unique<OutputDir>(args.out_dir);

  const auto& data_cfg = job.data();
  const detail::JobData sets = detail::LoadJobData(job);
  const data::Dataset& train_set = sets.train;
  const data::Dataset& test_set = sets.test;
  const size_t batch = static_cast<size_t>(train_cfg.batch_size());
  const size_t max_batch = std::max<size_t>(batch, 500);
  auto stack = BuildLayers(job.model());
  CheckModelFitsInMemory(stack, max_batch, 2);
  auto model = std::make_unique<layers::Model>(std::move(stack), max_batch);
  std::vector<float> params(model->num_params());
  model->Init(params, train_cfg.seed());
  train::ClassifierTask task(*model, train_set, batch, env.rank, env.world_size,
                             train_cfg.seed(), {data_cfg.input_mean(), data_cfg.input_std()});
  train::StragglerObjective objective(task, StragglerFromConfig(job, env.world_size), env.rank);
  const int64_t steps_per_epoch = static_cast<int64_t>(task.steps_per_epoch());
  if (steps_per_epoch == 0) {
    Throw(ErrorCode::kInvalidArgument,
          "train.batch_size = {} x world size {} = {} samples per step, but the training set "
          "({}) has only {} samples",
          batch, env.world_size, batch * env.world_size, data_cfg.train_images(),
          train_set.count);
  }
  const int64_t n = env.world_size;
  const int64_t total_steps = train_cfg.max_steps() > 0
                                  ? train_cfg.max_steps()
                                  : int64_t{train_cfg.epochs()} * steps_per_epoch;
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

  // The scheduler lives in rank 0; its port reaches the others through one exact AllReduce of
  // everyone (a port fits a float exactly).
  train::GroupSchedulerOptions sopt;
  sopt.world_size = env.world_size;
  sopt.period = sd.period();
  sopt.window_init_s = sd.window_init_s();
  sopt.window_min_s = sd.window_min_s();
  sopt.window_max_s = sd.window_max_s();
  sopt.window_grow = sd.window_grow();
  sopt.window_shrink = sd.window_shrink();
  sopt.min_group = sd.min_group();
  sopt.epoch_updates = steps_per_epoch * n;
  sopt.total_updates = total_steps * n;
  std::unique_ptr<train::GroupSchedulerService> service;
  std::vector<float> port = {0.0f};
  if (lead) {
    service = std::make_unique<train::GroupSchedulerService>(sopt, 1, "0.0.0.0", env.job_token);
    port[0] = static_cast<float>(service->port());
  }
  std::vector<int> everyone(env.world_size);
  std::iota(everyone.begin(), everyone.end(), 0);
  collective::AllReduceOptions exact;
  exact.compress = false;
  comm.AllReduce(port, collective::ReduceOp::kSum, everyone, start_deadline, nullptr, exact);
  const std::string scheduler_host = env.world_size == 1 ? "127.0.0.1" : env.master_addr;
  train::GroupSchedulerClient client(scheduler_host, static_cast<uint16_t>(port[0]), env.rank,
                                     env.world_size, env.job_token, start_deadline);
  if (lead) {
    PSGD_LOG_INFO("group scheduler at {}:{}; {} ranks over {}", scheduler_host,
                  static_cast<int>(port[0]), env.world_size, comm.transport().Describe());
  }
  ClientGroups groups(client, comm_cfg.timeout_s());

  train::SgdOptimizer sgd({train_cfg.learning_rate(), train_cfg.momentum(),
                           train_cfg.weight_decay()},
                          params.size());
  train::SdpipeTrainer trainer(comm, objective, sgd, params, groups,
                               {comm_cfg.timeout_s(), comm_cfg.warmup_steps()});

  const int epochs = static_cast<int>((total_steps + steps_per_epoch - 1) / steps_per_epoch);
  const int progress = train_cfg.progress_per_epoch();
  const auto train_start = Clock::now();
  auto epoch_start = train_start;
  int64_t epoch_first_round = 0;  // this rank's rounds before the epoch
  int64_t updates_before = 0;     // every rank's local steps before the epoch
  float final_accuracy = 0;
  int64_t next_progress = progress > 0 ? steps_per_epoch / (progress + 1) : -1;
  while (true) {
    const train::GroupDecision d = trainer.Step();
    const int64_t round_in_epoch = trainer.steps() - epoch_first_round;
    if (lead && next_progress > 0 && round_in_epoch == next_progress && !d.epoch_end) {
      next_progress += steps_per_epoch / (progress + 1);
      PSGD_LOG_INFO("epoch {}/{}: rank 0 step {}: loss {:.4f} (group of {}), {} local steps in "
                    "all ranks",
                    d.epoch + 1, epochs, round_in_epoch, trainer.losses().back(),
                    d.members.size(), d.updates);
    }
    if (!d.epoch_end) continue;

    // The barrier averaged everyone: every rank holds the same parameters now.
    const double train_s = Seconds(epoch_start);
    layers::EvalResult local = task.EvaluateShard(params, test_set, env.rank, env.world_size);
    std::vector<float> sums = {static_cast<float>(local.loss_sum),
                               static_cast<float>(local.correct),
                               static_cast<float>(local.count)};
    trainer.AllReduceAll(sums, collective::ReduceOp::kSum);
    const double accuracy = sums[2] > 0 ? sums[1] / sums[2] : 0.0;
    const double test_loss = sums[2] > 0 ? sums[0] / sums[2] : 0.0;
    final_accuracy = static_cast<float>(accuracy);
    const auto& losses = trainer.losses();
    double loss_sum = 0;
    for (size_t i = static_cast<size_t>(epoch_first_round); i < losses.size(); ++i) {
      loss_sum += losses[i];
    }
    const double train_loss = loss_sum / std::max<double>(1, losses.size() - epoch_first_round);
    const int64_t updates = d.updates - updates_before;
    const double samples_per_s = static_cast<double>(updates) * batch / train_s;
    const double wall_s = Seconds(train_start);
    if (lead) {
      PSGD_LOG_INFO("epoch {}/{}: train_loss {:.4f}  test_loss {:.4f}  test_accuracy {:.4f}  "
                    "{:.0f} samples/s  wall {:.1f} s  rank 0: {} rounds, {} alone",
                    d.epoch, epochs, train_loss, test_loss, accuracy, samples_per_s, wall_s,
                    trainer.steps() - epoch_first_round, trainer.skipped());
      if (out) {
        out->AppendMetrics({{"epoch", d.epoch},
                            {"steps", d.updates / n},
                            {"local_steps_all_ranks", d.updates},
                            {"train_loss", train_loss},
                            {"test_loss", test_loss},
                            {"test_accuracy", accuracy},
                            {"samples_per_s", samples_per_s},
                            {"wall_s", wall_s}});
      }
    }
    epoch_first_round = trainer.steps();
    updates_before = d.updates;
    next_progress = progress > 0 ? steps_per_epoch / (progress + 1) : -1;
    epoch_start = Clock::now();
    if (d.stop) break;
  }

  const double wall_s = Seconds(start);
  if (lead) {
    const std::vector<train::GroupDecision> decisions = service->decisions();
    std::map<int, int64_t> sizes;
    std::map<std::string, int64_t> kinds;
    for (const auto& d : decisions) {
      sizes[static_cast<int>(d.members.size())] += 1;
      kinds[train::RoundKindName(d.kind)] += 1;
    }
    nlohmann::json size_hist = nlohmann::json::object();
    for (const auto& [size, count] : sizes) size_hist[std::to_string(size)] = count;
    PSGD_LOG_INFO("final test accuracy: {:.4f} ({} local steps in all ranks, {} rounds, {:.1f} "
                  "s); group sizes {}",
                  final_accuracy, decisions.empty() ? 0 : decisions.back().updates,
                  decisions.size(), wall_s, size_hist.dump());
    if (out) {
      nlohmann::json summary = {{"final_test_accuracy", final_accuracy},
                                {"wall_s", wall_s},
                                {"train_wall_s", Seconds(train_start)},
                                {"steps", decisions.empty() ? 0 : decisions.back().updates / n},
                                {"local_steps_all_ranks",
                                 decisions.empty() ? 0 : decisions.back().updates},
                                {"world_size", env.world_size},
                                {"mode", "SDPIPE"},
                                {"rounds", decisions.size()},
                                {"rounds_by_kind", kinds},
                                {"group_sizes", size_hist},
                                {"rank0_rounds_alone", trainer.skipped()},
                                {"rank0_wire_bytes", trainer.wire_bytes()},
                                {"transport", comm.transport().name()},
                                {"config", ConfigAsJson(job)}};
      out->WriteSummary(summary);
    }
  }
}

}  // namespace pipesgd::launcher
