#include "launcher/bench.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <span>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/collective/ring_allreduce.h"
#include "configs/pipesgd.pb.h"
#include "core/job/config.h"
#include "core/job/worker.h"

namespace pipesgd::launcher {
namespace {

using Clock = std::chrono::steady_clock;
using collective::ReduceOp;

struct Result {
  double time_us = 0;
  double algbw = 0;
  double busbw = 0;
  int64_t wrong = 0;
  int64_t differs_from_out_of_place = -1;  // compressed in-place pass: elements whose bits differ
  bool ranks_agree = true;                 // every rank's result has the same bits
};

// FNV-1a over the result's bytes: equal results, equal hashes (compared across ranks).
uint64_t Fnv1a(const std::vector<float>& data) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  for (size_t i = 0; i < data.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// Small integers so that every sum is exact in float: rank r, element i -> r + (i mod 97).
float Pattern(int rank, uint64_t i) { return static_cast<float>(rank + static_cast<int>(i % 97)); }
float Expected(int world, uint64_t i) {
  return static_cast<float>(world * (world - 1) / 2 + world * static_cast<int>(i % 97));
}

}  // namespace

uint64_t ParseBytes(const std::string& text) {
  if (text.empty()) Throw(ErrorCode::kInvalidArgument, "size '': expected e.g. 4096, 4K, 64M, 1G");
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (...) {
    Throw(ErrorCode::kInvalidArgument, "size '{}': expected e.g. 4096, 4K, 64M, 1G", text);
  }
  std::string suffix = text.substr(used);
  double scale = 1;
  if (suffix == "K" || suffix == "k") scale = 1024.0;
  else if (suffix == "M" || suffix == "m") scale = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "g") scale = 1024.0 * 1024 * 1024;
  else if (!suffix.empty()) Throw(ErrorCode::kInvalidArgument, "size '{}': unknown suffix '{}' (K, M or G)", text, suffix);
  if (!(value >= 0) || value * scale > 1e12) {
    Throw(ErrorCode::kInvalidArgument, "size '{}': expected 0 to 1T bytes", text);
  }
  return static_cast<uint64_t>(value * scale);
}

namespace {

// The flags as the comm.* overrides they stand for, then the user's --set ones.
std::vector<std::string> CommOverrides(const AllReduceBenchArgs& a) {
  std::vector<std::string> sets = {
      fmt::format("comm.chunk_bytes={}", a.chunk_bytes),
      fmt::format("comm.streams={}", a.streams),
      fmt::format("comm.compression={}", a.compression),
      fmt::format("comm.transport={}", job::TransportEnumName(a.transport)),
      fmt::format("comm.ib_port={}", a.ib_port),
      fmt::format("comm.gid_index={}", a.gid_index)};
  if (!a.network_interface.empty()) sets.push_back("comm.network_interface=" + a.network_interface);
  if (!a.ib_device.empty()) sets.push_back("comm.ib_device=" + a.ib_device);
  sets.insert(sets.end(), a.overrides.begin(), a.overrides.end());
  return sets;
}

}  // namespace

config::Job CheckAllReduceBenchArgs(const AllReduceBenchArgs& a) {
  const auto bad = [](const std::string& what) {
    Throw(ErrorCode::kInvalidArgument, "bench allreduce: {}", what);
  };
  if (a.min_bytes > a.max_bytes) {
    bad(fmt::format("-b {} is larger than -e {}: expected -b <= -e", a.min_bytes, a.max_bytes));
  }
  if ((a.min_bytes + 3) / 4 * 4 > a.max_bytes) {
    bad(fmt::format("-b {} -e {}: no whole float32 element (4 bytes) in between", a.min_bytes,
                    a.max_bytes));
  }
  if (!(a.factor > 1)) bad(fmt::format("-f {}: expected a factor > 1", a.factor));
  if (a.iters < 1) bad(fmt::format("-n {}: expected >= 1 iterations", a.iters));
  if (a.warmup < 0) bad(fmt::format("-w {}: expected >= 0 warm-up iterations", a.warmup));
  if (a.check < 0) bad(fmt::format("-c {}: expected 0 (no check) or a number of checks", a.check));
  if (a.gpus != 1) {
    bad(fmt::format("-g {}: pipesgd drives one device per rank, expected -g 1 (start more ranks "
                    "with --np or your launcher)",
                    a.gpus));
  }
  if (a.datatype != "float") {
    bad(fmt::format("-d {}: expected float (the ring reduces float32)", a.datatype));
  }
  if (a.op != "sum" && a.op != "avg") bad(fmt::format("-o {}: expected sum or avg", a.op));
  if (a.threads != 1) bad(fmt::format("-t {}: expected 1 (one thread drives a rank)", a.threads));
  if (a.agg_iters != 1) bad(fmt::format("-m {}: expected 1 (one AllReduce per iteration)", a.agg_iters));
  if (a.graph != 0) bad(fmt::format("-G {}: expected 0 (no CUDA graphs here)", a.graph));
  if (a.blocking != 0 && a.blocking != 1) bad(fmt::format("-z {}: expected 0 or 1", a.blocking));
  if (a.parallel_init != 0 && a.parallel_init != 1) {
    bad(fmt::format("-p {}: expected 0 or 1", a.parallel_init));
  }
  if (a.average < 0 || a.average > 3) {
    bad(fmt::format("-a {}: expected 0 (rank 0), 1 (mean), 2 (min) or 3 (max)", a.average));
  }
  // The comm settings by the job's own rules (naming the flag's or the --set's value).
  config::Job job = job::CollectiveJobConfig(CommOverrides(a));
  const config::Comm& comm = job.comm();
  if (comm.streams() == 0) {
    bad("comm.streams = 0 (auto): jobs time their streams at start; the bench times the value "
        "given, expected one in [1, 16]");
  }
  if (a.check > 0 && comm.compression() != config::Comm::none &&
      (comm.error_feedback() || comm.stochastic_rounding())) {
    bad(fmt::format("-c {} with comm.{}: a call's result then {}, so no per-call bound can be "
                    "checked; use -c 0 (times only)",
                    a.check, comm.error_feedback() ? "error_feedback" : "stochastic_rounding",
                    comm.error_feedback() ? "carries the previous call's residual"
                                          : "depends on the noise of its call"));
  }
  return job;
}

std::vector<std::string> AllReduceBenchWorkerCommand(const AllReduceBenchArgs& a) {
  std::vector<std::string> cmd = {"bench", "allreduce", "-b", std::to_string(a.min_bytes),
                                  "-e", std::to_string(a.max_bytes),
                                  a.step_bytes > 0 ? "-i" : "-f",
                                  a.step_bytes > 0 ? std::to_string(a.step_bytes)
                                                   : fmt::format("{}", a.factor),
                                  "-n", std::to_string(a.iters), "-w", std::to_string(a.warmup),
                                  "-c", std::to_string(a.check), "-g", std::to_string(a.gpus),
                                  "-d", a.datatype, "-o", a.op, "-a", std::to_string(a.average),
                                  "--chunk-bytes", std::to_string(a.chunk_bytes),
                                  "--streams", std::to_string(a.streams),
                                  "--compression", a.compression,
                                  "--transport", a.transport,
                                  "--ib-port", std::to_string(a.ib_port),
                                  "--gid-index", std::to_string(a.gid_index)};
  if (!a.network_interface.empty()) {
    cmd.push_back("--network-interface");
    cmd.push_back(a.network_interface);
  }
  if (!a.ib_device.empty()) {
    cmd.push_back("--ib-device");
    cmd.push_back(a.ib_device);
  }
  if (a.link_gbps > 0) {
    cmd.push_back("--link-gbps");
    cmd.push_back(fmt::format("{}", a.link_gbps));
  }
  if (!a.json_path.empty()) {
    cmd.push_back("--json");
    cmd.push_back(a.json_path);
  }
  for (const std::string& spec : a.overrides) {
    cmd.push_back("--set");
    cmd.push_back(spec);
  }
  return cmd;
}


namespace {

// nccl-tests' header lines, with the values that apply here.
void PrintBenchHeader(const AllReduceBenchArgs& args, int n, const std::string& transport,
                      bool compressed) {
  const std::string chunk = args.chunk_bytes == 0 ? std::string("auto")
                                                  : fmt::format("{} B", args.chunk_bytes);
  std::printf("# nThread 1 nGpus 1 minBytes %llu maxBytes %llu step: %s warmup iters: %d "
              "iters: %d agg iters: 1 validation: %d graph: 0\n#\n",
              static_cast<unsigned long long>(args.min_bytes),
              static_cast<unsigned long long>(args.max_bytes),
              args.step_bytes > 0 ? fmt::format("{}(bytes)", args.step_bytes).c_str()
                                  : fmt::format("{}(factor)", args.factor).c_str(),
              args.warmup, args.iters, args.check > 0 ? 1 : 0);
  static const char* const kAverages[] = {"rank 0's", "the mean over ranks", "the minimum over ranks",
                                          "the maximum over ranks"};
  std::printf("# pipesgd bench allreduce: %d ranks, %s x %d stream(s) per neighbour, chunk %s, "
              "compression %s; time is %s\n#\n",
              n, transport.c_str(), args.streams, chunk.c_str(), args.compression.c_str(),
              kAverages[args.average]);
  if (compressed) {
    std::printf("# sizes, algbw and busbw count float32 bytes; 'none' is the same in-place "
                "call uncompressed (us), 'speedup' = none / in-place time\n");
  }
  const char* link = args.link_gbps > 0 ? "  %link" : "";
  const char* extra = compressed ? "     none  speedup" : "";
  std::printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       "
              "in-place          \n", "", "", "", "", "");
  std::printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s%s%s%s\n",
              "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
              "time", "algbw", "busbw", "#wrong", link, link, extra);
  std::printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "(B)",
              "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
              "(GB/s)", "");
}

