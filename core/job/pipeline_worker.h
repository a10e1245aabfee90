#pragma once

#include <chrono>

#include "configs/pipesgd.pb.h"
#include "core/job/worker.h"

namespace pipesgd::job {

// train.mode: SDPIPE with pipeline.stages > 1 (docs/pipeline.md): this rank runs one stage of
// one pipeline (core/train/pipeline_trainer.h) to completion. `start`: when the worker started.
// Throws pipesgd::Error on any failure, kInvalidArgument for a world size that is not a
// multiple of pipeline.stages.
void RunPipelineWorker(const WorkerArgs& args, const JobEnv& env, const config::Job& job,
                       std::chrono::steady_clock::time_point start);

}  // namespace pipesgd::job
