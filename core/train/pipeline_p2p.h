// Point-to-point tensors between consecutive pipeline stages (activations forward, their
// gradients backward) over one transport::Connection, the same transports the ring uses.
//
// Each tensor is one send of two parts, a fixed 64-byte header and the payload (rows x shape
// floats, row-major); the receiver reads the header first, checks it against what its schedule
// expects (kind, step, micro-batch, rows, per-sample shape) and only then receives the payload
// into the caller's buffer, so a wrong tensor is reported and never lands in memory. Receives
// mirror the sender's parts, as the message transports require (transport/transport.h,
// Framing). Sends do not block: they complete while the caller waits for something else (the
// transport makes progress on every connection while any op is waited for), which is what lets
// the 1F1B schedule run with blocking receives only.
//
// Thread-compatible: one thread (the stage's) uses a link and its transport.
#pragma once

#include <cstdint>
#include <deque>

#include "core/base/deadline.h"
#include "layers/layer.h"
#include "transport/transport.h"

namespace pipesgd::train {

enum class TensorKind : uint32_t { kActivation = 1, kGradient = 2 };

// On the wire, little-endian host order (every rank of a job runs the same build).
struct TensorHeader {
  uint32_t magic = 0;        // kTensorMagic
  uint32_t kind = 0;         // TensorKind
  int32_t from_stage = 0;
  int32_t micro_batch = 0;
  int64_t step = 0;          // the minibatch (global step) the micro-batch belongs to
  uint64_t rows = 0;         // samples
  uint64_t channels = 0;     // per-sample shape
  uint64_t height = 0;
  uint64_t width = 0;
  uint64_t reserved = 0;
};
static_assert(sizeof(TensorHeader) == 64);
inline constexpr uint32_t kTensorMagic = 0x50535450;  // "PTSP"

// "activations" / "gradients".
const char* TensorKindName(TensorKind kind);

// The link between this stage and one neighbour stage (the previous or the next).
class StageLink {
 public:
  // `connection` to the neighbour's rank, on `transport`; both must outlive the link.
  StageLink(transport::Transport& transport, transport::Connection& connection, int stage,
            int peer_stage);
  // Waits for the sends still in flight (bounded by 30 s); errors are dropped (the transport is
  // failing anyway).
  ~StageLink();
  StageLink(const StageLink&) = delete;
  StageLink& operator=(const StageLink&) = delete;

  // Posts `rows` x `shape` floats at data (which must stay unchanged until the send completes:
  // WaitSend) without blocking. Returns the send's number (0, 1, ... per link).
  uint64_t Send(TensorKind kind, int64_t step, int micro_batch, size_t rows,
            const layers::Shape& shape, const float* data);
  // Receives the neighbour's tensor into data (rows x shape floats), checking its header: a
  // different kind, step or micro-batch, rows or per-sample shape throws Error(kDataLoss) naming
  // both stages, both ranks and both values (for the shape: "stage 1 (rank 1) expects
  // activations of 64 rows x 20x1x1 per sample from stage 0 (rank 0), which sent 64 rows x
  // 30x1x1"). Also throws what Transport::Wait throws (kDeadlineExceeded, kUnavailable, ...).
  void Recv(TensorKind kind, int64_t step, int micro_batch, size_t rows,
            const layers::Shape& shape, float* data, Deadline deadline);
  // Waits until send number `seq` (and every send before it) has completed; rethrows a send's
  // error.
  void WaitSend(uint64_t seq, Deadline deadline);
  // Waits until every posted send has completed; rethrows a send's error.
  void WaitSends(Deadline deadline);
  size_t sends_in_flight() const { return sends_.size(); }
  uint64_t bytes_sent() const { return bytes_sent_; }

 private:
  struct PendingSend {
    uint64_t seq = 0;
    TensorHeader header;
    transport::Op op;
  };
  void Reap();  // drops completed sends from the front (rethrowing an error)

  transport::Transport& transport_;
  transport::Connection& connection_;
  int stage_;
  int peer_stage_;
  std::deque<PendingSend> sends_;  // deque: elements never move while ops point to them
  TensorHeader recv_header_;
  transport::Op recv_op_;
  uint64_t bytes_sent_ = 0;
  uint64_t next_seq_ = 0;
};

}  // namespace pipesgd::train
