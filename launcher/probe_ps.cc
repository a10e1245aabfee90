#include <chrono>
#include <span>
#include <vector>

#include "core/base/check.h"
#include "core/base/measure.h"
#include "core/train/classifier_task.h"
#include "core/train/ps_trainer.h"
#include "launcher/probe.h"

namespace pipesgd::launcher::probe {

void MeasurePsSteps(transport::Transport& transport, std::vector<transport::Connection*> links,
                    int rank, train::ClassifierTask& task, std::span<const float> params,
                    const config::Job& job, int steps, RankProbe& mine) {
  PSGD_CHECK(steps >= 1 && !links.empty() && (rank == 0 || links.size() == 1));
  constexpr int kUntimed = 2;
  const auto& train_cfg = job.train();
  // One scheme after the other, kStepRounds times, the median round of each: one round of ~0.3 s
  // read the 4-worker steps it predicts between -21% and +34% of their jobs (five probes).
  // Beside each step time, this process's CPU time per second over it: on one host, their sum
  // over the ranks is how many of its CPUs the scheme keeps busy.
  std::vector<double> step[2], cpu[2];
  for (int round = 0; round < kStepRounds; ++round) {
    for (const train::PsMode mode : {train::PsMode::kSync, train::PsMode::kAsync}) {
      const int m = mode == train::PsMode::kSync ? 0 : 1;
      const train::PsOptions options{mode, job.comm().timeout_s()};
      std::vector<float> scratch(params.begin(), params.end());
      if (rank == 0) {
        train::SgdOptimizer sgd(
            {train_cfg.learning_rate(), train_cfg.momentum(), train_cfg.weight_decay()},
            scratch.size());
        train::PsServer server(transport, links, sgd, scratch, options);
        const auto t0 = std::chrono::steady_clock::now();
        const double cpu0 = ProcessCpuSeconds();
        server.Run();
        cpu[m].push_back((ProcessCpuSeconds() - cpu0) / SecondsSince(t0));
        continue;
      }
      train::PsWorker worker(transport, *links[0], task, scratch, rank, options);
      for (int i = 0; i < kUntimed; ++i) worker.Step();
      const auto t0 = std::chrono::steady_clock::now();
      const double cpu0 = ProcessCpuSeconds();
      for (int i = 0; i < steps; ++i) worker.Step();
      const double wall = SecondsSince(t0);
      step[m].push_back(wall / steps);
      cpu[m].push_back((ProcessCpuSeconds() - cpu0) / wall);
      worker.Bye();
    }
  }
  mine.set_ps_sync_step_s(rank == 0 ? 0 : Median(step[0]));
  mine.set_ps_async_step_s(rank == 0 ? 0 : Median(step[1]));
  mine.set_ps_sync_cpu_share(Median(cpu[0]));
  mine.set_ps_async_cpu_share(Median(cpu[1]));
}

}  // namespace pipesgd::launcher::probe
