// What each training mode supports, and which mode runs a job: the part of the modes' registry
// (job_modes.cc) that the config validator reads. The modes themselves: job_mode.h.
#pragma once

#include <memory>
#include <span>

#include "configs/pipesgd.pb.h"

namespace pipesgd::job {

// What a mode can do. The validator refuses a job asking for something its mode cannot, naming
// the field, the mode and the modes that can (config_validate.cc, CheckModeSupports).
struct ModeSupport {
  bool checkpoints = false;  // checkpoint.dir and --resume
  bool cuda = false;         // model.device: CUDA
  bool timeline = false;     // --timeline
  bool compression = false;  // comm.compression other than none
  bool powersgd = false;     // comm.powersgd_rank > 0
};

class JobMode;

// A mode's registration: its name as messages give it, what it supports, which jobs it runs
// and how to make it. Exactly one registered mode selects any job.
struct ModeInfo {
  const char* name;  // "train.mode = RING"
  ModeSupport support;
  bool (*selects)(const config::Job& job);
  std::unique_ptr<JobMode> (*make)(const config::Job& job);
};

// Every registered mode (job_modes.cc), and the one that runs `job`. ModeOf throws
// Error(kInvalidArgument) where none does.
std::span<const ModeInfo* const> RegisteredModes();
const ModeInfo& ModeOf(const config::Job& job);

}  // namespace pipesgd::job
