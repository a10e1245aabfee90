#include "core/job/model_builder.h"
#include "launcher/timing.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/base/measure.h"
#include "core/collective/codec.h"
#include "core/collective/ring_allreduce.h"
#include "core/data/dataset.h"
#include "core/train/classifier_task.h"
#include "core/train/timing_model.h"
#include "core/job/config.h"
#include "core/job/worker.h"
#include "layers/model.h"

namespace pipesgd::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// latency, bandwidth (the link alone), overhead, compute, update, reduce, ring bandwidth, and
// the job's own AllReduce of the model at kSmallChunk, kMidChunk and kLargeChunk
constexpr int kFields = 10;
// The ring's per-chunk cost shows only in a real AllReduce with many chunks (a wake-up, a header,
// a reduction call per chunk): 4 KiB, the smallest chunk `pipesgd model` considers; the link's
// rate with one chunk per block (16 MiB: the largest); how much the two overlap in between.
constexpr uint64_t kSmallChunk = 4096;
constexpr uint64_t kMidChunk = 64u << 10;
constexpr uint64_t kLargeChunk = 16u << 20;
constexpr uint64_t kTimedChunks[] = {kSmallChunk, kMidChunk, kLargeChunk};
constexpr int kAllReduceReps = 10;
constexpr size_t kBigBytes = 8u << 20;
constexpr size_t kStreamBytes = 16u << 10;
constexpr int kStreamMessages = 256;
constexpr int kBigReps = 3;

struct LinkNumbers {
  double latency_s = 0, bandwidth_Bps = 0, overhead_s = 0;
};

class Prober {
 public:
  Prober(transport::Transport& t, double timeout_s) : t_(t), timeout_s_(timeout_s) {}

  void Send(transport::Connection& c, const void* data, size_t bytes) {
    transport::Op op;
    op.Set(data, bytes);
    c.PostSend(op);
    t_.Wait(op, Deadline::After(timeout_s_), "a probe message");
  }
  void Recv(transport::Connection& c, void* data, size_t bytes) {
    transport::Op op;
    op.Set(data, bytes);
    c.PostRecv(op);
    t_.Wait(op, Deadline::After(timeout_s_), "a probe message");
  }

  LinkNumbers Ping(transport::Connection& c, int pings) {
    LinkNumbers out;
    uint64_t word = 0;
    std::vector<double> rtts;
    for (int i = 0; i < 20 + pings; ++i) {
      const auto t0 = Clock::now();
      Send(c, &word, sizeof(word));
      Recv(c, &word, sizeof(word));
      if (i >= 20) rtts.push_back(SecondsSince(t0));
    }
    const double rtt = Median(rtts);
    out.latency_s = rtt / 2;
    big_.resize(kBigBytes);
    std::vector<double> times;
    for (int i = 0; i < 1 + kBigReps; ++i) {
      const auto t0 = Clock::now();
      Send(c, big_.data(), big_.size());
      Recv(c, &word, sizeof(word));
      if (i >= 1) times.push_back(SecondsSince(t0));
    }
    out.bandwidth_Bps = kBigBytes / std::max(1e-9, Median(times) - rtt);
    std::vector<transport::Op> ops(kStreamMessages);
    const auto t0 = Clock::now();
    for (auto& op : ops) {
      op.Set(big_.data(), kStreamBytes);
      c.PostSend(op);
    }
    for (auto& op : ops) t_.Wait(op, Deadline::After(timeout_s_), "a probe message");
    Recv(c, &word, sizeof(word));
    const double t = SecondsSince(t0) - rtt;
    out.overhead_s = std::max(0.0, t / kStreamMessages - kStreamBytes / out.bandwidth_Bps);
    return out;
  }

