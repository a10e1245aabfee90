#include "launcher/report.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/base/error.h"
#include "launcher/process.h"

namespace pipesgd::launcher {
namespace {

namespace fs = std::filesystem;

struct Point {
  double wall_s = 0, accuracy = 0, samples_per_s = 0;
};

struct Run {
  std::string name, path;
  std::string summary_path;  // where `summary` was read from
  std::vector<Point> curve;
  std::optional<nlohmann::json> summary;
};

// What a field read from a run may hold: a finite number in [lo, hi] (an integer where
// `integer`), as the message says.
struct Range {
  double lo, hi;
  bool integer;
  const char* expected;
};
constexpr Range kSeconds{0, 1e9, false, "a number of seconds in [0, 1e9]"};
constexpr Range kAccuracy{0, 1, false, "an accuracy in [0, 1]"};
constexpr Range kTarget{0, 1, false, "an accuracy in [0, 1] (0: no target)"};
constexpr Range kRate{0, 1e15, false, "samples per second in [0, 1e15]"};
constexpr Range kCount{0, 9.0e15, true, "an integer >= 0"};
constexpr Range kPositiveCount{1, 9.0e15, true, "an integer >= 1"};

// Field `pointer` of `j`, read from `where` (a file, or a file's line): nullopt when absent and
// not `required`; else a number in `range`, or an Error(kDataLoss) naming the file, the field,
// the value found and what was expected. (null is a bad value, not an absent one: summary.json
// and metrics.jsonl are written without nulls.)
std::optional<double> Number(const nlohmann::json& j, const std::string& where,
                             const char* pointer, const Range& range, bool required) {
  const nlohmann::json::json_pointer p(pointer);
  const char* field = pointer + 1;
  if (!j.contains(p)) {
    if (!required) return std::nullopt;
    Throw(ErrorCode::kDataLoss, "report: {}: field {} is missing; expected {}", where, field,
          range.expected);
  }
  const nlohmann::json& v = j.at(p);
  const bool ok = v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= range.lo &&
                  v.get<double>() <= range.hi &&
                  (!range.integer || v.get<double>() == std::floor(v.get<double>()));
  if (!ok) {
    Throw(ErrorCode::kDataLoss, "report: {}: field {} is {}; expected {}", where, field, v.dump(),
          range.expected);
  }
  return v.get<double>();
}

// Every summary field report reads, checked once where it is loaded: the text fields are
// strings (absent: "-"), the numbers in range. steps and global_batch are needed only with
// train_wall_s (samples per second).
void ValidateSummary(const nlohmann::json& summary, const std::string& where) {
  for (const char* pointer : {"/mode", "/transport", "/launcher", "/config/comm/compression"}) {
    const nlohmann::json::json_pointer p(pointer);
    if (summary.contains(p) && !summary.at(p).is_string()) {
      Throw(ErrorCode::kDataLoss, "report: {}: field {} is {}; expected a string", where,
            pointer + 1, summary.at(p).dump());
    }
  }
  const nlohmann::json::json_pointer ef("/config/comm/error_feedback");
  if (summary.contains(ef) && !summary.at(ef).is_boolean()) {
    Throw(ErrorCode::kDataLoss, "report: {}: field config/comm/error_feedback is {}; expected "
          "true or false", where, summary.at(ef).dump());
  }
  Number(summary, where, "/config/comm/powersgd_rank", kCount, false);
  Number(summary, where, "/config/train/pipeline_width", kCount, false);
  Number(summary, where, "/target_accuracy", kTarget, false);
  if (Number(summary, where, "/train_wall_s", kSeconds, false)) {
    Number(summary, where, "/steps", kCount, true);
    Number(summary, where, "/global_batch", kPositiveCount, true);
  }
}

Run LoadRun(const std::string& path) {
  Run run;
  run.path = path;
  fs::path metrics = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    metrics = fs::path(path) / "metrics.jsonl";
    run.name = fs::path(path).lexically_normal().filename().string();
    if (run.name.empty()) {
      run.name = fs::path(path).lexically_normal().parent_path().filename().string();
    }
    const fs::path summary = fs::path(path) / "summary.json";
    if (fs::exists(summary, ec)) {
      std::ifstream in(summary);
      try {
        run.summary = nlohmann::json::parse(in);
      } catch (const nlohmann::json::exception& e) {
        Throw(ErrorCode::kDataLoss, "report: {}: not JSON: {}", summary.string(), e.what());
      }
      run.summary_path = summary.string();
      if (!run.summary->is_object()) {
        Throw(ErrorCode::kDataLoss, "report: {}: {}: expected a summary object", summary.string(),
              run.summary->dump());
      }
      ValidateSummary(*run.summary, run.summary_path);
    }
  } else {
    run.name = fs::path(path).filename().string();
    for (const char* suffix : {".metrics.jsonl", ".jsonl"}) {
      if (run.name.ends_with(suffix) && run.name.size() > std::strlen(suffix)) {
        run.name.resize(run.name.size() - std::strlen(suffix));
        break;
      }
    }
  }
  std::ifstream in(metrics);
  if (!in) {
    Throw(ErrorCode::kNotFound,
          "report: {}: cannot read {} (expected a --out directory or a metrics.jsonl file)", path,
          metrics.string());
  }
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      Throw(ErrorCode::kDataLoss,
            "report: {} line {}: expected a metrics object with wall_s and test_accuracy: {}",
            metrics.string(), number, e.what());
    }
    const std::string where = fmt::format("{} line {}", metrics.string(), number);
    if (!j.is_object()) {
      Throw(ErrorCode::kDataLoss,
            "report: {}: {}: expected a metrics object with wall_s and test_accuracy", where,
            j.dump());
    }
    run.curve.push_back({*Number(j, where, "/wall_s", kSeconds, true),
                         *Number(j, where, "/test_accuracy", kAccuracy, true),
                         Number(j, where, "/samples_per_s", kRate, false).value_or(0.0)});
  }
  if (run.curve.empty()) {
    Throw(ErrorCode::kDataLoss, "report: {}: no evaluations (an empty metrics.jsonl)",
          metrics.string());
  }
  return run;
}

