// Pipelined data-parallel SGD of width K (Pipe-SGD, Li et al., NeurIPS 2018, Sec. 3).
//
// Each worker runs two threads: the caller's thread computes gradients and applies updates; a
// communication thread owned by the Trainer runs the ring AllReduces, one at a time, in order.
// Step t:
//   1. compute g[t] = grad f(w[t]; this rank's slice of global batch t) into slot t mod K;
//   2. hand the slot to the communication thread, which averages it over the ranks: G[t];
//   3. if t >= K-1, wait for G[t-K+1] and apply it:  w[t+1] = w[t] - lr * G[t-K+1]
//      (with momentum/weight decay, whatever the Optimizer does with G); else w[t+1] = w[t].
// K = 1 is synchronous SGD (w[t+1] = w[t] - lr * G[t]). K = 2 is Pipe-SGD: the AllReduce of
// step t runs while step t+1 is computed, and every update is one step stale. While a step is
// being computed at most K-1 AllReduces are in flight. Every rank applies the same aggregates in
// the same order, so the replicas stay bitwise identical.
//
// The rank's mean loss rides along as one extra element of each gradient buffer, so the loss
// averaged over ranks arrives with G[t] at no extra collective, and a non-finite loss stops every
// rank at the same step with the same error.
//
// The slots are one store (core/train/gradient_slots.h): in host memory by default, reduced by the
// ring or TrainerOptions::reducer (PowerSGD); with TrainerOptions::gradient_slots (the GPU path)
// in device memory instead: the objective writes g[t] there, the communication thread AllReduces
// the device slot (staged through pinned host buffers, core/collective/staged_allreduce.h), and
// the optimizer reads G[t] there, so the gradient never makes a whole extra trip through host
// memory.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "core/base/error.h"
#include "core/base/timeline.h"
#include "core/collective/powersgd.h"
#include "core/collective/ring_allreduce.h"
#include "core/train/gradient_slots.h"

namespace pipesgd::train {

// What the trainer trains: anything that can compute a gradient at given parameters. The
// trainer knows nothing of layers or data beyond this.
class Objective {
 public:
  virtual ~Objective() = default;
  virtual size_t num_params() const = 0;
  // This rank's gradient of its local loss for global step `step` at `params`: OVERWRITES
  // grads (num_params floats) and returns the local mean loss.
  virtual float ComputeGradient(int64_t step, std::span<const float> params,
                                std::span<float> grads) = 0;
  // As ComputeGradient, into DEVICE memory (num_params floats at device_grads), for a trainer
  // with device gradient slots. The default throws Error(kInvalidArgument): host-only objectives.
  virtual float ComputeGradientOnDevice(int64_t step, std::span<const float> params,
                                        float* device_grads);
};

// Applies one rank-averaged gradient to the parameters (SGD, momentum, ...).
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void Apply(std::span<float> params, std::span<const float> grads) = 0;
  // Writes to `out` the parameters that Apply-ing each of `grads` in turn (num_params floats
  // each) would give, with Apply's arithmetic to the bit, and changes nothing: the weight
  // prediction of train::StalenessCompensation. The default throws Error(kInvalidArgument).
  virtual void Predict(std::span<const float> params,
                       std::span<const std::span<const float>> grads,
                       std::span<float> out) const;
  // Apply(params, grads), then Predict(params, {ahead}, out): the width-2 trainer's update
  // followed by its next prediction. The default makes the two calls; an optimizer may fuse
  // them into one pass (same results to the bit).
  virtual void ApplyAndPredict(std::span<float> params, std::span<const float> grads,
                               std::span<const float> ahead, std::span<float> out);
  // As Apply with the averaged gradient in DEVICE memory (num_params floats); params is the
  // host copy, updated too. The default throws Error(kInvalidArgument).
  virtual void ApplyFromDevice(std::span<float> params, const float* device_grads);
  // Everything Apply depends on besides params and grads, for checkpoints (e.g. momentum).
  virtual std::vector<float> SaveState() const { return {}; }
  // Restores SaveState's floats; throws Error(kDataLoss) when they do not fit.
  virtual void LoadState(std::span<const float> state) {
    if (!state.empty()) {
      Throw(ErrorCode::kDataLoss, "optimizer state of {} floats: this optimizer has none",
            state.size());
    }
  }
};

// The trainer's own state between steps, for checkpoints: with width K, the aggregates of the
// last K-1 steps have been reduced but not applied yet; they are part of the state, so that a
// resumed run applies exactly what the uninterrupted one would have.
struct TrainerSnapshot {
  int64_t steps = 0;    // gradients computed so far (the next step to compute)
  int64_t applied = 0;  // updates applied so far
  std::vector<float> losses;  // rank-averaged loss of every step so far (NaN: unknown)
  struct Pending {
    int64_t step = 0;
    std::vector<float> aggregate;  // num_params averaged gradient floats, then the loss
    // This rank's own gradient of the step (num_params floats), kept for the weight prediction
    // of StalenessCompensation::kLocalGradient; empty otherwise.
    std::vector<float> local;
  };
  std::vector<Pending> pending;  // ascending steps, at most K-1
};

