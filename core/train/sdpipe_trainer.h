// SDPipe's semi-decentralized data-parallel SGD (Miao et al., VLDB 2023, Appendix C, Eq. for
// X[k+1]): every rank, at its own pace,
//   1. computes its local gradient g on its own slice of the next batch and takes a local
//      optimizer step:   x <- x - lr * g   (momentum and weight decay as the Optimizer does);
//   2. asks the group scheduler for its group S (core/train/sdpipe_scheduler.h);
//   3. if |S| > 1, averages its parameters with the other members over a ring of just S
//      (core/collective/group_allreduce.h):  x <- mean over S of x;  alone, it skips this.
// So X[k+1] = (X[k] - lr*G[k]) W[k] with W the group-averaging matrix. Fast ranks do more steps
// than slow ones instead of waiting for them; the scheduler's connect rounds and epoch barriers
// keep the replicas from drifting apart. The optimizer state (momentum) stays local.
//
// Unlike the Trainer (trainer.h) there is no communication thread: the averaging of round k runs
// before step k+1 is computed (the paper overlaps them; not done here).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <vector>

#include "core/base/timeline.h"
#include "core/collective/group_allreduce.h"
#include "core/train/sdpipe_scheduler.h"
#include "core/train/trainer.h"

namespace pipesgd::train {

// Where a rank's groups come from: the scheduler service's client in a job, a script in tests.
class GroupSource {
 public:
  virtual ~GroupSource() = default;
  // This rank finished local step `step` (1, 2, ...): its group for this round.
  virtual GroupDecision Next(int64_t step) = 0;
};

struct SdpipeOptions {
  double timeout_s = 120;  // bound on each group AllReduce
  // Rounds 0 .. warmup-1 average uncompressed even when the communicator has a codec.
  int64_t compression_warmup_steps = 0;
};

class SdpipeTrainer {
 public:
  // `params` (objective.num_params() floats) must be identical on every rank at the start and
  // outlive the trainer. Throws Error(kInvalidArgument) on a size mismatch.
  SdpipeTrainer(collective::GroupCommunicator& comm, Objective& objective, Optimizer& optimizer,
                std::span<float> params, GroupSource& groups, const SdpipeOptions& options);

  // One round: local step, group, averaging. Returns the round's decision. After it returns,
  // params hold this rank's x[k+1]. Throws Error: kNumerical (the local loss or gradient is not
  // finite; nothing is applied), whatever the GroupSource and the group AllReduce throw.
  GroupDecision Step();

  // Reduces `data` over every rank (e.g. evaluation counts), uncompressed. Every rank must call
  // it at the same point, e.g. right after an epoch barrier.
  void AllReduceAll(std::span<float> data, collective::ReduceOp op);

  int64_t steps() const { return steps_; }
  // Mean loss over the group of each round (the loss rides with the parameters), by round.
  const std::vector<float>& losses() const { return losses_; }
  int64_t syncs() const { return syncs_; }      // rounds in a group of >= 2
  int64_t skipped() const { return skipped_; }  // rounds alone
  // Rounds by group size, as seen by this rank.
  const std::map<int, int64_t>& group_sizes() const { return group_sizes_; }
  uint64_t wire_bytes() const { return wire_bytes_; }
  // --timeline: the update and the wait for the group on the compute track (the objective
  // records its own forward and backward), the group averaging on the communication track,
  // though the same thread runs it. Null: none.
  void set_timeline(timeline::Recorder* recorder) { timeline_ = recorder; }

 private:
  collective::GroupCommunicator& comm_;
  Objective& objective_;
  Optimizer& optimizer_;
  std::span<float> params_;
  GroupSource& groups_;
  SdpipeOptions options_;
  std::vector<float> grads_;
  std::vector<float> buffer_;  // params, then the local loss: what the group averages
  std::vector<int> everyone_;
  int64_t steps_ = 0;
  std::vector<float> losses_;
  int64_t syncs_ = 0;
  int64_t skipped_ = 0;
  std::map<int, int64_t> group_sizes_;
  uint64_t wire_bytes_ = 0;
  timeline::Recorder* timeline_ = nullptr;
};

}  // namespace pipesgd::train
