#include "launcher/probe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "core/base/cpu_quota.h"
#include "core/base/error.h"
#include "core/base/measure.h"
#include "core/collective/codec.h"
#include "core/collective/ring_allreduce.h"
#include "core/train/trainer.h"
#include "core/job/model_builder.h"
#include "core/job/worker_detail.h"
#include "launcher/link_prober.h"
#include "transport/rendezvous.h"

namespace pipesgd::launcher::probe {

using Clock = std::chrono::steady_clock;

std::vector<double> MeasureOnRing(const RingProbe& in, std::vector<double> mine) {
  const job::JobEnv& env = in.env;
  const config::Job& job = in.job;
  const auto& train_cfg = job.train();
  train::ClassifierTask& task = in.task;
  const std::vector<float> params(in.params.begin(), in.params.end());
  const size_t p = params.size();
  const double compute_s = in.compute_s, update_s = in.update_s;
  std::vector<double> all(static_cast<size_t>(kFields) * env.world_size, 0.0);
  std::vector<double> times;
  const int w = env.world_size, r = env.rank;
  // The ring's neighbours and, for the PS exchange, a star around rank 0.
  std::vector<int> peers = collective::Communicator::RingPeers(r, w);
  if (r == 0) {
    for (int q = 1; q < w; ++q) peers.push_back(q);
  } else if (w > 1) {
    peers.push_back(0);
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  job::PeerLinks links = job::ConnectPeers(env, "pipesgd " PIPESGD_VERSION " probe\n" + job::JobDescription(job),
                                 peers, job.comm(), Deadline::After(job.comm().start_timeout_s()),
                                 fmt::format("comm.start_timeout_s = {} s", job.comm().start_timeout_s()));
  auto conn = [&](int peer) -> transport::Connection& {
    for (size_t i = 0; i < peers.size(); ++i) {
      if (peers[i] == peer) return *links.connections[i];
    }
    Throw(ErrorCode::kInternal, "probe: no connection to rank {}", peer);
  };
  mine[kLoopback] = transport::IsLoopbackIp(links.data_address) ? 1.0 : 0.0;
  mine[kHostCpus] = ProcessCpus();
  transport::Connection& right = conn((r + 1) % w);
  transport::Connection& left = conn((r + w - 1) % w);
  Prober prober(*links.transport, job.comm().timeout_s());
  // Round i: rank i measures its link to rank i+1, which answers; one link at a time.
  for (int i = 0; i < w; ++i) {
    if (r == i) {
      const LinkNumbers link = prober.Ping(right, in.pings);
      mine[0] = link.latency_s;
      mine[1] = link.bandwidth_Bps;
      mine[2] = link.overhead_s;
    } else if (r == (i + 1) % w) {
      prober.Pong(left, in.pings);
    }
  }
  mine[6] = prober.RingExchange(right, left, kBigBytes, kBigReps).bandwidth_Bps;
  // The PS schemes' messages, the whole model each: as many as make 32 MiB, at least 8.
  mine[kExchangeCpu] =
      prober.RingExchange(right, left, 4 * p, std::max<int>(8, (32u << 20) / (4 * p)))
          .cpu_s_per_byte;
  // The job's AllReduce itself on these connections (a communicator per chunk size; the
  // transport stays the caller's), median of kAllReduceReps after 2 untimed.
  {
    const std::shared_ptr<transport::Transport> shared(links.transport.get(),
                                                       [](transport::Transport*) {});
    std::vector<float> values(p, 1.0f);
    int field = 7;
    for (uint64_t chunk : kTimedChunks) {
      collective::CommunicatorOptions copt;
      copt.chunk_bytes = chunk;
      auto ring = collective::Communicator::CreateOnConnections(shared, r, w, {&left}, {&right},
                                                                copt);
      times.clear();
      double cpu0 = 0;
      for (int i = 0; i < 2 + kAllReduceReps; ++i) {
        if (i == 2) cpu0 = ProcessCpuSeconds();
        const auto t0 = Clock::now();
        ring->AllReduce(values, collective::ReduceOp::kAverage, Deadline::After(job.comm().timeout_s()));
        if (i >= 2) times.push_back(SecondsSince(t0));
      }
      mine[kCpuAllReduce + (field - 7)] = (ProcessCpuSeconds() - cpu0) / kAllReduceReps;
      mine[field++] = Median(times);
    }
    // The same AllReduce with each codec (the config's codec options, error feedback
    // included): what a codec costs in the ring, which its encode and decode alone do not show.
    for (int c = 0; c < kNumProbeCodecs; ++c) {
      for (const bool large : {false, true}) {
        collective::CommunicatorOptions copt = job::CommunicatorOptionsFromConfig(job);
        copt.chunk_bytes = large ? kLargeChunk : kMidChunk;
        copt.streams = 1;
        copt.codec.kind = ParseCodecKind(kProbeCodecs[c]);
        copt.compression_min_bytes = 0;
        auto ring = collective::Communicator::CreateOnConnections(shared, r, w, {&left},
                                                                  {&right}, copt);
        times.clear();
        double cpu0 = 0;
        for (int i = 0; i < 2 + kAllReduceReps; ++i) {
          if (i == 2) cpu0 = ProcessCpuSeconds();
          const auto t0 = Clock::now();
          ring->AllReduce(values, collective::ReduceOp::kAverage,
                          Deadline::After(job.comm().timeout_s()));
          if (i >= 2) times.push_back(SecondsSince(t0));
        }
        mine[CodecField(c, large, true)] = (ProcessCpuSeconds() - cpu0) / kAllReduceReps;
        mine[CodecField(c, large, false)] = Median(times);
      }
    }
    // Width 2's situation: this thread reduces while a second one computes, on every rank at
    // once. Where they share cores (loopback, a node under a CPU quota) each slows the other,
    // which the times above, each taken alone, cannot show. The call count comes from an
    // AllReduce of every rank's time, the same bits on every rank.
    collective::CommunicatorOptions copt;
    copt.chunk_bytes = kLargeChunk;
    auto ring = collective::Communicator::CreateOnConnections(shared, r, w, {&left}, {&right},
                                                              copt);
    std::vector<float> mean_large = {static_cast<float>(mine[9])};
    ring->AllReduce(mean_large, collective::ReduceOp::kAverage,
                    Deadline::After(job.comm().timeout_s()));
    const int calls = std::clamp(
        static_cast<int>(kOverlapBudgetS / std::max(1e-6, double(mean_large[0]))), 5, 100);
    std::atomic<bool> stop{false};
    double compute_window_s = 0, compute_thread_cpu_s = 0;
    int64_t overlapped_steps = 0;
    const auto a0 = Clock::now();
    const double overlap_cpu0 = ProcessCpuSeconds();
    std::exception_ptr compute_error;
    {
      std::jthread computer([&] {
        try {
          // The job's thread counts here too (OpenMP keeps them per thread).
          job::FitThreadsToCpuQuota(job.model());
          std::vector<float> cparams(params), cgrads(p);
          const auto c0 = Clock::now();
          const double cpu0 = ThreadCpuSeconds();
          while (!stop.load(std::memory_order_relaxed)) {
            (void)task.ComputeGradient(overlapped_steps, cparams, cgrads);
            ++overlapped_steps;
          }
          compute_window_s = SecondsSince(c0);
          compute_thread_cpu_s = ThreadCpuSeconds() - cpu0;
        } catch (...) {
          compute_error = std::current_exception();
        }
      });
      try {
        for (int i = 0; i < calls; ++i) {
          ring->AllReduce(values, collective::ReduceOp::kAverage,
                          Deadline::After(job.comm().timeout_s()));
        }
      } catch (...) {
        stop = true;
        throw;
      }
      stop = true;
    }
    if (compute_error) std::rethrow_exception(compute_error);
    const double overlap_cpu_s = ProcessCpuSeconds() - overlap_cpu0;
    mine[kCpuShare] = overlap_cpu_s / SecondsSince(a0);
    mine[kOverlapComputeCpu] =
        overlapped_steps > 0 ? compute_thread_cpu_s / static_cast<double>(overlapped_steps) : 0;
    mine[kOverlapAllReduceCpu] = (overlap_cpu_s - compute_thread_cpu_s) / calls;
    mine[kOverlapAllReduce] = SecondsSince(a0) / calls;
    mine[kOverlapCompute] =
        overlapped_steps > 0 ? compute_window_s / static_cast<double>(overlapped_steps) : 0;

    // Real width-1 and width-2 steps (the job's trainer, its communication thread, StepChunk's
    // chunks) on a scratch copy, without a codec and with the one whose AllReduce is fastest
    // (sigma shrinks as the AllReduce grows: a late rank's lag hides in a long one). What they
    // take beyond C + U + T_AR is the model's sigma. The codec and the step counts, as the
    // call count above, from an AllReduce: the same on every rank.
    const uint64_t step_chunk = StepChunk(job, p, w);
    const bool large = step_chunk == kLargeChunk;
    std::vector<float> agreed(2 + kNumProbeCodecs);
    for (int c = 0; c < kNumProbeCodecs; ++c) {
      agreed[2 + c] = static_cast<float>(mine[CodecField(c, large, false)]);
    }
    ring->AllReduce(agreed, collective::ReduceOp::kAverage,
                    Deadline::After(job.comm().timeout_s()));
    const int fast = static_cast<int>(
        std::min_element(agreed.begin() + 2, agreed.end()) - (agreed.begin() + 2));
    mine[kFastCodec] = fast;
    agreed[0] = static_cast<float>(compute_s + update_s + mine[large ? 9 : 8]);
    agreed[1] = static_cast<float>(compute_s + update_s + mine[CodecField(fast, large, false)]);
    ring->AllReduce(agreed, collective::ReduceOp::kAverage,
                    Deadline::After(job.comm().timeout_s()));
    const auto steps_for = [&](float estimate) {
      return std::clamp(
          static_cast<int>(kSyncBudgetS / kStepRounds / std::max(1e-6, double(estimate))), 4,
          50);
    };
    const int sync_steps = steps_for(agreed[0]), fast_steps = steps_for(agreed[1]);
    collective::CommunicatorOptions step_options;
    step_options.chunk_bytes = step_chunk;
    auto step_ring = collective::Communicator::CreateOnConnections(shared, r, w, {&left},
                                                                   {&right}, step_options);
    collective::CommunicatorOptions fast_options = job::CommunicatorOptionsFromConfig(job);
    fast_options.chunk_bytes = step_chunk;
    fast_options.streams = 1;
    fast_options.codec.kind = ParseCodecKind(kProbeCodecs[fast]);
    fast_options.compression_min_bytes = 0;
    auto fast_ring = collective::Communicator::CreateOnConnections(shared, r, w, {&left},
                                                                   {&right}, fast_options);
    fast_options.chunk_bytes = large ? kMidChunk : kLargeChunk;
    auto fast_other_ring = collective::Communicator::CreateOnConnections(
        shared, r, w, {&left}, {&right}, fast_options);
    std::vector<float> scratch(params);
    train::SgdOptimizer scratch_sgd(
        {train_cfg.learning_rate(), train_cfg.momentum(), train_cfg.weight_decay()}, p);
    train::TrainerOptions trainer_options;
    trainer_options.pipeline_width = 1;
    trainer_options.timeout_s = job.comm().timeout_s();
    // Steps of one width at a time; width 2's pipeline fills in its first step (it applies
    // nothing), so the untimed steps cover it.
    const auto time_steps = [&](collective::Communicator& comm, int steps, int width) {
      trainer_options.pipeline_width = width;
      trainer_options.compensation =
          width >= 2 ? job::detail::CompensationFromConfig(train_cfg.staleness_compensation())
                     : train::StalenessCompensation::kNone;
      train::Trainer trainer(comm, task, scratch_sgd, scratch, trainer_options);
      for (int i = 0; i < 2; ++i) trainer.Step();
      const auto s0 = Clock::now();
      for (int i = 0; i < steps; ++i) trainer.Step();
      const double per_step = SecondsSince(s0) / steps;
      trainer.Drain(false);
      return per_step;
    };
    // In turn, so that none takes all of a slow moment, nor pays alone for what warms up
    // first.
    std::vector<double> rounds[6];
    for (int round = 0; round < kStepRounds; ++round) {
      rounds[0].push_back(time_steps(*step_ring, sync_steps, 1));
      rounds[1].push_back(time_steps(*step_ring, sync_steps, 2));
      rounds[2].push_back(time_steps(*fast_ring, fast_steps, 1));
      rounds[3].push_back(time_steps(*fast_ring, fast_steps, 2));
      rounds[4].push_back(time_steps(*fast_other_ring, fast_steps, 1));
      rounds[5].push_back(time_steps(*fast_other_ring, fast_steps, 2));
    }
    mine[kSyncStep] = Median(rounds[0]);
    mine[kPipeStep] = Median(rounds[1]);
    mine[kFastSyncStep] = Median(rounds[2]);
    mine[kFastPipeStep] = Median(rounds[3]);
    mine[kFastSyncStepOther] = Median(rounds[4]);
    mine[kFastPipeStepOther] = Median(rounds[5]);

    // The PS schemes' steps: a synchronous one computes and moves (W-1) models into rank 0 and
    // out, at about W times the 16 MiB AllReduce's link time; the step count, as above, agreed.
    std::vector<float> ps_estimate = {static_cast<float>(compute_s + w * mine[9])};
    ring->AllReduce(ps_estimate, collective::ReduceOp::kAverage,
                    Deadline::After(job.comm().timeout_s()));
    const int ps_steps = std::clamp(
        static_cast<int>(kPsBudgetS / kStepRounds / std::max(1e-6, double(ps_estimate[0]))), 3,
        30);
    std::vector<transport::Connection*> star;
    if (r == 0) {
      for (int q = 1; q < w; ++q) star.push_back(&conn(q));
    } else {
      star.push_back(&conn(0));
    }
    MeasurePsSteps(*links.transport, star, r, task, params, job, ps_steps, mine);
  }
  // Gather every rank's numbers at rank 0: one pass around the ring.
  const size_t bytes = all.size() * sizeof(double);
  if (r == 0) {
    std::copy(mine.begin(), mine.end(), all.begin());
    prober.Send(right, all.data(), bytes);
    prober.Recv(left, all.data(), bytes);
  } else {
    prober.Recv(left, all.data(), bytes);
    std::copy(mine.begin(), mine.end(), all.begin() + kFields * r);
    prober.Send(right, all.data(), bytes);
  }
  return all;
}

}  // namespace pipesgd::launcher::probe
