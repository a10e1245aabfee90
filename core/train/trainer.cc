#include "core/train/trainer.h"

#include <cmath>
#include <limits>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::train {

using collective::ReduceOp;

Trainer::Trainer(collective::Communicator& comm, Objective& objective, Optimizer& optimizer,
                 std::span<float> params, const TrainerOptions& options)
    : comm_(comm),
      objective_(objective),
      optimizer_(optimizer),
      params_(params),
      options_(options),
      num_params_(objective.num_params()) {
  if (options.pipeline_width < 1) {
    Throw(ErrorCode::kInvalidArgument, "pipeline width {}: expected an integer >= 1",
          options.pipeline_width);
  }
  if (params.size() != num_params_) {
    Throw(ErrorCode::kInvalidArgument, "trainer got {} parameters, the objective has {}",
          params.size(), num_params_);
  }
  slots_.resize(options.pipeline_width);
  for (Slot& slot : slots_) {
    slot.buffer.assign(num_params_ + 1, 0.0f);
    // Registered once, so RDMA transports move it with no per-step registration.
    slot.region = comm_.RegisterMemory(slot.buffer);
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
      if (timeline_ && job->step >= 0) timeline_->SetStep(timeline::kComm, job->step);
      timeline::Span span(job->step >= 0 ? timeline_ : nullptr, timeline::kComm, "allreduce");
      comm_.AllReduce(job->data, job->op, Deadline::After(options_.timeout_s), &abort_,
                      job->call);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      comm_error_ = std::current_exception();
      cv_.notify_all();
      return;  // the communicator is unusable now; every later wait rethrows comm_error_
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (job->gradient) {
        const collective::WireStats& stats = comm_.last_wire_stats();
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

void Trainer::Step() {
  const int64_t t = steps_;
  const int k = options_.pipeline_width;
  Slot& slot = slots_[t % k];
  PSGD_CHECK(!slot.busy);  // Finish() released it K steps ago
  if (timeline_) timeline_->SetStep(timeline::kCompute, t);

  std::span<float> grads(slot.buffer.data(), num_params_);
  const float loss = objective_.ComputeGradient(t, params_, grads);
  slot.buffer[num_params_] = loss;
  slot.step = t;
  slot.busy = true;
  slot.job.data = slot.buffer;
  slot.job.op = ReduceOp::kAverage;
  slot.job.gradient = true;
  slot.job.step = t;
  slot.job.call.compress = t >= options_.compression_warmup_steps;
  slot.job.call.exact_tail = 1;  // the loss: reported exactly, never error-fed
  Submit(slot.job);
  steps_ = t + 1;
  losses_.push_back(std::numeric_limits<float>::quiet_NaN());

  // Apply G[t-K+1]: with K = 1 that is this step's own aggregate (synchronous SGD). After a
  // restore from a drained snapshot, steps before finished_ were applied already.
  if (t - k + 1 >= finished_) Finish(t - k + 1, /*apply=*/true);
}

void Trainer::Finish(int64_t s, bool apply) {
  PSGD_CHECK_EQ(s, finished_);
  Slot& slot = slots_[s % options_.pipeline_width];
  PSGD_CHECK_EQ(slot.step, s);
  {
    timeline::Span span(timeline_, timeline::kCompute, "wait_aggregate");
    std::unique_lock<std::mutex> lock(mu_);
    WaitJob(lock, slot.job, s);
  }
  const float loss = slot.buffer[num_params_];
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
    for (size_t i = 0; i < num_params_; ++i) {
      if (!std::isfinite(slot.buffer[i])) {
        Throw(ErrorCode::kNumerical,
              "rank {}: step {}: the averaged gradient has a non-finite value ({}) at parameter "
              "{}; stopping without applying this update",
              comm_.rank(), s, slot.buffer[i], i);
      }
    }
    timeline::Span span(timeline_, timeline::kCompute, "update");
    optimizer_.Apply(params_, std::span<const float>(slot.buffer.data(), num_params_));
    ++applied_;
  }
  slot.busy = false;
  finished_ = s + 1;
}

void Trainer::HarvestLosses() {
  for (Slot& slot : slots_) {
    if (slot.busy && slot.job.done) losses_[slot.step] = slot.buffer[num_params_];
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
  Sync();
  TrainerSnapshot snapshot;
  snapshot.steps = steps_;
  snapshot.applied = applied_;
  snapshot.losses = losses_;
  for (int64_t s = finished_; s < steps_; ++s) {
    const Slot& slot = slots_[s % options_.pipeline_width];
    PSGD_CHECK_EQ(slot.step, s);
    for (size_t i = 0; i < slot.buffer.size(); ++i) {
      if (!std::isfinite(slot.buffer[i])) {
        Throw(ErrorCode::kNumerical,
              "rank {}: step {}: the pending aggregate has a non-finite value ({}) at element "
              "{}; not taking a checkpoint of this state",
              comm_.rank(), s, slot.buffer[i], i);
      }
    }
    snapshot.pending.push_back({s, slot.buffer});
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
  losses_ = snapshot.losses;
  for (const TrainerSnapshot::Pending& p : snapshot.pending) {
    Slot& slot = slots_[p.step % k];
    slot.buffer = p.aggregate;
    slot.step = p.step;
    slot.busy = true;
    slot.job.data = slot.buffer;
    slot.job.done = true;  // reduced before the checkpoint; nothing to send
  }
}

}  // namespace pipesgd::train