  // Every rank at once sends kBigBytes to its right and receives as many from its left, as in a
  // ring AllReduce step: what a link gives when every link and both directions of every rank
  // are busy (the CPU that sends also receives). Bytes per second per direction, the median of
  // kBigReps after one untimed.
  double RingExchange(transport::Connection& right, transport::Connection& left) {
    big_.resize(kBigBytes);
    in_.resize(kBigBytes);
    std::vector<double> times;
    for (int i = 0; i < 1 + kBigReps; ++i) {
      transport::Op send, recv;
      recv.Set(in_.data(), in_.size());
      left.PostRecv(recv);
      const auto t0 = Clock::now();
      send.Set(big_.data(), big_.size());
      right.PostSend(send);
      t_.Wait(send, Deadline::After(timeout_s_), "a ring probe message to the right");
      t_.Wait(recv, Deadline::After(timeout_s_), "a ring probe message from the left");
      if (i >= 1) times.push_back(SecondsSince(t0));
    }
    return kBigBytes / std::max(1e-9, Median(times));
  }

  void Pong(transport::Connection& c, int pings) {
    uint64_t word = 0;
    for (int i = 0; i < 20 + pings; ++i) {
      Recv(c, &word, sizeof(word));
      Send(c, &word, sizeof(word));
    }
    big_.resize(kBigBytes);
    for (int i = 0; i < 1 + kBigReps; ++i) {
      Recv(c, big_.data(), big_.size());
      Send(c, &word, sizeof(word));
    }
    std::vector<transport::Op> ops(kStreamMessages);
    for (auto& op : ops) {
      op.Set(big_.data(), kStreamBytes);
      c.PostRecv(op);
    }
    for (auto& op : ops) t_.Wait(op, Deadline::After(timeout_s_), "a probe message");
    Send(c, &word, sizeof(word));
  }

