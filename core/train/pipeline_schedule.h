// The 1F1B schedule of pipeline-parallel training (PipeDream, Narayanan et al., SOSP 2019,
// Sec. 3.2 "1F1B"; the same non-interleaved order as Megatron-LM's PipeDream-Flush): which
// forward and backward micro-batch passes a stage runs, in order.
//
// Stage s of M (0 = the stage that reads the data, M-1 = the one with the loss) runs, for m
// micro-batches numbered 0..m-1:
//   warm-up:  w = min(M-s-1, m) forwards F(0)..F(w-1), so that the stages after it fill up;
//   steady:   for j = 0..m-w-1: F(w+j), then B(j) (one forward, one backward);
//   drain:    B(m-w)..B(m-1).
// So the last stage alternates F(i), B(i) from the start, and stage s holds at most
// min(M-s, m) micro-batches in flight (forwarded, not yet backwarded). Every micro-batch is
// forwarded once and backwarded once, forwards and backwards each in ascending order. With
// blocking receives of activations (from s-1) and gradients (from s+1) and sends that do not
// block, this order cannot deadlock: the standard 1F1B argument.
//
// Pure function, no state: tests assert the order step by step.
#pragma once

#include <string>
#include <vector>

namespace pipesgd::train {

struct PipelineOp {
  enum class Kind { kForward, kBackward };
  Kind kind = Kind::kForward;
  int micro_batch = 0;  // 0 .. m-1

  bool operator==(const PipelineOp&) const = default;
};

// "F3" or "B0".
std::string ToString(const PipelineOp& op);
// "F0 F1 B0 F2 B1 B2".
std::string ToString(const std::vector<PipelineOp>& ops);

// Stage `stage` of `stages` with `micro_batches` micro-batches: its 2*micro_batches ops in order.
// Throws Error(kInvalidArgument) naming the value for stages < 1, stage outside [0, stages) or
// micro_batches < 1.
std::vector<PipelineOp> OneFOneBSchedule(int stages, int stage, int micro_batches);

// Micro-batches stage `stage` has forwarded but not yet backwarded at most: min(stages-stage, m).
// REQUIRES: arguments valid as above.
int MaxInFlight(int stages, int stage, int micro_batches);

}  // namespace pipesgd::train
