// `pipesgd model` (launcher/timing.h): the timing models of core/train/timing_model.h from the
// command line or from a probe's JSON, each scheme beside the terms it is made of.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/base/error.h"
#include "core/base/measure.h"
#include "core/collective/codec.h"
#include "core/train/timing_model.h"
#include "launcher/timing.h"

namespace pipesgd::launcher {
namespace {

// What an input of the model may be: finite, in [lo, hi] ((lo, hi] where lo_open), an integer
// where `integer`; `unit` names it in messages. The bounds are what is physically meaningful
// (docs/timing_models.md, "Inputs"), so that a typo or a corrupt probe file (model_bytes 1e300)
// is refused by name instead of printing 300-digit times.
struct InputRange {
  double lo, hi;
  bool lo_open = false;
  bool integer = false;
  const char* unit = "a number";
};
constexpr double kMaxBytes = 1099511627776.0;  // 2^40: 1 TiB of gradients, of a chunk
constexpr InputRange kWorkersRange{1, 1 << 20, false, true, "an integer"};
constexpr InputRange kModelBytes{0, kMaxBytes, true, false, "bytes"};
constexpr InputRange kChunkBytes{1, kMaxBytes, false, false, "bytes"};
// A step, a message or an overhead of more than an hour is no measurement of one.
constexpr InputRange kSeconds{0, 3600, false, false, "seconds"};
constexpr InputRange kSignedSeconds{-3600, 3600, false, false, "seconds"};  // sigma, sigma_2
// 1 ms per byte is 1 KB/s: slower than any CPU or link the model is for.
constexpr InputRange kSecondsPerByte{0, 1e-3, false, false, "seconds per byte"};
constexpr InputRange kCodecSecondsPerByte{-1e-3, 1e-3, false, false, "seconds per byte"};
constexpr InputRange kCodecSeconds{-3600, 3600, false, false, "seconds"};
// 1e13 B/s (80 Tbit/s) is beyond any link or memory copy of a host today.
constexpr InputRange kBandwidth{0, 1e13, true, false, "bytes per second"};
constexpr InputRange kProbeBandwidth{0, 1e13, false, false, "bytes per second"};
constexpr InputRange kLinkRate{0, 8e13, true, false, "bits per second"};
constexpr InputRange kShare{0, 1, false, false, "a share"};          // gamma
constexpr InputRange kFactor{1, 1000, false, false, "a factor"};     // f_c, f_a
constexpr InputRange kCpus{0, 1 << 20, false, false, "CPUs"};        // s_c, s, K, D
constexpr InputRange kChunkCount{0, kMaxBytes, false, false, "chunks"};  // m_sigma
constexpr InputRange kRatio{1, 1024, false, false, "a ratio"};       // r

std::string Describe(const InputRange& r) {
  return fmt::format("{} in {}{}, {}]", r.unit, r.lo_open ? "(" : "[", r.lo, r.hi);
}

bool InRange(double v, const InputRange& r) {
  return std::isfinite(v) && (r.lo_open ? v > r.lo : v >= r.lo) && v <= r.hi &&
         (!r.integer || v == std::floor(v));
}

// `where` ("model --probe FILE", "model"): `field` = `shown`: expected ...
[[noreturn]] void RefuseInput(const std::string& where, const std::string& field,
                              const std::string& shown, const InputRange& r) {
  Throw(ErrorCode::kInvalidArgument, "{}: {} = {}: expected {}", where, field, shown, Describe(r));
}

double CheckedNumber(const nlohmann::json& v, const std::string& where, const std::string& field,
                     const InputRange& r) {
  if (!v.is_number() || !InRange(v.get<double>(), r)) RefuseInput(where, field, v.dump(), r);
  return v.get<double>();
}

// Field `key` of the probe's object `j`, checked; `fallback` where an earlier probe did not
// write it (absent and no fallback: refused as missing).
double ProbeNumber(const nlohmann::json& j, const std::string& where, const std::string& key,
                   const InputRange& r, std::optional<double> fallback = std::nullopt) {
  if (!j.contains(key)) {
    if (fallback) return *fallback;
    Throw(ErrorCode::kInvalidArgument, "{}: {} is missing: expected {}", where, key, Describe(r));
  }
  return CheckedNumber(j.at(key), where, key, r);
}

// What the probe measured, over its ranks, beside what the model makes of the same inputs:
// the compute (the model takes the slowest rank's) and the AllReduce of the model at each chunk
// size timed, without a codec and with each codec it timed. Nothing for a probe of an older
// version, which did not record them.
std::vector<std::string> ProbeSpread(const nlohmann::json& probe, const std::string& path,
                                     const train::TimingInputs& in,
                                     const std::vector<train::CodecCost>& codecs) {
  std::vector<std::string> lines;
  if (!probe.is_object() || !probe.contains("per_rank")) return lines;
  const std::string where = "model --probe " + path;
  // One rank timed no AllReduce; with --np another world size the model answers a question the
  // probe did not measure.
  if (in.workers == 1 || probe.value("workers", 0.0) != in.workers) return lines;
  auto spread = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return fmt::format("{:.3f} / {:.3f} / {:.3f} ms", v.front() * 1e3, Median(v) * 1e3,
                       v.back() * 1e3);
  };
  // {"CHUNK_BYTES": seconds, ...} of one rank, into times[chunk].
  using ByChunk = std::map<double, std::vector<double>>;
  const auto add_times = [&](const nlohmann::json& by_chunk, ByChunk& times) {
    for (const auto& [chunk, sec] : by_chunk.items()) {
      char* end = nullptr;
      const double bytes = std::strtod(chunk.c_str(), &end);
      if (end == chunk.c_str() || *end != '\0' || !InRange(bytes, kChunkBytes)) {
        Throw(ErrorCode::kInvalidArgument,
              "model --probe {}: per_rank allreduce_s key \"{}\": expected a chunk size in "
              "{}", path, chunk, Describe(kChunkBytes));
      }
      times[bytes].push_back(
          CheckedNumber(sec, where, fmt::format("per_rank allreduce_s \"{}\"", chunk), kSeconds));
    }
  };
  try {
    const auto& per_rank = probe.at("per_rank");
    if (per_rank.empty()) return lines;
    std::vector<double> compute;
    std::vector<ByChunk> allreduce(codecs.size());  // by codec (codecs[0]: none), by chunk size
    std::vector<double> sync_step, pipe_step, fast_sync_step, fast_pipe_step;
    std::vector<double> other_sync_step, other_pipe_step;  // the fast codec at its other chunk
    for (const auto& r : per_rank) {
      compute.push_back(CheckedNumber(r.at("compute_s"), where, "per_rank compute_s", kSeconds));
      for (auto [key, steps] : {std::pair{"sync_step_s", &sync_step},
                                std::pair{"pipe_step_s", &pipe_step},
                                std::pair{"fast_sync_step_s", &fast_sync_step},
                                std::pair{"fast_pipe_step_s", &fast_pipe_step},
                                std::pair{"fast_other_sync_step_s", &other_sync_step},
                                std::pair{"fast_other_pipe_step_s", &other_pipe_step}}) {
        if (r.contains(key)) {
          steps->push_back(CheckedNumber(r.at(key), where, fmt::format("per_rank {}", key),
                                         kSeconds));
        }
      }
      if (r.contains("allreduce_s")) add_times(r.at("allreduce_s"), allreduce[0]);
      for (size_t c = 1; c < codecs.size() && r.contains("codec_allreduce_s"); ++c) {
        const auto& by_codec = r.at("codec_allreduce_s");
        if (by_codec.contains(codecs[c].name)) add_times(by_codec.at(codecs[c].name), allreduce[c]);
      }
    }
    lines.push_back(fmt::format("measured by the probe on {} ranks (min / median / max): compute "
                                "{}; the model takes the slowest, {:.3f} ms",
                                per_rank.size(), spread(compute), in.compute_s * 1e3));
    for (size_t c = 0; c < codecs.size(); ++c) {
      for (const auto& [chunk, secs] : allreduce[c]) {
        const double model = train::RingAllReduceTime(in, codecs[c], chunk);
        lines.push_back(fmt::format(
            "measured AllReduce ({}) at {:.0f} B chunks: {}; the model gives {:.3f} ms ({:+.1f}% "
            "of the slowest rank's)",
            codecs[c].name, chunk, spread(secs), model * 1e3,
            100 * (model / *std::max_element(secs.begin(), secs.end()) - 1)));
      }
    }
    // The real steps of each width (the trainer at one chunk size), beside the model's.
    const auto step_line = [&](const nlohmann::json& at, const char* key,
                               const train::CodecCost& codec, const std::vector<double>& steps,
                               int width) {
      if (steps.empty()) return;
      const double chunk = CheckedNumber(at.at("chunk_bytes"), where,
                                         fmt::format("{} chunk_bytes", key), kChunkBytes);
      const double model = train::PipeTime(in, codec, chunk, width);
      lines.push_back(fmt::format(
          "measured width-{} step ({}) at {:.0f} B chunks: {}; the model gives {:.3f} ms "
          "({:+.1f}% of the slowest rank's)",
          width, codec.name, chunk, spread(steps), model * 1e3,
          100 * (model / *std::max_element(steps.begin(), steps.end()) - 1)));
    };
    if (probe.contains("sync_step_s")) {
      step_line(probe.at("sync_step_s"), "sync_step_s", codecs[0], sync_step, 1);
    }
    if (probe.contains("pipe_step_s")) {
      step_line(probe.at("pipe_step_s"), "pipe_step_s", codecs[0], pipe_step, 2);
    }
    if (probe.contains("fast_codec")) {
      const auto& fast = probe.at("fast_codec");
      const auto codec = std::find_if(codecs.begin(), codecs.end(), [&](const auto& c) {
        return c.name == fast.at("name").get<std::string>();
      });
      if (codec != codecs.end()) {
        step_line(fast, "fast_codec", *codec, fast_sync_step, 1);
        step_line(fast, "fast_codec", *codec, fast_pipe_step, 2);
        if (probe.contains("fast_codec_other_chunk")) {
          const auto& other = probe.at("fast_codec_other_chunk");
          step_line(other, "fast_codec_other_chunk", *codec, other_sync_step, 1);
          step_line(other, "fast_codec_other_chunk", *codec, other_pipe_step, 2);
        }
      }
    }
  } catch (const nlohmann::json::exception& e) {
    Throw(ErrorCode::kInvalidArgument, "model --probe {}: per_rank is not a probe's: {}", path,
          e.what());
  }
  return lines;
}


// The probe's JSON: the model's inputs and its codecs, each field checked against its range;
// a field an earlier probe did not write takes what that probe's model assumed. Returns the
// JSON (ProbeSpread reads its per-rank part).
nlohmann::json ReadProbe(const std::string& path, train::TimingInputs& in,
                         std::vector<train::CodecCost>& codecs) {
  nlohmann::json probe;
  std::ifstream f(path);
  if (!f) Throw(ErrorCode::kIo, "model --probe {}: cannot read", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
    probe = j;
    const std::string where = "model --probe " + path;
    if (!j.is_object()) {
      Throw(ErrorCode::kInvalidArgument, "{}: {}: expected a probe's JSON object", where,
            j.dump());
    }
    const auto get = [&](const char* key, const InputRange& r,
                         std::optional<double> fallback = std::nullopt) {
      return ProbeNumber(j, where, key, r, fallback);
    };
    in.workers = static_cast<int>(get("workers", kWorkersRange));
    in.model_bytes = get("model_bytes", kModelBytes);
    in.latency_s = get("latency_s", kSeconds);
    // 0: a probe of one rank, which measured no link (a model of more ranks then asks for B).
    in.bandwidth_Bps = get("bandwidth_Bps", kProbeBandwidth);
    in.chunk_overhead_s = get("chunk_overhead_s", kSeconds);
    in.contention = get("contention", kShare, 0.0);  // earlier probes: none
    in.overlap_compute_factor = get("overlap_compute_factor", kFactor, 1.0);
    in.overlap_allreduce_factor = get("overlap_allreduce_factor", kFactor, 1.0);
    // Earlier probes: no CPU bound.
    in.compute_cpu_share = get("compute_cpu_share", kCpus, 0.0);
    in.cpu_share = get("cpu_share", kCpus, 0.0);
    in.transport_cpu_s_per_byte = get("transport_cpu_s_per_byte", kSecondsPerByte, 0.0);
    in.transport_cpu_s_per_message = get("transport_cpu_s_per_message", kSeconds, 0.0);
    in.compute_s = get("compute_s", kSeconds);
    in.update_s = get("update_s", kSeconds);
    in.pipelined_update_s = get("pipelined_update_s", kSeconds, 0.0);  // earlier probes: U
    in.sync_overhead_s = get("sync_overhead_s", kSignedSeconds, 0.0);
    in.pipe_overhead_s = get("pipe_overhead_s", kSignedSeconds, 0.0);  // earlier probes: none
    // Earlier probes: sigma at one AllReduce time, the same everywhere.
    in.overhead_allreduce_s = get("overhead_allreduce_s", kSeconds, 0.0);
    in.fast_allreduce_s = get("fast_allreduce_s", kSeconds, 0.0);
    in.fast_sync_overhead_s = get("fast_sync_overhead_s", kSignedSeconds, 0.0);
    in.fast_pipe_overhead_s = get("fast_pipe_overhead_s", kSignedSeconds, 0.0);
    // Earlier probes: no per-chunk cost.
    in.overhead_chunks_per_block = get("overhead_chunks_per_block", kChunkCount, 0.0);
    in.sync_overhead_per_chunk_s = get("sync_overhead_per_chunk_s", kSeconds, 0.0);
    in.pipe_overhead_per_chunk_s = get("pipe_overhead_per_chunk_s", kSeconds, 0.0);
    in.big_message_cpu_s_per_byte = get("big_message_cpu_s_per_byte", kSecondsPerByte, 0.0);
    if (j.contains("loopback") && !j.at("loopback").is_boolean()) {
      Throw(ErrorCode::kInvalidArgument, "{}: loopback = {}: expected true or false", where,
            j.at("loopback").dump());
    }
    in.loopback = j.value("loopback", false);  // earlier probes: links
    in.host_cpus = get("host_cpus", kCpus, 0.0);
    // Earlier probes: no PS steps, the formulas.
    const double ps_sync = get("ps_sync_step_s", kSeconds, 0.0);
    const double ps_async = get("ps_async_step_s", kSeconds, 0.0);
    if (in.workers > 1 && ps_sync > 0 && ps_async > 0) {
      in.ps_probe_workers = in.workers - 1;
      in.ps_sync_beyond_compute_s = std::max(0.0, ps_sync - in.compute_s);
      in.ps_async_beyond_compute_s = std::max(0.0, ps_async - in.compute_s);
      in.ps_sync_busy_cpus = get("ps_sync_busy_cpus", kCpus, 0.0);
      in.ps_async_busy_cpus = get("ps_async_busy_cpus", kCpus, 0.0);
    }
    in.reduce_s_per_byte = get("reduce_s_per_byte", kSecondsPerByte);
    for (const auto& c : j.at("codecs")) {
      const std::string name = c.at("name").get<std::string>();
      const std::string codec_where = fmt::format("{}: codec {}", where, name);
      codecs.push_back({name, ProbeNumber(c, codec_where, "ratio", kRatio),
                        ProbeNumber(c, codec_where, "s_per_byte", kCodecSecondsPerByte),
                        std::nullopt});
      // Earlier probes: kappa from encode + decode alone, its CPU not known.
      if (c.contains("cpu_s_per_byte")) {
        codecs.back().cpu_s_per_byte =
            ProbeNumber(c, codec_where, "cpu_s_per_byte", kCodecSecondsPerByte);
      }
      codecs.back().s_per_chunk = ProbeNumber(c, codec_where, "s_per_chunk", kCodecSeconds, 0.0);
      codecs.back().cpu_s_per_chunk =
          ProbeNumber(c, codec_where, "cpu_s_per_chunk", kCodecSeconds, 0.0);
    }
  } catch (const nlohmann::json::exception& e) {
    Throw(ErrorCode::kInvalidArgument, "model --probe {}: not a probe result: {}", path,
          e.what());
  }
  return probe;
}

// The flags given (their defaults mark "not given"), in the same ranges as the probe's fields,
// over the probe's values.
void ApplyFlags(const ModelArgs& a, train::TimingInputs& in) {
  for (const auto& [flag, value, given, range] :
       {std::tuple{"-np", static_cast<double>(a.workers), a.workers > 0, kWorkersRange},
        std::tuple{"--model-bytes", a.model_bytes, a.model_bytes > 0, kModelBytes},
        std::tuple{"--latency-s", a.latency_s, a.latency_s >= 0, kSeconds},
        std::tuple{"--bandwidth-Bps", a.bandwidth_Bps, a.bandwidth_Bps > 0, kBandwidth},
        std::tuple{"--link-rate-bps", a.link_rate_bps, a.link_rate_bps > 0, kLinkRate},
        std::tuple{"--compute-s", a.compute_s, a.compute_s >= 0, kSeconds},
        std::tuple{"--update-s", a.update_s, a.update_s >= 0, kSeconds},
        std::tuple{"--pipelined-update-s", a.pipelined_update_s, a.pipelined_update_s >= 0,
                   kSeconds},
        std::tuple{"--reduce-s-per-byte", a.reduce_s_per_byte, a.reduce_s_per_byte >= 0,
                   kSecondsPerByte},
        std::tuple{"--chunk-overhead-s", a.chunk_overhead_s, a.chunk_overhead_s >= 0, kSeconds},
        std::tuple{"--contention", a.contention, a.contention >= 0, kShare},
        std::tuple{"--chunk-bytes", a.chunk_bytes, a.chunk_bytes > 0, kChunkBytes}}) {
    if (given && !InRange(value, range)) {
      RefuseInput("model", flag, fmt::format("{}", value), range);
    }
  }
  if (a.workers > 0) in.workers = a.workers;
  if (a.model_bytes > 0) in.model_bytes = a.model_bytes;
  if (a.latency_s >= 0) in.latency_s = a.latency_s;
  if (a.link_rate_bps > 0) in.bandwidth_Bps = a.link_rate_bps / 8;
  if (a.bandwidth_Bps > 0) in.bandwidth_Bps = a.bandwidth_Bps;
  // A bandwidth given by hand is a link's: the PS schemes take it, not the loopback CPU. Nor do
  // they take the steps the probe timed where a hand value changes what those steps hold (the
  // link, the model, the server's update or sum): the formulas then. C and W by hand keep them
  // (C + what the step took beyond C, scaled to W).
  if (a.link_rate_bps > 0 || a.bandwidth_Bps > 0) in.loopback = false;
  if (a.link_rate_bps > 0 || a.bandwidth_Bps > 0 || a.model_bytes > 0 || a.latency_s >= 0 ||
      a.update_s >= 0 || a.reduce_s_per_byte >= 0) {
    in.ps_probe_workers = 0;
  }
  if (a.compute_s >= 0) in.compute_s = a.compute_s;
  if (a.update_s >= 0) in.update_s = a.update_s;
  if (a.pipelined_update_s >= 0) in.pipelined_update_s = a.pipelined_update_s;
  if (a.reduce_s_per_byte >= 0) in.reduce_s_per_byte = a.reduce_s_per_byte;
  if (a.chunk_overhead_s >= 0) in.chunk_overhead_s = a.chunk_overhead_s;
  if (a.contention >= 0) in.contention = a.contention;
}

// What the ranges alone cannot say: the factors, the contention and each codec's costs against
// the float32 path's; no negative or non-finite term.
void CheckInputs(const ModelArgs& a, const train::TimingInputs& in,
                 const std::vector<train::CodecCost>& codecs) {
  for (const auto& [name, f] : {std::pair{"overlap_compute_factor", in.overlap_compute_factor},
                                std::pair{"overlap_allreduce_factor", in.overlap_allreduce_factor}}) {
    if (!(f >= 1)) {
      Throw(ErrorCode::kInvalidArgument, "model --probe {}: {} = {}: expected a number >= 1",
            a.probe_json, name, f);
    }
  }
  if (!a.probe_json.empty()) {
    if (!(in.contention >= 0 && in.contention <= 1)) {
      Throw(ErrorCode::kInvalidArgument, "model --probe {}: contention = {}: expected a number in "
            "[0, 1]", a.probe_json, in.contention);
    }
    // codecs[0] is the baseline every row's "vs none" and the AllReduce line compare with.
    if (codecs.empty() || codecs[0].name != "none") {
      std::vector<std::string> names;
      for (const auto& c : codecs) names.push_back(c.name);
      Throw(ErrorCode::kInvalidArgument,
            "model --probe {}: codecs = [{}]: expected the list a probe writes, \"none\" first",
            a.probe_json, fmt::join(names, ", "));
    }
    for (const train::CodecCost& c : codecs) {
      // A codec's costs are beside the float32 path's, and can be below it (its decode adds in
      // the same pass): per byte as low as -reduce_s_per_byte, per chunk as low as
      // -chunk_overhead_s (its CPU: -transport_cpu_s_per_message), as train::FitCodec fits them.
      const double cpu = c.cpu_s_per_byte.value_or(0);
      const double floor = -std::max(0.0, in.reduce_s_per_byte);
      if (!(c.ratio >= 1) || !std::isfinite(c.ratio) || !(c.s_per_byte >= floor) ||
          !std::isfinite(c.s_per_byte) || !(cpu >= floor) || !std::isfinite(cpu)) {
        Throw(ErrorCode::kInvalidArgument,
              "model --probe {}: codec {}: ratio = {}, s_per_byte = {}, cpu_s_per_byte = {}: "
              "expected a ratio >= 1 and costs >= -reduce_s_per_byte ({})",
              a.probe_json, c.name, c.ratio, c.s_per_byte, cpu, floor);
      }
      const double chunk_floor = -std::max(0.0, in.chunk_overhead_s);
      const double chunk_cpu_floor = -std::max(0.0, in.transport_cpu_s_per_message);
      if (!(c.s_per_chunk >= chunk_floor) || !std::isfinite(c.s_per_chunk) ||
          !(c.cpu_s_per_chunk >= chunk_cpu_floor) || !std::isfinite(c.cpu_s_per_chunk)) {
        Throw(ErrorCode::kInvalidArgument,
              "model --probe {}: codec {}: s_per_chunk = {}, cpu_s_per_chunk = {}: expected "
              "costs >= -chunk_overhead_s ({}) and >= -transport_cpu_s_per_message ({})",
              a.probe_json, c.name, c.s_per_chunk, c.cpu_s_per_chunk, chunk_floor,
              chunk_cpu_floor);
      }
    }
  }
  // Fields only newer probes write (0 without one), then those every probe has (without one,
  // -1 marks "not given"): a negative or non-finite one would give negative or NaN times.
  std::vector<std::pair<const char*, double>> non_negative = {
      {"compute_cpu_share", in.compute_cpu_share},
      {"cpu_share", in.cpu_share},
      {"pipelined_update_s", in.pipelined_update_s},
      {"overhead_allreduce_s", in.overhead_allreduce_s},
      {"fast_allreduce_s", in.fast_allreduce_s},
      {"overhead_chunks_per_block", in.overhead_chunks_per_block},
      {"sync_overhead_per_chunk_s", in.sync_overhead_per_chunk_s},
      {"pipe_overhead_per_chunk_s", in.pipe_overhead_per_chunk_s},
      {"big_message_cpu_s_per_byte", in.big_message_cpu_s_per_byte},
      {"transport_cpu_s_per_byte", in.transport_cpu_s_per_byte},
      {"transport_cpu_s_per_message", in.transport_cpu_s_per_message},
      {"host_cpus", in.host_cpus},
      {"ps_sync_step_s less compute_s", in.ps_sync_beyond_compute_s},
      {"ps_async_step_s less compute_s", in.ps_async_beyond_compute_s},
      {"ps_sync_busy_cpus", in.ps_sync_busy_cpus},
      {"ps_async_busy_cpus", in.ps_async_busy_cpus}};
  if (!a.probe_json.empty()) {
    non_negative.insert(non_negative.begin(),
                        {{"model_bytes", in.model_bytes},
                         {"latency_s", in.latency_s},
                         {"bandwidth_Bps", in.bandwidth_Bps},
                         {"chunk_overhead_s", in.chunk_overhead_s},
                         {"compute_s", in.compute_s},
                         {"update_s", in.update_s},
                         {"reduce_s_per_byte", in.reduce_s_per_byte}});
  }
  for (const auto& [name, v] : non_negative) {
    if (!(v >= 0) || !std::isfinite(v)) {
      Throw(ErrorCode::kInvalidArgument, "model --probe {}: {} = {}: expected a number >= 0",
            a.probe_json, name, v);
    }
  }
  // sigma and sigma_2 may be negative (a late rank's lag hidden in a long AllReduce).
  for (const auto& [name, v] : {std::pair{"sync_overhead_s", in.sync_overhead_s},
                                std::pair{"pipe_overhead_s", in.pipe_overhead_s},
                                std::pair{"fast_sync_overhead_s", in.fast_sync_overhead_s},
                                std::pair{"fast_pipe_overhead_s", in.fast_pipe_overhead_s}}) {
    if (!std::isfinite(v)) {
      Throw(ErrorCode::kInvalidArgument, "model --probe {}: {} = {}: expected a finite number",
            a.probe_json, name, v);
    }
  }
}

void RequireComplete(const ModelArgs& a, int probed_workers, train::TimingInputs& in) {
  // A probe of one rank measured no link: its zeros are not a latency or a bandwidth for more.
  if (!a.probe_json.empty() && probed_workers == 1 && in.workers > 1) {
    if (a.latency_s < 0) in.latency_s = -1;
    if (a.bandwidth_Bps <= 0 && a.link_rate_bps <= 0) in.bandwidth_Bps = 0;
  }
  if (in.workers == 1 && in.latency_s < 0) in.latency_s = 0;  // no link: nothing to wait for
  std::vector<std::string> missing;
  if (in.model_bytes <= 0) missing.push_back("--model-bytes (> 0)");
  // One worker has no AllReduce and no server: nothing crosses a link.
  if (in.workers > 1 && in.latency_s < 0) missing.push_back("--latency-s (>= 0)");
  if (in.workers > 1 && in.bandwidth_Bps <= 0) {
    missing.push_back("--bandwidth-Bps or --link-rate-bps (> 0)");
  }
  if (in.compute_s < 0) missing.push_back("--compute-s (>= 0)");
  if (!missing.empty()) {
    Throw(ErrorCode::kInvalidArgument, "model: give {} (or --probe FILE from pipesgd probe --json)",
          fmt::join(missing, ", "));
  }
}

// Without a probe: ratios of the codecs, their CPU cost unknown (0).
std::vector<train::CodecCost> DefaultCodecs() {
  std::vector<train::CodecCost> codecs;
  // Ratios of a 256 Ki-element chunk, as the probe measures them.
  codecs = {{"none", 1, 0, std::nullopt},
            {"trunc16", 2, 0, std::nullopt},
            {"fp16", 2, 0, std::nullopt}};
  for (const char* name : {"q8", "q4", "sign1"}) {
    CodecOptions copt;
    copt.kind = ParseCodecKind(name);
    const size_t chunk = 1 << 18;
    codecs.push_back(
        {name, 4.0 * chunk / static_cast<double>(MakeCodec(copt)->EncodedBytes(chunk)), 0,
         std::nullopt});
  }
  return codecs;
}

void PrintInputs(const train::TimingInputs& in) {
  std::printf("# pipesgd model: W=%d workers, M=%.0f bytes, alpha=%.1f us, B=%.3f MB/s, C=%.3f ms, "
              "U=%.3f ms (U_K=%.3f ms), sigma=%.3f ms, sigma_2=%.3f ms, rho=%.4f ns/B, o=%.2f us, "
              "gamma=%.3f, width 2's overlap f_c=%.2f f_a=%.2f, CPU shares s_c=%.2f s=%.2f, "
              "transport CPU %.3f ns/B %.2f us/message (%.3f ns/B in whole-model messages)\n",
              in.workers, in.model_bytes, in.latency_s * 1e6, in.bandwidth_Bps / 1e6,
              in.compute_s * 1e3, in.update_s * 1e3, train::UpdateTime(in, 2) * 1e3,
              in.sync_overhead_s * 1e3, in.pipe_overhead_s * 1e3, in.reduce_s_per_byte * 1e9,
              in.chunk_overhead_s * 1e6,
              in.contention, in.overlap_compute_factor, in.overlap_allreduce_factor,
              in.compute_cpu_share, in.cpu_share, in.transport_cpu_s_per_byte * 1e9,
              in.transport_cpu_s_per_message * 1e6, in.big_message_cpu_s_per_byte * 1e9);
  if (in.workers > 1 && in.overhead_allreduce_s > 0 && in.fast_allreduce_s > 0) {
    std::printf("# sigma and sigma_2 at the AllReduce times they were measured at: %.3f ms and "
                "%.3f ms at %.3f ms (no codec), %.3f ms and %.3f ms at %.3f ms (the fastest "
                "codec); between them linear in 1/T_AR, beyond them the nearer one's\n",
                in.sync_overhead_s * 1e3, in.pipe_overhead_s * 1e3, in.overhead_allreduce_s * 1e3,
                in.fast_sync_overhead_s * 1e3, in.fast_pipe_overhead_s * 1e3,
                in.fast_allreduce_s * 1e3);
  }
  if (in.workers > 1 && in.overhead_chunks_per_block > 0) {
    std::printf("# a step's chunk messages beyond the AllReduce alone: %.1f us (width 1) and "
                "%.1f us (width 2) per chunk per ring block beyond %.0f\n",
                in.sync_overhead_per_chunk_s * 1e6, in.pipe_overhead_per_chunk_s * 1e6,
                in.overhead_chunks_per_block);
  }
  if (in.workers == 1) {
    std::printf("# one worker: no AllReduce and no parameter server; each row is compute and "
                "update alone\n");
  }
  if (in.compute_cpu_share <= 0 && in.workers > 1) {
    std::printf("# no CPU shares (a probe of an earlier version, or none): no CPU bound\n");
  } else if (in.loopback && in.workers > 1 && in.ps_probe_workers == 0) {
    std::printf("# loopback (the probe's ranks share a host): the PS schemes' server moves its "
                "bytes at the CPU it gets, %.3f ns per byte in whole-model messages, not at B\n",
                in.big_message_cpu_s_per_byte * 1e9);
  }
  if (in.ps_probe_workers > 0 && in.workers > 1) {
    std::printf("# the PS rows: the probe's real steps (rank 0 serving %d workers) beyond C, "
                "%.3f ms synchronous and %.3f ms asynchronous, x %.3f and x %.3f for %d workers "
                "and a server%s\n",
                in.ps_probe_workers, in.ps_sync_beyond_compute_s * 1e3,
                in.ps_async_beyond_compute_s * 1e3, train::PsScale(in, in.ps_sync_busy_cpus),
                train::PsScale(in, in.ps_async_busy_cpus), in.workers,
                in.loopback && in.host_cpus > 0
                    ? fmt::format(" on {:.2f} CPUs of one host, of which they kept {:.2f} and "
                                  "{:.2f} busy",
                                  in.host_cpus, in.ps_sync_busy_cpus, in.ps_async_busy_cpus)
                          .c_str()
                    : "");
  }
}

// One line per row, beside the terms it is made of ("vs best": against best_s); returns the
// rows as JSON.
nlohmann::json PrintRows(const std::vector<train::SchemePrediction>& report_rows, double best_s,
                         const train::TimingInputs& in) {
  // Each row next to what it is made of: C + U, the communication, and for the ring schemes
  // T_AR's terms (docs/timing_models.md) with the one that sets it; "vs none" is what the
  // row's codec gains its scheme.
  std::printf("# %-12s %-7s %9s %10s %8s %8s | %9s %9s %7s %9s %9s %9s %9s %5s %9s %s\n",
              "scheme", "codec", "chunk(B)", "iter(ms)", "vs best", "vs none", "C+U(ms)",
              "comm(ms)", "m", "alpha(ms)", "link(ms)", "cpu(ms)", "fill(ms)", "gamma",
              "cpubnd(ms)", "bound");
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : report_rows) {
    double none_s = row.iteration_s;
    for (const auto& other : report_rows) {
      if (other.scheme == row.scheme && other.codec == "none") none_s = other.iteration_s;
    }
    const bool ring = row.chunk_bytes > 0;
    const train::RingTerms& t = row.ring;
    const char* bound = row.comm_s > row.compute_s ? "comm" : "compute";
    if (ring && row.comm_s > row.compute_s) bound = t.link_s >= t.cpu_s ? "comm:link" : "comm:cpu";
    if (row.cpu_bound_s > 0 && row.cpu_bound_s >= row.iteration_s * (1 - 1e-9)) bound = "cpu";
    std::printf("  %-12s %-7s %9s %10.3f %7.2fx %7.2fx | %9.3f %9.3f %7s %9s %9s %9s %9s %5s %9s "
                "%s\n",
                row.scheme.c_str(), row.codec.c_str(),
                ring ? fmt::format("{:.0f}", row.chunk_bytes).c_str() : "-", row.iteration_s * 1e3,
                row.iteration_s / best_s, row.iteration_s / none_s,
                row.compute_s * 1e3, row.comm_s * 1e3,
                ring ? fmt::format("{:.0f}", t.chunks_per_block).c_str() : "-",
                ring ? fmt::format("{:.3f}", t.latency_s * 1e3).c_str() : "-",
                ring ? fmt::format("{:.3f}", t.link_s * 1e3).c_str() : "-",
                ring ? fmt::format("{:.3f}", t.cpu_s * 1e3).c_str() : "-",
                ring ? fmt::format("{:.3f}", t.tail_s * 1e3).c_str() : "-",
                ring ? fmt::format("{:.3f}", in.contention).c_str() : "-",
                row.cpu_bound_s > 0 ? fmt::format("{:.3f}", row.cpu_bound_s * 1e3).c_str() : "-",
                bound);
    nlohmann::json r = {{"scheme", row.scheme},   {"codec", row.codec},
                        {"chunk_bytes", row.chunk_bytes}, {"iteration_s", row.iteration_s},
                        {"vs_none", row.iteration_s / none_s}, {"compute_s", row.compute_s},
                        {"comm_s", row.comm_s}, {"cpu_bound_s", row.cpu_bound_s},
                        {"bound", bound}};
    if (ring) {
      r["ring_terms"] = {{"chunks_per_block", t.chunks_per_block}, {"latency_s", t.latency_s},
                         {"link_s", t.link_s}, {"cpu_s", t.cpu_s}, {"tail_s", t.tail_s}};
    }
    rows.push_back(r);
  }
  return rows;
}