// One size's row: all_reduce_perf's columns and widths (%12 size, %12 count, %8 type, %6 redop,
// %6 root, then per pass %7 time (one decimal below 10 ms), %6.2f algbw and busbw, %6 #wrong),
// then ours.
void PrintBenchRow(const AllReduceBenchArgs& args, uint64_t bytes, uint64_t count,
                   const Result (&results)[3], bool compressed) {
  const auto pass_columns = [](const Result& r) {
    const std::string time = r.time_us < 1e4 ? fmt::format("{:7.1f}", r.time_us)
                                             : fmt::format("{:7.0f}", r.time_us);
    return fmt::format("  {}  {:6.2f}  {:6.2f}  {:>6}", time, r.algbw, r.busbw,
                       r.wrong < 0 ? std::string("N/A") : std::to_string(r.wrong));
  };
  auto link = [&](const Result& r) {
    return args.link_gbps > 0 ? fmt::format("  {:5.1f}", 100.0 * r.busbw * 8 / args.link_gbps)
                              : std::string();
  };
  const std::string speedup =
      compressed ? fmt::format("  {:7.1f}  {:7.2f}", results[2].time_us,
                               results[1].time_us > 0 ? results[2].time_us / results[1].time_us : 0.0)
                 : std::string();
  std::printf("%12llu  %12llu  %8s  %6s  %6d%s%s%s%s%s\n",
              static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(count),
              "float", args.op.c_str(), -1, pass_columns(results[0]).c_str(),
              pass_columns(results[1]).c_str(), link(results[0]).c_str(),
              link(results[1]).c_str(), speedup.c_str());
  std::fflush(stdout);
}

