// `pipesgd probe`'s internals: what each rank measures with its ring neighbours (probe_ring.cc,
// probe_ps.cc) into its RankProbe message (core/train/probe.proto), gathered at rank 0 in one
// pass around the ring; timing.cc measures the rest and prints what core/train/probe_fit.h makes
// of every rank's.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/job/config.h"
#include "core/job/worker.h"
#include "core/probe.pb.h"  // generated from core/train/probe.proto
#include "core/train/classifier_task.h"

namespace pipesgd::launcher::probe {

using RankProbe = ::pipesgd::probe::RankProbe;

// The codecs whose AllReduce the probe times in the ring (core/train/probe.proto, CodecAllReduce).
inline constexpr const char* kProbeCodecs[] = {"trunc16", "fp16", "q8", "q4", "sign1"};
inline constexpr int kNumProbeCodecs = 5;
// About how long the overlapped AllReduces run (seconds), in calls every rank agrees on.
inline constexpr double kOverlapBudgetS = 0.5;
// Real steps of each width without a codec and with the fast one (at two chunk sizes), in
// kStepRounds rounds of the six in turn, each about kSyncBudgetS / kStepRounds: the median round
// of each counts (one round of 0.4 s per width read sigma 0.63 and 1.64 ms in two probes minutes
// apart on the unshaped lab).
inline constexpr double kSyncBudgetS = 0.4;
inline constexpr int kStepRounds = 3;
// The ring's per-chunk cost shows only in a real AllReduce with many chunks (a wake-up, a header,
// a reduction call per chunk): 4 KiB, the smallest chunk `pipesgd model` considers; the link's
// rate with one chunk per block (16 MiB: the largest); how much the two overlap in between.
inline constexpr uint64_t kSmallChunk = 4096;
inline constexpr uint64_t kMidChunk = 64u << 10;
inline constexpr uint64_t kLargeChunk = 16u << 20;
inline constexpr uint64_t kTimedChunks[] = {kSmallChunk, kMidChunk, kLargeChunk};
// The chunk size of the real steps (sigma, sigma_2): kLargeChunk where the job's chunk size (its
// config's; where auto, the default's) holds a whole ring block, as for the MLP on 4 ranks, else
// kMidChunk. A step's chunk messages cost more than the AllReduce alone shows (1 Gbit/s and
// 100 Mbit/s labs: jobs at 4 chunks per block 0.2-1.6 ms slower per step than at 1, where the
// AllReduce alone differs by 0.1-0.5 ms), so the steps are timed as the job will cut the model.
inline uint64_t StepChunk(const config::Job& job, size_t params, int world_size) {
  const int64_t configured = job.comm().chunk_bytes();
  const uint64_t chunk = configured > 0 ? static_cast<uint64_t>(configured)
                                        : static_cast<uint64_t>(config::Comm().chunk_bytes());
  return chunk * static_cast<uint64_t>(world_size) >= 4 * params ? kLargeChunk : kMidChunk;
}
inline constexpr int kAllReduceReps = 10;
// About how long each of the two PS schemes' timed steps run (seconds, over kStepRounds rounds),
// in steps every rank agrees on.
inline constexpr double kPsBudgetS = 0.6;

// What the ring measurements need of the probe: the job, this rank's place, the model and its
// compute and update times (the step counts are estimated from them).
struct RingProbe {
  const job::JobEnv& env;
  const config::Job& job;
  int pings;
  train::ClassifierTask& task;
  std::span<const float> params;
  double compute_s;
  double update_s;
};

// Connects to the ring neighbours and measures, every rank at once: each link in turn, every
// link busy, the job's AllReduce at kTimedChunks without a codec and at kMidChunk and
// kLargeChunk with each codec, compute and AllReduce at once, and real width-1 and width-2
// steps without a codec and with the fastest one. Fills `mine` and returns every rank's, in rank
// order, at rank 0; at another rank, those of the ranks up to it.
std::vector<RankProbe> MeasureOnRing(const RingProbe& in, RankProbe mine);

// The parameter-server schemes' real steps on the probe's ranks, the job's own PsServer and
// PsWorker on a scratch copy: rank 0 serves the W-1 others (`links`: rank 0's connections to
// ranks 1..W-1 in order; another rank's one, to rank 0), which train `steps` synchronous steps
// and then `steps` asynchronous ones, each after 2 untimed, kStepRounds times (the median). The
// job has W workers and a server: the model scales what a step takes beyond C to W pushes
// (TimingInputs::ps_sync_beyond_compute_s, PsScale).
// Fills the ps_* fields of `mine`.
void MeasurePsSteps(transport::Transport& transport, std::vector<transport::Connection*> links,
                    int rank, train::ClassifierTask& task, std::span<const float> params,
                    const config::Job& job, int steps, RankProbe& mine);

}  // namespace pipesgd::launcher::probe