 private:
  transport::Transport& t_;
  double timeout_s_;
  std::vector<char> big_;
  std::vector<char> in_;
};

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
  while (computed < args.compute_steps || SecondsSince(compute_start) < 1.5) {
    (void)task.ComputeGradient(3 + computed, params, grads);
    ++computed;
  }
  const double compute_s = SecondsSince(compute_start) / static_cast<double>(computed);
  std::vector<double> times;
  train::SgdOptimizer sgd({train_cfg.learning_rate(), train_cfg.momentum(), train_cfg.weight_decay()}, p);
  std::fill(grads.begin(), grads.end(), 1e-6f);
  times.clear();
  for (int i = 0; i < 10; ++i) {
    const auto t0 = Clock::now();
    sgd.Apply(params, grads);
    times.push_back(SecondsSince(t0));
  }
  const double update_s = Median(times);
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
  for (const char* name : {"trunc16", "fp16", "q8", "q4", "sign1"}) {
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
                      {"s_per_byte", Median(times) / (4.0 * p)}});
  }

  std::vector<double> mine = {0, 0, 0, compute_s, update_s, reduce_s_per_byte, 0, 0, 0, 0};
  std::vector<double> all(static_cast<size_t>(kFields) * env.world_size, 0.0);
  if (env.world_size > 1) {
    const int w = env.world_size, r = env.rank;
    const std::vector<int> peers = collective::Communicator::RingPeers(r, w);
    job::PeerLinks links = job::ConnectPeers(env, "pipesgd " PIPESGD_VERSION " probe\n" + job::JobDescription(job),
                                   peers, job.comm(), Deadline::After(job.comm().start_timeout_s()),
                                   fmt::format("comm.start_timeout_s = {} s", job.comm().start_timeout_s()));
    auto conn = [&](int peer) -> transport::Connection& {
      for (size_t i = 0; i < peers.size(); ++i) {
        if (peers[i] == peer) return *links.connections[i];
      }
      Throw(ErrorCode::kInternal, "probe: no connection to rank {}", peer);
    };
    transport::Connection& right = conn((r + 1) % w);
    transport::Connection& left = conn((r + w - 1) % w);
    Prober prober(*links.transport, job.comm().timeout_s());
    // Round i: rank i measures its link to rank i+1, which answers; one link at a time.
    for (int i = 0; i < w; ++i) {
      if (r == i) {
        const LinkNumbers link = prober.Ping(right, args.pings);
        mine[0] = link.latency_s;
        mine[1] = link.bandwidth_Bps;
        mine[2] = link.overhead_s;
      } else if (r == (i + 1) % w) {
        prober.Pong(left, args.pings);
      }
    }
    mine[6] = prober.RingExchange(right, left);
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
        for (int i = 0; i < 2 + kAllReduceReps; ++i) {
          const auto t0 = Clock::now();
          ring->AllReduce(values, collective::ReduceOp::kAverage, Deadline::After(job.comm().timeout_s()));
          if (i >= 2) times.push_back(SecondsSince(t0));
        }
        mine[field++] = Median(times);
      }
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
  } else {
    all = mine;
  }
  if (env.rank != 0) return;

  nlohmann::json per_rank = nlohmann::json::array();
  double latency = 0, alone = 0, ring = 0, overhead = 0, compute = 0, update = 0, reduce = 0;
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
                        {"update_s", v[4]},
                        {"reduce_s_per_byte", v[5]}});
    latency = std::max(latency, v[0]);
    alone = r == 0 ? v[1] : std::min(alone, v[1]);
    ring = r == 0 ? v[6] : std::min(ring, v[6]);
    overhead = std::max(overhead, v[2]);
    compute = std::max(compute, v[3]);
    update = std::max(update, v[4]);
    reduce = std::max(reduce, v[5]);
  }
  for (const auto& c : codecs) {
    std::printf("# codec %-8s ratio %.3f, encode+decode %.3f ns per float32 byte (rank 0)\n",
                c["name"].get<std::string>().c_str(), c["ratio"].get<double>(),
                c["s_per_byte"].get<double>() * 1e9);
  }
  // The per-byte CPU rates are properties of the machines, alike on every node: the median over
  // ranks, so one rank preempted while it measured (a shared host) does not set them.
  std::vector<double> compute_by_rank;
  double allreduce_small = 0, allreduce_mid = 0, allreduce_large = 0;  // the slowest rank's
  {
    std::vector<double> rho, ovh;
    for (int r = 0; r < env.world_size; ++r) {
      ovh.push_back(all[kFields * r + 2]);
      rho.push_back(all[kFields * r + 5]);
      compute_by_rank.push_back(all[kFields * r + 3]);
      allreduce_small = std::max(allreduce_small, all[kFields * r + 7]);
      allreduce_mid = std::max(allreduce_mid, all[kFields * r + 8]);
      allreduce_large = std::max(allreduce_large, all[kFields * r + 9]);
    }
    overhead = Median(ovh);
    reduce = Median(rho);
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
  std::printf("# for the model: the slowest link and the slowest rank: latency %.1f us, bandwidth "
              "%.2f MB/s fitted to the ring's AllReduce (%.2f MB/s a link alone), compute %.3f ms, "
              "update %.3f ms; median over ranks: chunk overhead %.2f us, reduce %.4f ns/B\n",
              latency * 1e6, bandwidth / 1e6, alone / 1e6, compute * 1e3, update * 1e3,
              overhead * 1e6, reduce * 1e9);
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
                        {"allreduce_s", {{std::to_string(kSmallChunk), allreduce_small},
                                         {std::to_string(kMidChunk), allreduce_mid},
                                         {std::to_string(kLargeChunk), allreduce_large}}},
                        {"compute_s", compute},
                        {"compute_s_spread",
                         {{"min", *std::min_element(compute_by_rank.begin(), compute_by_rank.end())},
                          {"median", Median(compute_by_rank)},
                          {"max", compute}}},
                        {"update_s", update},
                        {"reduce_s_per_byte", reduce},
                        {"codecs", codecs},
                        {"per_rank", per_rank}};
    std::ofstream out(args.json_path);
    out << j.dump(2) << "\n";
    if (!out) Throw(ErrorCode::kIo, "probe --json {}: cannot write", args.json_path);
  }
  if (env.relay) env.relay->Goodbye();  // a normal end (transport/failure_relay.h)
}

