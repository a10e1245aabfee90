// The registered modes: one line each. A mode's file defines its ModeInfo (job_mode.h).
#include <array>

#include "core/base/error.h"
#include "core/job/job_mode.h"

namespace pipesgd::job {

extern const ModeInfo kRingMode;         // ring_mode.cc
extern const ModeInfo kPsSyncMode;       // ps_mode.cc
extern const ModeInfo kPsAsyncMode;      // ps_mode.cc
extern const ModeInfo kSdpipeMode;       // sdpipe_mode.cc
extern const ModeInfo kPipelineMode;     // pipeline_mode.cc

namespace {
const std::array<const ModeInfo*, 5> kModes = {&kRingMode, &kPsSyncMode, &kPsAsyncMode,
                                               &kSdpipeMode, &kPipelineMode};
}  // namespace

std::span<const ModeInfo* const> RegisteredModes() { return kModes; }

const ModeInfo& ModeOf(const config::Job& job) {
  const ModeInfo* found = nullptr;
  for (const ModeInfo* m : kModes) {
    if (!m->selects(job)) continue;
    if (found) {
      Throw(ErrorCode::kInternal, "two modes select this job: {} and {}", found->name, m->name);
    }
    found = m;
  }
  if (!found) {
    Throw(ErrorCode::kInvalidArgument, "train.mode = {}: no mode runs it",
          config::TrainMode_Name(job.train().mode()));
  }
  return *found;
}

}  // namespace pipesgd::job