// What each H buys: its fastest row, blocking and overlapped (among equal times the least lossy
// codec, the first listed), against the fastest scheme that communicates every step; samples
// per second where the batch is known.
void PrintOuterSummary(const std::vector<train::SchemePrediction>& outer,
                       const train::ModelReport& report, const train::TimingInputs& in,
                       int batch) {
  std::map<std::string, const train::SchemePrediction*> best;  // by scheme name
  std::vector<std::string> order;
  for (const auto& row : outer) {
    auto [it, fresh] = best.emplace(row.scheme, &row);
    if (fresh) order.push_back(row.scheme);
    if (row.iteration_s < it->second->iteration_s) it->second = &row;
  }
  for (const std::string& scheme : order) {
    const train::SchemePrediction& row = *best.at(scheme);
    std::printf("# %s: fastest with %s (of equal times, the least lossy), %.3f ms per inner "
                "step, %.2fx the best every-step scheme (%s %s)%s\n",
                scheme.c_str(), row.codec.c_str(), row.iteration_s * 1e3,
                report.best.iteration_s / row.iteration_s, report.best.scheme.c_str(),
                report.best.codec.c_str(),
                batch > 0 ? fmt::format(", {:.0f} samples/s at batch {} per worker",
                                        in.workers * batch / row.iteration_s, batch)
                                .c_str()
                          : "");
  }
}

