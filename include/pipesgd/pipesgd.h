// pipesgd as a library: the small API for programs that embed pipesgd (a simulator, a robot's
// learner, another framework) and bring their own buffers and their own model.
//
//   #include <pipesgd/pipesgd.h>          // CMake: find_package(pipesgd); link pipesgd::pipesgd
//                                         // pkg-config: pkg-config --cflags --libs pipesgd
//
// Three things, each usable alone:
//  1. Connect(): a ring communicator from a torchrun-style rendezvous (master address and port,
//     rank, world size, job token, transport).
//  2. AllReduce(): the chunk-pipelined ring AllReduce (reduce-scatter then all-gather, Patarasuk
//     & Yuan 2009), optionally with lossy compression inside the ring (docs/compression.md), in
//     place on the caller's own float32 buffer. No copy of the buffer is made or kept.
//  3. FunctionObjective / FunctionOptimizer + train::Trainer: pipelined SGD of width K
//     (Pipe-SGD, Li et al., NeurIPS 2018, Sec. 3; see core/train/trainer.h for the update rule)
//     driving a model that pipesgd knows nothing about, through two callbacks: "compute this
//     rank's gradient at these parameters into this buffer" and "apply this rank-averaged
//     gradient to the parameters".
//
// Errors: everything here throws pipesgd::Error (core/base/error.h; code() says which kind:
// kInvalidArgument, kIo, kUnavailable, kDeadlineExceeded, kDataLoss, kNumerical, ...), with the
// rank, peer and sizes in what(). After an error a communicator is unusable; reconnect.
// Threads: a communicator is used by one thread at a time; a Trainer owns one extra thread.
// Linking: static libraries; this header needs C++20.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "core/base/deadline.h"
#include "core/base/error.h"
#include "core/collective/codec.h"
#include "core/collective/ring_allreduce.h"
#include "core/train/trainer.h"
#include "transport/factory.h"

