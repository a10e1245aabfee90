// `auto` values of a ring job (train.pipeline_width, comm.chunk_bytes, comm.streams), chosen at
// start by measuring what the job itself will run: its own AllReduce of its gradient (model
// size, codec, connections) at every candidate chunk size and stream count, then a few real
// training steps at each candidate width on scratch copies of the parameters and optimizer.
//
// Why measured and not predicted: the timing model (timing_model.h) misses the contention of
// the compute and communication threads for the same cores (width 2 measured 0.92x of width 1
// on 4 ranks on 2 cores where the model said 1.53x; issue 20). A trial step contains that
// contention; the model's prediction is logged next to it, so the gap shows.
//
// Rank 0 decides and every rank takes its decision (one exact AllReduce), so ranks whose
// measurements would lead them elsewhere cannot split the job. Everything runs on rings built
// on the job ring's connections (Communicator::CreateOnConnections): the job ring's collective
// sequence and error-feedback residual are untouched, so a job with auto values trains to the
// same bits as the job with the chosen values written in its config.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/collective/ring_allreduce.h"
#include "core/train/trainer.h"

namespace pipesgd::train {

struct AllReduceTiming {
  uint64_t chunk_bytes = 0;
  int streams = 1;
  double seconds = 0;  // median of the timed calls, the slowest rank's
};

// The chosen chunk size and streams with another codec: what comm.compression would gain.
struct CodecTiming {
  CodecKind codec = CodecKind::kNone;
  double seconds = 0;  // median of the timed calls, the slowest rank's
};

struct WidthTiming {
  int width = 1;
  double step_s = 0;       // measured: a training step in the steady state, the slowest rank's
  double predicted_s = 0;  // the timing model's: C + T_AR (width 1), max(C, T_AR) (width >= 2)
};

// What rank 0 chooses from the gathered measurements (the same vectors on every rank); indices
// into them. The default (ChooseByTime) is replaced by tests that make ranks disagree.
using AutoChooser = std::function<size_t(int rank, const std::vector<double>& seconds,
                                         size_t preferred)>;

struct AutoTuneRequest {
  // Candidates; one entry: that value is fixed. Every stream count must be at most the streams
  // the job ring was connected with. Chunk sizes that cut this gradient into the same number
  // of chunks per ring block run identically; only the first of them (the preferred value
  // first) is timed.
  std::vector<uint64_t> chunk_bytes = {64u << 10, 256u << 10, 1u << 20, 4u << 20};
  std::vector<int> streams = {1, 2};
  std::vector<int> widths = {1, 2};
  // Kept unless another candidate is faster by more than `tie` (a fraction): the defaults
  // (configuration.md), so that where the trial cannot tell the candidates apart the job runs
  // what it would have run without auto. Width 2 is the default: with its compensation it ends
  // at width 1's accuracy (time_to_accuracy.md), and where it is 1-2% faster (100mbit, link-bound)
  // a trial of 8 steps per width cannot resolve that; preferring width 1 there lost 2% to the
  // defaults (auto_grid/README.md).
  uint64_t preferred_chunk_bytes = 1u << 20;
  int preferred_streams = 1;
  int preferred_width = 2;
  double tie = 0.01;
  // About how long each chunk x streams candidate is measured (seconds): a few calls at least.
  double budget_s = 0.15;
  // About how long each width's trial steps run (8 steps at least): long enough to span ~10
  // periods of a CPU quota (CFS: 100 ms), which throttles two busy threads sooner than one. With
  // 0.3 s, on 4 lab nodes at half a CPU each and 1 Gbit/s, the trial had width 2 7% faster
  // while whole runs had it 2.6% slower.
  double width_budget_s = 1.0;
  double timeout_s = 60;  // every collective of the tuning
  // The job's trainer options; the width is each candidate's, the warm-ups are dropped.
  TrainerOptions trainer;
  // A fresh optimizer with the job's settings, for the trial steps (never the job's own: its
  // momentum must not move).
  std::function<std::unique_ptr<Optimizer>()> make_optimizer;
  AutoChooser choose;  // null: ChooseByTime
  // Codecs also timed at the chosen chunk size and streams, for the log (compression stays the
  // user's choice: it changes accuracy); the job's own codec is timed among the candidates.
  std::vector<CodecKind> compare_codecs;
};

struct AutoTuneResult {
  uint64_t chunk_bytes = 0;
  int streams = 1;
  int width = 1;
  std::vector<AllReduceTiming> allreduce;  // every candidate timed
  std::vector<WidthTiming> widths;         // empty when the width was fixed
  std::vector<CodecTiming> codecs;         // request.compare_codecs, in order
  double compute_s = 0;  // forward + backward of one batch, the slowest rank's (0: not measured)
  double seconds = 0;    // the whole tuning on this rank
  // The congestion control restarted on the job ring's connections after the tuning (TCP:
  // "bbr", "cubic"; "" where none was: another transport, one rank, or not allowed).
  std::string congestion_restarted;
};

// Measures, decides on rank 0, agrees, and Retunes `comm` to the chosen chunk size and streams.
// `objective` computes the job's gradients (its steps from 0 are computed again later: it must
// be a function of the step and the parameters); `params` is the job's starting point (copied).
// Collective: every rank calls it with the same request. Throws what the AllReduces and the
// trainer throw. One rank measures nothing (it has nothing to reduce): the preferred values, or
// each list's first where the preferred is not a candidate.
AutoTuneResult AutoTune(collective::Communicator& comm, Objective& objective,
                        std::span<const float> params, const AutoTuneRequest& request);

// The preferred index unless another is faster by more than `tie` (times[preferred] >
// (1 + tie) * min), then the fastest (the first of equals). REQUIRES: preferred < size.
size_t ChooseByTime(const std::vector<double>& seconds, size_t preferred, double tie);

// Rank 0's `values` on every rank of `comm` (one exact AllReduce: the others add zeros).
// REQUIRES: every value a float (integers below 2^24 are exact).
std::vector<float> TakeRankZeros(collective::Communicator& comm, std::vector<float> values,
                                 double timeout_s);

// The number of chunks per ring block a chunk size gives `count` floats over `world_size`
// ranks: equal counts run identically.
uint64_t ChunksPerBlock(uint64_t count, int world_size, uint64_t chunk_bytes);

}  // namespace pipesgd::train
