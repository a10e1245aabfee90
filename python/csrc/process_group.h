// The "pipesgd" c10d backend: torch.distributed's collectives on pipesgd's ring (TCP, UCX or
// ibverbs, chunk-pipelined), and pipesgd's codecs and PowerSGD for DDP's communication hooks.
//
// Set-up: the transport is made as a job makes it (comm.transport, comm.network_interface or
// PIPESGD_SOCKET_IFNAME, the ib_* fields); its address goes through torch's Store (the group's
// prefix store, as gloo's and UCC's do), together with the effective comm settings and the
// resolved transport, which every rank checks against rank 0's before anything connects. Then
// the ring connects to its two neighbours.
//
// Threads: one communication thread per group runs the collectives in the order they were
// called (c10d's contract: every rank calls them in the same order), so each call returns a
// Work at once and DDP's backward overlaps with the ring, as with gloo. The Work completes on
// that thread; a failure (a dead peer, a deadline, ranks that disagree) completes it with a
// pipesgd Error naming the ranks, and every later call on the group fails naming the first.
//
// Tensors: contiguous, on the CPU (CUDA tensors are staged through host memory: untested where
// no GPU ran them). all_reduce SUM and AVG of float32 run on the ring in place; float16 and
// bfloat16 on the ring through a float32 copy; float64, integers and the other ops (PRODUCT,
// MIN, MAX, BAND, BOR, BXOR) as an all-gather of every rank's bytes and a fold in rank order,
// exact and the same bits on every rank, at world-size times the bytes (for metadata and
// metrics, not gradients). broadcast and all_gather move bytes (any dtype, bitwise).
// reduce_scatter is an all_reduce of the concatenated inputs, keeping this rank's part.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/base/deadline.h"
#include "core/collective/powersgd.h"
#include "core/collective/ring_allreduce.h"
#include "python/csrc/torch_compat.h"

namespace pipesgd::torch_backend {

struct BackendOptions {
  // comm.* settings as `pipesgd run --set` takes them ("comm.transport=UCX"), checked by the
  // job config's rules.
  std::vector<std::string> overrides;
  // torch's timeout for the group (init_process_group(timeout=...)): each collective's deadline
  // unless comm.timeout_s is among the overrides; the set-up's unless comm.start_timeout_s is.
  double timeout_s = 1800;
};

// One collective on the communication thread, from its start there to its end (not from the
// call: a call queued behind another waits first), for a timeline (python/pipesgd/torch/
// timeline.py). Seconds on the steady clock, which is time.perf_counter()'s on Linux.
struct CommSpan {
  OpType type = OpType::UNKNOWN;  // named when taken, off the communication thread
  int64_t step = -1;  // the caller's step, where it gave one (the Pipe-SGD optimizer does)
  double begin_s = 0;
  double end_s = 0;
};

// What one codec hook call sent (for the wire-bytes checks and benchmarks).
struct HookWireStats {
  uint64_t bytes_sent = 0;
  uint64_t payload_bytes = 0;
  uint64_t raw_payload_bytes = 0;
  bool compressed = false;
};

class ProcessGroupPipesgd final : public BackendBase {
 public:
  // Connects the ring (blocks until every rank of the group has arrived, or the set-up
  // deadline). Throws pipesgd::Error: kInvalidArgument naming a bad option or the rank whose
  // settings differ from rank 0's, kDeadlineExceeded naming the ranks that never arrived.
  ProcessGroupPipesgd(const c10::intrusive_ptr<Store>& store, int rank, int size,
                      const BackendOptions& options);
  ~ProcessGroupPipesgd() override;

  const std::string getBackendName() const override { return "pipesgd"; }