void WriteModelJson(const std::string& path, const train::TimingInputs& in, double t_ar,
                    const nlohmann::json& rows, const nlohmann::json& outer_rows, int batch,
                    const train::ModelReport& report) {
  nlohmann::json j = {{"workers", in.workers},
                      {"model_bytes", in.model_bytes},
                      {"latency_s", in.latency_s},
                      {"bandwidth_Bps", in.bandwidth_Bps},
                      {"compute_s", in.compute_s},
                      {"update_s", in.update_s},
                      {"pipelined_update_s", train::UpdateTime(in, 2)},
                      {"sync_overhead_s", in.sync_overhead_s},
                      {"pipe_overhead_s", in.pipe_overhead_s},
                      {"overhead_allreduce_s", in.overhead_allreduce_s},
                      {"fast_allreduce_s", in.fast_allreduce_s},
                      {"fast_sync_overhead_s", in.fast_sync_overhead_s},
                      {"fast_pipe_overhead_s", in.fast_pipe_overhead_s},
                      {"overhead_chunks_per_block", in.overhead_chunks_per_block},
                      {"sync_overhead_per_chunk_s", in.sync_overhead_per_chunk_s},
                      {"pipe_overhead_per_chunk_s", in.pipe_overhead_per_chunk_s},
                      {"big_message_cpu_s_per_byte", in.big_message_cpu_s_per_byte},
                      {"loopback", in.loopback},
                      {"host_cpus", in.host_cpus},
                      {"ps_probe_workers", in.ps_probe_workers},
                      {"ps_sync_beyond_compute_s", in.ps_sync_beyond_compute_s},
                      {"ps_async_beyond_compute_s", in.ps_async_beyond_compute_s},
                      {"ps_sync_busy_cpus", in.ps_sync_busy_cpus},
                      {"ps_async_busy_cpus", in.ps_async_busy_cpus},
                      {"reduce_s_per_byte", in.reduce_s_per_byte},
                      {"chunk_overhead_s", in.chunk_overhead_s},
                      {"contention", in.contention},
                      {"overlap_compute_factor", in.overlap_compute_factor},
                      {"overlap_allreduce_factor", in.overlap_allreduce_factor},
                      {"compute_cpu_share", in.compute_cpu_share},
                      {"cpu_share", in.cpu_share},
                      {"transport_cpu_s_per_byte", in.transport_cpu_s_per_byte},
                      {"transport_cpu_s_per_message", in.transport_cpu_s_per_message},
                      {"allreduce_s", t_ar},
                      {"rows", rows},
                      {"outer_rows", outer_rows},
                      {"batch_size", batch},
                      {"best", {{"scheme", report.best.scheme},
                                {"codec", report.best.codec},
                                {"width", report.best_width},
                                {"chunk_bytes", report.best.chunk_bytes},
                                {"iteration_s", report.best.iteration_s}}}};
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) Throw(ErrorCode::kIo, "model --json {}: cannot write", path);
}

}  // namespace