// Where a trainer of width K >= 2 computes g[t], given that K-1 updates are still in flight
// (docs/staleness.md has the recurrences and where they come from).
enum class StalenessCompensation {
  // At w[t]: the plain Pipe-SGD recurrence w[t+1] = w[t] - lr * G[t-K+1].
  kNone,
  // At the weights the in-flight updates would give if their gradients were zero: only the
  // optimizer's own part of them (momentum, weight decay). Weight prediction from the momentum
  // buffer, as in SpecTrain and PipeMare.
  kMomentum,
  // At the weights the in-flight updates would give if each aggregate G[s] equalled this rank's
  // own gradient g[s]. With identical gradients on every rank this is synchronous SGD exactly,
  // one step late: w[t+1] = v[t] where v[t+1] = v[t] - lr * G(v[t]).
  kLocalGradient,
};

struct TrainerOptions {
  int pipeline_width = 2;  // K >= 1
  // Bound on every wait: one AllReduce, and the compute thread's wait for an aggregate.
  double timeout_s = 120;
  // Steps 0 .. warmup_steps-1 send their gradients uncompressed even when the communicator
  // has a codec (early gradients are large and change fast; compression error hurts most).
  int64_t compression_warmup_steps = 0;
  // The gradient slots (null: HostGradientSlots the trainer makes, reduced by `reducer` or the
  // ring). At least pipeline_width slots of num_params + 1 floats; must outlive the trainer.
  GradientSlots* gradient_slots = nullptr;
  // With K >= 2; needs host gradient slots and an optimizer with Predict.
  StalenessCompensation compensation = StalenessCompensation::kNone;
  // Reduces the gradient slots instead of one Communicator::AllReduce each (PowerSGD); needs
  // host gradient slots; must outlive the trainer. Its state (residual, warm start) is not part
  // of a TrainerSnapshot, so Snapshot refuses. Other collectives (AllReduce) stay plain.
  collective::GradientReducer* reducer = nullptr;
  // Steps 0 .. sync_warmup_steps-1 are synchronous (each applies its own aggregate before the next
  // step is computed); the pipeline of width K starts after them (BytePS's
  // pipesgd_warmup_iter). The first pipelined step applies nothing, as step 0 does.
  int64_t sync_warmup_steps = 0;
};

// What the gradient AllReduces sent so far, summed over steps (as seen by this rank).
struct WireTotals {
  int64_t steps = 0;
  int64_t compressed_steps = 0;
  uint64_t bytes_sent = 0;         // headers and payloads
  uint64_t payload_bytes = 0;
  uint64_t raw_payload_bytes = 0;  // the same payloads as float32
  uint64_t saturated = 0;
};

