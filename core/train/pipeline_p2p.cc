#include "core/train/pipeline_p2p.h"

#include <exception>

#include "core/base/error.h"
#include "core/base/log.h"

namespace pipesgd::train {

const char* TensorKindName(TensorKind kind) {
  switch (kind) {
    case TensorKind::kActivation:
      return "activations";
    case TensorKind::kGradient:
      return "gradients";
  }
  return "unknown tensors";
}

StageLink::StageLink(transport::Transport& transport, transport::Connection& connection,
                     int stage, int peer_stage)
    : transport_(transport), connection_(connection), stage_(stage), peer_stage_(peer_stage) {}

StageLink::~StageLink() {
  try {
    WaitSends(Deadline::After(30));
  } catch (const std::exception& e) {
    PSGD_LOG_WARN("stage {}: a send to stage {} failed while closing: {}", stage_, peer_stage_,
                  e.what());
  }
}

void StageLink::Reap() {
  while (!sends_.empty() && sends_.front().op.done) {
    std::exception_ptr error = sends_.front().op.error;
    sends_.pop_front();
    if (error) std::rethrow_exception(error);
  }
}

uint64_t StageLink::Send(TensorKind kind, int64_t step, int micro_batch, size_t rows,
                     const layers::Shape& shape, const float* data) {
  Reap();
  PendingSend& send = sends_.emplace_back();
  send.seq = next_seq_++;
  send.header.magic = kTensorMagic;
  send.header.kind = static_cast<uint32_t>(kind);
  send.header.from_stage = stage_;
  send.header.micro_batch = micro_batch;
  send.header.step = step;
  send.header.rows = rows;
  send.header.channels = shape.channels;
  send.header.height = shape.height;
  send.header.width = shape.width;
  const size_t bytes = rows * shape.size() * sizeof(float);
  send.op.Set(&send.header, sizeof(TensorHeader), data, bytes);
  bytes_sent_ += sizeof(TensorHeader) + bytes;
  connection_.PostSend(send.op);
  return send.seq;
}

void StageLink::Recv(TensorKind kind, int64_t step, int micro_batch, size_t rows,
                     const layers::Shape& shape, float* data, Deadline deadline) {
  const int me = transport_.rank();
  const int peer = connection_.peer_rank();
  recv_op_.Set(&recv_header_, sizeof(TensorHeader));
  connection_.PostRecv(recv_op_);
  transport_.Wait(recv_op_, deadline, "pipeline tensor header");
  const TensorHeader& h = recv_header_;
  if (h.magic != kTensorMagic) {
    Throw(ErrorCode::kDataLoss,
          "stage {} (rank {}): the frame from stage {} (rank {}) is not a pipeline tensor (magic "
          "{:#x}, expected {:#x})",
          stage_, me, peer_stage_, peer, h.magic, kTensorMagic);
  }
  const layers::Shape got{h.channels, h.height, h.width};
  if (h.kind != static_cast<uint32_t>(kind) || h.from_stage != peer_stage_ || h.step != step ||
      h.micro_batch != micro_batch) {
    Throw(ErrorCode::kDataLoss,
          "stage {} (rank {}) expects {} of step {} micro-batch {} from stage {} (rank {}), "
          "which sent {} of step {} micro-batch {} as stage {}",
          stage_, me, TensorKindName(kind), step, micro_batch, peer_stage_, peer,
          TensorKindName(static_cast<TensorKind>(h.kind)), h.step, h.micro_batch, h.from_stage);
  }
  if (h.rows != rows || got != shape) {
    Throw(ErrorCode::kDataLoss,
          "stage {} (rank {}) expects {} of {} rows x {} per sample from stage {} (rank {}), "
          "which sent {} rows x {}",
          stage_, me, TensorKindName(kind), rows, layers::ToString(shape), peer_stage_, peer,
          h.rows, layers::ToString(got));
  }
  recv_op_.Set(data, rows * shape.size() * sizeof(float));
  connection_.PostRecv(recv_op_);
  transport_.Wait(recv_op_, deadline, "pipeline tensor payload");
  Reap();
}

void StageLink::WaitSend(uint64_t seq, Deadline deadline) {
  Reap();
  while (!sends_.empty() && sends_.front().seq <= seq) {
    transport_.Wait(sends_.front().op, deadline, "pipeline tensor send");
    Reap();
  }
}

void StageLink::WaitSends(Deadline deadline) {
  while (!sends_.empty()) {
    transport_.Wait(sends_.front().op, deadline, "pipeline tensor send");
    Reap();
  }
}

}  // namespace pipesgd::train