void RunModel(const ModelArgs& a) {
  train::TimingInputs in;
  std::vector<train::CodecCost> codecs;
  nlohmann::json probe;  // the probe's result, if given
  if (!a.probe_json.empty()) {
    probe = ReadProbe(a.probe_json, in, codecs);
  } else {
    in.workers = 4;
    in.bandwidth_Bps = 0;
    in.latency_s = -1;
    in.compute_s = -1;
  }
  const int probed_workers = in.workers;
  ApplyFlags(a, in);
  CheckInputs(a, in, codecs);
  RequireComplete(a, probed_workers, in);
  if (codecs.empty()) codecs = DefaultCodecs();
  const std::vector<double> chunks =
      a.chunk_bytes > 0 ? std::vector<double>{a.chunk_bytes} : train::DefaultChunkSizes();
  const train::ModelReport report = train::PredictAll(in, codecs, chunks);
  for (const auto& row : report.rows) {
    if (!std::isfinite(row.iteration_s)) {
      Throw(ErrorCode::kInvalidArgument,
            "model: {} with {} gives {} s per iteration from W = {}, M = {} B, alpha = {} s, "
            "B = {} B/s, C = {} s: expected inputs whose times are finite",
            row.scheme, row.codec, row.iteration_s, in.workers, in.model_bytes, in.latency_s,
            in.bandwidth_Bps, in.compute_s);
    }
  }

  // The probe's batch (earlier probes: none), unless given.
  const int batch = a.batch_size > 0 ? a.batch_size
                                     : static_cast<int>(probe.is_object()
                                                            ? probe.value("batch_size", 0.0)
                                                            : 0.0);
  const std::vector<train::SchemePrediction> outer =
      train::PredictOuter(in, codecs, chunks, a.local_steps);

  PrintInputs(in);
  const nlohmann::json rows = PrintRows(report.rows, report.best.iteration_s, in);
  for (const std::string& line : ProbeSpread(probe, a.probe_json, in, codecs)) {
    std::printf("# %s\n", line.c_str());
  }
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
  if (report.best.scheme.rfind("ps_", 0) == 0) {
    // The probe's W ranks all train; a PS job of W workers needs one more, the server.
    std::printf("# %s: W = %d workers and one more rank for the server (run -np %d, "
                "train.mode = %s)\n",
                report.best.scheme.c_str(), in.workers, in.workers + 1,
                report.best.scheme == "ps_sync" ? "PS_SYNC" : "PS_ASYNC");
  }
  nlohmann::json outer_rows = nlohmann::json::array();
  if (!outer.empty()) {
    std::printf("# the outer loop (train.local_steps H, docs/outer_loop.md): per inner step, a "
                "round of H steps and one AllReduce of the pseudo-gradient; _ov: "
                "train.outer_overlap 1. What H costs in accuracy is measured, not modelled\n");
    outer_rows = PrintRows(outer, report.best.iteration_s, in);
    PrintOuterSummary(outer, report, in, batch);
  }
  if (!a.json_path.empty()) WriteModelJson(a.json_path, in, t_ar, rows, outer_rows, batch, report);
}

}  // namespace pipesgd::launcher
