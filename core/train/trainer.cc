#include "core/train/trainer.h"

#include <cmath>
#include <limits>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::train {

using collective::ReduceOp;

float Objective::ComputeGradientOnDevice(int64_t, std::span<const float>, float*) {
  Throw(ErrorCode::kInvalidArgument,
        "this objective computes gradients in host memory only; the trainer was given device "
        "gradient slots");
}

void Optimizer::Predict(std::span<const float>, std::span<const std::span<const float>>,
                        std::span<float>) const {
  Throw(ErrorCode::kInvalidArgument,
        "this optimizer cannot predict weights, which a staleness compensation needs (use "
        "train.staleness_compensation = NONE)");
}

void Optimizer::ApplyAndPredict(std::span<float> params, std::span<const float> grads,
                                std::span<const float> ahead, std::span<float> out) {
  Apply(params, grads);
  const std::span<const float> one[] = {ahead};
  Predict(params, one, out);
}

void Optimizer::ApplyFromDevice(std::span<float>, const float*) {
  Throw(ErrorCode::kInvalidArgument,
        "this optimizer applies gradients from host memory only; the trainer was given device "
        "gradient slots");
}

Trainer::Trainer(collective::Communicator& comm, Objective& objective, Optimizer& optimizer,
                 std::span<float> params, const TrainerOptions& options)
    : comm_(comm),
      objective_(objective),
      optimizer_(optimizer),
      params_(params),
      options_(options),
      num_params_(objective.num_params()),
      store_(options.gradient_slots) {
  if (options.pipeline_width < 1) {
    Throw(ErrorCode::kInvalidArgument, "pipeline width {}: expected an integer >= 1",
          options.pipeline_width);
  }
  if (params.size() != num_params_) {
    Throw(ErrorCode::kInvalidArgument, "trainer got {} parameters, the objective has {}",
          params.size(), num_params_);
  }
  if (store_ != nullptr &&
      (store_->slots() < options.pipeline_width || store_->slot_elems() != num_params_ + 1)) {
    Throw(ErrorCode::kInvalidArgument,
          "gradient slots: {} of {} floats; pipeline width {} needs {} of {}",
          store_->slots(), store_->slot_elems(), options.pipeline_width,
          options.pipeline_width, num_params_ + 1);
  }
  if (options.reducer != nullptr && store_ != nullptr) {
    Throw(ErrorCode::kInvalidArgument,
          "a gradient reducer (PowerSGD) reduces the trainer's own host slots; the gradient slots "
          "given reduce themselves (give the reducer to them instead)");
  }
  if (options.sync_warmup_steps < 0) {
    Throw(ErrorCode::kInvalidArgument, "synchronous steps {}: expected an integer >= 0",
          options.sync_warmup_steps);
  }
  const bool compensating =
      options.compensation != StalenessCompensation::kNone && options.pipeline_width > 1;
  if (compensating && store_ != nullptr && store_->host_slot(0).empty()) {
    Throw(ErrorCode::kInvalidArgument,
          "a staleness compensation needs host gradient slots: the weight prediction reads "
          "this rank's gradient and the optimizer state on the host");
  }
  if (compensating) {
    predicted_.assign(num_params_, 0.0f);
    ahead_.reserve(static_cast<size_t>(options.pipeline_width));
    if (options.compensation == StalenessCompensation::kLocalGradient) {
      local_.assign(options.pipeline_width, std::vector<float>(num_params_, 0.0f));
    } else {
      zeros_.assign(num_params_, 0.0f);
    }
  }
  slots_.resize(options.pipeline_width);
  if (store_ == nullptr) {
    host_slots_ = std::make_unique<HostGradientSlots>(
        comm, options.reducer != nullptr ? *options.reducer : comm, options.pipeline_width,
        num_params_ + 1);
    store_ = host_slots_.get();
  }
  comm_thread_ = std::thread([this] { CommLoop(); });
}

Trainer::~Trainer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (!queue_.empty()) abort_ = true;  // don't finish work nobody will wait for
  }
  cv_.notify_all();
  comm_thread_.join();
}