// The same row for --json.
nlohmann::json BenchRowJson(const AllReduceBenchArgs& args, uint64_t bytes, uint64_t count,
                            const Result (&results)[3], bool compressed, int n,
                            const std::string& transport) {
  auto as_json = [&](const Result& r) {
    nlohmann::json j = {{"time_us", r.time_us}, {"algbw_gbs", r.algbw}, {"busbw_gbs", r.busbw}};
    if (r.wrong >= 0) {
      j["wrong"] = r.wrong;
      j["same_bits_on_every_rank"] = r.ranks_agree;
    }
    if (r.differs_from_out_of_place >= 0) {
      j["differs_from_out_of_place"] = r.differs_from_out_of_place;
    }
    if (args.link_gbps > 0) j["busbw_link_share"] = r.busbw * 8 / args.link_gbps;
    return j;
  };
  nlohmann::json row = {{"size_bytes", bytes}, {"count", count}, {"type", "float"},
                        {"redop", args.op}, {"ranks", n}, {"compression", args.compression},
                        {"transport", transport}, {"streams", args.streams},
                        {"out_of_place", as_json(results[0])},
                        {"in_place", as_json(results[1])}};
  if (compressed) {
    row["in_place_uncompressed"] = as_json(results[2]);
    row["speedup_over_none"] =
        results[1].time_us > 0 ? results[2].time_us / results[1].time_us : 0.0;
  }
  return row;
}