namespace pipesgd {

// CodecKind (core/collective/codec.h) is pipesgd::CodecKind already.
using collective::Communicator;
using collective::ReduceOp;
using transport::TransportKind;

// Version of the installed library ("MAJOR.MINOR.PATCH").
const char* Version();

struct ConnectOptions {
  // Rendezvous: rank 0 listens on master_addr:master_port (TCP) until every rank has dialled in;
  // the others retry until the deadline, so ranks may start in any order.
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  int rank = 0;        // in [0, world_size)
  int world_size = 1;  // >= 1
  // Shared secret: rank 0 ignores peers that do not present it ("" = accept anyone).
  std::string token;
  // Must be byte-identical on every rank (e.g. a description of the job); a rank with a
  // different one is rejected with the first differing line.
  std::string job = "pipesgd";
  // kTcp is always built; kUcx and kIbverbs only where found at build time
  // (transport::TransportCompiled). TCP: the ring connects from bind_host, a numeric IP the
  // other ranks can reach ("" = the local address on the route toward master_addr).
  TransportKind transport = TransportKind::kTcp;
  std::string bind_host = "127.0.0.1";
  // Chunking: bytes per chunk, a multiple of 4 (0 = automatic, AutoChunkBytes), and parallel
  // connections per neighbour (>= 1).
  uint64_t chunk_bytes = 1 << 20;
  int streams = 1;
  // Compression on the wire: kNone, kTrunc16 (bf16 by truncation), kFp16, kQ8 (8-bit with a
  // per-chunk scale), kQ4 (4-bit, a scale per 256 elements), kSign1 (1-bit scaled sign);
  // error_feedback keeps what each encode lost and adds it to the next call.
  // Buffers smaller than compression_min_bytes go uncompressed.
  CodecKind codec = CodecKind::kNone;
  bool error_feedback = false;
  uint64_t compression_min_bytes = 0;
  // Seconds for the whole rendezvous and connection set-up.
  double timeout_s = 60;
};

// ConnectOptions for this process from its launcher's environment (transport/launch_env.h):
// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun and `pipesgd run` set them, or Slurm's
// srun (SLURM_PROCID, SLURM_STEP_NUM_TASKS, the step's first node), or Open MPI's mpirun
// (OMPI_COMM_WORLD_RANK, _SIZE, mpirun's host); PIPESGD_JOB_TOKEN as the token. With none of
// them, a single process (rank 0 of 1). bind_host is "" (the address toward the master) unless
// the master is on loopback. The other fields keep their defaults. Throws
// Error(kInvalidArgument) naming a variable whose value does not parse.
ConnectOptions ConnectOptionsFromEnv();

// Creates the transport, runs the rendezvous and connects this rank to its ring neighbours.
// Blocks until every rank has arrived or options.timeout_s has passed.
// Throws Error: kInvalidArgument (bad rank/world size/chunk_bytes/streams, a transport not in
// this build, a rank rejected by rank 0: duplicate rank, world size mismatch, wrong token),
// kDeadlineExceeded (naming the missing ranks or the master), kIo (rank 0 cannot listen).
std::unique_ptr<Communicator> Connect(const ConnectOptions& options);

// Reduces data (count = data.size() float32 elements, the same count on every rank) in place
// across all ranks: kSum or kAverage (sum / world_size). Every rank calls it in the same order.
// Uncompressed, integer-valued inputs whose sums stay below 2^24 give exact results; with a
// codec the error is bounded as documented on Communicator::AllReduce. Throws Error
// (kDeadlineExceeded after timeout_s seconds, kUnavailable, kDataLoss, kNumerical).
void AllReduce(Communicator& comm, std::span<float> data, ReduceOp op = ReduceOp::kSum,
               double timeout_s = 60, bool compress = true);

// The caller's model as a train::Objective. `gradient(step, params, grads)` must OVERWRITE
// grads (num_params floats) with this rank's gradient of its local loss for global step `step`
// at `params` (num_params floats) and return that local mean loss. Called on the caller's thread.
class FunctionObjective : public train::Objective {
 public:
  using GradientFn =
      std::function<float(int64_t step, std::span<const float> params, std::span<float> grads)>;
  FunctionObjective(size_t num_params, GradientFn gradient)
      : num_params_(num_params), gradient_(std::move(gradient)) {}
  size_t num_params() const override { return num_params_; }
  float ComputeGradient(int64_t step, std::span<const float> params,
                        std::span<float> grads) override {
    return gradient_(step, params, grads);
  }

 private:
  size_t num_params_;
  GradientFn gradient_;
};

// The caller's update rule as a train::Optimizer: `apply(params, grads)` gets the gradient
// averaged over all ranks (num_params floats) and updates params in place. Stateless as far as
// checkpoints go (Trainer::Snapshot saves nothing for it).
class FunctionOptimizer : public train::Optimizer {
 public:
  using ApplyFn = std::function<void(std::span<float> params, std::span<const float> grads)>;
  explicit FunctionOptimizer(ApplyFn apply) : apply_(std::move(apply)) {}
  void Apply(std::span<float> params, std::span<const float> grads) override {
    apply_(params, grads);
  }

 private:
  ApplyFn apply_;
};

// Plain SGD, w -= lr * G, for programs that need nothing more.
inline FunctionOptimizer PlainSgd(float lr) {
  return FunctionOptimizer([lr](std::span<float> w, std::span<const float> g) {
    for (size_t i = 0; i < w.size(); ++i) w[i] -= lr * g[i];
  });
}

// Runs `steps` steps of width-K pipelined SGD on `params` (the caller's buffer, identical on
// every rank at the start) and then Drain(true), so params hold w[steps + K - 1] in the
// recurrence of core/train/trainer.h. Returns the rank-averaged loss of every step.
// Throws like train::Trainer::Step (kNumerical on a non-finite loss or gradient, ...).
std::vector<float> Train(Communicator& comm, train::Objective& objective,
                         train::Optimizer& optimizer, std::span<float> params, int64_t steps,
                         int pipeline_width = 2, double timeout_s = 120);

}  // namespace pipesgd
