// What every training mode reports, the same way: the run plan of job.train, the console and
// metrics.jsonl lines of each evaluation, the last line, and summary.json (worker_detail.h).

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include <google/protobuf/util/json_util.h>
#include <nlohmann/json.hpp>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/job/config.h"
#include "core/job/model_builder.h"
#include "core/job/worker_detail.h"
#include "transport/launch_env.h"

namespace pipesgd::job {

void CheckOutDirIsFree(const std::string& dir, bool replace) {
  const std::filesystem::path summary = std::filesystem::path(dir) / "summary.json";
  std::error_code ec;
  if (replace || !std::filesystem::exists(summary, ec)) return;
  std::string started = "at an unknown time";
  try {
    std::ifstream in(summary);
    const auto j = nlohmann::json::parse(in);
    if (j.contains("start_time")) started = "at " + j.at("start_time").get<std::string>();
  } catch (const std::exception&) {
  }
  Throw(ErrorCode::kInvalidArgument,
        "--out {}: holds a finished run (summary.json, started {}); pass --overwrite to replace "
        "it, or choose another --out",
        dir, started);
}

}  // namespace pipesgd::job

namespace pipesgd::job::detail {

nlohmann::json ConfigAsJson(const config::Job& job) {
  std::string text;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(job, &text, options);
  return nlohmann::json::parse(text);
}

// Writes to a temporary file, then renames it over `path`, so a reader never sees half a file.
void WriteFileAtomically(const std::filesystem::path& path, const std::string& contents) {
  auto tmp = path;
  tmp += ".tmp";
  std::FILE* out = std::fopen(tmp.c_str(), "w");
  bool ok = out && std::fwrite(contents.data(), 1, contents.size(), out) == contents.size();
  const int err = errno;
  if (out && std::fclose(out) != 0) ok = false;
  if (!ok) {
    std::remove(tmp.c_str());
    Throw(ErrorCode::kIo, "cannot write {}: {}", tmp.string(), std::strerror(err));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    Throw(ErrorCode::kIo, "cannot rename {} to {}: {}", tmp.string(), path.string(), ec.message());
  }
}


train::RunPlan PlanFromConfig(const config::Job& job, int64_t steps_per_epoch,
                              int64_t global_batch) {
  const auto& t = job.train();
  train::RunPlan plan;
  plan.steps_per_epoch = steps_per_epoch;
  plan.epochs = t.epochs();
  plan.max_steps = t.max_steps();
  plan.eval_every_steps = t.eval_every_steps();
  plan.target_accuracy = t.target_accuracy();
  plan.global_batch = global_batch;
  plan.progress_per_epoch = t.progress_per_epoch();
  // The synchronous warm-up runs another schedule; 10 more, as benchmarks leave out (Horovod's
  // synthetic benchmark: 10 warm-up batches).
  plan.warmup_steps = std::max<int64_t>(0, t.sync_warmup_steps()) + 10;
  return plan;
}

void LogEffectiveConfig(const std::string& path, const config::Job& job) {
  PSGD_LOG_INFO("config {} (-v prints the effective config; --out keeps it in summary.json)", path);
  PSGD_LOG_DEBUG("effective config ({}): {}", path, FormatConfig(job, true));
}

// "4.2 s", "42 s", "3 min 05 s", "2 h 04 min": short, for a progress line.
static std::string Duration(double s) {
  if (!(s >= 0)) return "?";
  if (s < 10) return fmt::format("{:.1f} s", s);
  const auto n = static_cast<int64_t>(std::llround(std::min(s, 1e9)));
  if (n < 60) return fmt::format("{} s", n);
  if (n < 3600) return fmt::format("{} min {:02} s", n / 60, n % 60);
  return fmt::format("{} h {:02} min", n / 3600, (n % 3600) / 60);
}

void LeadReporter::Progress(const train::Progress& p) {
  if (!lead_) return;
  PSGD_LOG_INFO("epoch {}/{} step {}/{}: loss {:.4f}, {:.0f} samples/s, {} elapsed, ETA {}",
                p.epoch, p.epochs, p.done, p.total, p.loss, p.samples_per_s,
                Duration(p.elapsed_s), Duration(p.eta_s));
}

void LeadReporter::Evaluated(const train::Evaluation& e, int epochs) {
  if (!lead_) return;
  const std::string where = e.epoch_end ? fmt::format("epoch {}/{}", e.epoch, epochs)
                                        : fmt::format("epoch {}/{} step {}", e.epoch, epochs, e.step);
  const std::string wire =
      show_wire_ ? fmt::format("  wire {:.3f} MB/step (compression {:.2f}x)",
                               e.wire_bytes_per_step / 1e6, e.compression_ratio)
                 : "";
  PSGD_LOG_INFO("{}: train_loss {:.4f}  test_loss {:.4f}  test_accuracy {:.4f}  {:.0f} samples/s  "
                "wall {:.1f} s{}",
                where, e.train_loss, e.test_loss, e.test_accuracy, e.samples_per_s, e.wall_s, wire);
  if (out_ == nullptr) return;
  out_->AppendMetrics({{"step", e.step},
                       {"epoch", e.epoch},
                       {"epoch_end", e.epoch_end},
                       {"wall_s", e.wall_s},
                       {"eval_s", e.eval_s},
                       {"train_loss", e.train_loss},
                       {"test_loss", e.test_loss},
                       {"test_accuracy", e.test_accuracy},
                       {"samples_per_s", e.samples_per_s},
                       {"wire_bytes_per_step", e.wire_bytes_per_step},
                       {"compression_ratio", e.compression_ratio}});
}

void LogFinal(const train::RunOutcome& outcome, const train::RunPlan& plan, double wall_s) {
  std::string target;
  if (plan.target_accuracy > 0) {
    target = outcome.reached_target
                 ? fmt::format("; target {:.4f} reached at step {} after {:.1f} s of training",
                               plan.target_accuracy, outcome.steps_to_target,
                               outcome.time_to_target_s)
                 : fmt::format("; target {:.4f} not reached", plan.target_accuracy);
  }
  PSGD_LOG_INFO("final test accuracy: {:.4f} ({} steps, {:.1f} s){}", outcome.final_test_accuracy,
                outcome.steps, wall_s, target);
}

namespace {

// When this worker started, from how long it has run: ISO 8601 in UTC.
std::string StartTime(double wall_s) {
  const auto start = std::chrono::system_clock::now() -
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(
                         std::chrono::duration<double>(wall_s));
  const std::time_t t = std::chrono::system_clock::to_time_t(start);
  std::tm utc{};
  gmtime_r(&t, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

// The command that started the job: the launcher's (PIPESGD_COMMAND_LINE, set by pipesgd
// run), else this worker's own, as one shell-quoted line.
std::string CommandLine() {
  if (const char* line = std::getenv("PIPESGD_COMMAND_LINE"); line != nullptr && *line) {
    return line;
  }
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> words;
  for (std::string word; std::getline(in, word, '\0');) words.push_back(word);
  return transport::ShellJoin(words);
}

// Every rank's host in rank order where the launcher knows them (pipesgd run sets
// PIPESGD_HOSTS); else rank 0's alone.
nlohmann::json Hosts() {
  nlohmann::json hosts = nlohmann::json::array();
  const char* list = std::getenv("PIPESGD_HOSTS");
  std::string_view rest = list != nullptr ? list : "";
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    hosts.push_back(std::string(rest.substr(0, comma)));
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  if (hosts.empty()) hosts.push_back(transport::RankHost());
  return hosts;
}

std::string LauncherName() {
  try {
    return transport::ToString(transport::ReadLaunchEnv().launcher);
  } catch (const Error&) {
    return "?";
  }
}

}  // namespace

nlohmann::json Summary(const SummaryInputs& in, const train::RunOutcome& outcome,
                       const config::Job& job, nlohmann::json details) {
  // -1 and null-free numbers: a run that did not reach its target says so with
  // reached_target = false, and steps_to_target / time_to_target_s = -1.
  return {{"mode", in.mode},
          {"final_test_accuracy", outcome.final_test_accuracy},
          {"final_test_loss", outcome.final_test_loss},
          {"steps", outcome.steps},
          {"evaluations", outcome.evaluations},
          {"world_size", in.world_size},
          {"workers", in.workers},
          {"global_batch", in.global_batch},
          {"target_accuracy", in.target_accuracy},
          {"reached_target", outcome.reached_target},
          {"steps_to_target", outcome.steps_to_target},
          {"time_to_target_s", outcome.time_to_target_s},
          {"wall_s", in.wall_s},
          {"train_wall_s", outcome.train_s},
          {"eval_s", outcome.eval_s},
          {"steady_step_s", outcome.steady_step_s},
          {"steady_steps", outcome.steady_steps},
          {"transport", in.transport},
          {"kernels", KernelsInUse(job.model())},
          {"wire_bytes", in.wire_bytes},
          {"version", PIPESGD_VERSION},
          {"start_time", StartTime(in.wall_s)},
          {"host", transport::RankHost()},  // rank 0's
          {"hosts", Hosts()},
          {"launcher", LauncherName()},
          {"command_line", CommandLine()},
          {"details", std::move(details)},
          {"config", ConfigAsJson(job)}};
}

}  // namespace pipesgd::job::detail
