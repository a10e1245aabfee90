// The job lifecycle's pieces that the job skeleton (job.cc) and the modes (ring_mode.cc,
// ps_mode.cc, sdpipe_mode.cc, pipeline_mode.cc) share, so that each mode's file is only what
// makes that mode different. Set-up in setup.cc, outputs in worker_report.cc.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "configs/pipesgd.pb.h"
#include "core/base/error.h"
#include "core/base/timeline.h"
#include "core/collective/group_allreduce.h"
#include "core/collective/powersgd.h"
#include "core/data/dataset.h"
#include "core/train/checkpoint.h"
#include "core/train/run_loop.h"
#include "core/train/sdpipe_service.h"
#include "core/train/straggler.h"
#include "core/train/trainer.h"
#include "core/job/worker.h"
#include "layers/model.h"

namespace pipesgd::job::detail {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since);
// Refuses a model whose buffers (parameters, momentum, `width` gradient buffers, and the
// activations, their gradients and the layers' workspaces at `max_batch`) cannot fit in this
// machine's memory, before allocating any of it. Throws Error(kInvalidArgument).
void CheckModelFitsInMemory(const std::vector<std::unique_ptr<layers::Layer>>& stack,
                            size_t max_batch, int width);
int NumClasses(const config::Model& spec);
// The job's training and test sets (job.data), loaded for NumClasses(job.model()) classes.
struct JobData {
  data::Dataset train;
  data::Dataset test;
};
// Loads both sets and checks them against each other and against the model's input: the IDX
// images (one channel, rows x cols) must be model.input_channels x input_height x input_width =
// 1 x rows x cols. Throws Error(kInvalidArgument) naming both shapes and the file on a mismatch,
// and what data::LoadDataset / data::CheckSameShape throw.
JobData LoadJobData(const config::Job& job);
nlohmann::json ConfigAsJson(const config::Job& job);
// Writes to a temporary file, then renames it over `path`. Throws Error(kIo).
void WriteFileAtomically(const std::filesystem::path& path, const std::string& contents);
// The transport, made for every other rank (SDPIPE groups may pair any two ranks; ibverbs needs
// its peers up front), and every rank's address; nothing is connected yet. `start_deadline`
// is comm.start_timeout_s from the worker's start. Throws what ConnectTransport throws.
ConnectedTransport TransportForEveryone(const JobEnv& env, const config::Job& job,
                                        Deadline start_deadline);
train::StalenessCompensation CompensationFromConfig(config::StalenessCompensation c);
// The ring of a RING job (the pipelined trainer or the outer loop): rendezvous, then each rank
// connected to its neighbours within comm.start_timeout_s; the lead rank logs it.
std::unique_ptr<collective::Communicator> ConnectJobRing(const config::Job& job, const JobEnv& env,
                                                         bool lead);
// The test set's accuracy and mean loss over every rank's shard (`local` is this rank's),
// summed on the trainer's ring: the same numbers on every rank.
struct TestSetResult {
  double accuracy = 0;
  double loss = 0;
};
TestSetResult SumTestShards(train::Trainer& trainer, const layers::EvalResult& local);
// The codec's ratio (raw float32 bytes over payload bytes) of the gradient AllReduces between
// two readings of the trainer's wire totals; 1 where nothing was sent.
double CompressionRatio(const train::WireTotals& before, const train::WireTotals& now);
// The loop failed: let the trainer's collectives in flight end on every rank before it goes, so
// this rank's failure does not turn into a confusing connection error on its peers.
void DrainQuietly(train::Trainer* trainer);
// Checkpoints of the ring's modes (RING and the outer loop). A checkpoint belongs to the job,
// not to where it is kept: the identity is the effective config without checkpoint.dir, so that
// a copied or moved directory resumes (checkpoint.dir = the new place).
std::string CheckpointIdentity(const config::Job& job);
// --resume (`resume`): the checkpoint every rank agrees on, checked against `identity`, with the
// parameters, the error-feedback residual and the collective sequence restored; nullopt without
// --resume. The optimizers' state and the trainer's are the mode's to restore.
std::optional<checkpoint::Checkpoint> ResumeRingJob(const config::Job& job,
                                                    const std::string& identity,
                                                    collective::Communicator& comm,
                                                    const JobEnv& env, bool resume,
                                                    std::span<float> params);
