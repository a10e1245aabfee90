// What `pipesgd probe` makes of every rank's measurements (core/train/probe.proto): the values
// the timing models take (the slowest link, the slowest rank's compute, per-byte CPU rates as a
// median over ranks) and the terms fitted so that the model reproduces the AllReduces and the
// real steps timed (docs/timing_models.md, "Inputs"). The launcher only measures, prints and
// writes; this is the part a test can feed with numbers.
#pragma once

#include <string>
#include <vector>

#include "core/probe.pb.h"  // generated from core/train/probe.proto
#include "core/train/timing_model.h"

namespace pipesgd::train {

// One AllReduce over ranks: the slowest rank's wall time, the median CPU time.
struct AllReduceOverRanks {
  double chunk_bytes = 0;
  double seconds = 0;
  double cpu_s = 0;
  double modelled_s = 0;  // what the fitted model gives for it
};

struct CodecOverRanks {
  std::string name;
  double ratio = 1;                     // rank 0's encode + decode alone
  double encode_decode_s_per_byte = 0;  // idem
  std::vector<AllReduceOverRanks> timed;  // in the ring (several ranks only)
  CodecCost fit;
};

struct ProbeFit {
  int world_size = 1;
  double model_bytes = 0;
  TimingInputs inputs;  // every term the model takes, fitted

  // Links: the slowest; a link alone and every link busy (before B is fitted to the AllReduce).
  double link_alone_Bps = 0;
  double ring_exchange_Bps = 0;
  double stream_chunk_overhead_s = 0;  // o of a stream of messages, median over ranks
  RingFit ring;
  std::vector<AllReduceOverRanks> allreduce;  // without a codec, every timed chunk size
  std::vector<double> compute_by_rank;
  // The slowest rank's C, U and U_K, and the CPU shares of the rank that computes slowest (they
  // go with its C); `inputs` takes each where the fit of the terms after it needs it.
  double compute_s = 0, update_s = 0, pipelined_update_s = 0;
  double compute_cpu_share = 0, cpu_share = 0;
  double big_message_cpu_s_per_byte = 0;
  TransportCpu transport_cpu;
  std::vector<CodecOverRanks> codecs;

  // Compute and AllReduce at once, the slowest rank's, and their factors (>= 1).
  double overlap_compute_s = 0, overlap_allreduce_s = 0, overlap_chunk_bytes = 0;
  double compute_factor = 1, allreduce_factor = 1;

  // Real steps, the slowest rank's, and sigma fitted to them (several ranks only).
  struct Steps {
    double chunk_bytes = 0;
    double chunks_per_block = 0;
    double allreduce_s = 0;  // the AllReduce of these steps, as timed
    double sync_step_s = 0, pipe_step_s = 0;
    double sync_overhead_s = 0, pipe_overhead_s = 0;
  };
  Steps plain;       // without a codec, at the steps' chunk size
  int fast = -1;     // index into codecs of the fastest one (rank 0's word: every rank agreed)
  Steps fast_steps;  // with it
  Steps fast_other;  // with it at the other chunk size
  double sync_per_chunk_s = 0, pipe_per_chunk_s = 0;

  bool loopback = false;
  double host_cpus = 0;  // rank 0's
  double ps_sync_step_s = 0, ps_async_step_s = 0;  // the slowest worker's
  double ps_sync_cpus = 0, ps_async_cpus = 0;      // every rank's CPU per second, summed
};

// `ranks`: every rank's measurements in rank order (one rank: no ring terms). Throws
// pipesgd::Error kInvalidArgument where a rank lacks what the others have (a chunk size or codec).
ProbeFit FitProbe(const std::vector<probe::RankProbe>& ranks, double model_bytes);

}  // namespace pipesgd::train
