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
#include "core/train/probe_fit.h"
#include "core/train/timing_model.h"
#include "core/train/trainer.h"
#include "core/job/config.h"
#include "core/job/worker.h"
#include "launcher/probe.h"
#include "layers/model.h"

namespace pipesgd::launcher {
namespace {

using Clock = std::chrono::steady_clock;
// The timed chunk sizes and codecs (launcher/probe.h).
using namespace probe;  // NOLINT(google-build-using-namespace)
using train::ProbeFit;

// Compute: forward + backward of one step, averaged over at least compute_steps steps and
// 1.5 s after 3 untimed: a node under a CPU quota (scripts/lab cpu, a cgroup) runs at full
// speed until its quota of the 100 ms period is spent, then waits, so only an average over
// many periods gives the rate training will see.
void MeasureCompute(train::ClassifierTask& task, std::span<const float> params, int min_steps,
                    RankProbe& mine) {
  std::vector<float> grads(params.size());
  for (int i = 0; i < 3; ++i) (void)task.ComputeGradient(i, params, grads);
  int64_t computed = 0;
  const auto compute_start = Clock::now();
  const double compute_cpu0 = ProcessCpuSeconds();
  while (computed < min_steps || SecondsSince(compute_start) < 1.5) {
    (void)task.ComputeGradient(3 + computed, params, grads);
    ++computed;
  }
  const double compute_wall_s = SecondsSince(compute_start);
  mine.set_compute_s(compute_wall_s / static_cast<double>(computed));
  // The CPU this rank gets while every rank computes: below 1 where ranks share cores or a
  // quota holds the node back (the model's CPU bound).
  mine.set_compute_cpu_share((ProcessCpuSeconds() - compute_cpu0) / compute_wall_s);
}

// U: what a step does besides forward + backward (core/train/trainer.cc), averaged over 0.3 s,
// as C, so that both are times at the CPU share the rank gets. Width 1: check the aggregate for
// non-finite values and update. Width >= 2 with a staleness compensation (U_K) adds keeping the
// local gradient for the prediction and the next step's prediction, made in the same pass as
// the update. Then the reduction, averaged over 0.5 s for the same reason.
void MeasureUpdateAndReduction(const config::Train& train_cfg, std::vector<float> params,
                               RankProbe& mine) {
  const size_t p = params.size();
  train::SgdOptimizer sgd({train_cfg.learning_rate(), train_cfg.momentum(), train_cfg.weight_decay()}, p);
  std::vector<float> grads(p, 1e-6f), local(p), predicted(p);
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
  mine.set_update_s(time_update(false));
  mine.set_pipelined_update_s(time_update(true));
  if (nonfinite != 0) Throw(ErrorCode::kInternal, "probe: the update's gradient is not finite");
  std::vector<float> a(p, 1.0f), b(p, 2.0f);
  int64_t adds = 0;
  const auto add_start = Clock::now();
  while (adds < 10 || SecondsSince(add_start) < 0.5) {
    for (size_t j = 0; j < p; ++j) a[j] += b[j] * 1e-9f;
    ++adds;
  }
  mine.set_reduce_s_per_byte(SecondsSince(add_start) / static_cast<double>(adds) / (4.0 * p));
  if (!std::isfinite(a[p / 2])) Throw(ErrorCode::kInternal, "probe: the reduction overflowed");
}

// Each codec's encode + decode of the whole model in 256 Ki-element chunks, median of 5.
void MeasureCodecsAlone(size_t p, RankProbe& mine) {
  for (const char* name : kProbeCodecs) {
    CodecOptions copt;
    copt.kind = ParseCodecKind(name);
    auto codec = MakeCodec(copt);
    const size_t chunk = std::min<size_t>(p, 1 << 18);
    std::vector<std::byte> wire(codec->EncodedBytes(chunk));
    std::vector<float> values(p), decoded(chunk);
    for (size_t j = 0; j < p; ++j) values[j] = std::sin(0.001f * static_cast<float>(j)) * 1e-3f;
    size_t wire_bytes = 0;
    std::vector<double> times;
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
    ::pipesgd::probe::CodecAlone& alone = *mine.add_codec_alone();
    alone.set_codec(name);
    alone.set_ratio(4.0 * p / wire_bytes);
    alone.set_encode_decode_s_per_byte(Median(times) / (4.0 * p));
  }
}

// A timed AllReduce, a rank's or the fit's over ranks: its chunk size, wall and CPU seconds.
uint64_t ChunkOf(const ::pipesgd::probe::TimedAllReduce& t) { return t.chunk_bytes(); }
uint64_t ChunkOf(const train::AllReduceOverRanks& t) { return static_cast<uint64_t>(t.chunk_bytes); }
double SecondsOf(const ::pipesgd::probe::TimedAllReduce& t, bool cpu) {
  return cpu ? t.cpu_s() : t.seconds();
}
double SecondsOf(const train::AllReduceOverRanks& t, bool cpu) { return cpu ? t.cpu_s : t.seconds; }

// {"4096": seconds, ...} of timed AllReduces (wall or CPU); zeros at kTimedChunks where there are
// none (one rank).
template <typename List>
nlohmann::json ByChunk(const List& timed, bool cpu) {
  nlohmann::json j = nlohmann::json::object();
  if (timed.empty()) {
    for (uint64_t chunk : kTimedChunks) j[std::to_string(chunk)] = 0.0;
  }
  for (const auto& t : timed) j[std::to_string(ChunkOf(t))] = SecondsOf(t, cpu);
  return j;
}

nlohmann::json PerRankJson(const RankProbe& v, int world_size) {
  nlohmann::json j = {
      {"rank", v.rank()},
      {"right", (v.rank() + 1) % world_size},
      {"latency_s", v.latency_s()},
      {"bandwidth_Bps", v.bandwidth_bps()},
      {"ring_bandwidth_Bps", v.ring_bandwidth_bps()},
      {"allreduce_s", ByChunk(v.allreduce(), /*cpu=*/false)},
      {"chunk_overhead_s", v.chunk_overhead_s()},
      {"compute_s", v.compute_s()},
      {"overlap", {{"compute_s", v.overlap_compute_s()}, {"allreduce_s", v.overlap_allreduce_s()}}},
      {"update_s", v.update_s()},
      {"pipelined_update_s", v.pipelined_update_s()},
      {"sync_step_s", v.sync_step_s()},
      {"pipe_step_s", v.pipe_step_s()},
      {"fast_sync_step_s", v.fast_sync_step_s()},
      {"fast_pipe_step_s", v.fast_pipe_step_s()},
      {"fast_other_sync_step_s", v.fast_other_sync_step_s()},
      {"fast_other_pipe_step_s", v.fast_other_pipe_step_s()},
      {"reduce_s_per_byte", v.reduce_s_per_byte()},
      {"loopback", v.loopback()},
      {"ps_sync_step_s", v.ps_sync_step_s()},
      {"ps_async_step_s", v.ps_async_step_s()},
      {"host_cpus", v.host_cpus()},
      {"ps_sync_cpu_share", v.ps_sync_cpu_share()},
      {"ps_async_cpu_share", v.ps_async_cpu_share()},
      {"cpu", {{"compute_share", v.compute_cpu_share()},
               {"share", v.overlap_cpu_share()},
               {"overlap_compute_s", v.overlap_compute_cpu_s()},
               {"overlap_allreduce_s", v.overlap_allreduce_cpu_s()},
               {"exchange_s_per_byte", v.exchange_cpu_s_per_byte()},
               {"allreduce_s", ByChunk(v.allreduce(), /*cpu=*/true)}}}};
  for (const auto& codec : v.codec()) {
    j["codec_allreduce_s"][codec.codec()] = ByChunk(codec.timed(), /*cpu=*/false);
  }
  return j;
}

void PrintPerRank(const std::vector<RankProbe>& ranks, size_t p, size_t batch) {
  const int w = static_cast<int>(ranks.size());
  std::printf("# pipesgd probe: %d ranks, model %zu params (%.0f bytes), batch %zu per rank\n", w,
              p, 4.0 * p, batch);
  std::printf("# %4s %5s %12s %14s %14s %14s %12s %12s %14s\n", "rank", "right", "latency(us)",
              "alone(MB/s)", "ring(MB/s)", "chunk_ovh(us)", "compute(ms)", "update(ms)",
              "reduce(ns/B)");
  for (const auto& v : ranks) {
    std::printf("  %4d %5d %12.1f %14.2f %14.2f %14.2f %12.3f %12.3f %14.4f\n", v.rank(),
                w > 1 ? (v.rank() + 1) % w : -1, v.latency_s() * 1e6, v.bandwidth_bps() / 1e6,
                v.ring_bandwidth_bps() / 1e6, v.chunk_overhead_s() * 1e6, v.compute_s() * 1e3,
                v.update_s() * 1e3, v.reduce_s_per_byte() * 1e9);
  }
  std::vector<double> compute;
  for (const auto& v : ranks) compute.push_back(v.compute_s());
  std::printf("# compute over ranks: min %.3f ms, median %.3f ms, max %.3f ms\n",
              *std::min_element(compute.begin(), compute.end()) * 1e3, Median(compute) * 1e3,
              *std::max_element(compute.begin(), compute.end()) * 1e3);
}

unsigned long long Bytes(double chunk) { return static_cast<unsigned long long>(chunk); }

// The ring's fit, the transport's CPU and each codec's (several ranks only).
void PrintRingFit(const ProbeFit& f) {
  const auto& ar = f.allreduce;
  std::printf("# AllReduce of the model, slowest rank: %.3f ms at %llu B chunks, %.3f ms at %llu "
              "B, %.3f ms at %llu B; fitted to them: bandwidth %.2f MB/s (8 MiB exchanged with "
              "every link busy: %.2f MB/s), chunk overhead %.2f us (a stream of messages: %.2f "
              "us), contention %.3f; the model then gives %.3f ms, %.3f ms and %.3f ms\n",
              ar[0].seconds * 1e3, Bytes(ar[0].chunk_bytes), ar[1].seconds * 1e3,
              Bytes(ar[1].chunk_bytes), ar[2].seconds * 1e3, Bytes(ar[2].chunk_bytes),
              f.inputs.bandwidth_Bps / 1e6, f.ring_exchange_Bps / 1e6,
              f.inputs.chunk_overhead_s * 1e6, f.stream_chunk_overhead_s * 1e6, f.ring.contention,
              ar[0].modelled_s * 1e3, ar[1].modelled_s * 1e3, ar[2].modelled_s * 1e3);
  if (!f.ring.bandwidth_fitted) {
    // A loaded machine can time the large AllReduce below what the measured latency and
    // reduction cost alone allow; the model cannot reproduce it then, and says so.
    std::printf("# bandwidth not fitted: no B gives %.3f ms at %llu B chunks with latency %.1f "
                "us and reduce %.4f ns/B; kept the exchange's %.2f MB/s\n",
                ar[2].seconds * 1e3, Bytes(ar[2].chunk_bytes), f.inputs.latency_s * 1e6,
                f.inputs.reduce_s_per_byte * 1e9, f.ring_exchange_Bps / 1e6);
  }
  std::printf("# CPU time of the AllReduce (every thread, median over ranks): %.3f ms at %llu B "
              "chunks, %.3f ms at %llu B, %.3f ms at %llu B; beyond the reduction: %.3f ns per "
              "byte sent, %.2f us per message (%.3f ns per byte in whole-model messages); CPU per "
              "second of the slowest rank: %.2f computing, %.2f computing and reducing at "
              "once\n",
              ar[0].cpu_s * 1e3, Bytes(ar[0].chunk_bytes), ar[1].cpu_s * 1e3,
              Bytes(ar[1].chunk_bytes), ar[2].cpu_s * 1e3, Bytes(ar[2].chunk_bytes),
              f.transport_cpu.s_per_byte * 1e9, f.transport_cpu.s_per_message * 1e6,
              f.big_message_cpu_s_per_byte * 1e9, f.compute_cpu_share, f.cpu_share);
  for (const auto& c : f.codecs) {
    std::printf("# codec %-7s ratio %.3f; its AllReduce, slowest rank: %.3f ms at %llu B "
                "chunks, %.3f ms at %llu B; fitted to them, beside float32's: %+.3f ns per "
                "float32 byte and %+.2f us per chunk (CPU: %+.3f ns, %+.2f us; encode + decode "
                "alone: %.3f ns, rank 0); the model then gives %.3f ms and %.3f ms\n",
                c.name.c_str(), c.fit.ratio, c.timed[0].seconds * 1e3,
                Bytes(c.timed[0].chunk_bytes), c.timed[1].seconds * 1e3,
                Bytes(c.timed[1].chunk_bytes), c.fit.s_per_byte * 1e9, c.fit.s_per_chunk * 1e6,
                c.fit.cpu_s_per_byte.value_or(0) * 1e9, c.fit.cpu_s_per_chunk * 1e6,
                c.encode_decode_s_per_byte * 1e9, c.timed[0].modelled_s * 1e3,
                c.timed[1].modelled_s * 1e3);
  }
}

// The real steps and sigma, sigma_2 fitted to them (several ranks only).
void PrintStepFit(const ProbeFit& f) {
  const char* fast = f.codecs[static_cast<size_t>(f.fast)].name.c_str();
  const ProbeFit::Steps &plain = f.plain, &fs = f.fast_steps, &other = f.fast_other;
  std::printf("# width-1 steps (the trainer, %llu B chunks), slowest rank: %.3f ms per step "
              "without a codec, %.3f ms with %s (the fastest AllReduce); beyond C + U + the "
              "AllReduce as timed (%.3f ms, %.3f ms), or the CPU bound: sigma %.3f ms, %.3f ms\n",
              Bytes(plain.chunk_bytes), plain.sync_step_s * 1e3, fs.sync_step_s * 1e3, fast,
              plain.allreduce_s * 1e3, fs.allreduce_s * 1e3, plain.sync_overhead_s * 1e3,
              fs.sync_overhead_s * 1e3);
  std::printf("# compute and AllReduce at once (every rank, %llu B chunks), slowest rank: "
              "compute %.3f ms per step (%.2fx alone), AllReduce %.3f ms (%.2fx alone)\n",
              Bytes(f.overlap_chunk_bytes), f.overlap_compute_s * 1e3, f.compute_factor,
              f.overlap_allreduce_s * 1e3, f.allreduce_factor);
  std::printf("# the steps with %s at %llu B chunks (%.0f per ring block), slowest rank: width 1 "
              "%.3f ms, width 2 %.3f ms (its AllReduce %.3f ms): sigma %.3f ms, sigma_2 %.3f ms "
              "against %.3f ms and %.3f ms at %.0f per block; per chunk per block beyond the "
              "AllReduce alone: %.1f us (width 1), %.1f us (width 2)\n",
              fast, Bytes(other.chunk_bytes), other.chunks_per_block, other.sync_step_s * 1e3,
              other.pipe_step_s * 1e3, other.allreduce_s * 1e3, other.sync_overhead_s * 1e3,
              other.pipe_overhead_s * 1e3, fs.sync_overhead_s * 1e3, fs.pipe_overhead_s * 1e3,
              fs.chunks_per_block, f.sync_per_chunk_s * 1e6, f.pipe_per_chunk_s * 1e6);
  std::printf("# width-2 steps (the trainer, %llu B chunks), slowest rank: %.3f ms per step "
              "without a codec, %.3f ms with %s; beyond the overlap of C + U_K and the "
              "AllReduce as timed, or the CPU bound: sigma_2 %.3f ms, %.3f ms\n",
              Bytes(plain.chunk_bytes), plain.pipe_step_s * 1e3, fs.pipe_step_s * 1e3, fast,
              plain.pipe_overhead_s * 1e3, fs.pipe_overhead_s * 1e3);
}

void PrintFit(const ProbeFit& f) {
  if (f.world_size == 1) {  // no ring to time a codec in
    std::printf("# codec %-8s ratio %.3f, encode+decode %.3f ns per float32 byte\n", "none", 1.0,
                0.0);
    for (const auto& c : f.codecs) {
      std::printf("# codec %-8s ratio %.3f, encode+decode %.3f ns per float32 byte\n",
                  c.name.c_str(), c.ratio, c.encode_decode_s_per_byte * 1e9);
    }
  } else {
    PrintRingFit(f);
    PrintStepFit(f);
  }
  std::printf("# for the model: the slowest link and the slowest rank: latency %.1f us, bandwidth "
              "%.2f MB/s %s (%.2f MB/s a link alone), compute %.3f ms, "
              "update %.3f ms (%.3f ms pipelined); median over ranks: chunk overhead %.2f us, "
              "reduce %.4f ns/B\n",
              f.inputs.latency_s * 1e6, f.inputs.bandwidth_Bps / 1e6,
              f.world_size == 1      ? "(one rank: no link)"
              : f.ring.bandwidth_fitted ? "fitted to the ring's AllReduce"
                                        : "from the exchange (not fitted)",
              f.link_alone_Bps / 1e6, f.compute_s * 1e3, f.update_s * 1e3,
              f.pipelined_update_s * 1e3, f.inputs.chunk_overhead_s * 1e6,
              f.inputs.reduce_s_per_byte * 1e9);
  if (f.loopback) {
    std::printf("# every rank's connections are on a loopback address: no link between the "
                "ranks, the kernel copies the bytes on their cores (%.2f CPUs; the PS schemes' "
                "server costs CPU: %.3f ns per byte in whole-model messages)\n",
                f.host_cpus, f.big_message_cpu_s_per_byte * 1e9);
  }
  if (f.world_size > 1) {
    std::printf("# the PS schemes' real steps, rank 0 serving the %d others, slowest worker: "
                "%.3f ms synchronous, %.3f ms asynchronous; every rank's CPU over them: %.2f "
                "and %.2f CPUs\n",
                f.world_size - 1, f.ps_sync_step_s * 1e3, f.ps_async_step_s * 1e3, f.ps_sync_cpus,
                f.ps_async_cpus);
  }
}

nlohmann::json CodecsJson(const ProbeFit& f) {
  nlohmann::json codecs = nlohmann::json::array();
  codecs.push_back({{"name", "none"}, {"ratio", 1.0}, {"s_per_byte", 0.0}});
  for (const auto& c : f.codecs) {
    nlohmann::json entry = {{"name", c.name},
                            {"ratio", c.ratio},
                            {"s_per_byte", c.encode_decode_s_per_byte},
                            {"encode_decode_s_per_byte", c.encode_decode_s_per_byte}};
    if (f.world_size > 1) {
      entry["s_per_byte"] = c.fit.s_per_byte;
      entry["cpu_s_per_byte"] = c.fit.cpu_s_per_byte.value_or(0);
      entry["s_per_chunk"] = c.fit.s_per_chunk;
      entry["cpu_s_per_chunk"] = c.fit.cpu_s_per_chunk;
      entry["allreduce_s"] = ByChunk(c.timed, /*cpu=*/false);
      entry["allreduce_cpu_s"] = ByChunk(c.timed, /*cpu=*/true);
    }
    codecs.push_back(entry);
  }
  return codecs;
}

// The steps' part of the JSON: sigma and sigma_2 with what they were fitted to.
void AddStepsJson(const ProbeFit& f, nlohmann::json& j) {
  const bool ring = f.world_size > 1;
  const ProbeFit::Steps &plain = f.plain, &fs = f.fast_steps, &other = f.fast_other;
  j["sync_step_s"] = {{"chunk_bytes", Bytes(plain.chunk_bytes)}, {"seconds", plain.sync_step_s}};
  j["sync_overhead_s"] = plain.sync_overhead_s;
  j["overhead_allreduce_s"] = plain.allreduce_s;
  j["fast_codec"] = {{"name", ring ? f.codecs[static_cast<size_t>(f.fast)].name : "none"},
                     {"chunk_bytes", Bytes(fs.chunk_bytes)},
                     {"allreduce_s", fs.allreduce_s},
                     {"sync_step_s", fs.sync_step_s},
                     {"pipe_step_s", fs.pipe_step_s}};
  j["fast_allreduce_s"] = fs.allreduce_s;
  j["fast_sync_overhead_s"] = fs.sync_overhead_s;
  j["fast_pipe_overhead_s"] = fs.pipe_overhead_s;
  j["fast_codec_other_chunk"] = {{"chunk_bytes", Bytes(other.chunk_bytes)},
                                 {"allreduce_s", other.allreduce_s},
                                 {"sync_step_s", other.sync_step_s},
                                 {"pipe_step_s", other.pipe_step_s},
                                 {"sync_overhead_s", other.sync_overhead_s},
                                 {"pipe_overhead_s", other.pipe_overhead_s}};
  j["overhead_chunks_per_block"] = ring ? plain.chunks_per_block : 0.0;
  j["sync_overhead_per_chunk_s"] = f.sync_per_chunk_s;
  j["pipe_overhead_per_chunk_s"] = f.pipe_per_chunk_s;
  j["pipe_step_s"] = {{"chunk_bytes", Bytes(plain.chunk_bytes)}, {"seconds", plain.pipe_step_s}};
  j["pipe_overhead_s"] = plain.pipe_overhead_s;
}

nlohmann::json ProbeJson(const ProbeFit& f, const std::vector<RankProbe>& ranks, size_t p,
                         size_t batch) {
  const std::vector<double>& c = f.compute_by_rank;
  nlohmann::json j = {{"world_size", f.world_size},
                      {"workers", f.world_size},
                      {"params", p},
                      {"model_bytes", 4.0 * p},
                      {"batch_size", batch},
                      {"latency_s", f.inputs.latency_s},
                      {"bandwidth_Bps", f.inputs.bandwidth_Bps},
                      {"link_alone_bandwidth_Bps", f.link_alone_Bps},
                      {"ring_exchange_bandwidth_Bps", f.ring_exchange_Bps},
                      {"chunk_overhead_s", f.inputs.chunk_overhead_s},
                      {"stream_chunk_overhead_s", f.stream_chunk_overhead_s},
                      {"contention", f.ring.contention},
                      {"bandwidth_fitted", f.ring.bandwidth_fitted},
                      {"overlap_compute_factor", f.compute_factor},
                      {"overlap_allreduce_factor", f.allreduce_factor},
                      {"overlap", {{"chunk_bytes", kLargeChunk},
                                   {"compute_s", f.overlap_compute_s},
                                   {"allreduce_s", f.overlap_allreduce_s}}},
                      {"allreduce_s", ByChunk(f.allreduce, /*cpu=*/false)},
                      {"compute_s", f.compute_s},
                      {"compute_s_spread", {{"min", *std::min_element(c.begin(), c.end())},
                                            {"median", Median(c)},
                                            {"max", f.compute_s}}},
                      {"update_s", f.update_s},
                      {"pipelined_update_s", f.pipelined_update_s},
                      {"reduce_s_per_byte", f.inputs.reduce_s_per_byte},
                      {"compute_cpu_share", f.compute_cpu_share},
                      {"cpu_share", f.cpu_share},
                      {"transport_cpu_s_per_byte", f.transport_cpu.s_per_byte},
                      {"transport_cpu_s_per_message", f.transport_cpu.s_per_message},
                      {"big_message_cpu_s_per_byte", f.big_message_cpu_s_per_byte},
                      {"loopback", f.loopback},
                      {"host_cpus", f.host_cpus},
                      {"ps_sync_step_s", f.ps_sync_step_s},
                      {"ps_async_step_s", f.ps_async_step_s},
                      {"ps_sync_busy_cpus", f.ps_sync_cpus},
                      {"ps_async_busy_cpus", f.ps_async_cpus},
                      {"allreduce_cpu_s", ByChunk(f.allreduce, /*cpu=*/true)},
                      {"codecs", CodecsJson(f)}};
  AddStepsJson(f, j);
  nlohmann::json per_rank = nlohmann::json::array();
  for (const auto& r : ranks) per_rank.push_back(PerRankJson(r, f.world_size));
  j["per_rank"] = per_rank;
  return j;
}

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
  std::vector<float> params(p);
  model->Init(params, train_cfg.seed());
  train::ClassifierTask task(*model, train_set, batch, env.rank, env.world_size, train_cfg.seed(),
                             {data_cfg.input_mean(), data_cfg.input_std()});
  if (task.steps_per_epoch() == 0) {
    Throw(ErrorCode::kInvalidArgument, "probe: the training set has fewer than {} samples",
          batch * env.world_size);
  }
  RankProbe mine;
  mine.set_rank(env.rank);
  MeasureCompute(task, params, args.compute_steps, mine);
  MeasureUpdateAndReduction(train_cfg, params, mine);
  MeasureCodecsAlone(p, mine);
  const uint64_t step_chunk = StepChunk(job, p, env.world_size);
  mine.set_step_chunk_bytes(step_chunk);
  mine.set_other_chunk_bytes(step_chunk == kLargeChunk ? kMidChunk : kLargeChunk);
  const std::vector<RankProbe> ranks =
      env.world_size > 1
          ? MeasureOnRing({env, job, args.pings, task, params, mine.compute_s(), mine.update_s()},
                          mine)
          : std::vector<RankProbe>{mine};
  if (env.rank != 0) return;

  const ProbeFit fit = train::FitProbe(ranks, 4.0 * p);
  PrintPerRank(ranks, p, batch);
  PrintFit(fit);
  if (!args.json_path.empty()) {
    std::ofstream out(args.json_path);
    out << ProbeJson(fit, ranks, p, batch).dump(2) << "\n";
    if (!out) Throw(ErrorCode::kIo, "probe --json {}: cannot write", args.json_path);
  }
  if (env.relay) env.relay->Goodbye();  // a normal end (transport/failure_relay.h)
}

}  // namespace pipesgd::launcher
