// pipesgd as a library: the small API for programs that embed pipesgd (a simulator, a robot's
// learner, another framework) and bring their own buffers and their own model.
//
//   #include <pipesgd/pipesgd.h>          // CMake: find_package(pipesgd); link pipesgd::pipesgd
//                                         // pkg-config: pkg-config --cflags --libs pipesgd
//
// Three things, each usable alone:
//  1. Connect(): a ring communicator from a torchrun-style rendezvous (master address and port,
//     rank, world size, job token, transport).
//  2. Communicator::AllReduce(): the chunk-pipelined ring AllReduce (reduce-scatter then
//     all-gather, Patarasuk & Yuan 2009), optionally with lossy compression inside the ring
//     (docs/compression.md), in place on the caller's own float32 buffer; and Broadcast,
//     AllGather and Barrier on the same ring.
//  3. Trainer / Train(): pipelined SGD of width K (Pipe-SGD, Li et al., NeurIPS 2018, Sec. 3)
//     driving a model that pipesgd knows nothing about, through two callbacks: "compute this
//     rank's gradient at these parameters into this buffer" and "apply this rank-averaged
//     gradient to the parameters".
//
// This header and the two it includes (pipesgd/error.h, pipesgd/types.h) are the whole
// installed interface: the types behind Communicator and Trainer stay inside the library, so a
// new pipesgd release does not break a program built against this one at the source level.
//
// Errors: everything here throws pipesgd::Error (code() says which kind: kInvalidArgument, kIo,
// kUnavailable, kDeadlineExceeded, kDataLoss, kNumerical, ...), with the rank, peer and sizes in
// what(). After an error a communicator is unusable; reconnect.
// Threads: a communicator is used by one thread at a time; a Trainer owns one extra thread and
// uses its communicator for its whole life.
// Linking: static libraries; this header needs C++20.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pipesgd/error.h"
#include "pipesgd/types.h"

namespace pipesgd {

namespace train {
class Trainer;  // inside the library
}  // namespace train

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
  // kTcp is always built; kUcx and kIbverbs only where found at build time.
  TransportKind transport = TransportKind::kTcp;
  // The local address the ring listens on, a numeric IP the other ranks can reach. "" (the
  // default): the address of the interface on the route toward master_addr, so a program that
  // sets only master_addr works across hosts (127.0.0.1 when the master is on loopback).
  std::string bind_host;
  // Chunking: bytes per chunk, a multiple of 4 (0 = automatic: about 16 chunks per ring block,
  // 256 KiB to 4 MiB), and parallel connections per neighbour (>= 1).
  uint64_t chunk_bytes = 1 << 20;
  int streams = 1;
  // Compression on the wire (CodecKind, pipesgd/types.h); error_feedback keeps what each
  // encode lost and adds it to the next call. Buffers smaller than compression_min_bytes go
  // uncompressed.
  CodecKind codec = CodecKind::kNone;
  bool error_feedback = false;
  uint64_t compression_min_bytes = 0;
  // Seconds for the whole rendezvous and connection set-up.
  double timeout_s = 60;
};

// ConnectOptions for this process from its launcher's environment: RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT as torchrun and `pipesgd run` set them, or Slurm's srun
// (SLURM_PROCID, SLURM_STEP_NUM_TASKS, the step's first node), or Open MPI's mpirun
// (OMPI_COMM_WORLD_RANK, _SIZE, mpirun's host); PIPESGD_JOB_TOKEN as the token. With none of
// them, a single process (rank 0 of 1). The other fields keep their defaults. Throws
// Error(kInvalidArgument) naming a variable whose value does not parse.
ConnectOptions ConnectOptionsFromEnv();

// What the last AllReduce put on the wire, as seen by this rank.
struct WireStats {
  uint64_t bytes_sent = 0;  // headers and payloads
  bool compressed = false;  // the codec was used for (part of) the call
  double compression_ratio = 1;  // raw float32 bytes / payload bytes (1 when nothing was sent)
};

class Trainer;

// A ring of ranks. Move-only; closing it (destruction) does not wait for the peers.
class Communicator {
 public:
  struct Impl;
  explicit Communicator(std::unique_ptr<Impl> impl);
  Communicator(Communicator&&) noexcept;
  Communicator& operator=(Communicator&&) noexcept;
  ~Communicator();