void Trainer::CommLoop() {
  while (true) {
    Job* job = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty() || abort_) return;
      job = queue_.front();
    }
    try {
      if (timeline_ && job->step >= 0) {
        timeline_->SetStep(timeline::kComm,
                           timeline_step_of_ ? timeline_step_of_(job->step) : job->step);
      }
      timeline::Span span(job->step >= 0 ? timeline_ : nullptr, timeline::kComm, "allreduce");
      if (job->slot >= 0) {
        store_->AllReduce(job->slot, job->op, Deadline::After(options_.timeout_s), &abort_,
                          job->call);
      } else {
        comm_.AllReduce(job->data, job->op, Deadline::After(options_.timeout_s), &abort_,
                        job->call);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      comm_error_ = std::current_exception();
      cv_.notify_all();
      return;  // the communicator is unusable now; every later wait rethrows comm_error_
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (job->gradient) {
        const collective::WireStats stats = store_->last_wire_stats();
        wire_.steps += 1;
        wire_.compressed_steps += stats.compressed ? 1 : 0;
        wire_.bytes_sent += stats.bytes_sent;
        wire_.payload_bytes += stats.payload_bytes;
        wire_.raw_payload_bytes += stats.raw_payload_bytes;
        wire_.saturated += stats.saturated;
      }
      job->done = true;
      queue_.pop_front();
    }
    cv_.notify_all();
  }
}

void Trainer::Submit(Job& job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_error_) std::rethrow_exception(comm_error_);
    job.done = false;
    queue_.push_back(&job);
  }
  cv_.notify_all();
}

void Trainer::WaitJob(std::unique_lock<std::mutex>& lock, Job& job, int64_t step) {
  // The AllReduce itself is bounded by timeout_s; allow for the ones queued ahead of it.
  const auto deadline = Deadline::After(options_.timeout_s * (options_.pipeline_width + 1));
  bool ok = cv_.wait_until(lock, deadline.when(), [&] { return job.done || comm_error_; });
  if (comm_error_) std::rethrow_exception(comm_error_);
  if (!ok) {
    Throw(ErrorCode::kDeadlineExceeded,
          "rank {}: the AllReduce of step {} did not finish within {:.0f} s", comm_.rank(), step,
          options_.timeout_s * (options_.pipeline_width + 1));
  }
}

std::span<const float> Trainer::GradientPoint() {
  if (predicted_.empty() || finished_ == steps_) return params_;  // nothing in flight
  if (predicted_for_ == steps_) return predicted_;  // made with the last update (Finish)
  // The updates of steps finished_ .. steps_-1 are still to come, in that order.
  const int k = options_.pipeline_width;
  ahead_.clear();  // reserved for K - 1: no allocation per step
  for (int64_t s = finished_; s < steps_; ++s) {
    ahead_.push_back(local_.empty() ? std::span<const float>(zeros_)
                                    : std::span<const float>(local_[static_cast<size_t>(s % k)]));
  }
  timeline::Span span(timeline_, timeline::kCompute, "predict");
  optimizer_.Predict(params_, ahead_, predicted_);
  return predicted_;
}

std::span<const float> Trainer::NextGradientPoint() {
  const std::span<const float> at = GradientPoint();
  if (!predicted_.empty() && at.data() == predicted_.data()) predicted_for_ = steps_;
  return at;
}

