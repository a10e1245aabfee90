#include "core/train/pipeline_trainer.h"

#include <cmath>
#include <limits>
#include <numeric>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/timeline.h"

namespace pipesgd::train {

AllReplicas::AllReplicas(int pipelines) : all_(static_cast<size_t>(std::max(pipelines, 1))) {
  std::iota(all_.begin(), all_.end(), 0);
}

GroupDecision AllReplicas::Next(int64_t step) {
  GroupDecision d;
  d.round = round_++;
  d.kind = RoundKind::kConnect;
  d.members = all_;
  d.updates = step * static_cast<int64_t>(all_.size());
  return d;
}

PipelineTrainer::PipelineTrainer(collective::GroupCommunicator& comm,
                                 const PipelineLayout& layout, PipelineStage& stage,
                                 Optimizer& optimizer, MicroBatchSource& data,
                                 GroupSource& groups, const PipelineTrainerOptions& options)
    : comm_(comm),
      layout_(layout),
      stage_(stage),
      optimizer_(optimizer),
      data_(data),
      groups_(groups),
      options_(options) {
  if (layout.stages < 1 || layout.pipelines < 1 ||
      layout.stages * layout.pipelines != comm.world_size()) {
    Throw(ErrorCode::kInvalidArgument,
          "pipeline layout of {} stages x {} pipelines does not match the world size {}",
          layout.stages, layout.pipelines, comm.world_size());
  }
  if (options.micro_batches < 1 || options.micro_batch_rows < 1) {
    Throw(ErrorCode::kInvalidArgument,
          "pipeline micro_batches ({}) and micro-batch rows ({}) must be >= 1",
          options.micro_batches, options.micro_batch_rows);
  }
  stage_index_ = layout.stage_of(comm.rank());
  pipeline_ = layout.pipeline_of(comm.rank());
  const int M = layout.stages;
  const bool first = stage_index_ == 0, last = stage_index_ == M - 1;
  if (stage.has_loss() != last) {
    Throw(ErrorCode::kInvalidArgument, "rank {} is stage {} of {}, but its model part {} a loss",
          comm.rank(), stage_index_, M, stage.has_loss() ? "has" : "lacks");
  }
  slots_ = MaxInFlight(M, stage_index_, options.micro_batches);
  if (stage.max_in_flight() < slots_) {
    Throw(ErrorCode::kInvalidArgument,
          "stage {} holds up to {} micro-batches in flight with {} micro-batches, its model part "
          "has {} slots",
          stage_index_, slots_, options.micro_batches, stage.max_in_flight());
  }
  schedule_ = OneFOneBSchedule(M, stage_index_, options.micro_batches);

  std::vector<int> peers;
  if (!first) peers.push_back(layout.rank_of(pipeline_, stage_index_ - 1));
  if (!last) peers.push_back(layout.rank_of(pipeline_, stage_index_ + 1));
  for (int q = 0; q < layout.pipelines; ++q) {
    if (q != pipeline_) peers.push_back(layout.rank_of(q, stage_index_));
  }
  comm.ConnectPeers(peers, Deadline::After(options.timeout_s));
  if (!first) {
    prev_ = std::make_unique<StageLink>(
        comm.transport(), comm.connection(layout.rank_of(pipeline_, stage_index_ - 1)),
        stage_index_, stage_index_ - 1);
  }
  if (!last) {
    next_ = std::make_unique<StageLink>(
        comm.transport(), comm.connection(layout.rank_of(pipeline_, stage_index_ + 1)),
        stage_index_, stage_index_ + 1);
  }
  grads_.assign(stage.num_params(), 0.0f);
  labels_.assign(options.micro_batch_rows, 0);
  buffer_.assign(stage.num_params() + 1, 0.0f);
  act_sends_.assign(static_cast<size_t>(slots_), std::nullopt);
  grad_sends_.assign(static_cast<size_t>(slots_), std::nullopt);
}

PipelineTrainer::~PipelineTrainer() = default;

uint64_t PipelineTrainer::p2p_bytes_sent() const {
  return (prev_ ? prev_->bytes_sent() : 0) + (next_ ? next_->bytes_sent() : 0);
}

GroupDecision PipelineTrainer::Step() {
  const int64_t t = steps_;
  const size_t rows = options_.micro_batch_rows;
  const layers::Shape in = stage_.in_shape(), out = stage_.out_shape();
  const bool first = prev_ == nullptr, last = next_ == nullptr;
  double loss_sum = 0;
  if (timeline_) {
    timeline_->SetStep(timeline::kCompute, t);
    timeline_->SetStep(timeline::kComm, t);
  }
  for (const PipelineOp& op : schedule_) {
    const int mb = op.micro_batch;
    const size_t slot = static_cast<size_t>(mb % slots_);
    const Deadline deadline = Deadline::After(options_.timeout_s);
    if (op.kind == PipelineOp::Kind::kForward) {
      float* x = stage_.InputBuffer(mb);
      if (first) {
        data_.Load(t, pipeline_, mb, x, last ? labels_.data() : nullptr);
      } else {
        timeline::Span recv(timeline_, timeline::kCompute, "recv", mb);
        prev_->Recv(TensorKind::kActivation, t, mb, rows, in, x, deadline);
        recv.End();
        if (last) data_.Load(t, pipeline_, mb, nullptr, labels_.data());
      }
      // The slot's output is about to be overwritten: the send of its previous micro-batch's
      // activations must be done (it is, by the 1F1B order; this only reaps its completion).
      if (!last && act_sends_[slot]) next_->WaitSend(*act_sends_[slot], deadline);
      const layers::BatchKey key{
          .seed = options_.seed,
          .step = static_cast<uint64_t>(t),
          .first_row = (static_cast<uint64_t>(pipeline_) * options_.micro_batches + mb) * rows};
      timeline::Span forward(timeline_, timeline::kCompute, "forward", mb);
      const float loss = stage_.Forward(mb, rows, key, last ? labels_.data() : nullptr);
      forward.End();
      if (last) {
        if (!std::isfinite(loss)) {
          Throw(ErrorCode::kNumerical,
                "rank {} (stage {}): step {} micro-batch {}: the loss is {}: training diverged "
                "(try a lower learning rate or momentum); stopping without applying this update",
                comm_.rank(), stage_index_, t, mb, loss);
        }
        loss_sum += loss;
      } else {
        act_sends_[slot] = next_->Send(TensorKind::kActivation, t, mb, rows, out, stage_.Output(mb));
      }
    } else {
      if (!last) {
        timeline::Span recv(timeline_, timeline::kCompute, "recv", mb);
        next_->Recv(TensorKind::kGradient, t, mb, rows, out, stage_.OutputGradBuffer(mb), deadline);
      }
      if (!first && grad_sends_[slot]) prev_->WaitSend(*grad_sends_[slot], deadline);
      timeline::Span backward(timeline_, timeline::kCompute, "backward", mb);
      const int64_t used = stage_.Backward(mb, grads_);
      backward.End();
      stash_lags_.push_back(stage_.version() - used);
      for (size_t i = 0; i < grads_.size(); ++i) {
        if (!std::isfinite(grads_[i])) {
          Throw(ErrorCode::kNumerical,
                "rank {} (stage {}): step {} micro-batch {}: the gradient has a non-finite value "
                "({}) at parameter {}; stopping without applying this update",
                comm_.rank(), stage_index_, t, mb, grads_[i], i);
        }
      }
      if (!first) {
        grad_sends_[slot] = prev_->Send(TensorKind::kGradient, t, mb, rows, in, stage_.InputGrad(mb));
      }
      timeline::Span update(timeline_, timeline::kCompute, "update", mb);
      stage_.Update(optimizer_, grads_);
    }
  }
  // Every tensor of this minibatch has left before the slots are reused by the next one.
  const Deadline deadline = Deadline::After(options_.timeout_s);
  if (prev_) prev_->WaitSends(deadline);
  if (next_) next_->WaitSends(deadline);
  std::fill(act_sends_.begin(), act_sends_.end(), std::nullopt);
  std::fill(grad_sends_.begin(), grad_sends_.end(), std::nullopt);
  steps_ = t + 1;

  const float loss = last ? static_cast<float>(loss_sum / options_.micro_batches)
                          : std::numeric_limits<float>::quiet_NaN();
  timeline::Span wait_group(timeline_, timeline::kCompute, "wait_group");
  GroupDecision d = groups_.Next(steps_);
  wait_group.End();
  std::vector<int> ranks;
  for (int p : d.members) {
    if (p < 0 || p >= layout_.pipelines) {
      Throw(ErrorCode::kInvalidArgument,
            "rank {} (stage {}): the group scheduler named pipeline {}, expected [0, {})",
            comm_.rank(), stage_index_, p, layout_.pipelines);
    }
    ranks.push_back(layout_.rank_of(p, stage_index_));
  }
  if (ranks.size() > 1) {
    const std::span<const float> w = stage_.params();
    std::copy(w.begin(), w.end(), buffer_.begin());
    buffer_.back() = last ? loss : 0.0f;
    collective::AllReduceOptions call;
    call.compress = t >= options_.compression_warmup_steps;
    call.exact_tail = 1;
    timeline::Span average(timeline_, timeline::kComm, "average");
    comm_.AllReduce(buffer_, collective::ReduceOp::kAverage, ranks,
                    Deadline::After(options_.timeout_s), nullptr, call);
    average.End();
    stage_.SetParams(std::span<const float>(buffer_).first(grads_.size()));
    losses_.push_back(last ? buffer_.back() : std::numeric_limits<float>::quiet_NaN());
    sync_wire_bytes_ += comm_.last_wire_stats().bytes_sent;
    ++syncs_;
  } else {
    losses_.push_back(loss);
    ++skipped_;
  }
  return d;
}

DatasetMicroBatches::DatasetMicroBatches(const data::Dataset& train, size_t batch, size_t rows,
                                         int pipeline, int pipelines, uint64_t seed,
                                         const data::InputScaling& scaling)
    : train_(train),
      rows_(rows),
      scaling_(scaling),
      sampler_(train.count, batch, pipeline, pipelines, seed),
      x_(rows * train.features),
      labels_(rows) {
  PSGD_CHECK(rows >= 1 && batch % rows == 0);
}

void DatasetMicroBatches::Load(int64_t step, int, int mb, float* x, uint8_t* labels) {
  const auto per_epoch = static_cast<int64_t>(sampler_.steps_per_epoch());
  const auto indices = sampler_.Batch(static_cast<int>(step / per_epoch),
                                      static_cast<size_t>(step % per_epoch));
  const auto part = indices.subspan(static_cast<size_t>(mb) * rows_, rows_);
  data::GatherBatch(train_, part, x != nullptr ? x : x_.data(),
                    labels != nullptr ? labels : labels_.data(), scaling_);
}

FullSyncPlan::FullSyncPlan(int period, const RunPlan& plan, int pipelines)
    : period_(period), plan_(plan), all_(static_cast<size_t>(pipelines)) {
  PSGD_CHECK(period >= 1 && pipelines >= 1);
  std::iota(all_.begin(), all_.end(), 0);
  last_request_ = plan.total_steps();
  while (last_request_ > 0 && FullSync(last_request_)) --last_request_;
}

bool FullSyncPlan::FullSync(int64_t step) const {
  return step % period_ == 0 || plan_.EvaluatesAfter(step);
}

GroupDecision FullSyncPlan::Decision(int64_t step) const {
  GroupDecision d;
  const bool epoch_end = plan_.EpochEndAt(step);
  d.kind = epoch_end ? RoundKind::kBarrier : RoundKind::kConnect;
  d.members = all_;
  d.epoch_end = epoch_end;
  d.evaluate = plan_.EvaluatesAfter(step);
  d.epoch = plan_.EpochOf(step);
  d.stop = step == plan_.total_steps();
  return d;
}

}  // namespace pipesgd::train
