#include "core/job/model_builder.h"
#include "launcher/timing.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/base/measure.h"
#include "core/collective/codec.h"
#include "core/data/dataset.h"
#include "core/train/classifier_task.h"
#include "core/train/timing_model.h"
#include "core/train/trainer.h"
#include "core/job/config.h"
#include "core/job/worker.h"
#include "launcher/probe.h"
#include "layers/model.h"

namespace pipesgd::launcher {
namespace {

using Clock = std::chrono::steady_clock;
// The per-rank fields, the timed chunk sizes and codecs (launcher/probe.h).
using namespace probe;  // NOLINT(google-build-using-namespace)

}  // namespace

std::vector<std::string> ProbeWorkerCommand(const ProbeArgs& a) {
  std::vector<std::string> cmd = {"probe", a.config_path, "--pings", std::to_string(a.pings),
                                  "--compute-steps", std::to_string(a.compute_steps)};
  for (const auto& o : a.overrides) {
    cmd.push_back("--set");
    cmd.push_back(o);
  }
  if (!a.json_path.empty()) {
    cmd.push_back("--json");
    cmd.push_back(a.json_path);
  }
  return cmd;
}

void RunProbe(const ProbeArgs& args) {
  const job::JobEnv env = job::ReadJobEnv();
  const config::Job job = job::LoadJobConfig(args.config_path, args.overrides);
  const auto& data_cfg = job.data();
  const auto& train_cfg = job.train();
  int classes = 0;
  for (const auto& l : job.model().layers()) {
    if (l.has_linear()) classes = l.linear().out_features();
  }
  data::Dataset train_set = data::LoadDataset(data_cfg.train_images(), data_cfg.train_labels(),
                                              classes, data_cfg.train_limit());
  const size_t batch = static_cast<size_t>(train_cfg.batch_size());
  auto model = std::make_unique<layers::Model>(job::BuildLayers(job.model()), batch);
  const size_t p = model->num_params();
  std::vector<float> params(p), grads(p);
  model->Init(params, train_cfg.seed());
  train::ClassifierTask task(*model, train_set, batch, env.rank, env.world_size, train_cfg.seed(),
                             {data_cfg.input_mean(), data_cfg.input_std()});
  if (task.steps_per_epoch() == 0) {
    Throw(ErrorCode::kInvalidArgument, "probe: the training set has fewer than {} samples",
          batch * env.world_size);
  }
  // Compute: forward + backward of one step, averaged over at least compute_steps steps and
  // 1.5 s after 3 untimed: a node under a CPU quota (scripts/lab cpu, a cgroup) runs at full
  // speed until its quota of the 100 ms period is spent, then waits, so only an average over
  // many periods gives the rate training will see.
  for (int i = 0; i < 3; ++i) (void)task.ComputeGradient(i, params, grads);
  int64_t computed = 0;
  const auto compute_start = Clock::now();
  const double compute_cpu0 = ProcessCpuSeconds();
  while (computed < args.compute_steps || SecondsSince(compute_start) < 1.5) {
    (void)task.ComputeGradient(3 + computed, params, grads);
    ++computed;
  }
  const double compute_wall_s = SecondsSince(compute_start);
  const double compute_s = compute_wall_s / static_cast<double>(computed);
  // The CPU this rank gets while every rank computes: below 1 where ranks share cores or a
  // quota holds the node back (the model's CPU bound).
  const double my_compute_cpu_share = (ProcessCpuSeconds() - compute_cpu0) / compute_wall_s;
  std::vector<double> times;
  // U: what a step does besides forward + backward (core/train/trainer.cc), averaged over 0.3 s,
  // as C, so that both are times at the CPU share the rank gets. Width 1: check the aggregate
  // for non-finite values and update. Width >= 2 with a staleness compensation (U_K) adds
  // keeping the local gradient for the prediction and the next step's prediction, made in the
  // same pass as the update.
  train::SgdOptimizer sgd({train_cfg.learning_rate(), train_cfg.momentum(), train_cfg.weight_decay()}, p);
  std::fill(grads.begin(), grads.end(), 1e-6f);
  std::vector<float> local(p), predicted(p);
  int64_t nonfinite = 0;
  const auto time_update = [&](bool pipelined) {
    const bool predicting = pipelined && train_cfg.staleness_compensation() != config::NONE;
    const bool keep_local = pipelined && train_cfg.staleness_compensation() == config::LOCAL_GRADIENT;
    int64_t updates = 0;
    const auto start = Clock::now();
    while (updates < 10 || SecondsSince(start) < 0.3) {
      if (keep_local) std::copy(grads.begin(), grads.end(), local.begin());
      nonfinite +=
          std::count_if(grads.begin(), grads.end(), [](float g) { return !std::isfinite(g); });
      if (predicting) {
        sgd.ApplyAndPredict(params, grads, local, predicted);
      } else {
        sgd.Apply(params, grads);
      }
      ++updates;
    }
    return SecondsSince(start) / static_cast<double>(updates);
  };
  // Untimed first: the optimizer's momentum and the prediction's buffers are touched for the
  // first time here, a cost that would fall on U alone.
  sgd.ApplyAndPredict(params, grads, local, predicted);
  const double update_s = time_update(false);
  const double pipelined_update_s = time_update(true);
  if (nonfinite != 0) Throw(ErrorCode::kInternal, "probe: the update's gradient is not finite");
  // The reduction, averaged over 0.5 s for the same reason.
  std::vector<float> a(p, 1.0f), b(p, 2.0f);
  int64_t adds = 0;
  const auto add_start = Clock::now();
  while (adds < 10 || SecondsSince(add_start) < 0.5) {
    for (size_t j = 0; j < p; ++j) a[j] += b[j] * 1e-9f;
    ++adds;
  }
  const double reduce_s_per_byte = SecondsSince(add_start) / static_cast<double>(adds) / (4.0 * p);
  if (!std::isfinite(a[p / 2])) Throw(ErrorCode::kInternal, "probe: the reduction overflowed");

  // Codecs: encode + decode of the whole model in 256 Ki-element chunks.
  nlohmann::json codecs = nlohmann::json::array();
  codecs.push_back({{"name", "none"}, {"ratio", 1.0}, {"s_per_byte", 0.0}});
  for (const char* name : kProbeCodecs) {
    CodecOptions copt;
    copt.kind = ParseCodecKind(name);
    auto codec = MakeCodec(copt);
    const size_t chunk = std::min<size_t>(p, 1 << 18);
    std::vector<std::byte> wire(codec->EncodedBytes(chunk));
    std::vector<float> values(p), decoded(chunk);
    for (size_t j = 0; j < p; ++j) values[j] = std::sin(0.001f * static_cast<float>(j)) * 1e-3f;
    size_t wire_bytes = 0;
    times.clear();
    for (int rep = 0; rep < 5; ++rep) {
      wire_bytes = 0;
      const auto t0 = Clock::now();
      for (size_t off = 0; off < p; off += chunk) {
        const size_t n = std::min(chunk, p - off);
        const size_t bytes = codec->EncodedBytes(n);
        codec->Encode({values.data() + off, n}, {wire.data(), bytes}, rep);
        codec->Decode({wire.data(), bytes}, {decoded.data(), n});
        wire_bytes += bytes;
      }
      times.push_back(SecondsSince(t0));
    }
    codecs.push_back({{"name", name},
                      {"ratio", 4.0 * p / wire_bytes},
                      {"s_per_byte", Median(times) / (4.0 * p)},
                      {"encode_decode_s_per_byte", Median(times) / (4.0 * p)}});
  }

  std::vector<double> mine(kFields, 0.0);
  mine[3] = compute_s;
  mine[4] = update_s;
  mine[kPipelinedUpdate] = pipelined_update_s;
  mine[5] = reduce_s_per_byte;
  mine[kComputeCpuShare] = my_compute_cpu_share;
  const std::vector<double> all =
      env.world_size > 1
          ? MeasureOnRing({env, job, args.pings, task, params, compute_s, update_s}, mine)
          : mine;
  if (env.rank != 0) return;

  nlohmann::json per_rank = nlohmann::json::array();
  double latency = 0, alone = 0, ring = 0, overhead = 0, compute = 0, update = 0, reduce = 0;
  double pipelined_update = 0;
  std::printf("# pipesgd probe: %d ranks, model %zu params (%.0f bytes), batch %zu per rank\n",
              env.world_size, p, 4.0 * p, batch);
  std::printf("# %4s %5s %12s %14s %14s %14s %12s %12s %14s\n", "rank", "right", "latency(us)",
              "alone(MB/s)", "ring(MB/s)", "chunk_ovh(us)", "compute(ms)", "update(ms)",
              "reduce(ns/B)");
  for (int r = 0; r < env.world_size; ++r) {
    const double* v = all.data() + kFields * r;
    std::printf("  %4d %5d %12.1f %14.2f %14.2f %14.2f %12.3f %12.3f %14.4f\n", r,
                env.world_size > 1 ? (r + 1) % env.world_size : -1, v[0] * 1e6, v[1] / 1e6,
                v[6] / 1e6, v[2] * 1e6, v[3] * 1e3, v[4] * 1e3, v[5] * 1e9);
    per_rank.push_back({{"rank", r},
                        {"right", (r + 1) % env.world_size},
                        {"latency_s", v[0]},
                        {"bandwidth_Bps", v[1]},
                        {"ring_bandwidth_Bps", v[6]},
                        {"allreduce_s", {{std::to_string(kSmallChunk), v[7]},
                                         {std::to_string(kMidChunk), v[8]},
                                         {std::to_string(kLargeChunk), v[9]}}},
                        {"chunk_overhead_s", v[2]},
                        {"compute_s", v[3]},
                        {"overlap", {{"compute_s", v[kOverlapCompute]},
                                     {"allreduce_s", v[kOverlapAllReduce]}}},
                        {"update_s", v[4]},
                        {"pipelined_update_s", v[kPipelinedUpdate]},
                        {"sync_step_s", v[kSyncStep]},
                        {"pipe_step_s", v[kPipeStep]},
                        {"fast_sync_step_s", v[kFastSyncStep]},
                        {"fast_pipe_step_s", v[kFastPipeStep]},
                        {"fast_other_sync_step_s", v[kFastSyncStepOther]},
                        {"fast_other_pipe_step_s", v[kFastPipeStepOther]},
                        {"reduce_s_per_byte", v[5]},
                        {"loopback", v[kLoopback] == 1.0},
                        {"ps_sync_step_s", v[kPsSyncStep]},
                        {"ps_async_step_s", v[kPsAsyncStep]},
                        {"host_cpus", v[kHostCpus]},
                        {"ps_sync_cpu_share", v[kPsSyncCpu]},
                        {"ps_async_cpu_share", v[kPsAsyncCpu]},
                        {"cpu", {{"compute_share", v[kComputeCpuShare]},
                                 {"share", v[kCpuShare]},
                                 {"overlap_compute_s", v[kOverlapComputeCpu]},
                                 {"overlap_allreduce_s", v[kOverlapAllReduceCpu]},
                                 {"exchange_s_per_byte", v[kExchangeCpu]},
                                 {"allreduce_s", {{std::to_string(kSmallChunk), v[kCpuAllReduce]},
                                                  {std::to_string(kMidChunk), v[kCpuAllReduce + 1]},
                                                  {std::to_string(kLargeChunk),
                                                   v[kCpuAllReduce + 2]}}}}}});
    if (env.world_size > 1) {
      nlohmann::json& by_codec = per_rank.back()["codec_allreduce_s"];
      for (int c = 0; c < kNumProbeCodecs; ++c) {
        by_codec[kProbeCodecs[c]] = {{std::to_string(kMidChunk), v[CodecField(c, false, false)]},
                                     {std::to_string(kLargeChunk), v[CodecField(c, true, false)]}};
      }
    }
    latency = std::max(latency, v[0]);
    alone = r == 0 ? v[1] : std::min(alone, v[1]);
    ring = r == 0 ? v[6] : std::min(ring, v[6]);
    overhead = std::max(overhead, v[2]);
    compute = std::max(compute, v[3]);
    update = std::max(update, v[4]);
    pipelined_update = std::max(pipelined_update, v[kPipelinedUpdate]);
    reduce = std::max(reduce, v[5]);
  }
  // The per-byte CPU rates are properties of the machines, alike on every node: the median over
  // ranks, so one rank preempted while it measured (a shared host) does not set them.
  std::vector<double> compute_by_rank;
  double allreduce_small = 0, allreduce_mid = 0, allreduce_large = 0;  // the slowest rank's
  double overlap_compute = 0, overlap_allreduce = 0;                    // the slowest rank's
  double sync_step = 0;  // the slowest rank's width-1 step (StepChunk's chunks)
  double pipe_step = 0;  // and width-2 step
  double fast_sync_step = 0, fast_pipe_step = 0;  // the same with the fast codec
  double fast_sync_step_other = 0, fast_pipe_step_other = 0;  // and at the other chunk size
  // The PS schemes' real steps (rank 0 serving the others), the slowest worker's.
  double ps_sync_step = 0, ps_async_step = 0;
  // And the CPUs they kept busy: every rank's CPU time per second over them, summed.
  double ps_sync_cpus = 0, ps_async_cpus = 0;
  // The CPU shares of the rank that computes slowest (they go with its C); the AllReduce's CPU
  // time per call, the median over ranks (small, mid, large chunks).
  double compute_cpu_share = 0, cpu_share = 0;
  // CPU per byte sent in messages of the whole model (as the PS schemes send), median over ranks.
  double big_message_cpu = 0;
  // Every rank's ring connections on a loopback address: one host, no link between the ranks.
  bool loopback = env.world_size > 1;
  std::vector<double> cpu_allreduce(3, 0.0);
  {
    std::vector<double> rho, ovh, exchange_cpu;
    std::vector<std::vector<double>> cpu_ar(3);
    int slowest = 0;
    for (int r = 0; r < env.world_size; ++r) {
      if (all[kFields * r + 3] > all[kFields * slowest + 3]) slowest = r;
      for (int i = 0; i < 3; ++i) cpu_ar[i].push_back(all[kFields * r + kCpuAllReduce + i]);
      ovh.push_back(all[kFields * r + 2]);
      rho.push_back(all[kFields * r + 5]);
      exchange_cpu.push_back(all[kFields * r + kExchangeCpu]);
      loopback = loopback && all[kFields * r + kLoopback] == 1.0;
      compute_by_rank.push_back(all[kFields * r + 3]);
      allreduce_small = std::max(allreduce_small, all[kFields * r + 7]);
      allreduce_mid = std::max(allreduce_mid, all[kFields * r + 8]);
      allreduce_large = std::max(allreduce_large, all[kFields * r + 9]);
      overlap_compute = std::max(overlap_compute, all[kFields * r + kOverlapCompute]);
      overlap_allreduce = std::max(overlap_allreduce, all[kFields * r + kOverlapAllReduce]);
      sync_step = std::max(sync_step, all[kFields * r + kSyncStep]);
      pipe_step = std::max(pipe_step, all[kFields * r + kPipeStep]);
      fast_sync_step = std::max(fast_sync_step, all[kFields * r + kFastSyncStep]);
      fast_pipe_step = std::max(fast_pipe_step, all[kFields * r + kFastPipeStep]);
      fast_sync_step_other = std::max(fast_sync_step_other, all[kFields * r + kFastSyncStepOther]);
      fast_pipe_step_other = std::max(fast_pipe_step_other, all[kFields * r + kFastPipeStepOther]);
      ps_sync_step = std::max(ps_sync_step, all[kFields * r + kPsSyncStep]);
      ps_async_step = std::max(ps_async_step, all[kFields * r + kPsAsyncStep]);
      ps_sync_cpus += all[kFields * r + kPsSyncCpu];
      ps_async_cpus += all[kFields * r + kPsAsyncCpu];
    }
    overhead = Median(ovh);
    reduce = Median(rho);
    big_message_cpu = Median(exchange_cpu);
    compute_cpu_share = all[kFields * slowest + kComputeCpuShare];
    cpu_share = all[kFields * slowest + kCpuShare];
    for (int i = 0; i < 3; ++i) cpu_allreduce[i] = Median(cpu_ar[i]);
  }
  // What the model uses for B and o: fitted so that its AllReduce of this model is the one
  // measured, with few chunks (B) and with many (o). One link alone, or a stream of messages on
  // it, read B ~2x too high and o ~7x too low on loopback, and `pipesgd model` then advised 4 KiB
  // chunks that ran 3.3x slower than the default. The all-links-busy exchange (ring) stays in
  // the output as a check; one rank has no link at all.
  const double stream_overhead = overhead;
  train::TimingInputs fit_in;
  fit_in.workers = env.world_size;
  fit_in.model_bytes = 4.0 * p;
  fit_in.latency_s = latency;
  fit_in.reduce_s_per_byte = reduce;
  fit_in.chunk_overhead_s = stream_overhead;
  double bandwidth = env.world_size > 1 ? ring : alone;
  double contention = 0;
  bool bandwidth_fitted = false;
  if (env.world_size > 1) {
    fit_in.bandwidth_Bps = bandwidth;
    const train::RingFit fit = train::FitRing(fit_in, {double(kSmallChunk), allreduce_small},
                                              {double(kMidChunk), allreduce_mid},
                                              {double(kLargeChunk), allreduce_large});
    bandwidth = fit.bandwidth_Bps;
    overhead = fit.chunk_overhead_s;
    contention = fit.contention;
    bandwidth_fitted = fit.bandwidth_fitted;
  }
  fit_in.bandwidth_Bps = bandwidth;
  fit_in.chunk_overhead_s = overhead;
  fit_in.contention = contention;
  std::printf("# compute over ranks: min %.3f ms, median %.3f ms, max %.3f ms\n",
              *std::min_element(compute_by_rank.begin(), compute_by_rank.end()) * 1e3,
              Median(compute_by_rank) * 1e3,
              *std::max_element(compute_by_rank.begin(), compute_by_rank.end()) * 1e3);
  if (env.world_size == 1) {  // no ring to time a codec in
    for (const auto& c : codecs) {
      std::printf("# codec %-8s ratio %.3f, encode+decode %.3f ns per float32 byte\n",
                  c["name"].get<std::string>().c_str(), c["ratio"].get<double>(),
                  c["s_per_byte"].get<double>() * 1e9);
    }
  }
  if (env.world_size > 1) {
    const train::CodecCost none;
    std::printf("# AllReduce of the model, slowest rank: %.3f ms at %llu B chunks, %.3f ms at %llu "
                "B, %.3f ms at %llu B; fitted to them: bandwidth %.2f MB/s (8 MiB exchanged with "
                "every link busy: %.2f MB/s), chunk overhead %.2f us (a stream of messages: %.2f "
                "us), contention %.3f; the model then gives %.3f ms, %.3f ms and %.3f ms\n",
                allreduce_small * 1e3, static_cast<unsigned long long>(kSmallChunk),
                allreduce_mid * 1e3, static_cast<unsigned long long>(kMidChunk),
                allreduce_large * 1e3, static_cast<unsigned long long>(kLargeChunk),
                bandwidth / 1e6, ring / 1e6, overhead * 1e6, stream_overhead * 1e6, contention,
                train::RingAllReduceTime(fit_in, none, kSmallChunk) * 1e3,
                train::RingAllReduceTime(fit_in, none, kMidChunk) * 1e3,
                train::RingAllReduceTime(fit_in, none, kLargeChunk) * 1e3);
    if (!bandwidth_fitted) {
      // A loaded machine can time the large AllReduce below what the measured latency and
      // reduction cost alone allow; the model cannot reproduce it then, and says so.
      std::printf("# bandwidth not fitted: no B gives %.3f ms at %llu B chunks with latency %.1f "
                  "us and reduce %.4f ns/B; kept the exchange's %.2f MB/s\n",
                  allreduce_large * 1e3, static_cast<unsigned long long>(kLargeChunk),
                  latency * 1e6, reduce * 1e9, ring / 1e6);
    }
  }
  // The transport's CPU time per byte sent and per message, from the AllReduce's CPU time with
  // many chunks and with few; with the shares, the model's CPU bound.
  train::TransportCpu transport_cpu;
  double sync_overhead = 0, pipe_overhead = 0, fast_sync_overhead = 0, fast_pipe_overhead = 0;
  // The fast codec's steps at the other chunk size: its sigmas there, and the per-chunk cost.
  double other_sync_overhead = 0, other_pipe_overhead = 0;
  double sync_per_chunk = 0, pipe_per_chunk = 0;
  // Each codec as fitted, and its AllReduce at the steps' chunk size as timed (the slowest
  // rank's).
  std::vector<train::CodecCost> fitted(kNumProbeCodecs);
  std::vector<double> codec_step(kNumProbeCodecs, 0.0), codec_other(kNumProbeCodecs, 0.0);
  const uint64_t step_chunk = StepChunk(job, p, env.world_size);
  const uint64_t other_chunk = step_chunk == kLargeChunk ? kMidChunk : kLargeChunk;
  const double m_step = train::ChunksPerBlock(fit_in, double(step_chunk));
  const double m_other = train::ChunksPerBlock(fit_in, double(other_chunk));
  const double allreduce_step = step_chunk == kLargeChunk ? allreduce_large : allreduce_mid;
  const int fast = static_cast<int>(all[kFastCodec]);  // the same on every rank
  if (env.world_size > 1) {
    fit_in.compute_cpu_share = compute_cpu_share;  // the reduction's CPU is s_c of its wall time
    transport_cpu = train::FitTransportCpu(fit_in, {double(kSmallChunk), cpu_allreduce[0]},
                                           {double(kLargeChunk), cpu_allreduce[2]});
    std::printf("# CPU time of the AllReduce (every thread, median over ranks): %.3f ms at %llu B "
                "chunks, %.3f ms at %llu B, %.3f ms at %llu B; beyond the reduction: %.3f ns per "
                "byte sent, %.2f us per message (%.3f ns per byte in whole-model messages); CPU per "
                "second of the slowest rank: %.2f computing, %.2f computing and reducing at "
                "once\n",
                cpu_allreduce[0] * 1e3, static_cast<unsigned long long>(kSmallChunk),
                cpu_allreduce[1] * 1e3, static_cast<unsigned long long>(kMidChunk),
                cpu_allreduce[2] * 1e3, static_cast<unsigned long long>(kLargeChunk),
                transport_cpu.s_per_byte * 1e9, transport_cpu.s_per_message * 1e6,
                big_message_cpu * 1e9, compute_cpu_share, cpu_share);
    // Each codec's cost in the ring, from its AllReduces: the slowest rank's wall time and the
    // median CPU time over ranks, as without a codec.
    fit_in.transport_cpu_s_per_byte = transport_cpu.s_per_byte;
    fit_in.transport_cpu_s_per_message = transport_cpu.s_per_message;
    for (int c = 0; c < kNumProbeCodecs; ++c) {
      nlohmann::json& entry = codecs[c + 1];
      std::vector<train::TimedCodec> timed;
      for (const bool large : {false, true}) {
        std::vector<double> cpu;
        double slowest = 0;
        for (int r = 0; r < env.world_size; ++r) {
          slowest = std::max(slowest, all[kFields * r + CodecField(c, large, false)]);
          cpu.push_back(all[kFields * r + CodecField(c, large, true)]);
        }
        timed.push_back({double(large ? kLargeChunk : kMidChunk), slowest, Median(cpu)});
      }
      const train::CodecCost fit =
          train::FitCodec(fit_in, kProbeCodecs[c], entry["ratio"].get<double>(), timed);
      fitted[c] = fit;
      codec_step[c] = timed[step_chunk == kLargeChunk ? 1 : 0].seconds;
      codec_other[c] = timed[step_chunk == kLargeChunk ? 0 : 1].seconds;
      entry["s_per_byte"] = fit.s_per_byte;
      entry["cpu_s_per_byte"] = fit.cpu_s_per_byte.value_or(0);
      entry["s_per_chunk"] = fit.s_per_chunk;
      entry["cpu_s_per_chunk"] = fit.cpu_s_per_chunk;
      entry["allreduce_s"] = {{std::to_string(kMidChunk), timed[0].seconds},
                              {std::to_string(kLargeChunk), timed[1].seconds}};
      entry["allreduce_cpu_s"] = {{std::to_string(kMidChunk), timed[0].cpu_s},
                                  {std::to_string(kLargeChunk), timed[1].cpu_s}};
      std::printf("# codec %-7s ratio %.3f; its AllReduce, slowest rank: %.3f ms at %llu B "
                  "chunks, %.3f ms at %llu B; fitted to them, beside float32's: %+.3f ns per "
                  "float32 byte and %+.2f us per chunk (CPU: %+.3f ns, %+.2f us; encode + decode "
                  "alone: %.3f ns, rank 0); the model then gives %.3f ms and %.3f ms\n",
                  kProbeCodecs[c], fit.ratio, timed[0].seconds * 1e3,
                  static_cast<unsigned long long>(kMidChunk), timed[1].seconds * 1e3,
                  static_cast<unsigned long long>(kLargeChunk), fit.s_per_byte * 1e9,
                  fit.s_per_chunk * 1e6, fit.cpu_s_per_byte.value_or(0) * 1e9,
                  fit.cpu_s_per_chunk * 1e6, entry["encode_decode_s_per_byte"].get<double>() * 1e9,
                  train::RingAllReduceTime(fit_in, fit, kMidChunk) * 1e3,
                  train::RingAllReduceTime(fit_in, fit, kLargeChunk) * 1e3);
    }
    // sigma at two AllReduce times: the slowest rank's width-1 step beyond C + U + its
    // AllReduce as timed (or the CPU bound), without a codec and with the fast one.
    fit_in.compute_s = compute;
    fit_in.update_s = update;
    fit_in.cpu_share = cpu_share;
    sync_overhead = train::FitSyncOverhead(fit_in, train::CodecCost{}, double(step_chunk),
                                           allreduce_step, sync_step);
    fast_sync_overhead = train::FitSyncOverhead(fit_in, fitted[fast], double(step_chunk),
                                                codec_step[fast], fast_sync_step);
    other_sync_overhead = train::FitSyncOverhead(fit_in, fitted[fast], double(other_chunk),
                                                 codec_other[fast], fast_sync_step_other);
    sync_per_chunk =
        train::FitChunkOverhead(m_step, fast_sync_overhead, m_other, other_sync_overhead);
    std::printf("# width-1 steps (the trainer, %llu B chunks), slowest rank: %.3f ms per step "
                "without a codec, %.3f ms with %s (the fastest AllReduce); beyond C + U + the "
                "AllReduce as timed (%.3f ms, %.3f ms), or the CPU bound: sigma %.3f ms, %.3f ms\n",
                static_cast<unsigned long long>(step_chunk), sync_step * 1e3,
                fast_sync_step * 1e3, kProbeCodecs[fast], allreduce_step * 1e3,
                codec_step[fast] * 1e3, sync_overhead * 1e3, fast_sync_overhead * 1e3);
  }
  // How much each thread slows the other where they run at once (1: not at all); the model's
  // width-2 prediction uses them.
  const double compute_factor =
      env.world_size > 1 && compute > 0 ? std::max(1.0, overlap_compute / compute) : 1.0;
  const double allreduce_factor = env.world_size > 1 && allreduce_large > 0
                                      ? std::max(1.0, overlap_allreduce / allreduce_large)
                                      : 1.0;
  if (env.world_size > 1) {
    std::printf("# compute and AllReduce at once (every rank, %llu B chunks), slowest rank: "
                "compute %.3f ms per step (%.2fx alone), AllReduce %.3f ms (%.2fx alone)\n",
                static_cast<unsigned long long>(kLargeChunk), overlap_compute * 1e3,
                compute_factor, overlap_allreduce * 1e3, allreduce_factor);
    // sigma_2: the slowest rank's width-2 steps beyond the overlap formula, as sigma.
    fit_in.pipelined_update_s = pipelined_update;
    fit_in.overlap_compute_factor = compute_factor;
    fit_in.overlap_allreduce_factor = allreduce_factor;
    pipe_overhead = train::FitPipeOverhead(fit_in, train::CodecCost{}, double(step_chunk),
                                           allreduce_step, pipe_step);
    fast_pipe_overhead = train::FitPipeOverhead(fit_in, fitted[fast], double(step_chunk),
                                                codec_step[fast], fast_pipe_step);
    other_pipe_overhead = train::FitPipeOverhead(fit_in, fitted[fast], double(other_chunk),
                                                 codec_other[fast], fast_pipe_step_other);
    pipe_per_chunk =
        train::FitChunkOverhead(m_step, fast_pipe_overhead, m_other, other_pipe_overhead);
    std::printf("# the steps with %s at %llu B chunks (%.0f per ring block), slowest rank: width 1 "
                "%.3f ms, width 2 %.3f ms (its AllReduce %.3f ms): sigma %.3f ms, sigma_2 %.3f ms "
                "against %.3f ms and %.3f ms at %.0f per block; per chunk per block beyond the "
                "AllReduce alone: %.1f us (width 1), %.1f us (width 2)\n",
                kProbeCodecs[fast], static_cast<unsigned long long>(other_chunk), m_other,
                fast_sync_step_other * 1e3, fast_pipe_step_other * 1e3, codec_other[fast] * 1e3,
                other_sync_overhead * 1e3, other_pipe_overhead * 1e3, fast_sync_overhead * 1e3,
                fast_pipe_overhead * 1e3, m_step, sync_per_chunk * 1e6, pipe_per_chunk * 1e6);
    std::printf("# width-2 steps (the trainer, %llu B chunks), slowest rank: %.3f ms per step "
                "without a codec, %.3f ms with %s; beyond the overlap of C + U_K and the "
                "AllReduce as timed, or the CPU bound: sigma_2 %.3f ms, %.3f ms\n",
                static_cast<unsigned long long>(step_chunk), pipe_step * 1e3,
                fast_pipe_step * 1e3, kProbeCodecs[fast], pipe_overhead * 1e3,
                fast_pipe_overhead * 1e3);
  }
  std::printf("# for the model: the slowest link and the slowest rank: latency %.1f us, bandwidth "
              "%.2f MB/s %s (%.2f MB/s a link alone), compute %.3f ms, "
              "update %.3f ms (%.3f ms pipelined); median over ranks: chunk overhead %.2f us, "
              "reduce %.4f ns/B\n",
              latency * 1e6, bandwidth / 1e6,
              env.world_size == 1 ? "(one rank: no link)"
              : bandwidth_fitted  ? "fitted to the ring's AllReduce"
                                  : "from the exchange (not fitted)",
              alone / 1e6, compute * 1e3, update * 1e3,
              pipelined_update * 1e3, overhead * 1e6, reduce * 1e9);
  if (loopback) {
    std::printf("# every rank's connections are on a loopback address: no link between the "
                "ranks, the kernel copies the bytes on their cores (%.2f CPUs; the PS schemes' "
                "server costs CPU: %.3f ns per byte in whole-model messages)\n",
                all[kHostCpus], big_message_cpu * 1e9);
  }
  if (env.world_size > 1) {
    std::printf("# the PS schemes' real steps, rank 0 serving the %d others, slowest worker: "
                "%.3f ms synchronous, %.3f ms asynchronous; every rank's CPU over them: %.2f "
                "and %.2f CPUs\n",
                env.world_size - 1, ps_sync_step * 1e3, ps_async_step * 1e3, ps_sync_cpus,
                ps_async_cpus);
  }
  if (!args.json_path.empty()) {
    nlohmann::json j = {{"world_size", env.world_size},
                        {"workers", env.world_size},
                        {"params", p},
                        {"model_bytes", 4.0 * p},
                        {"batch_size", batch},
                        {"latency_s", latency},
                        {"bandwidth_Bps", bandwidth},
                        {"link_alone_bandwidth_Bps", alone},
                        {"ring_exchange_bandwidth_Bps", ring},
                        {"chunk_overhead_s", overhead},
                        {"stream_chunk_overhead_s", stream_overhead},
                        {"contention", contention},
                        {"bandwidth_fitted", bandwidth_fitted},
                        {"overlap_compute_factor", compute_factor},
                        {"overlap_allreduce_factor", allreduce_factor},
                        {"overlap", {{"chunk_bytes", kLargeChunk},
                                     {"compute_s", overlap_compute},
                                     {"allreduce_s", overlap_allreduce}}},
                        {"allreduce_s", {{std::to_string(kSmallChunk), allreduce_small},
                                         {std::to_string(kMidChunk), allreduce_mid},
                                         {std::to_string(kLargeChunk), allreduce_large}}},
                        {"compute_s", compute},
                        {"compute_s_spread",
                         {{"min", *std::min_element(compute_by_rank.begin(), compute_by_rank.end())},
                          {"median", Median(compute_by_rank)},
                          {"max", compute}}},
                        {"update_s", update},
                        {"pipelined_update_s", pipelined_update},
                        {"reduce_s_per_byte", reduce},
                        {"compute_cpu_share", env.world_size > 1 ? compute_cpu_share : 0.0},
                        {"cpu_share", env.world_size > 1 ? cpu_share : 0.0},
                        {"transport_cpu_s_per_byte", transport_cpu.s_per_byte},
                        {"transport_cpu_s_per_message", transport_cpu.s_per_message},
                        {"sync_step_s", {{"chunk_bytes", step_chunk}, {"seconds", sync_step}}},
                        {"sync_overhead_s", sync_overhead},
                        {"overhead_allreduce_s", env.world_size > 1 ? allreduce_step : 0.0},
                        {"fast_codec",
                         {{"name", env.world_size > 1 ? kProbeCodecs[fast] : "none"},
                          {"chunk_bytes", step_chunk},
                          {"allreduce_s", env.world_size > 1 ? codec_step[fast] : 0.0},
                          {"sync_step_s", fast_sync_step},
                          {"pipe_step_s", fast_pipe_step}}},
                        {"fast_allreduce_s", env.world_size > 1 ? codec_step[fast] : 0.0},
                        {"fast_sync_overhead_s", fast_sync_overhead},
                        {"fast_pipe_overhead_s", fast_pipe_overhead},
                        {"fast_codec_other_chunk",
                         {{"chunk_bytes", other_chunk},
                          {"allreduce_s", env.world_size > 1 ? codec_other[fast] : 0.0},
                          {"sync_step_s", fast_sync_step_other},
                          {"pipe_step_s", fast_pipe_step_other},
                          {"sync_overhead_s", other_sync_overhead},
                          {"pipe_overhead_s", other_pipe_overhead}}},
                        {"overhead_chunks_per_block", env.world_size > 1 ? m_step : 0.0},
                        {"sync_overhead_per_chunk_s", sync_per_chunk},
                        {"pipe_overhead_per_chunk_s", pipe_per_chunk},
                        {"pipe_step_s", {{"chunk_bytes", step_chunk}, {"seconds", pipe_step}}},
                        {"pipe_overhead_s", pipe_overhead},
                        {"big_message_cpu_s_per_byte", big_message_cpu},
                        {"loopback", loopback},
                        {"host_cpus", all[kHostCpus]},
                        {"ps_sync_step_s", ps_sync_step},
                        {"ps_async_step_s", ps_async_step},
                        {"ps_sync_busy_cpus", ps_sync_cpus},
                        {"ps_async_busy_cpus", ps_async_cpus},
                        {"allreduce_cpu_s", {{std::to_string(kSmallChunk), cpu_allreduce[0]},
                                             {std::to_string(kMidChunk), cpu_allreduce[1]},
                                             {std::to_string(kLargeChunk), cpu_allreduce[2]}}},
                        {"codecs", codecs},
                        {"per_rank", per_rank}};
    std::ofstream out(args.json_path);
    out << j.dump(2) << "\n";
    if (!out) Throw(ErrorCode::kIo, "probe --json {}: cannot write", args.json_path);
  }
  if (env.relay) env.relay->Goodbye();  // a normal end (transport/failure_relay.h)
}

}  // namespace pipesgd::launcher
