// Parameter-server baselines (the conventional schemes Pipe-SGD is compared against: Li et al.,
// NeurIPS 2018, Sec. 1 and Fig. 1(a); Dean et al. 2012 "Downpour SGD" for the asynchronous
// one), on the same transports, model, data and optimizer as the ring trainer.
//
// Layout: rank 0 is a dedicated server; it holds the weights and the optimizer state and
// computes no gradients. Ranks 1..W (W = world size - 1) are the workers; worker w trains on
// shard w-1 of W of every global batch, so the global batch is batch_size * W, as a ring job
// of W ranks. One connection per worker, star-shaped.
//
//   synchronous (PS_SYNC): step t: every worker pushes g_w[t] computed on w[t]; the server waits
//     for all W, sums them in worker order 1..W, divides by W, applies the optimizer once:
//     w[t+1] = w[t] - lr * (1/W) sum_w g_w[t], and sends w[t+1] to every worker. The same
//     recurrence as the ring with width 1; only the order of the additions differs.
//   asynchronous (PS_ASYNC): each worker loops: push its gradient, receive the weights. The
//     server applies each gradient as soon as it arrives, scaled by 1/W (so that W pushes move
//     the weights as far as one synchronous step), and answers that worker alone with the
//     weights as they are right after: w <- w - lr * g_w / W. A worker's gradient is therefore
//     computed on weights that are up to W-1 updates old (random staleness).
//
// Evaluation and other counts (SumOverWorkers) go through the server too: it waits until every
// worker has sent its vector, sums them in worker order and sends the sum to all.
//
// Wire: every message is a 32-byte PsHeader followed by `count` float32 values, sent as one op
// of two parts (header, payload) and received as two receives, so the message transports (UCX,
// ibverbs) see mirrored parts. Every header is checked (magic, kind, step, count) and a mismatch
// throws Error(kDataLoss) naming both ranks and both values.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/base/deadline.h"
#include "core/base/error.h"
#include "core/base/timeline.h"
#include "core/train/trainer.h"
#include "transport/transport.h"

namespace pipesgd::train {

enum class PsMode : uint8_t { kSync = 1, kAsync = 2 };

// 32 bytes, host byte order (little-endian on every supported platform).
struct PsHeader {
  static constexpr uint32_t kMagic = 0x50475350;  // "PSGP"
  enum Kind : uint32_t {
    kPush = 1,     // worker -> server: count = num_params + 1 (gradient, then the local loss)
    kWeights = 2,  // server -> worker: count = num_params + 1 (weights, then a loss, see Step)
    kSum = 3,      // worker -> server: a vector to sum over the workers
    kSumResult = 4,  // server -> worker: the sum
    kBye = 5,      // worker -> server: no more messages (count 0)
  };
  uint32_t magic = kMagic;
  uint32_t kind = 0;
  int64_t step = 0;   // the push's step (kPush, kWeights); the call's index (kSum, kSumResult)
  uint64_t count = 0;  // float32 values that follow
  uint32_t sender_rank = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(PsHeader) == 32);

// Checks `got` against what `rank` expects from `peer`. Throws Error(kDataLoss) naming both.
void CheckPsHeader(const PsHeader& got, uint32_t kind, int64_t step, uint64_t count, int rank,
                   int peer);

struct PsOptions {
  PsMode mode = PsMode::kSync;
  double timeout_s = 120;  // bound on every wait for a message
};

// Rank 0. `workers[i]` is the connection to rank i + 1; `transport` drives them. `params` (the
// initial weights, the same on every rank) must outlive the server.
class PsServer {
 public:
  PsServer(transport::Transport& transport, std::vector<transport::Connection*> workers,
           Optimizer& optimizer, std::span<float> params, const PsOptions& options);
  PsServer(const PsServer&) = delete;
  PsServer& operator=(const PsServer&) = delete;

  // Serves until every worker has said bye. Throws Error: kDataLoss (a bad header),
  // kUnavailable (a worker is gone), kDeadlineExceeded (no message for timeout_s),
  // kNumerical (a non-finite pushed loss: names the worker and step); the transport is then
  // closed (its pending receives fail before this server's ops are freed).
  void Run();

