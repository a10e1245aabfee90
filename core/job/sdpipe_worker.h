// `train.mode: SDPIPE` in `pipesgd worker` (docs/sdpipe.md): the same data, model and epochs as
// the ring, trained with SDPipe's local steps and group-wise averaging. Rank 0 also runs the
// group scheduler service (core/train/sdpipe_service.h).
#pragma once

#include <chrono>

#include "configs/pipesgd.pb.h"
#include "core/job/worker.h"

namespace pipesgd::job {

// Runs this rank to completion. `start`: when the worker started (for wall-clock totals).
// Throws pipesgd::Error on any failure.
void RunSdpipeWorker(const WorkerArgs& args, const JobEnv& env, const config::Job& job,
                     std::chrono::steady_clock::time_point start);

}  // namespace pipesgd::job
