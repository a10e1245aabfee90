// `pipesgd worker`: one rank of a job, whatever its mode (the skeleton: job.cc), with its
// failure reported through the job's relay so that every rank names the same failed rank.
#include "core/job/worker.h"

#include <chrono>
#include <new>
#include <string>

#include "core/base/error.h"
#include "core/base/log.h"
#ifdef PIPESGD_HAVE_CUDA_BACKEND
#include "core/base/cuda/device.h"
#endif
#include "core/job/job_mode.h"

namespace pipesgd::job {

void CheckLocalGpus(const config::Job& job, int local_ranks) {
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  if (job.model().device() != config::Model::CUDA) return;
  std::string why;
  const int count = cuda::CudaDeviceCount(&why);
  if (count == 0) {
    Throw(ErrorCode::kInvalidArgument,
          "model.device = CUDA: this machine has no CUDA device ({}); no rank was started; use "
          "model.device: CPU or run on a machine with a GPU",
          why);
  }
  const int gpu_index = job.model().gpu_index();
  const int highest = gpu_index >= 0 ? gpu_index : local_ranks - 1;
  if (highest >= count) {
    Throw(ErrorCode::kInvalidArgument,
          "model.device = CUDA: {} needs GPU {}, but this machine has {} CUDA device(s) "
          "(0..{}); no rank was started",
          gpu_index >= 0 ? "model.gpu_index" : fmt::format("local rank {}", highest), highest,
          count, count - 1);
  }
#else
  (void)job;
  (void)local_ranks;
#endif
}

void RunWorker(const WorkerArgs& args) {
  const auto start = std::chrono::steady_clock::now();
  const JobEnv env = ReadJobEnv();
  try {
    RunJob(args, env, start);
  } catch (const Error& e) {
    if (!env.relay) throw;
    // Every rank names the same failed rank: rank 0 decides (transport/failure_relay.h).
    throw transport::FailureRelay::Explain(e, env.rank, env.relay->Report(e));
  } catch (const std::bad_alloc&) {
    if (env.relay) env.relay->Report(Error(ErrorCode::kInternal, fmt::format("rank {}: out of memory", env.rank)));
    throw;
  } catch (const std::exception& e) {
    if (!env.relay) throw;
    const Error error(ErrorCode::kInternal, fmt::format("rank {}: unexpected failure: {}", env.rank, e.what()));
    throw transport::FailureRelay::Explain(error, env.rank, env.relay->Report(error));
  }
  if (env.relay) env.relay->Goodbye();
}

}  // namespace pipesgd::job