  // Updates applied (sync: one per step; async: one per push).
  int64_t updates() const { return updates_; }
  // The largest staleness seen: updates applied between a worker's pull of the weights and
  // the arrival of the gradient computed on them (sync: always 0).
  int64_t max_staleness() const { return max_staleness_; }

  // Spans of the server's own work (the sum of the W gradients, the update) at the step of the
  // push they serve, so that a job's --timeline has rank 0 beside its workers.
  void set_timeline(timeline::Recorder* recorder) { timeline_ = recorder; }

 private:
  struct Peer {
    transport::Connection* conn = nullptr;
    int rank = 0;
    PsHeader recv_header;
    transport::Op header_op;
    transport::Op payload_op;
    std::vector<float> inbox;       // the received payload
    PsHeader send_header;
    transport::Op send_op;
    std::vector<float> outbox;      // weights (async) or a sum, as sent
    bool reading_payload = false;
    bool message_ready = false;     // a whole message is in recv_header + inbox
    bool bye = false;
    bool send_posted = false;
    int64_t pulled_at = 0;          // updates_ when this worker last received weights
  };

  void Serve();  // Run's loop
  void PostHeader(Peer& p);
  // Advances p's receive; true when a whole message has arrived.
  bool Progress(Peer& p);
  void Handle(Peer& p);
  void Send(Peer& p, uint32_t kind, int64_t step, std::span<const float> values);
  void FlushSends(Peer& p);
  void SyncStepIfReady();
  void SumIfReady();

  transport::Transport& transport_;
  Optimizer& optimizer_;
  std::span<float> params_;
  PsOptions options_;
  const size_t num_params_;
  std::vector<Peer> peers_;
  std::vector<float> accumulate_;  // num_params + 1
  int64_t updates_ = 0;
  int64_t max_staleness_ = 0;
  int64_t sync_step_ = 0;
  int64_t sum_calls_ = 0;
  timeline::Recorder* timeline_ = nullptr;
};

// Ranks 1..W. Computes a gradient on the weights it holds, pushes it and replaces its weights
// with the server's answer. Single-threaded: a PS worker has nothing to overlap (that is the
// point of the comparison).
class PsWorker {
 public:
  // `server` connects to rank 0; `params` (initial weights) must outlive the worker.
  PsWorker(transport::Transport& transport, transport::Connection& server, Objective& objective,
           std::span<float> params, int rank, const PsOptions& options);
  PsWorker(const PsWorker&) = delete;
  PsWorker& operator=(const PsWorker&) = delete;

  // Step t = steps(): g = grad on the weights held; push; receive new weights into params.
  // The returned loss is the mean over workers of step t (sync) or this worker's own (async).
  // Throws Error: kDataLoss, kUnavailable, kDeadlineExceeded, kNumerical (own loss non-finite);
  // after a failed exchange with the server the transport is closed.
  void Step();
  int64_t steps() const { return steps_; }
  float StepLoss(int64_t step) const;

  // Sums `data` over the workers through the server (every worker must call it, in the same
  // order, with the same size), in place.
  void SumOverWorkers(std::span<float> data);

  // Tells the server this worker is done (no message may follow).
  void Bye();

  // Bytes of the gradient pushes sent so far (headers and payloads).
  uint64_t bytes_sent() const { return push_bytes_; }

  void set_timeline(timeline::Recorder* recorder) { timeline_ = recorder; }

 private:
  void Exchange(uint32_t kind, int64_t step, std::span<const float> out, uint32_t reply_kind,
                std::span<float> in);

  transport::Transport& transport_;
  transport::Connection& server_;
  Objective& objective_;
  std::span<float> params_;
  int rank_;
  PsOptions options_;
  std::vector<float> buffer_;  // gradient + loss; then weights + loss
  std::vector<float> losses_;
  int64_t steps_ = 0;
  int64_t sums_ = 0;
  uint64_t push_bytes_ = 0;
  timeline::Recorder* timeline_ = nullptr;
};

}  // namespace pipesgd::train
