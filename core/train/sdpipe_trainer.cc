#include "core/train/sdpipe_trainer.h"

#include <cmath>
#include <numeric>

#include "core/base/error.h"
#include "core/base/timeline.h"

namespace pipesgd::train {

SdpipeTrainer::SdpipeTrainer(collective::GroupCommunicator& comm, Objective& objective,
                             Optimizer& optimizer, std::span<float> params, GroupSource& groups,
                             const SdpipeOptions& options)
    : comm_(comm),
      objective_(objective),
      optimizer_(optimizer),
      params_(params),
      groups_(groups),
      options_(options) {
  if (params.size() != objective.num_params()) {
    Throw(ErrorCode::kInvalidArgument, "sdpipe trainer got {} parameters, the objective has {}",
          params.size(), objective.num_params());
  }
  grads_.assign(params.size(), 0.0f);
  buffer_.assign(params.size() + 1, 0.0f);
  everyone_.resize(comm.world_size());
  std::iota(everyone_.begin(), everyone_.end(), 0);
}

GroupDecision SdpipeTrainer::Step() {
  const int64_t t = steps_;
  if (timeline_) {
    timeline_->SetStep(timeline::kCompute, t);
    timeline_->SetStep(timeline::kComm, t);
  }
  const float loss = objective_.ComputeGradient(t, params_, grads_);
  if (!std::isfinite(loss)) {
    Throw(ErrorCode::kNumerical,
          "rank {}: step {}: the local loss is {}: training diverged (try a lower learning rate "
          "or momentum); stopping without applying this update",
          comm_.rank(), t, loss);
  }
  for (size_t i = 0; i < grads_.size(); ++i) {
    if (!std::isfinite(grads_[i])) {
      Throw(ErrorCode::kNumerical,
            "rank {}: step {}: the local gradient has a non-finite value ({}) at parameter {}; "
            "stopping without applying this update",
            comm_.rank(), t, grads_[i], i);
    }
  }
  {
    timeline::Span update(timeline_, timeline::kCompute, "update");
    optimizer_.Apply(params_, grads_);
  }
  steps_ = t + 1;

  timeline::Span wait_group(timeline_, timeline::kCompute, "wait_group");
  GroupDecision d = groups_.Next(steps_);
  wait_group.End();
  const int size = static_cast<int>(d.members.size());
  group_sizes_[size] += 1;
  if (size > 1) {
    std::copy(params_.begin(), params_.end(), buffer_.begin());
    buffer_.back() = loss;
    collective::AllReduceOptions call;
    call.compress = t >= options_.compression_warmup_steps;
    call.exact_tail = 1;
    timeline::Span average(timeline_, timeline::kComm, "average");
    comm_.AllReduce(buffer_, collective::ReduceOp::kAverage, d.members,
                    Deadline::After(options_.timeout_s), nullptr, call);
    average.End();
    std::copy(buffer_.begin(), buffer_.end() - 1, params_.begin());
    losses_.push_back(buffer_.back());
    wire_bytes_ += comm_.last_wire_stats().bytes_sent;
    ++syncs_;
  } else {
    losses_.push_back(loss);
    ++skipped_;
  }
  return d;
}

void SdpipeTrainer::AllReduceAll(std::span<float> data, collective::ReduceOp op) {
  collective::AllReduceOptions exact;
  exact.compress = false;
  comm_.AllReduce(data, op, everyone_, Deadline::After(options_.timeout_s), nullptr, exact);
}

}  // namespace pipesgd::train