// The timed passes of one size on the ring: pass 0 out of place, 1 in place, 2 (with a codec)
// in place uncompressed; each warmed up, timed over the iterations from a common start, then
// checked against the exact sums and across ranks.
class BenchPasses {
 public:
  BenchPasses(collective::Communicator& comm, const AllReduceBenchArgs& args, ReduceOp op,
              int rank, int n, const Codec* codec, double timeout_s)
      : comm_(comm), args_(args), op_(op), rank_(rank), n_(n), codec_(codec),
        timeout_s_(timeout_s) {
    // Timings and counts travel uncompressed: a codec would round them (trunc16 keeps 8 bits).
    exact_.compress = false;
  }

  // Buffers of `count` floats, registered once per size, as a trainer registers its gradient
  // buffers, so RDMA transports are not timed registering memory on every call.
  void Resize(uint64_t count) {
    input_region_.reset();
    output_region_.reset();
    input_.assign(count, 0.0f);
    output_.assign(count, 0.0f);
    input_region_ = comm_.RegisterMemory(input_);
    output_region_ = comm_.RegisterMemory(output_);
  }

  Result Run(int pass) {
    const bool in_place = pass > 0;
    collective::AllReduceOptions call;
    call.compress = pass < 2;
    const uint64_t count = input_.size();
    const uint64_t bytes = count * sizeof(float);
    auto refill = [&] {
      for (uint64_t i = 0; i < count; ++i) input_[i] = Pattern(rank_, i);
    };
    auto once = [&] {
      if (in_place) {
        comm_.AllReduce(input_, op_, Deadline::After(timeout_s_), nullptr, call);
      } else {
        std::memcpy(output_.data(), input_.data(), bytes);
        comm_.AllReduce(output_, op_, Deadline::After(timeout_s_), nullptr, call);
      }
    };
    refill();
    for (int i = 0; i < args_.warmup; ++i) once();
    float sync = 0;
    comm_.AllReduce(std::span<float>(&sync, 1), ReduceOp::kSum, Deadline::After(timeout_s_),
                    nullptr, exact_);  // common start
    const auto t0 = Clock::now();
    for (int i = 0; i < args_.iters; ++i) once();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / args_.iters;

    double wrong = 0, differs = 0;
    uint64_t hash = 0;
    for (int check = 0; check < args_.check; ++check) {
      refill();
      once();
      const std::vector<float>& result = in_place ? input_ : output_;
      Check(result, in_place, call.compress, &wrong, &differs);
      hash = Fnv1a(result);
    }
    return Gather(seconds, wrong, differs, hash, bytes);
  }

 private:
  // The exact result: integer sums below 2^24, and for avg that sum divided by n in float, as
  // the ring divides.
  float Expect(uint64_t i) const {
    const float sum = Expected(n_, i);
    return op_ == ReduceOp::kAverage ? sum / static_cast<float>(n_) : sum;
  }