void Trainer::Step() {
  const int64_t t = steps_;
  const int k = options_.pipeline_width;
  const int index = static_cast<int>(t % k);
  Slot& slot = slots_[index];
  PSGD_CHECK(!slot.busy);  // Finish() released it K steps ago
  if (timeline_) {
    timeline_->SetStep(timeline::kCompute, timeline_step_of_ ? timeline_step_of_(t) : t);
  }

  const std::span<const float> at = GradientPoint();
  store_->Compute(objective_, index, t, at);
  slot.job.slot = index;
  if (!local_.empty()) {
    // The AllReduce overwrites the slot with G[t]; the prediction needs g[t] until G[t] is
    // applied.
    const std::span<const float> grads = store_->host_slot(index).first(num_params_);
    std::copy(grads.begin(), grads.end(), local_[index].begin());
  }
  slot.step = t;
  slot.busy = true;
  slot.job.op = ReduceOp::kAverage;
  slot.job.gradient = true;
  slot.job.step = t;
  slot.job.call.compress = t >= options_.compression_warmup_steps;
  slot.job.call.exact_tail = 1;  // the loss: reported exactly, never error-fed
  Submit(slot.job);
  steps_ = t + 1;
  losses_.push_back(std::numeric_limits<float>::quiet_NaN());

  // Apply G[t-K+1]: with K = 1, or during the synchronous steps, that is this step's own
  // aggregate. Steps before finished_ were applied already: after a restore from a drained
  // snapshot, and for the first K-1 pipelined steps after the synchronous ones.
  const int64_t lag = t < options_.sync_warmup_steps ? 0 : k - 1;
  if (t - lag >= finished_) Finish(t - lag, /*apply=*/true);
}

void Trainer::CheckAggregate(int index, int64_t s, const char* what,
                             const char* consequence) {
  const SlotSummary summary = store_->Summary(index);
  const int64_t bad = summary.first_nonfinite;
  const float value = summary.nonfinite_value;
  if (bad < 0) return;
  Throw(ErrorCode::kNumerical, "rank {}: step {}: the {} has a non-finite value ({}) at {} {}; {}",
        comm_.rank(), s, what, value,
        static_cast<size_t>(bad) == num_params_ ? "the loss, element" : "parameter", bad,
        consequence);
}

void Trainer::Finish(int64_t s, bool apply) {
  PSGD_CHECK_EQ(s, finished_);
  const int index = static_cast<int>(s % options_.pipeline_width);
  Slot& slot = slots_[index];
  PSGD_CHECK_EQ(slot.step, s);
  {
    timeline::Span span(timeline_, timeline::kCompute, "wait_aggregate");
    std::unique_lock<std::mutex> lock(mu_);
    WaitJob(lock, slot.job, s);
  }
  const float loss = store_->Loss(index);
  losses_[s] = loss;
  // Checked only for updates that are applied: Drain(false) after an error must still release
  // every slot (so no peer is left inside a collective), whatever the values.
  if (apply && !std::isfinite(loss)) {
    Throw(ErrorCode::kNumerical,
          "rank {}: step {}: the loss averaged over ranks is {}: training diverged (try a lower "
          "learning rate or momentum); stopping without applying this update",
          comm_.rank(), s, loss);
  }
  if (apply) {
    CheckAggregate(index, s, "averaged gradient", "stopping without applying this update");
    timeline::Span span(timeline_, timeline::kCompute, "update");
    if (!predicted_.empty() && steps_ == s + 2) {
      // One step (s + 1) stays in flight: the next gradient's point comes out of the same pass.
      const size_t next = static_cast<size_t>((s + 1) % options_.pipeline_width);
      optimizer_.ApplyAndPredict(params_, store_->host_slot(index).first(num_params_),
                                 local_.empty() ? std::span<const float>(zeros_)
                                                : std::span<const float>(local_[next]),
                                 predicted_);
      predicted_for_ = steps_;
    } else {
      store_->Apply(optimizer_, index, params_);
    }
    ++applied_;
  }
  slot.busy = false;
  finished_ = s + 1;
}

void Trainer::HarvestLosses() {
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    if (slot.busy && slot.job.done) losses_[slot.step] = store_->Loss(static_cast<int>(i));
  }
}

void Trainer::Sync() {
  std::unique_lock<std::mutex> lock(mu_);
  for (Slot& slot : slots_) {
    if (slot.busy) WaitJob(lock, slot.job, slot.step);
  }
  HarvestLosses();
}

void Trainer::Drain(bool apply) {
  while (finished_ < steps_) Finish(finished_, apply);
}