// What the probe measured, over its ranks, beside what the model makes of the same inputs:
// the compute (the model takes the slowest rank's) and the AllReduce of the model at each chunk
// size timed. Nothing for a probe of an older version, which did not record them.
std::vector<std::string> ProbeSpread(const nlohmann::json& probe, const std::string& path,
                                     const train::TimingInputs& in) {
  std::vector<std::string> lines;
  if (!probe.is_object() || !probe.contains("per_rank")) return lines;
  auto spread = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return fmt::format("{:.3f} / {:.3f} / {:.3f} ms", v.front() * 1e3, Median(v) * 1e3,
                       v.back() * 1e3);
  };
  try {
    const auto& per_rank = probe.at("per_rank");
    if (per_rank.empty()) return lines;
    std::vector<double> compute;
    std::map<double, std::vector<double>> allreduce;  // by chunk size
    for (const auto& r : per_rank) {
      compute.push_back(r.at("compute_s").get<double>());
      if (r.contains("allreduce_s")) {
        for (const auto& [chunk, sec] : r.at("allreduce_s").items()) {
          allreduce[std::strtod(chunk.c_str(), nullptr)].push_back(sec.get<double>());
        }
      }
    }
    lines.push_back(fmt::format("measured by the probe on {} ranks (min / median / max): compute "
                                "{}; the model takes the slowest, {:.3f} ms",
                                per_rank.size(), spread(compute), in.compute_s * 1e3));
    for (const auto& [chunk, secs] : allreduce) {
      lines.push_back(fmt::format(
          "measured AllReduce (none) at {:.0f} B chunks: {}; the model gives {:.3f} ms ({:+.1f}% "
          "of the slowest rank's)",
          chunk, spread(secs), train::RingAllReduceTime(in, train::CodecCost{}, chunk) * 1e3,
          100 * (train::RingAllReduceTime(in, train::CodecCost{}, chunk) /
                     *std::max_element(secs.begin(), secs.end()) -
                 1)));
    }
  } catch (const nlohmann::json::exception& e) {
    Throw(ErrorCode::kInvalidArgument, "model --probe {}: per_rank is not a probe's: {}", path,
          e.what());
  }
  return lines;
}