  c10::intrusive_ptr<WorkBase> broadcast(std::vector<at::Tensor>& tensors,
                                         const ::c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<WorkBase> allreduce(std::vector<at::Tensor>& tensors,
                                         const ::c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<WorkBase> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                         std::vector<at::Tensor>& inputs,
                                         const ::c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<WorkBase> _allgather_base(at::Tensor& output, at::Tensor& input,
                                               const ::c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<WorkBase> reduce_scatter(std::vector<at::Tensor>& outputs,
                                              std::vector<std::vector<at::Tensor>>& inputs,
                                              const ::c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<WorkBase> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const ::c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<WorkBase> barrier(const ::c10d::BarrierOptions& opts) override;

  // pipesgd's own, for DDP's communication hooks (python/pipesgd/torch/hooks.py): the average
  // of a float32 bucket with a codec inside the ring ("none", "trunc16", "fp16", "q8", "q4",
  // "sign1"), error feedback kept per `key` (the bucket's index) across calls; every rank ends
  // with bitwise the same values.
  c10::intrusive_ptr<WorkBase> AllReduceCodec(at::Tensor bucket, int64_t key,
                                              const std::string& codec, bool error_feedback,
                                              int64_t step = -1);
  // The average of a float32 bucket by PowerSGD (core/collective/powersgd.h) of rank `rank`:
  // `matrices` are (offset, rows, cols) of the bucket's weight matrices; the factors, the warm
  // start and the residuals are kept per `key`. compress = false: a plain average (warm-up).
  c10::intrusive_ptr<WorkBase> AllReducePowerSgd(at::Tensor bucket, int64_t key,
                                                 std::vector<std::vector<int64_t>> matrices,
                                                 int rank, bool compress, int64_t step = -1);
  // A checkpoint of what bucket `key` carries from call to call: [] before its first call;
  // a codec's [error-feedback residual] (empty without error feedback); PowerSGD's [Q (the
  // warm start), residual]. Copies, taken on the communication thread after every call queued
  // before (blocks until then).
  std::vector<at::Tensor> HookState(int64_t key);
  // Hands `state` (from HookState) to bucket `key`: the bucket is made again at its next call
  // and starts from it. That call throws kInvalidArgument naming the sizes when `state` does
  // not fit the bucket it makes (another codec, layout or rank).
  void RestoreHookState(int64_t key, std::vector<at::Tensor> state);
  // What the last codec or PowerSGD call sent (read after its Work completed).
  HookWireStats last_hook_stats() const;
  // The spans of the collectives finished since the last call, oldest first (the newest
  // kMaxSpans at most: a caller that never takes them costs a bounded buffer).
  std::vector<CommSpan> TakeSpans();
  static constexpr size_t kMaxSpans = 1 << 16;
  // "tcp 127.0.0.1:41234, 1 stream, chunks of 1048576 bytes".
  std::string Describe() const { return describe_; }

 private:
  using Body = std::function<void(Deadline)>;
  // Queues `body` for the communication thread; the Work completes when it returns or throws.
  c10::intrusive_ptr<WorkBase> Enqueue(OpType type, std::vector<at::Tensor> outputs, Body body,
                                       std::chrono::milliseconds timeout, int64_t step = -1);
  void Loop();
  // In place on the ring: a contiguous CPU tensor of any dtype, any reduction (see the top).
  void Reduce(at::Tensor& tensor, Reduction op, Deadline deadline);
  // The state of one hook bucket: its own ring on the group's connections (its own residual),
  // and PowerSGD's factors.
  struct HookBucket {
    std::unique_ptr<collective::Communicator> ring;
    std::string codec;
    bool error_feedback = false;
    std::unique_ptr<collective::PowerSgd> powersgd;
    uint64_t count = 0;
    std::vector<collective::PowerSgd::Matrix> matrices;
    int powersgd_rank = 0;
  };
  HookBucket& Bucket(int64_t key);
  // Seeds a bucket just made from a RestoreHookState for `key`, if one is waiting.
  void Restore(int64_t key, HookBucket& b);
  // A ring of its own (its own residual and sequence numbers) on the group's connections.
  std::unique_ptr<collective::Communicator> HookRing(CodecKind codec, bool error_feedback);

  BackendOptions options_;
  double collective_timeout_s_ = 1800;
  collective::CommunicatorOptions ring_options_;
  std::unique_ptr<collective::Communicator> ring_;
  std::map<int64_t, HookBucket> buckets_;  // the communication thread's only
  std::map<int64_t, std::vector<at::Tensor>> restore_;  // the communication thread's only
  std::string describe_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  struct Task {
    c10::intrusive_ptr<PipesgdWork> work;
    Body body;
    std::chrono::milliseconds timeout;
    OpType type = OpType::UNKNOWN;
    int64_t step = -1;
  };
  std::deque<Task> queue_;
  bool stopping_ = false;
  HookWireStats hook_stats_;
  std::deque<CommSpan> spans_;
  std::atomic<bool> abort_{false};
  std::thread thread_;
};

}  // namespace pipesgd::torch_backend