void Trainer::AllReduce(std::span<float> data, ReduceOp op) {
  Job job;
  job.data = data;
  job.op = op;
  job.call.compress = false;  // metrics and checks: exact
  Submit(job);
  std::unique_lock<std::mutex> lock(mu_);
  WaitJob(lock, job, steps_);
  HarvestLosses();  // every gradient submitted before `job` has finished too
}

float Trainer::StepLoss(int64_t step) const {
  if (step < 0 || step >= static_cast<int64_t>(losses_.size())) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  return losses_[step];
}

WireTotals Trainer::wire_totals() const {
  std::lock_guard<std::mutex> lock(mu_);
  return wire_;
}

TrainerSnapshot Trainer::Snapshot() {
  if (!store_->checkpointable()) {
    Throw(ErrorCode::kInvalidArgument,
          "checkpoints with a gradient reducer (comm.powersgd_rank) are not implemented: its "
          "residual and warm-start factors are not saved");
  }
  Sync();
  TrainerSnapshot snapshot;
  snapshot.steps = steps_;
  snapshot.applied = applied_;
  snapshot.losses = losses_;
  for (int64_t s = finished_; s < steps_; ++s) {
    const int index = static_cast<int>(s % options_.pipeline_width);
    const Slot& slot = slots_[index];
    PSGD_CHECK_EQ(slot.step, s);
    CheckAggregate(index, s, "pending aggregate", "not taking a checkpoint of this state");
    std::vector<float> aggregate(num_params_ + 1);
    store_->Read(index, aggregate);
    std::vector<float> local;
    if (!local_.empty()) local = local_[static_cast<size_t>(index)];
    snapshot.pending.push_back({s, std::move(aggregate), std::move(local)});
  }
  return snapshot;
}

void Trainer::Restore(const TrainerSnapshot& snapshot) {
  PSGD_CHECK_EQ(steps_, 0);
  const int64_t k = options_.pipeline_width;
  const auto pending = static_cast<int64_t>(snapshot.pending.size());
  // A drained snapshot (the end of a run) has none: the pipeline then refills, as at step 0.
  const int64_t expected_pending = std::min<int64_t>(k - 1, snapshot.steps);
  if (snapshot.steps < 0 || pending > expected_pending ||
      snapshot.losses.size() != static_cast<size_t>(snapshot.steps)) {
    Throw(ErrorCode::kDataLoss,
          "trainer snapshot at step {} has {} pending aggregates and {} losses: expected at most "
          "{} pending (pipeline width {}) and {} losses",
          snapshot.steps, pending, snapshot.losses.size(), expected_pending, k, snapshot.steps);
  }
  for (int64_t i = 0; i < pending; ++i) {
    const TrainerSnapshot::Pending& p = snapshot.pending[i];
    const size_t local_size = local_.empty() ? 0 : num_params_;
    if (p.local.size() != local_size) {
      Throw(ErrorCode::kDataLoss,
            "trainer snapshot at step {}: pending step {} has {} floats of this rank's own "
            "gradient; expected {} (the staleness compensation of this trainer)",
            snapshot.steps, p.step, p.local.size(), local_size);
    }
    if (p.step != snapshot.steps - pending + i || p.aggregate.size() != num_params_ + 1) {
      Throw(ErrorCode::kDataLoss,
            "trainer snapshot at step {}: pending aggregate {} is for step {} with {} floats; "
            "expected step {} with {}",
            snapshot.steps, i, p.step, p.aggregate.size(), snapshot.steps - pending + i,
            num_params_ + 1);
    }
  }
  steps_ = snapshot.steps;
  applied_ = snapshot.applied;
  finished_ = snapshot.steps - pending;
  predicted_for_ = -1;
  losses_ = snapshot.losses;
  for (const TrainerSnapshot::Pending& p : snapshot.pending) {
    const int index = static_cast<int>(p.step % k);
    Slot& slot = slots_[index];
    store_->Write(index, p.aggregate);
    slot.job.slot = index;
    if (!local_.empty()) local_[static_cast<size_t>(index)] = p.local;
    slot.step = p.step;
    slot.busy = true;
    slot.job.done = true;  // reduced before the checkpoint; nothing to send
  }
}

}  // namespace pipesgd::train
