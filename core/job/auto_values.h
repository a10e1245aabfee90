// A RING job's `auto` values (0 in train.pipeline_width, comm.chunk_bytes, comm.streams): what
// the ring is connected with before they are known, and the values in effect after the start-up
// tuning (core/train/autotune.h) or, on --resume, the checkpoint's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include <nlohmann/json.hpp>

#include "configs/pipesgd.pb.h"
#include "core/collective/ring_allreduce.h"
#include "core/checkpoint.pb.h"  // generated from core/train/checkpoint.proto
#include "core/train/trainer.h"

namespace pipesgd::job {

// The most streams an auto comm.streams tries: the ring connects this many.
inline constexpr int kAutoMaxStreams = 2;

struct RingSettings {
  int pipeline_width = 2;
  uint64_t chunk_bytes = 1u << 20;
  int streams = 1;
  // summary.json's "auto": what was auto, what was measured and chosen; null without auto.
  nlohmann::json report;
};

// The communicator options to connect a RING job's ring with: job.comm's, with an auto stream
// count at kAutoMaxStreams (the tuning keeps fewer if they are as fast).
collective::CommunicatorOptions RingConnectOptions(const config::Job& job);

// The values in effect. Without auto: the config's. With auto: the resumed checkpoint's where it
// records them (so the resume continues the same computation), else measured on `comm` with
// `objective` from `params` (a few seconds at most on a slow link), decided by rank 0, and
// `comm` retuned. Rank `lead` logs each choice with its measurements and the model's prediction.
// Collective over `comm`. Throws what train::AutoTune throws.
RingSettings ResolveRingSettings(const config::Job& job, collective::Communicator& comm,
                                 train::Objective& objective, std::span<const float> params,
                                 const train::TrainerOptions& trainer,
                                 std::function<std::unique_ptr<train::Optimizer>()> make_optimizer,
                                 const checkpoint::Checkpoint* resumed, bool lead);

}  // namespace pipesgd::job