void RunModel(const ModelArgs& a) {
  train::TimingInputs in;
  std::vector<train::CodecCost> codecs;
  nlohmann::json probe;  // the probe's result, if given
  if (!a.probe_json.empty()) {
    std::ifstream f(a.probe_json);
    if (!f) Throw(ErrorCode::kIo, "model --probe {}: cannot read", a.probe_json);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(f);
      probe = j;
      in.workers = j.at("workers").get<int>();
      in.model_bytes = j.at("model_bytes").get<double>();
      in.latency_s = j.at("latency_s").get<double>();
      in.bandwidth_Bps = j.at("bandwidth_Bps").get<double>();
      in.chunk_overhead_s = j.at("chunk_overhead_s").get<double>();
      in.contention = j.value("contention", 0.0);  // earlier probes: none
      in.compute_s = j.at("compute_s").get<double>();
      in.update_s = j.at("update_s").get<double>();
      in.reduce_s_per_byte = j.at("reduce_s_per_byte").get<double>();
      for (const auto& c : j.at("codecs")) {
        codecs.push_back({c.at("name").get<std::string>(), c.at("ratio").get<double>(),
                          c.at("s_per_byte").get<double>()});
      }
    } catch (const nlohmann::json::exception& e) {
      Throw(ErrorCode::kInvalidArgument, "model --probe {}: not a probe result: {}", a.probe_json,
            e.what());
    }
  } else {
    in.workers = 4;
    in.bandwidth_Bps = 0;
    in.latency_s = -1;
    in.compute_s = -1;
  }
  if (a.workers > 0) in.workers = a.workers;
  if (a.model_bytes > 0) in.model_bytes = a.model_bytes;
  if (a.latency_s >= 0) in.latency_s = a.latency_s;
  if (a.link_rate_bps > 0) in.bandwidth_Bps = a.link_rate_bps / 8;
  if (a.bandwidth_Bps > 0) in.bandwidth_Bps = a.bandwidth_Bps;
  if (a.compute_s >= 0) in.compute_s = a.compute_s;
  if (a.update_s >= 0) in.update_s = a.update_s;
  if (a.reduce_s_per_byte >= 0) in.reduce_s_per_byte = a.reduce_s_per_byte;
  if (a.chunk_overhead_s >= 0) in.chunk_overhead_s = a.chunk_overhead_s;
  if (a.contention >= 0) in.contention = a.contention;
  std::vector<std::string> missing;
  if (in.model_bytes <= 0) missing.push_back("--model-bytes (> 0)");
  if (in.latency_s < 0) missing.push_back("--latency-s (>= 0)");
  if (in.bandwidth_Bps <= 0) missing.push_back("--bandwidth-Bps or --link-rate (> 0)");
  if (in.compute_s < 0) missing.push_back("--compute-s (>= 0)");
  if (!missing.empty()) {
    Throw(ErrorCode::kInvalidArgument, "model: give {} (or --probe FILE from pipesgd probe --json)",
          fmt::join(missing, ", "));
  }
  if (codecs.empty()) {
    // Without a probe: ratios of the codecs, their CPU cost unknown (0).
    // Ratios of a 256 Ki-element chunk, as the probe measures them.
    codecs = {{"none", 1, 0}, {"trunc16", 2, 0}, {"fp16", 2, 0}};
    for (const char* name : {"q8", "q4", "sign1"}) {
      CodecOptions copt;
      copt.kind = ParseCodecKind(name);
      const size_t chunk = 1 << 18;
      codecs.push_back({name, 4.0 * chunk / static_cast<double>(MakeCodec(copt)->EncodedBytes(chunk)), 0});
    }
  }
  const std::vector<double> chunks =
      a.chunk_bytes > 0 ? std::vector<double>{a.chunk_bytes} : train::DefaultChunkSizes();
  const train::ModelReport report = train::PredictAll(in, codecs, chunks);

  std::printf("# pipesgd model: W=%d workers, M=%.0f bytes, alpha=%.1f us, B=%.3f MB/s, C=%.3f ms, "
              "U=%.3f ms, rho=%.4f ns/B, o=%.2f us, gamma=%.3f\n",
              in.workers, in.model_bytes, in.latency_s * 1e6, in.bandwidth_Bps / 1e6,
              in.compute_s * 1e3, in.update_s * 1e3, in.reduce_s_per_byte * 1e9,
              in.chunk_overhead_s * 1e6, in.contention);
  // Each row next to what it is made of: C + U, the communication, and for the ring schemes
  // T_AR's terms (docs/timing_models.md) with the one that sets it; "vs none" is what the
  // row's codec gains its scheme.
  std::printf("# %-9s %-7s %9s %10s %8s %8s | %9s %9s %7s %9s %9s %9s %9s %5s %s\n", "scheme",
              "codec", "chunk(B)", "iter(ms)", "vs best", "vs none", "C+U(ms)", "comm(ms)", "m",
              "alpha(ms)", "link(ms)", "cpu(ms)", "fill(ms)", "gamma", "bound");
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : report.rows) {
    double none_s = row.iteration_s;
    for (const auto& other : report.rows) {
      if (other.scheme == row.scheme && other.codec == "none") none_s = other.iteration_s;
    }
    const bool ring = row.chunk_bytes > 0;
    const train::RingTerms& t = row.ring;
    const char* bound = row.comm_s > row.compute_s ? "comm" : "compute";
    if (ring && row.comm_s > row.compute_s) bound = t.link_s >= t.cpu_s ? "comm:link" : "comm:cpu";
    std::printf("  %-9s %-7s %9s %10.3f %7.2fx %7.2fx | %9.3f %9.3f %7s %9s %9s %9s %9s %5s %s\n",
                row.scheme.c_str(), row.codec.c_str(),
                ring ? fmt::format("{:.0f}", row.chunk_bytes).c_str() : "-", row.iteration_s * 1e3,
                row.iteration_s / report.best.iteration_s, row.iteration_s / none_s,
                row.compute_s * 1e3, row.comm_s * 1e3,
                ring ? fmt::format("{:.0f}", t.chunks_per_block).c_str() : "-",
                ring ? fmt::format("{:.3f}", t.latency_s * 1e3).c_str() : "-",
                ring ? fmt::format("{:.3f}", t.link_s * 1e3).c_str() : "-",
                ring ? fmt::format("{:.3f}", t.cpu_s * 1e3).c_str() : "-",
                ring ? fmt::format("{:.3f}", t.tail_s * 1e3).c_str() : "-",
                ring ? fmt::format("{:.3f}", in.contention).c_str() : "-", bound);
    nlohmann::json r = {{"scheme", row.scheme},   {"codec", row.codec},
                        {"chunk_bytes", row.chunk_bytes}, {"iteration_s", row.iteration_s},
                        {"vs_none", row.iteration_s / none_s}, {"compute_s", row.compute_s},
                        {"comm_s", row.comm_s}};
    if (ring) {
      r["ring_terms"] = {{"chunks_per_block", t.chunks_per_block}, {"latency_s", t.latency_s},
                         {"link_s", t.link_s}, {"cpu_s", t.cpu_s}, {"tail_s", t.tail_s}};
    }
    rows.push_back(r);
  }
  for (const std::string& line : ProbeSpread(probe, a.probe_json, in)) std::printf("# %s\n", line.c_str());
  const double t_ar = train::RingAllReduceTime(
      in, codecs[0], train::BestChunkBytes(in, codecs[0], chunks));
  std::printf("# AllReduce (none) %.3f ms vs compute + update %.3f ms: %s-bound\n", t_ar * 1e3,
              (in.compute_s + in.update_s) * 1e3,
              t_ar > in.compute_s + in.update_s ? "communication" : "compute");
  std::printf("best: %s, compression %s, pipeline width %d, chunk %s: %.3f ms per iteration\n",
              report.best.scheme.c_str(), report.best.codec.c_str(), report.best_width,
              report.best.chunk_bytes > 0 ? fmt::format("{:.0f} B", report.best.chunk_bytes).c_str()
                                          : "-",
              report.best.iteration_s * 1e3);
  if (!a.json_path.empty()) {
    nlohmann::json j = {{"workers", in.workers},
                        {"model_bytes", in.model_bytes},
                        {"latency_s", in.latency_s},
                        {"bandwidth_Bps", in.bandwidth_Bps},
                        {"compute_s", in.compute_s},
                        {"update_s", in.update_s},
                        {"reduce_s_per_byte", in.reduce_s_per_byte},
                        {"chunk_overhead_s", in.chunk_overhead_s},
                        {"contention", in.contention},
                        {"allreduce_s", t_ar},
                        {"rows", rows},
                        {"best", {{"scheme", report.best.scheme},
                                  {"codec", report.best.codec},
                                  {"width", report.best_width},
                                  {"chunk_bytes", report.best.chunk_bytes},
                                  {"iteration_s", report.best.iteration_s}}}};
    std::ofstream out(a.json_path);
    out << j.dump(2) << "\n";
    if (!out) Throw(ErrorCode::kIo, "model --json {}: cannot write", a.json_path);
  }
}

}  // namespace pipesgd::launcher