// Writes this rank's `c` into checkpoint.dir; the lead rank logs it.
void WriteRingCheckpoint(train::Trainer& trainer, const config::Checkpoint& cfg,
                         const checkpoint::Checkpoint& c, const JobEnv& env, bool lead);
// comm.powersgd_rank's PowerSGD on `comm`, for gradient slots of the model's parameters and the
// loss after them; the lead rank logs what it compresses.
std::unique_ptr<collective::PowerSgd> MakePowerSgd(const config::Job& job,
                                                   const layers::Model& model,
                                                   collective::Communicator& comm, bool lead);
// job.straggler for this job; throws Error(kInvalidArgument) for a rank outside [0, world_size).
train::StragglerOptions StragglerFromConfig(const config::Job& job, int world_size);

// The output directory of a job, locked so that two jobs cannot interleave their files, with
// metrics.jsonl appended and flushed line by line so a crash keeps every finished epoch.
class OutputDir {
 public:
  // `replace`: a finished run there (summary.json) may be replaced (--overwrite, --resume).
  OutputDir(const std::string& dir, bool replace) : dir_(dir) {
    CheckOutDirIsFree(dir, replace);
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) Throw(ErrorCode::kIo, "--out {}: cannot create the directory: {}", dir, ec.message());
    const auto lock_path = dir_ / ".pipesgd.lock";
    lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock_fd_ < 0) {
      Throw(ErrorCode::kIo, "--out {}: cannot write in the directory: {}", dir, std::strerror(errno));
    }
    if (flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      Throw(ErrorCode::kIo, "--out {}: another pipesgd job is writing to this directory; use "
                            "another --out",
            dir);
    }
    // The old summary goes first: a replaced run that then fails must not leave it looking new.
    std::filesystem::remove(dir_ / "summary.json", ec);
    const auto metrics = dir_ / "metrics.jsonl";
    metrics_ = std::fopen(metrics.c_str(), "w");
    if (!metrics_) {
      Throw(ErrorCode::kIo, "cannot write {}: {}", metrics.string(), std::strerror(errno));
    }
  }
  ~OutputDir() {
    if (metrics_) std::fclose(metrics_);
    if (lock_fd_ >= 0) close(lock_fd_);  // releases the lock
  }
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  void AppendMetrics(const nlohmann::json& line) {
    const std::string text = line.dump() + "\n";
    if (std::fwrite(text.data(), 1, text.size(), metrics_) != text.size() ||
        std::fflush(metrics_) != 0) {
      Throw(ErrorCode::kIo, "cannot write {}: {}", (dir_ / "metrics.jsonl").string(),
            std::strerror(errno));
    }
  }
  void WriteSummary(const nlohmann::json& summary) {
    WriteFileAtomically(dir_ / "summary.json", summary.dump(2) + "\n");
  }

 private:
  std::filesystem::path dir_;
  int lock_fd_ = -1;
  std::FILE* metrics_ = nullptr;
};

// A deadline error with the setting that bounds it appended ("... (comm.timeout_s = 60 s)"),
// same code and culprit.
Error WithTimeoutSetting(const Error& e, const std::string& timeout_setting);

// Rank `lead` claims --out before anything slow (a bad --out fails at once, before the data
// loads); null on the other ranks and without --out.
std::unique_ptr<OutputDir> ClaimOutputDir(bool lead, const WorkerArgs& args);

// The job's model on this rank: job.model's layers, checked against this machine's memory for
// `gradient_buffers` gradients in flight, with parameters initialised from train.seed (the same
// on every rank). Evaluation batches hold up to 500 samples, fewer where a sample's activations
// are large (~64 MiB per rank at most).
struct JobModel {
  std::unique_ptr<layers::Model> model;
  std::vector<float> params;
  size_t eval_batch = 0;
  size_t max_batch = 0;  // max(train.batch_size, eval_batch): what the model is built for
};
JobModel BuildJobModel(const config::Job& job, int gradient_buffers);

