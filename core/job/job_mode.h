// One job skeleton for every training mode. RunJob (job.cc) does the steps every mode shares,
// once and in this order: the config; the mode's layout (world size, which rank reports); the
// output directory, claimed before anything slow; the data; the mode's model; the run plan; the
// mode's connections; what the mode restores (--resume); the timeline; the training loop; the
// timeline file; the last line and summary.json. A mode supplies only what differs, as a JobMode,
// and declares what it supports (ModeSupport), from which the config validator refuses the
// rest before any rank starts. Adding a mode is one file (its JobMode and its ModeInfo) and one
// line in job_modes.cc.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "configs/pipesgd.pb.h"
#include "core/base/timeline.h"
#include "core/job/mode_info.h"
#include "core/job/worker.h"
#include "core/job/worker_detail.h"
#include "core/train/run_loop.h"

namespace pipesgd::job {

// Where this rank sits in the mode, decided before anything slow.
struct ModeLayout {
  int lead_rank = 0;     // prints the evaluations, writes --out
  int log_rank = 0;      // prints the job's first lines (the PS server: rank 0)
  int64_t replicas = 0;  // model replicas that each take train.batch_size samples per step
  const char* replica_kind = "ranks";  // for CheckStepsPerEpoch's message
};

// What the skeleton has made so far, handed to the mode at each step.
struct JobContext {
  JobContext(const WorkerArgs& a, const JobEnv& e, const config::Job& j,
             std::chrono::steady_clock::time_point s)
      : args(a), env(e), job(j), start(s) {}
  const WorkerArgs& args;
  const JobEnv& env;
  const config::Job& job;
  std::chrono::steady_clock::time_point start;
  ModeLayout layout;
  bool lead = false;
  std::unique_ptr<detail::OutputDir> out;  // on the lead rank, with --out
  detail::JobData data;
  train::RunPlan plan;
  std::unique_ptr<timeline::Recorder> recorder;  // --timeline; outlives the mode's trainer
};

// What Build made: the model's line, this mode's data line, and the steps of an epoch.
struct ModeModel {
  std::string description;   // "model: ..."
  std::string data_line;     // "data: ..."
  int64_t steps_per_epoch = 0;
};

// The summary's mode-specific part, on the lead rank.
struct ModeReport {
  std::string mode;     // summary.json "mode"
  int workers = 0;      // ranks that compute gradients
  std::string transport;
  uint64_t wire_bytes = 0;  // what the lead rank sent for training
  nlohmann::json details = nlohmann::json::object();
};

class JobMode {
 public:
  virtual ~JobMode() = default;
  // Checks what depends on the world size; throws Error(kInvalidArgument) naming the field.
  virtual ModeLayout Layout(const JobEnv& env) const = 0;
  // The job's first line, on layout.log_rank (the effective config follows it).
  virtual std::string StartLine(const JobEnv& env) const = 0;
  // The model, the task and the sampler, with the data loaded.
  virtual ModeModel Build(JobContext& ctx) = 0;
  // Meets the other ranks and connects what the mode needs (ctx.plan is set).
  virtual void Connect(JobContext& ctx) = 0;
  // After connecting, before the timeline: what --resume restores and what is measured at
  // start (auto values). Returns the step the run starts from.
  virtual int64_t Restore(JobContext& /*ctx*/) { return 0; }
  // A rank that serves instead of training (the parameter server) runs Serve and stops there.
  virtual bool Serves(const JobEnv& /*env*/) const { return false; }
  virtual void Serve(JobContext& /*ctx*/) {}
  // The trainer, recording on ctx.recorder, as the loop's strategy.
  virtual train::TrainingMode& Start(JobContext& ctx) = 0;
  // The loop failed: let in-flight collectives end on every rank before the trainer goes.
  virtual void Abandon() {}
  // The loop ended normally (a goodbye to the server, say).
  virtual void AfterLoop() {}
  // The console's evaluation lines name the wire bytes per step.
  virtual bool ShowsWire() const { return false; }
  // On the lead rank after the last line: what summary.json says of this mode (and its own
  // last lines, logged here).
  virtual ModeReport Report(const JobContext& ctx) = 0;
};

// The skeleton: one job on this rank, whatever its mode. Throws pipesgd::Error.
void RunJob(const WorkerArgs& args, const JobEnv& env, std::chrono::steady_clock::time_point start);

}  // namespace pipesgd::job
