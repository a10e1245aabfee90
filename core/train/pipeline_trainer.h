// Pipeline-parallel training with replicated stages (SDPipe, Miao et al., VLDB 2023, Sec. 3:
// M pipeline stages x N pipelines): rank = pipeline * M + stage holds stage `stage` of pipeline
// `pipeline` (core/train/pipeline_stage.h). Global step t (one minibatch): each pipeline
// takes its share of global batch t, split into m micro-batches, and
//   1. runs the 1F1B schedule (core/train/pipeline_schedule.h; PipeDream, Narayanan et al.,
//      SOSP 2019): activations go to the next stage, their gradients come back
//      (core/train/pipeline_p2p.h); after each backward the stage applies its gradient to its
//      latest weights with the optimizer, and each backward uses the weights its forward
//      stashed (weight stashing);
//   2. asks its GroupSource for this stage's group of replicas (pipeline indices; SDPipe's group
//      scheduler keeps one scheduler state per stage), and averages the stage's weights over the
//      ranks of that group with a ring of just those ranks (core/collective/group_allreduce.h).
//      A group of every pipeline (AllReplicas) is the synchronous baseline; a rank alone skips.
// The last stage's mean loss over the micro-batches rides along with the weights in the
// averaging (the other stages carry 0).
//
// M = 1 with one micro-batch is SdpipeTrainer's round (same step, same averaging), bitwise.
//
// Connections: the constructor connects, in one call, to the neighbour stages of this pipeline
// and to every replica of this stage (GroupCommunicator::ConnectPeers), so no rank dials a peer
// that is busy connecting elsewhere; every rank of the job must construct its trainer at about
// the same time. One thread (the caller's) does everything; there is no communication thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "core/base/timeline.h"
#include "core/collective/group_allreduce.h"
#include "core/data/dataset.h"
#include "core/train/pipeline_p2p.h"
#include "core/train/pipeline_schedule.h"
#include "core/train/pipeline_stage.h"
#include "core/train/run_loop.h"
#include "core/train/sdpipe_trainer.h"

namespace pipesgd::train {

struct PipelineLayout {
  int stages = 1;     // M >= 1
  int pipelines = 1;  // N >= 1; world size = M * N
  int stage_of(int rank) const { return rank % stages; }
  int pipeline_of(int rank) const { return rank / stages; }
  int rank_of(int pipeline, int stage) const { return pipeline * stages + stage; }
};

// The samples of one micro-batch, for the first stage (inputs) and the last (labels). Both
// stages of a pipeline must get the same samples: a pure function of its arguments.
class MicroBatchSource {
 public:
  virtual ~MicroBatchSource() = default;
  // Micro-batch `mb` of global step `step` for pipeline `pipeline`: writes rows * in floats to
  // x unless it is null, and rows labels to labels unless it is null.
  virtual void Load(int64_t step, int pipeline, int mb, float* x, uint8_t* labels) = 0;
};

// Pipeline p's share of global batch t (data::Sampler with rank p of N pipelines), cut into
// micro-batches of `rows` consecutive samples. The first and the last stage of a pipeline build
// the same source, so they see the same samples.
class DatasetMicroBatches : public MicroBatchSource {
 public:
  // REQUIRES rows >= 1 and batch a multiple of rows; `train` outlives this source.
  DatasetMicroBatches(const data::Dataset& train, size_t batch, size_t rows, int pipeline,
                      int pipelines, uint64_t seed, const data::InputScaling& scaling);
  size_t steps_per_epoch() const { return sampler_.steps_per_epoch(); }
  void Load(int64_t step, int pipeline, int mb, float* x, uint8_t* labels) override;

 private:
  const data::Dataset& train_;
  size_t rows_;
  data::InputScaling scaling_;
  data::Sampler sampler_;
  std::vector<float> x_;
  std::vector<uint8_t> labels_;
};

// When the stages average over all their replicas without asking the scheduler: at every
// `period`-th step and at every evaluation point of `plan` (each epoch's end, every
// eval_every_steps, the last step). Every rank knows these steps, so every stage of every
// pipeline synchronizes and evaluates at the same step (core/job/pipeline_mode.cc says why).
class FullSyncPlan {
 public:
  // REQUIRES period >= 1, pipelines >= 1.
  FullSyncPlan(int period, const RunPlan& plan, int pipelines);
  // Step 1, 2, ... averages over every replica.
  bool FullSync(int64_t step) const;
  // The last step that asks the scheduler (its request says it is the last); 0: none does.
  int64_t last_request() const { return last_request_; }
  // A full synchronization's round: every replica; an epoch's barrier at an epoch end, else a
  // connect round; evaluate at the plan's points; stop at its last step.
  GroupDecision Decision(int64_t step) const;