  void Check(const std::vector<float>& result, bool in_place, bool compress, double* wrong,
             double* differs) {
    if (!(codec_ && compress)) {
      for (uint64_t i = 0; i < result.size(); ++i) *wrong += result[i] != Expect(i);
      return;
    }
    // Every partial sum lies in [0, M]; N encodes of at most the bound each.
    const double m = Expected(n_, 96);
    const double bound = n_ * codec_->ErrorBound(m, 0, m) / (op_ == ReduceOp::kAverage ? n_ : 1);
    for (uint64_t i = 0; i < result.size(); ++i) {
      *wrong += std::fabs(static_cast<double>(result[i]) - Expect(i)) > bound;
    }
    // The codecs are deterministic (no stochastic rounding here): in place must give bitwise
    // what out of place gave.
    if (!in_place) {
      compressed_reference_ = result;
      return;
    }
    for (uint64_t i = 0; i < result.size(); ++i) {
      *differs += std::bit_cast<uint32_t>(result[i]) !=
                  std::bit_cast<uint32_t>(compressed_reference_[i]);
    }
  }

  // Per rank its time (slot 20 + rank); summed over ranks: wrong elements (exact below 2^24)
  // and, for the result's hash, per byte b the sums of b and b^2 (exact): the ranks hold the
  // same bits iff n * sum(b^2) == sum(b)^2 for every byte.
  Result Gather(double seconds, double wrong, double differs, uint64_t hash, uint64_t bytes) {
    std::vector<float> stats(20 + n_, 0.0f);
    stats[0] = static_cast<float>(wrong);
    stats[1] = static_cast<float>(differs);
    for (int k = 0; k < 8; ++k) {
      const float b = static_cast<float>((hash >> (8 * k)) & 0xff);
      stats[4 + 2 * k] = b;
      stats[5 + 2 * k] = b * b;
    }
    stats[20 + rank_] = static_cast<float>(seconds);
    comm_.AllReduce(std::span<float>(stats), ReduceOp::kSum, Deadline::After(timeout_s_), nullptr,
                    exact_);
    const std::span<const float> times(stats.data() + 20, static_cast<size_t>(n_));
    double t = 0;
    switch (args_.average) {
      case 0: t = times[0]; break;
      case 1: for (float x : times) t += x / n_; break;
      case 2: t = *std::min_element(times.begin(), times.end()); break;
      default: t = *std::max_element(times.begin(), times.end()); break;
    }
    Result r;
    r.time_us = t * 1e6;
    r.algbw = r.time_us > 0 ? bytes / (r.time_us * 1e-6) / 1e9 : 0;
    r.busbw = r.algbw * (n_ > 1 ? 2.0 * (n_ - 1) / n_ : 0.0);
    r.wrong = args_.check > 0 ? static_cast<int64_t>(stats[0]) : -1;
    r.differs_from_out_of_place = args_.check > 0 ? static_cast<int64_t>(stats[1]) : -1;
    bool same = true;
    for (int k = 0; k < 8; ++k) {
      const double sum = stats[4 + 2 * k], sum_sq = stats[5 + 2 * k];
      same &= n_ * sum_sq == sum * sum;
    }
    r.ranks_agree = same;
    // A bit mismatch between ranks or between in place and out of place is wrong too.
    if (args_.check > 0) r.wrong += r.differs_from_out_of_place + (same ? 0 : 1);
    return r;
  }

  collective::Communicator& comm_;
  const AllReduceBenchArgs& args_;
  const ReduceOp op_;
  const int rank_;
  const int n_;
  const Codec* codec_;
  const double timeout_s_;
  collective::AllReduceOptions exact_;
  std::vector<float> input_, output_, compressed_reference_;
  std::unique_ptr<transport::MemoryRegion> input_region_, output_region_;
};

}  // namespace