  int rank() const;
  int world_size() const;
  // The transport and how it is connected, for logs ("tcp: 2 streams ...").
  std::string Describe() const;

  // Reduces data (the same element count on every rank) in place across all ranks. Every rank
  // calls the collectives in the same order. Uncompressed, integer-valued inputs whose sums stay
  // below 2^24 give exact results; with compress and a codec, each element's error is at most
  // the codec's bound per encode times world size (docs/compression.md). Throws Error
  // (kDeadlineExceeded after timeout_s seconds, kUnavailable, kDataLoss, kNumerical).
  void AllReduce(std::span<float> data, ReduceOp op = ReduceOp::kSum, double timeout_s = 60,
                 bool compress = true);

  // Root's data on every rank, bitwise (data.size() the same on every rank; root in
  // [0, world_size)). Never compressed.
  void Broadcast(std::span<float> data, int root = 0, double timeout_s = 60);

  // Every rank's `mine` (the same size on every rank) side by side in `all`, rank r's at
  // [r * mine.size(), (r + 1) * mine.size()), bitwise. REQUIRES all.size() == world_size *
  // mine.size() (else Error kInvalidArgument). Never compressed.
  void AllGather(std::span<const float> mine, std::span<float> all, double timeout_s = 60);

  // Returns once every rank has called Barrier.
  void Barrier(double timeout_s = 60);

  // The last AllReduce's bytes and codec use.
  WireStats last_wire_stats() const;

 private:
  friend class Trainer;
  std::unique_ptr<Impl> impl_;
};

// Creates the transport, runs the rendezvous and connects this rank to its ring neighbours.
// Blocks until every rank has arrived or options.timeout_s has passed.
// Throws Error: kInvalidArgument (bad rank/world size/chunk_bytes/streams, a transport not in
// this build, a rank rejected by rank 0: duplicate rank, world size mismatch, wrong token),
// kDeadlineExceeded (naming the missing ranks or the master), kIo (rank 0 cannot listen).
Communicator Connect(const ConnectOptions& options);

// The caller's model: OVERWRITE grads (as many floats as params) with this rank's gradient of
// its local loss for global step `step` at `params`, and return that local mean loss. Called on
// the caller's thread.
using GradientFn =
    std::function<float(int64_t step, std::span<const float> params, std::span<float> grads)>;
// The caller's update rule: `grads` is the gradient averaged over all ranks; update params in
// place. Called on the caller's thread.
using ApplyFn = std::function<void(std::span<float> params, std::span<const float> grads)>;

// Plain SGD, w -= lr * G, for programs that need nothing more.
ApplyFn PlainSgd(float lr);

struct TrainOptions {
  // K: gradients in flight. 1 is synchronous SGD; 2 is Pipe-SGD (the AllReduce of step t runs
  // while step t+1 computes; the update of step t uses the aggregate of step t-1).
  int pipeline_width = 2;
  double timeout_s = 120;  // for each step's wait on its AllReduce
};

// Width-K pipelined SGD on the caller's parameter buffer (identical on every rank at the start)
// over `comm`, which it uses exclusively until destroyed. Every rank makes the same calls; every
// rank's parameters stay bitwise identical.
class Trainer {
 public:
  Trainer(Communicator& comm, std::span<float> params, GradientFn gradient, ApplyFn apply,
          const TrainOptions& options = {});
  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;
  // Waits for the AllReduces in flight without applying them.
  ~Trainer();

  // One step: waits for the AllReduce of step t-K+1, applies it, computes step t's gradient and
  // starts its AllReduce. Throws Error (kNumerical on a non-finite loss or gradient,
  // kDeadlineExceeded, kUnavailable, ...).
  void Step();
  // Waits for the AllReduces in flight and, with apply, applies them: params then hold the
  // result of every step taken (w[steps + K - 1] in the Pipe-SGD recurrence).
  void Drain(bool apply = true);
  int64_t steps() const;
  // The rank-averaged loss of step t (NaN until its AllReduce has completed).
  float StepLoss(int64_t t) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  // The library's trainer behind impl_ (Error kInvalidArgument once moved from).
  train::Trainer& Inner() const;
};

// Runs `steps` steps of a Trainer on params and then Drain(true). Returns the rank-averaged loss
// of every step.
std::vector<float> Train(Communicator& comm, std::span<float> params, int64_t steps,
                         GradientFn gradient, ApplyFn apply, const TrainOptions& options = {});

}  // namespace pipesgd