class Trainer {
 public:
  // `params` (objective.num_params() floats) must outlive the trainer; it must be identical on
  // every rank (same seed). Starts the communication thread. Throws Error kInvalidArgument for
  // a width < 1 or a size mismatch.
  Trainer(collective::Communicator& comm, Objective& objective, Optimizer& optimizer,
          std::span<float> params, const TrainerOptions& options);
  // Stops the communication thread; an AllReduce still in flight is aborted (the peers see the
  // connection close and fail too).
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Runs step t = steps(): computes g[t] (at w[t], or at a prediction of w[t+K-1] with a
  // compensation), submits its AllReduce and, if t >= K-1 (counted from the end of the
  // synchronous steps), waits for G[t-K+1] and applies it. After it returns, params hold w[t+1].
  // Throws Error: kNumerical (the rank-averaged loss or gradient of an applied step is not
  // finite; the update is not applied), kDeadlineExceeded, and whatever the AllReduce threw.
  void Step();

  // Where the next Step computes its gradient (w[t], or the prediction of a compensation),
  // computed now and kept for that Step. For a caller that does a step's work in pieces before
  // calling Step (the outer loop's inner steps, core/train/outer_loop.h). The span stays valid
  // and unchanged until that Step.
  std::span<const float> NextGradientPoint();

  // Waits until every submitted AllReduce has finished, so StepLoss() knows every step so far.
  // Pending aggregates stay pending (the pipeline is not disturbed).
  void Sync();

  // Waits for every submitted AllReduce and consumes the pending aggregates: with apply = true
  // they are applied in order (no computed gradient is lost; params = w[steps() + K - 1] in the
  // recurrence's terms); with apply = false they are dropped and params stay w[steps()]. Call it
  // before destroying the trainer so that no rank aborts a collective its peers are still in.
  void Drain(bool apply);

  // AllReduces `data` on the communication thread, after every gradient submitted so far, and
  // waits for it (e.g. evaluation counts), uncompressed. Throws like Step.
  void AllReduce(std::span<float> data, collective::ReduceOp op);

  int64_t steps() const { return steps_; }
  // Updates applied so far (steps() - K + 1 in steady state, steps() after Drain(true)).
  int64_t applied() const { return applied_; }
  int pipeline_width() const { return options_.pipeline_width; }
  // Loss of step `step` averaged over ranks, once its AllReduce has finished; NaN before.
  float StepLoss(int64_t step) const;
  // Totals over the gradient AllReduces finished so far (thread-safe).
  WireTotals wire_totals() const;

  // Records, per step, the compute thread's "update" and "wait_aggregate" spans and
  // the communication thread's "allreduce" span, and tells `recorder` which step each thread
  // is on (null: none). Call before the first Step; the recorder must outlive the trainer.
  // `step_of` maps a trainer step to the step the recorder's window counts in, where those
  // differ (the outer loop: a trainer step is a round of inner steps; the job's --timeline
  // window is in inner steps); empty: the trainer's own. Called on both threads: it must be pure.
  void set_timeline(timeline::Recorder* recorder,
                    std::function<int64_t(int64_t)> step_of = nullptr) {
    timeline_ = recorder;
    timeline_step_of_ = std::move(step_of);
  }

  // Waits for every AllReduce in flight and returns the state between steps (pending
  // aggregates included, not applied). Throws Error(kNumerical) if a pending aggregate is not
  // finite (no checkpoint is ever taken from such a state), and whatever the AllReduces threw.
  TrainerSnapshot Snapshot();
  // Continues from a snapshot. REQUIRES: no step has run on this trainer. Throws
  // Error(kDataLoss) if the snapshot does not fit (pending count or sizes, losses).
  void Restore(const TrainerSnapshot& snapshot);

 private:
  struct Job {
    std::span<float> data;
    collective::ReduceOp op = collective::ReduceOp::kAverage;
    collective::AllReduceOptions call;
    bool gradient = false;  // counts in wire_totals()
    int64_t step = -1;      // the gradient's step (timeline); -1 for other collectives
    int slot = -1;          // >= 0: AllReduce this gradient slot instead of data
    bool done = false;
  };
  struct Slot {
    Job job;
    int64_t step = -1;
    bool busy = false;  // submitted and not yet applied or released
  };

  void CommLoop();
  void Submit(Job& job);
  // Waits for `job` (lock held); rethrows the communication thread's error.
  void WaitJob(std::unique_lock<std::mutex>& lock, Job& job, int64_t step);
  // Waits for step s's aggregate, records its loss, checks it and (if apply) applies it.
  void Finish(int64_t s, bool apply);
  // Records the losses of finished AllReduces (REQUIRES: mu_ held).
  void HarvestLosses();
  // Where g[steps_] is computed: params_, or predicted_ holding the weight prediction.
  std::span<const float> GradientPoint();
  // Throws kNumerical when the aggregate in slot `index` (step s) has a non-finite value; the
  // message names `what` and ends with `consequence`.
  void CheckAggregate(int index, int64_t s, const char* what, const char* consequence);

  collective::Communicator& comm_;
  Objective& objective_;
  Optimizer& optimizer_;
  std::span<float> params_;
  TrainerOptions options_;
  const size_t num_params_;

  std::unique_ptr<HostGradientSlots> host_slots_;  // where options.gradient_slots is null
  GradientSlots* store_ = nullptr;  // options.gradient_slots or host_slots_
  std::vector<Slot> slots_;  // K of them; slot t % K holds step t
  int64_t steps_ = 0;
  int64_t applied_ = 0;
  int64_t finished_ = 0;     // steps whose aggregate has been consumed (applied or released)
  std::vector<float> losses_;  // by step; NaN until known (compute thread only)
  // Weight prediction (compensation != kNone): the predicted weights; per slot, this rank's own
  // gradient of the slot's step (kLocalGradient); zeros standing for unknown gradients
  // (kMomentum).
  std::vector<float> predicted_;
  std::vector<std::vector<float>> local_;
  std::vector<float> zeros_;
  std::vector<std::span<const float>> ahead_;  // the gradients Predict is given
  int64_t predicted_for_ = -1;  // predicted_ already holds step predicted_for_'s point

  mutable std::mutex mu_;  // guards queue_, Job::done, comm_error_, stop_, wire_
  std::condition_variable cv_;
  std::deque<Job*> queue_;
  std::exception_ptr comm_error_;
  WireTotals wire_;
  bool stop_ = false;
  std::atomic<bool> abort_{false};
  timeline::Recorder* timeline_ = nullptr;
  std::function<int64_t(int64_t)> timeline_step_of_;  // set before the first Step, then read-only
  std::thread comm_thread_;
};

}  // namespace pipesgd::train