int64_t RunAllReduceBench(const AllReduceBenchArgs& given) {
  // Every comm field through the job's own rules; the values the table prints are the
  // effective ones.
  const config::Job job = CheckAllReduceBenchArgs(given);
  const config::Comm& comm_cfg = job.comm();
  AllReduceBenchArgs args = given;
  args.chunk_bytes = static_cast<uint64_t>(comm_cfg.chunk_bytes());
  args.streams = comm_cfg.streams();
  args.compression = config::Comm::Compression_Name(comm_cfg.compression());
  const ReduceOp op = args.op == "avg" ? ReduceOp::kAverage : ReduceOp::kSum;
  const job::JobEnv env = job::ReadJobEnv();
  const int n = env.world_size;
  const collective::CommunicatorOptions options = job::CommunicatorOptionsFromConfig(job);
  const bool compressed = options.codec.kind != CodecKind::kNone;
  // What the ranks must agree on: the job's comm settings less the machine-local ones, and the
  // bench's own arguments.
  AllReduceBenchArgs shared = args;
  shared.network_interface.clear();
  shared.ib_device.clear();
  shared.ib_port = 0;
  shared.gid_index = -1;
  shared.overrides.clear();
  auto comm = job::ConnectRing(
      env,
      fmt::format("{}bench allreduce {}", job::JobDescription(job),
                  fmt::join(AllReduceBenchWorkerCommand(shared), " ")),
      options, comm_cfg, Deadline::After(comm_cfg.start_timeout_s()),
      fmt::format("comm.start_timeout_s = {} s", comm_cfg.start_timeout_s()));
  const bool lead = env.rank == 0;
  if (lead) PrintBenchHeader(args, n, comm->transport().Describe(), compressed);

  nlohmann::json rows = nlohmann::json::array();
  double busbw_total = 0;
  int busbw_count = 0;
  int64_t out_of_bounds = 0;
  const std::unique_ptr<Codec> codec = compressed ? MakeCodec(options.codec) : nullptr;
  {
    BenchPasses passes(*comm, args, op, env.rank, n, codec.get(), comm_cfg.timeout_s());
    const auto next_size = [&](double size) {
      return args.step_bytes > 0 ? size + static_cast<double>(args.step_bytes)
                                 : std::max(size * args.factor, size + 4);
    };
    // Whole float32 elements: -b rounds up to a multiple of 4 bytes (-b 3 starts at 4, not at
    // an empty row), as the rows count elements.
    const double first = static_cast<double>((args.min_bytes + 3) / 4 * 4);
    for (double size = first; size <= args.max_bytes * 1.0000001; size = next_size(size)) {
      const uint64_t count = static_cast<uint64_t>(size) / sizeof(float);
      const uint64_t bytes = count * sizeof(float);
      passes.Resize(count);
      Result results[3];
      for (int pass = 0; pass < (compressed ? 3 : 2); ++pass) {
        results[pass] = passes.Run(pass);
        if (pass < 2) {
          busbw_total += results[pass].busbw;
          ++busbw_count;
          out_of_bounds += std::max<int64_t>(results[pass].wrong, 0);
        }
      }
      if (lead) {
        PrintBenchRow(args, bytes, count, results, compressed);
        rows.push_back(BenchRowJson(args, bytes, count, results, compressed, n,
                                    comm->transport().name()));
      }
      if (count == 0 && args.max_bytes == 0) break;
    }
  }  // the registered buffers go before the ring
  if (lead) {
    std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(out_of_bounds),
                out_of_bounds == 0 ? "OK" : "FAILED");
    std::printf("# Avg bus bandwidth    : %g\n#\n",
                busbw_count ? busbw_total / busbw_count : 0.0);
    std::fflush(stdout);
    if (!args.json_path.empty()) {
      std::ofstream out(args.json_path, std::ios::trunc);
      out << rows.dump(2) << "\n";
      if (!out) Throw(ErrorCode::kIo, "--json {}: cannot write: {}", args.json_path, std::strerror(errno));
    }
  }
  if (env.relay) env.relay->Goodbye();  // a normal end (transport/failure_relay.h)
  return out_of_bounds;
}

}  // namespace pipesgd::launcher