 private:
  int period_;
  RunPlan plan_;
  std::vector<int> all_;
  int64_t last_request_ = 0;
};

// Every pipeline in every round: synchronous averaging of each stage over all its replicas.
class AllReplicas : public GroupSource {
 public:
  explicit AllReplicas(int pipelines);
  GroupDecision Next(int64_t step) override;

 private:
  std::vector<int> all_;
  int64_t round_ = 0;
};

struct PipelineTrainerOptions {
  int micro_batches = 1;        // m >= 1 per minibatch and pipeline
  size_t micro_batch_rows = 1;  // samples per micro-batch, >= 1
  uint64_t seed = 0;            // the run's seed, for the random layers' keys
  double timeout_s = 120;       // bound on every receive and every group AllReduce, seconds
  int64_t compression_warmup_steps = 0;  // as SdpipeOptions
};

class PipelineTrainer {
 public:
  // `comm` spans the whole job (M * N ranks); `stage` is stage layout.stage_of(comm.rank()) of
  // the model (its max_in_flight must be >= MaxInFlight(M, stage, m)). All must outlive the
  // trainer. Throws Error kInvalidArgument for a layout that does not match the world size, a
  // stage with too few slots or bad options; and what ConnectPeers throws.
  PipelineTrainer(collective::GroupCommunicator& comm, const PipelineLayout& layout,
                  PipelineStage& stage, Optimizer& optimizer, MicroBatchSource& data,
                  GroupSource& groups, const PipelineTrainerOptions& options);
  // Waits for the last sends (see StageLink).
  ~PipelineTrainer();
  PipelineTrainer(const PipelineTrainer&) = delete;
  PipelineTrainer& operator=(const PipelineTrainer&) = delete;

  // One minibatch, global step steps(): the 1F1B schedule with an update after each backward,
  // then this stage's group averaging. Returns the group decision (members are pipeline
  // indices). Throws Error: kNumerical (a non-finite loss or gradient; nothing more applied),
  // kDataLoss (a neighbour sent a tensor this stage did not expect: names both stages and
  // shapes), kDeadlineExceeded/kUnavailable from the transport, whatever the GroupSource and
  // the group AllReduce throw.
  GroupDecision Step();

  int64_t steps() const { return steps_; }
  int stage() const { return stage_index_; }
  int pipeline() const { return pipeline_; }
  // Per minibatch: the last stage's mean loss over its micro-batches, averaged over the group
  // (NaN on other stages: they have no loss).
  const std::vector<float>& losses() const { return losses_; }
  // Per backward, in order: how many updates the weights it used were behind the latest ones
  // (0: no staleness; weight stashing keeps this exact).
  const std::vector<int64_t>& stash_lags() const { return stash_lags_; }
  int64_t syncs() const { return syncs_; }
  int64_t skipped() const { return skipped_; }
  uint64_t p2p_bytes_sent() const;
  uint64_t sync_wire_bytes() const { return sync_wire_bytes_; }
  // --timeline: per micro-batch forward, backward, update and the receives they wait for, and
  // the wait for the stage's group, on the compute track; the group averaging on the
  // communication track. Null: none.
  void set_timeline(timeline::Recorder* recorder) { timeline_ = recorder; }

 private:
  collective::GroupCommunicator& comm_;
  PipelineLayout layout_;
  PipelineStage& stage_;
  Optimizer& optimizer_;
  MicroBatchSource& data_;
  GroupSource& groups_;
  PipelineTrainerOptions options_;
  int stage_index_ = 0;
  int pipeline_ = 0;
  std::unique_ptr<StageLink> prev_;  // to stage - 1, null on the first stage
  std::unique_ptr<StageLink> next_;  // to stage + 1, null on the last stage
  std::vector<PipelineOp> schedule_;
  int slots_ = 1;
  std::vector<float> grads_;
  std::vector<uint8_t> labels_;
  std::vector<float> buffer_;  // weights, then the loss: what the group averages
  std::vector<std::optional<uint64_t>> act_sends_;   // per slot: last activation send
  std::vector<std::optional<uint64_t>> grad_sends_;  // per slot: last gradient send
  int64_t steps_ = 0;
  std::vector<float> losses_;
  std::vector<int64_t> stash_lags_;
  int64_t syncs_ = 0;
  int64_t skipped_ = 0;
  uint64_t sync_wire_bytes_ = 0;
  timeline::Recorder* timeline_ = nullptr;
};

}  // namespace pipesgd::train