// A value of the summary by JSON pointer, as text; "-" when absent. ValidateSummary has checked
// its type.
std::string Field(const Run& run, const char* pointer) {
  if (!run.summary) return "-";
  const nlohmann::json::json_pointer p(pointer);
  if (!run.summary->contains(p)) return "-";
  const auto& v = run.summary->at(p);
  return v.is_string() ? v.get<std::string>() : v.dump();
}

std::string Codec(const Run& run) {
  if (!run.summary) return "-";
  std::string codec = Field(run, "/config/comm/compression");
  if (const std::string rank = Field(run, "/config/comm/powersgd_rank"); rank != "-" && rank != "0") {
    return "powersgd r" + rank;
  }
  if (codec != "none" && Field(run, "/config/comm/error_feedback") == "true") codec += " EF";
  return codec;
}

std::string Width(const Run& run) {
  const std::string mode = Field(run, "/mode");
  if (mode != "RING" && mode != "SDPIPE") return "-";
  return Field(run, "/config/train/pipeline_width");
}

// Samples per second of training: the summary's totals, else the mean of the metrics lines.
double SamplesPerSecond(const Run& run) {
  if (run.summary && run.summary->contains("train_wall_s")) {
    const double s = run.summary->at("train_wall_s").get<double>();
    const double samples =
        run.summary->at("steps").get<double>() * run.summary->at("global_batch").get<double>();
    return s > 0 ? samples / s : 0;
  }
  double sum = 0;
  for (const Point& p : run.curve) sum += p.samples_per_s;
  return sum / static_cast<double>(run.curve.size());
}

std::optional<double> TimeTo(const Run& run, double target) {
  for (const Point& p : run.curve) {
    if (p.accuracy >= target) return p.wall_s;
  }
  return std::nullopt;
}

