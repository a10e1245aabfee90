// PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): low-rank gradient compression by one
// step of power iteration per AllReduce, with error feedback and warm start, as PyTorch DDP's
// powerSGD_hook does it (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py).
//
// For every weight matrix M (rows n x cols m) of the gradient, with this rank's residual e and
// the rank-r factor Q (m x r) kept from the last call (identical on every rank):
//   M += e;  P = M Q;                      AllReduce(P) together with every uncompressed element
//   P = orthonormal columns of P (Gram-Schmidt, the same bits on every rank);
//   Q = M^T P;                             AllReduce(Q)
//   result = P Q^T;  e = M - result;  Q is kept for the next call (warm start).
// Two ring AllReduces of (n + m) r floats per matrix instead of n m: for the MLP's 256 x 784
// layer at r = 4, 4160 floats instead of 200704. Every rank computes the result from the same
// reduced P and Q with the same loops (no BLAS, whose kernels may differ between machines), so
// the replicas stay bitwise identical.
//
// Matrices where (n + m) r * min_compression_rate >= n m, and every element outside a weight
// matrix (biases, the trainer's loss), travel uncompressed in the first AllReduce. A call with
// AllReduceOptions::compress = false (the trainer's compression warm-up) is one plain AllReduce
// of everything and leaves the residual and Q untouched.
#pragma once

#include <atomic>
#include <cstdint>
#include <span>
#include <vector>

#include "core/base/deadline.h"
#include "core/collective/ring_allreduce.h"

namespace pipesgd::collective {

struct PowerSgdOptions {
  int rank = 4;  // r, in [1, 64]
  // Compress a matrix only when it shrinks at least this much (PyTorch's default, 2).
  double min_compression_rate = 2;
  // Seeds the initial Q (the same on every rank).
  uint64_t seed = 0;
};

class PowerSgd final : public GradientReducer {
 public:
  struct Matrix {
    uint64_t offset = 0, rows = 0, cols = 0;  // row-major, at data[offset, offset + rows*cols)
  };
  // `matrices` in ascending, non-overlapping order inside a slot of `count` floats. Throws
  // Error(kInvalidArgument) naming the matrix for a bad layout or rank.
  PowerSgd(Communicator& comm, uint64_t count, std::vector<Matrix> matrices,
           const PowerSgdOptions& options);

  void AllReduce(std::span<float> data, ReduceOp op, Deadline deadline,
                 const std::atomic<bool>* abort, const AllReduceOptions& call) override;
  const WireStats& last_wire_stats() const override { return stats_; }
  bool checkpointable() const override { return false; }

  // The matrices it compresses (the others travel as float32), and this rank's residual of
  // each, concatenated (empty before the first compressed call).
  const std::vector<Matrix>& compressed() const { return compressed_; }
  std::span<const float> residual() const { return residual_; }
  // Q^T of every compressed matrix (r x cols), concatenated: the warm start of the next call.
  std::span<const float> factors() const { return q_; }
  // Checkpoint restore: the factors and residual of an instance with the same layout and rank
  // (the same bits on every rank for the factors). Throws Error(kInvalidArgument) naming the
  // sizes when either does not fit.
  void Restore(std::span<const float> factors, std::span<const float> residual);

 private:
  void Add(const WireStats& s);

  Communicator& comm_;
  uint64_t count_;
  PowerSgdOptions options_;
  std::vector<Matrix> compressed_;
  // The elements outside compressed matrices, as [begin, end) ranges.
  std::vector<std::pair<uint64_t, uint64_t>> plain_;
  uint64_t plain_count_ = 0;
  std::vector<float> q_;         // per compressed matrix, Q^T (r x cols), concatenated
  std::vector<float> residual_;  // per compressed matrix, rows x cols, concatenated
  std::vector<float> first_;     // P of every matrix, then the plain elements
  std::vector<float> second_;    // Q^T of every matrix
  WireStats stats_;
};

}  // namespace pipesgd::collective
