#include "core/job/auto_values.h"

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/base/log.h"
#include "core/collective/codec.h"
#include "core/job/worker.h"
#include "core/train/autotune.h"

namespace pipesgd::job {
namespace {

std::string Bytes(uint64_t b) {
  if (b >= (1u << 20) && b % (1u << 20) == 0) return fmt::format("{} MiB", b >> 20);
  if (b >= 1024 && b % 1024 == 0) return fmt::format("{} KiB", b >> 10);
  return fmt::format("{} B", b);
}

}  // namespace

collective::CommunicatorOptions RingConnectOptions(const config::Job& job) {
  collective::CommunicatorOptions o = CommunicatorOptionsFromConfig(job);
  if (job.comm().streams() == 0) o.streams = kAutoMaxStreams;
  return o;
}

namespace {

// What AutoTune measured and chose, into the run's report (summary.json "auto") and, at the
// lead rank, the log.
void ReportAutoTune(const train::AutoTuneResult& r, CodecKind own, size_t params, bool lead,
                    RingSettings& s) {
  s.pipeline_width = r.width;
  s.chunk_bytes = r.chunk_bytes;
  s.streams = r.streams;
  nlohmann::json allreduce = nlohmann::json::array();
  std::vector<std::string> timed;
  for (const auto& t : r.allreduce) {
    allreduce.push_back(
        {{"chunk_bytes", t.chunk_bytes}, {"streams", t.streams}, {"seconds", t.seconds}});
    timed.push_back(fmt::format("{} x {}: {:.3f} ms", Bytes(t.chunk_bytes), t.streams,
                                t.seconds * 1e3));
  }
  nlohmann::json widths = nlohmann::json::array();
  for (const auto& w : r.widths) {
    widths.push_back(
        {{"width", w.width}, {"step_s", w.step_s}, {"predicted_s", w.predicted_s}});
  }
  double chosen_ar = 0;
  for (const auto& t : r.allreduce) {
    if (t.chunk_bytes == s.chunk_bytes && t.streams == s.streams) chosen_ar = t.seconds;
  }
  nlohmann::json codecs = nlohmann::json::array();
  std::vector<std::string> gains;
  for (const auto& c : r.codecs) {
    codecs.push_back({{"codec", CodecName(c.codec)}, {"seconds", c.seconds}});
    gains.push_back(fmt::format("{} {:.3f} ms ({:.2f}x)", CodecName(c.codec), c.seconds * 1e3,
                                chosen_ar > 0 ? c.seconds / chosen_ar : 0.0));
  }
  s.report["codecs"] = codecs;
  s.report["tuning_s"] = r.seconds;
  s.report["compute_s"] = r.compute_s;
  s.report["allreduce"] = allreduce;
  s.report["widths"] = widths;
  s.report["congestion_restarted"] = r.congestion_restarted;
  if (lead) {
    if (!r.allreduce.empty()) {
      PSGD_LOG_INFO("auto: comm.chunk_bytes = {}, comm.streams = {}: the gradient's AllReduce "
                    "({} B), slowest rank, at chunk x streams: {}",
                    Bytes(s.chunk_bytes), s.streams, 4 * (params + 1),
                    fmt::join(timed, ", "));
    } else {
      PSGD_LOG_INFO("auto: one rank: nothing to reduce, so nothing measured: "
                    "train.pipeline_width = {}, comm.chunk_bytes = {}, comm.streams = {}",
                    s.pipeline_width, Bytes(s.chunk_bytes), s.streams);
    }
    if (!gains.empty()) {
      PSGD_LOG_INFO("auto: the same AllReduce at {} x {} with comm.compression {} (this job's) "
                    "{:.3f} ms; with {}. Compression stays your choice: it changes accuracy "
                    "(docs/compression.md)",
                    Bytes(s.chunk_bytes), s.streams, CodecName(own),
                    chosen_ar * 1e3, fmt::join(gains, ", "));
    }
    if (!r.widths.empty()) {
      std::vector<std::string> steps;
      for (const auto& w : r.widths) {
        steps.push_back(fmt::format("width {} {:.3f} ms (model {:.3f} ms)", w.width,
                                    w.step_s * 1e3, w.predicted_s * 1e3));
      }
      PSGD_LOG_INFO("auto: train.pipeline_width = {}: a training step measured at {}; the "
                    "model's inputs: compute {:.3f} ms, AllReduce {:.3f} ms, no contention",
                    s.pipeline_width, fmt::join(steps, ", "), r.compute_s * 1e3,
                    chosen_ar * 1e3);
    }
    PSGD_LOG_INFO("auto: tuned in {:.2f} s{}", r.seconds,
                  r.congestion_restarted.empty()
                      ? ""
                      : fmt::format("; TCP congestion control ({}) restarted on the job's "
                                    "connections",
                                    r.congestion_restarted));
  }
}

}  // namespace

RingSettings ResolveRingSettings(const config::Job& job, collective::Communicator& comm,
                                 train::Objective& objective, std::span<const float> params,
                                 const train::TrainerOptions& trainer,
                                 std::function<std::unique_ptr<train::Optimizer>()> make_optimizer,
                                 const checkpoint::Checkpoint* resumed, bool lead) {
  const bool auto_width = job.train().pipeline_width() == 0;
  const bool auto_chunk = job.comm().chunk_bytes() == 0;
  const bool auto_streams = job.comm().streams() == 0;
  RingSettings s;
  s.pipeline_width = job.train().pipeline_width();
  s.chunk_bytes = static_cast<uint64_t>(job.comm().chunk_bytes());
  s.streams = job.comm().streams();
  if (!auto_width && !auto_chunk && !auto_streams) return s;

  std::vector<std::string> names;
  if (auto_width) names.push_back("train.pipeline_width");
  if (auto_chunk) names.push_back("comm.chunk_bytes");
  if (auto_streams) names.push_back("comm.streams");
  s.report = {{"auto", names}};

  // A resume continues with what the interrupted run chose (0: a checkpoint of an older
  // version, which did not record it; then it is measured again).
  bool from_checkpoint = false;
  train::AutoTuneRequest request;
  if (resumed && auto_width && resumed->pipeline_width() > 0) {
    s.pipeline_width = resumed->pipeline_width();
    from_checkpoint = true;
  }
  if (resumed && auto_chunk && resumed->chunk_bytes() > 0) {
    s.chunk_bytes = resumed->chunk_bytes();
    from_checkpoint = true;
  }
  if (resumed && auto_streams && resumed->streams() > 0 && resumed->streams() <= kAutoMaxStreams) {
    s.streams = resumed->streams();
    from_checkpoint = true;
  }
  const bool measure_width = auto_width && s.pipeline_width == 0;
  const bool measure_chunk = auto_chunk && s.chunk_bytes == 0;
  const bool measure_streams = auto_streams && s.streams == 0;
  s.report["from_checkpoint"] = from_checkpoint;
  if (!measure_chunk) request.chunk_bytes = {s.chunk_bytes};
  if (!measure_streams) request.streams = {s.streams};
  if (!measure_width) request.widths = {s.pipeline_width};
  if (!measure_width && !measure_chunk && !measure_streams) {
    comm.Retune(s.chunk_bytes, s.streams);
  } else {
    request.timeout_s = job.comm().timeout_s();
    request.trainer = trainer;
    request.make_optimizer = std::move(make_optimizer);
    const CodecKind own = comm.options().codec.kind;
    for (CodecKind kind : {CodecKind::kNone, CodecKind::kTrunc16, CodecKind::kFp16, CodecKind::kQ8,
                           CodecKind::kQ4, CodecKind::kSign1}) {
      if (kind != own) request.compare_codecs.push_back(kind);
    }
    ReportAutoTune(train::AutoTune(comm, objective, params, request), own, params.size(), lead, s);
  }
  if (lead && from_checkpoint) {
    PSGD_LOG_INFO("auto: kept the checkpoint's train.pipeline_width = {}, comm.chunk_bytes = {}, "
                  "comm.streams = {}",
                  s.pipeline_width, Bytes(s.chunk_bytes), s.streams);
  }
  s.report["chosen"] = {{"pipeline_width", s.pipeline_width},
                        {"chunk_bytes", s.chunk_bytes},
                        {"streams", s.streams}};
  return s;
}

}  // namespace pipesgd::job