// Throws Error(kInvalidArgument) when an epoch has no step: train.batch_size x `replicas`
// (`replica_kind`: "ranks", "workers", "pipelines") samples per step is more than the
// training set's `train_samples`.
void CheckStepsPerEpoch(int64_t steps_per_epoch, const config::Job& job, int64_t replicas,
                        const char* replica_kind, uint64_t train_samples);

// The group scheduler's options from job.sdpipe, for `world_size` replicas.
train::GroupSchedulerOptions SchedulerOptionsFromConfig(const config::Sdpipe& sd,
                                                        int world_size);
// Rank 0 starts the group scheduler (with `states` scheduler states); its port reaches every
// rank through one exact AllReduce of everyone (a port fits a float exactly).
struct SchedulerEndpoint {
  std::unique_ptr<train::GroupSchedulerService> service;  // rank 0 only
  std::string host;
  uint16_t port = 0;
};
SchedulerEndpoint StartScheduler(collective::GroupCommunicator& comm, const JobEnv& env,
                                 const train::GroupSchedulerOptions& options, int states,
                                 Deadline deadline);

// --timeline: this rank's recorder (null without it), and its file written at the end. The
// window's first step is --timeline-first-step, or for its default (auto) the first steady step
// of a run that starts at `start_step` (plan.warmup_steps later; the last timeline_steps steps
// of a run shorter than that).
int64_t TimelineFirstStep(const WorkerArgs& args, const train::RunPlan& plan,
                          int64_t start_step);
std::unique_ptr<timeline::Recorder> TimelineRecorder(const WorkerArgs& args, const JobEnv& env,
                                                     const train::RunPlan& plan,
                                                     int64_t start_step);
void WriteTimeline(const timeline::Recorder* recorder, const WorkerArgs& args,
                   const JobEnv& env);

// The run plan of job.train for a mode whose epoch has `steps_per_epoch` global steps of
// `global_batch` samples.
train::RunPlan PlanFromConfig(const config::Job& job, int64_t steps_per_epoch,
                              int64_t global_batch);

// What every mode reports, the same way: rank `lead` prints one line per evaluation and writes
// it to metrics.jsonl (when `out` is set); progress lines likewise.
class LeadReporter : public train::Reporter {
 public:
  // `show_wire`: the console line names the bytes per step and the compression ratio.
  LeadReporter(bool lead, OutputDir* out, bool show_wire)
      : lead_(lead), out_(out), show_wire_(show_wire) {}
  void Progress(const train::Progress& p) override;
  void Evaluated(const train::Evaluation& e, int epochs) override;

 private:
  bool lead_;
  OutputDir* out_;
  bool show_wire_;
};

// The lead rank's config lines: the file at info level, the effective config (one line, every
// field) at debug level (-v): a kilobyte and more that a quiet console does without.
void LogEffectiveConfig(const std::string& path, const config::Job& job);

// The last line of a run, on the lead rank.
void LogFinal(const train::RunOutcome& outcome, const train::RunPlan& plan, double wall_s);

// summary.json, the same top-level keys in every mode; what only one mode has goes in
// "details".
struct SummaryInputs {
  const char* mode = "";  // RING, PS_SYNC, PS_ASYNC, SDPIPE
  int world_size = 0;
  int workers = 0;  // ranks that compute gradients
  int64_t global_batch = 0;
  double target_accuracy = 0;
  double wall_s = 0;  // the whole worker, set-up included
  std::string transport;
  uint64_t wire_bytes = 0;  // what the reporting rank sent for training
};
nlohmann::json Summary(const SummaryInputs& in, const train::RunOutcome& outcome,
                       const config::Job& job, nlohmann::json details);

}  // namespace pipesgd::job::detail