// Quotes for a gnuplot string: single quotes, doubled inside.
std::string GnuplotQuote(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

void Plot(const std::vector<Run>& runs, const std::vector<double>& targets, const std::string& png) {
  const std::string gnuplot = FindProgram("gnuplot");  // throws naming PATH
  char pattern[] = "/tmp/pipesgd-report-XXXXXX";
  if (mkdtemp(pattern) == nullptr) {
    Throw(ErrorCode::kIo, "report: cannot make a temporary directory: {}", std::strerror(errno));
  }
  const fs::path dir = pattern;
  struct Cleanup {
    fs::path dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{dir};
  std::string plot;
  for (size_t i = 0; i < runs.size(); ++i) {
    const fs::path data = dir / fmt::format("run{}.dat", i);
    std::ofstream out(data);
    for (const Point& p : runs[i].curve) out << fmt::format("{} {}\n", p.wall_s, p.accuracy);
    plot += fmt::format("{}{} using 1:2 with linespoints lw 2 title {}", i ? ", \\\n     " : "",
                        GnuplotQuote(data.string()), GnuplotQuote(runs[i].name));
  }
  std::string script = fmt::format(
      "set terminal pngcairo size 960,600 noenhanced\nset output {}\nset key bottom right\nset grid\n"
      "set xlabel 'training time (s), evaluations left out'\nset ylabel 'test accuracy'\n"
      "set title 'test accuracy against training time'\n",
      GnuplotQuote(png));
  for (double t : targets) {
    script += fmt::format("set arrow from graph 0, first {0} to graph 1, first {0} nohead dt 2 "
                          "lc rgb 'gray'\n",
                          t);
  }
  script += "plot " + plot + "\n";
  const fs::path script_path = dir / "report.gp";
  std::ofstream(script_path) << script;
  ChildSpec spec;
  spec.argv = {gnuplot, script_path.string()};
  spec.own_process_group = false;
  const ChildResult done = RunChild(spec, "gnuplot", Deadline::After(120));
  if (ExitCodeOf(done.status) != 0) {
    Throw(ErrorCode::kUnavailable, "report: gnuplot {} writing {}: {}",
          DescribeWaitStatus(done.status), png, done.err);
  }
}

}  // namespace

void RunReport(const ReportArgs& args) {
  if (args.runs.empty()) Throw(ErrorCode::kInvalidArgument, "report: give at least one RUN");
  std::vector<Run> runs;
  for (const auto& path : args.runs) runs.push_back(LoadRun(path));
  // Runs of the same name (ring_k2 of two rates) are told apart by their paths.
  std::map<std::string, int> uses;
  for (const Run& r : runs) ++uses[r.name];
  for (Run& r : runs) {
    if (uses[r.name] > 1) r.name = r.path;
  }
  std::vector<double> targets = args.targets;
  if (targets.empty()) {
    std::set<double> given;
    for (const Run& r : runs) {
      const std::optional<double> t =
          r.summary ? Number(*r.summary, r.summary_path, "/target_accuracy", kTarget, false)
                    : std::nullopt;
      if (t && *t > 0) given.insert(*t);
    }
    targets.assign(given.begin(), given.end());
    if (targets.empty()) targets = {0.85};
  }
  for (double t : targets) {
    if (!(t > 0 && t <= 1)) {
      Throw(ErrorCode::kInvalidArgument, "report: --target {}: expected an accuracy in (0, 1]", t);
    }
  }

  std::string header = "| run | mode | width | codec | transport | launcher | samples/s |";
  std::string rule = "|---|---|---:|---|---|---|---:|";
  for (double t : targets) {
    header += fmt::format(" time to {:g} (s) |", t);
    rule += "---:|";
  }
  header += fmt::format(" final accuracy | speedup to {:g} vs {} |", targets[0], runs[0].name);
  rule += "---:|---:|";
  std::printf("%s\n%s\n", header.c_str(), rule.c_str());
  const std::optional<double> first = TimeTo(runs[0], targets[0]);
  for (const Run& r : runs) {
    std::string line = fmt::format("| {} | {} | {} | {} | {} | {} | {:.0f} |", r.name,
                                   Field(r, "/mode"), Width(r), Codec(r), Field(r, "/transport"),
                                   Field(r, "/launcher"), SamplesPerSecond(r));
    for (double t : targets) {
      const auto s = TimeTo(r, t);
      line += s ? fmt::format(" {:.1f} |", *s) : std::string(" never |");
    }
    const auto mine = TimeTo(r, targets[0]);
    line += fmt::format(" {:.4f} |", r.curve.back().accuracy);
    line += first && mine && *mine > 0 ? fmt::format(" {:.2f}x |", *first / *mine)
                                       : std::string(" - |");
    std::printf("%s\n", line.c_str());
  }
  std::printf("\n(times are training time, evaluations left out; 'never': not within the run)\n");
  std::fflush(stdout);
  if (!args.png.empty()) {
    Plot(runs, targets, args.png);
    std::printf("pipesgd report: test accuracy against training time in %s\n", args.png.c_str());
  }
}

}  // namespace pipesgd::launcher
