// The registered modes: one line each in PSGD_MODES. A mode's file defines its ModeInfo
// (job_mode.h).
#include <span>

#include "core/base/error.h"
#include "core/job/job_mode.h"

namespace pipesgd::job {

// One line per mode: X(the ModeInfo its file defines).
#define PSGD_MODES(X) \
  X(kRingMode)        /* ring_mode.cc */ \
  X(kPsSyncMode)      /* ps_mode.cc */ \
  X(kPsAsyncMode)     /* ps_mode.cc */ \
  X(kSdpipeMode)      /* sdpipe_mode.cc */ \
  X(kPipelineMode)    /* pipeline_mode.cc */ \
  X(kOuterMode)       /* outer_mode.cc */

#define PSGD_DECLARE_MODE(info) extern const ModeInfo info;
PSGD_MODES(PSGD_DECLARE_MODE)
#undef PSGD_DECLARE_MODE

namespace {
#define PSGD_MODE_ADDRESS(info) &info,
const ModeInfo* const kModes[] = {PSGD_MODES(PSGD_MODE_ADDRESS)};
#undef PSGD_MODE_ADDRESS
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
