// What every train.mode must do alike (issue 45), with whole `pipesgd run` jobs on loopback:
// SDPIPE runs exactly train.max_steps; every mode writes a --timeline with spans of each rank;
// every mode honours model.device = CUDA or refuses it before any rank starts; the default
// --timeline window of a Pipe-SGD job lies past its synchronous warm-up and shows the overlap.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "tests/support/cli.h"

namespace pipesgd {
namespace {

using testing::CliTempDir;
using testing::CommandResult;
using testing::kBinary;
using testing::kConfig;
using testing::RunCommand;

const std::string kPipelineConfig =
    std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_mlp_pipeline.pbtxt";

CommandResult RunJob(int np, const std::string& config, const std::vector<std::string>& sets,
                     const std::vector<std::string>& extra = {}) {
  std::vector<std::string> argv = {kBinary, "run", "-np", std::to_string(np), config};
  for (const auto& s : sets) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  argv.insert(argv.end(), extra.begin(), extra.end());
  return RunCommand(argv, {}, 180);
}

struct Span {
  int rank;
  std::string name;
  int64_t step;
  double begin, end;
};

std::vector<Span> ReadSpans(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  std::vector<Span> out;
  if (!in) return out;
  const auto j = nlohmann::json::parse(in);
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const double ts = e.at("ts").get<double>();
    out.push_back({e.at("pid").get<int>(), e.at("name").get<std::string>(),
                   e.at("args").at("step").get<int64_t>(), ts, ts + e.at("dur").get<double>()});
  }
  return out;
}

// 3 ranks, 10 steps per epoch (480 samples, batch 16 x 3), 23 steps: no multiple of the
// epoch, of the world size or of sdpipe.period (10). Issue 45: 120 asked, 116 reported.
TEST(JobModes, SdpipeRunsExactlyMaxSteps) {
  CliTempDir dir;
  const CommandResult r =
      RunJob(3, kConfig,
             {"train.mode=SDPIPE", "train.batch_size=16", "train.epochs=3", "train.max_steps=23",
              "data.train_limit=480", "data.test_limit=300"},
             {"--out", dir.path("out")});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream file(dir.path("out/summary.json"));
  ASSERT_TRUE(file);
  const auto summary = nlohmann::json::parse(file);
  EXPECT_EQ(summary.at("steps").get<int64_t>(), 23);
  EXPECT_EQ(summary.at("details").at("local_steps_all_ranks").get<int64_t>(), 23 * 3);
  std::ifstream metrics(dir.path("out/metrics.jsonl"));
  std::vector<int64_t> steps;
  for (std::string line; std::getline(metrics, line);) {
    steps.push_back(nlohmann::json::parse(line).at("step").get<int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{10, 20, 23}));  // the epochs' ends, the last step
}

// The outer loop (train.local_steps = H > 1) in the same skeleton: 23 inner steps of 3 ranks
// at H = 4, no multiple of H or of the epoch, run exactly: in 6 rounds (the last one cut short
// at the run's end, so no inner step is lost), or after 4 synchronous steps in 4 rounds of one
// step and 5 of H. The evaluations fall where the plan puts them, and the wire bytes are per
// inner step: each round's AllReduce over the steps it covers.
TEST(JobModes, TheOuterLoopRunsExactlyMaxStepsInRounds) {
  struct Case {
    const char* overlap;
    const char* warmup;
    int64_t rounds;
  };
  CliTempDir dir;
  for (const Case& c : {Case{"0", "0", 6}, Case{"1", "0", 6}, Case{"1", "4", 9}}) {
    const std::string out = dir.path(std::string("out") + c.overlap + c.warmup);
    const CommandResult r =
        RunJob(3, kConfig,
               {"train.batch_size=16", "train.epochs=3", "train.max_steps=23",
                "data.train_limit=480", "data.test_limit=300", "train.local_steps=4",
                std::string("train.outer_overlap=") + c.overlap,
                std::string("train.sync_warmup_steps=") + c.warmup},
               {"--out", out});
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find(std::string("outer loop every 4 steps after ") + c.warmup +
                         " synchronous ones (NESTEROV lr 0.7 momentum 0.9, "),
              std::string::npos)
        << r.out;
    std::ifstream file(out + "/summary.json");
    ASSERT_TRUE(file);
    const auto summary = nlohmann::json::parse(file);
    EXPECT_EQ(summary.at("steps").get<int64_t>(), 23);
    EXPECT_EQ(summary.at("details").at("local_steps").get<int64_t>(), 4);
    EXPECT_EQ(summary.at("details").at("rounds").get<int64_t>(), c.rounds);
    EXPECT_EQ(summary.at("details").at("outer_overlap").get<int>(), c.overlap[0] - '0');
    std::ifstream metrics(out + "/metrics.jsonl");
    std::vector<int64_t> steps;
    // The MLP's 235,146 parameters and the loss as float32: 2 (N-1) / N of them sent per round.
    const double round_bytes = 235147 * 4 * 2.0 * 2 / 3;
    for (std::string line; std::getline(metrics, line);) {
      const auto m = nlohmann::json::parse(line);
      steps.push_back(m.at("step").get<int64_t>());
      EXPECT_TRUE(std::isfinite(m.at("test_loss").get<double>())) << line;
      if (c.warmup[0] != '0') continue;
      // At step 10 the rounds up to step 8 are done, at 20 those up to 20; the last, of 3 steps,
      // ends at 23.
      const double per_step = round_bytes / (steps.back() == 23 ? 3 : 4);
      const double wire = m.at("wire_bytes_per_step").get<double>();
      EXPECT_GT(wire, per_step) << line;
      EXPECT_LT(wire, per_step * 1.01) << line;  // plus the chunks' headers
    }
    EXPECT_EQ(steps, (std::vector<int64_t>{10, 20, 23}));
  }
}

// The --timeline window counts the job's steps, which under the outer loop are inner steps.
// Before, the trainer told the recorder its round number: steps [10, 18) of a 24-step run of
// rounds of 4 (8 rounds) recorded nothing. Now each inner step's forward and backward are
// under that step (inside an "inner_step" span with its update), and a round's AllReduce under
// its last inner step. 2 synchronous steps first: rounds end at steps 0, 1, 5, 9, 13, 17, 21, 23.
TEST(JobModes, TheOuterLoopTimelineWindowCountsInnerSteps) {
  CliTempDir dir;
  const std::string tl = dir.path("outer.json");
  const CommandResult r = RunJob(
      2, kConfig,
      {"train.batch_size=16", "train.epochs=1", "train.max_steps=24", "data.train_limit=960",
       "data.test_limit=200", "train.local_steps=4", "train.sync_warmup_steps=2"},
      {"--timeline", tl, "--timeline-first-step", "10", "--timeline-steps", "8"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::set<int64_t> forward, inner, allreduce;
  for (const Span& s : ReadSpans(tl)) {
    if (s.rank != 0) continue;
    if (s.name == "forward") forward.insert(s.step);
    if (s.name == "inner_step") inner.insert(s.step);  // forward, backward and inner update
    if (s.name == "allreduce") allreduce.insert(s.step);
  }
  const std::set<int64_t> window = {10, 11, 12, 13, 14, 15, 16, 17};
  EXPECT_EQ(forward, window);
  EXPECT_EQ(inner, window);
  EXPECT_EQ(allreduce, (std::set<int64_t>{13, 17}));
}

// Issue 45: SDPIPE and the pipeline stages trained, then the merge failed ("cannot read
// ...rank0.json"): only RING and PS wrote a timeline.
TEST(JobModes, EveryModeWritesATimelineWithSpansOfEachRank) {
  struct Case {
    const char* name;
    int np;
    std::string config;
    std::vector<std::string> sets;
  };
  const std::vector<Case> cases = {
      {"RING", 2, kConfig, {}},
      {"PS_SYNC", 3, kConfig, {"train.mode=PS_SYNC"}},
      {"PS_ASYNC", 3, kConfig, {"train.mode=PS_ASYNC"}},
      {"SDPIPE", 2, kConfig, {"train.mode=SDPIPE"}},
      {"pipeline", 2, kPipelineConfig, {"sdpipe.min_group=1"}},
      {"outer loop", 2, kConfig, {"train.local_steps=4", "train.outer_overlap=1"}},
  };
  CliTempDir dir;
  for (const Case& c : cases) {
    std::vector<std::string> sets = {"train.batch_size=16", "train.epochs=1", "train.max_steps=12",
                                     "data.train_limit=960", "data.test_limit=200"};
    sets.insert(sets.end(), c.sets.begin(), c.sets.end());
    const std::string tl = dir.path(std::string(c.name) + ".json");
    // Every step: an SDPIPE rank's local steps differ from the job's global ones, and its last
    // barrier (where every rank averages) may lie past step 12.
    const CommandResult r =
        RunJob(c.np, c.config, sets,
               {"--timeline", tl, "--timeline-first-step", "0", "--timeline-steps", "1000"});
    EXPECT_EQ(r.exit_code, 0) << c.name << "\n" << r.out << r.err;
    if (r.exit_code != 0) continue;
    std::map<int, std::set<std::string>> names;
    for (const Span& s : ReadSpans(tl)) names[s.rank].insert(s.name);
    for (int rank = 0; rank < c.np; ++rank) {
      EXPECT_FALSE(names[rank].empty()) << c.name << ": no span of rank " << rank;
    }
    if (std::string(c.name) == "SDPIPE") {
      for (const char* name : {"forward", "backward", "update", "average"}) {
        EXPECT_EQ(names[0].count(name), 1u) << "SDPIPE: no " << name << " span";
      }
    }
    if (std::string(c.name) == "pipeline") {
      for (const char* name : {"forward", "backward", "update", "recv"}) {
        EXPECT_EQ(names[1].count(name), 1u) << "pipeline stage 1: no " << name << " span";
      }
    }
  }
}

// Issue 45: PS_SYNC, PS_ASYNC, SDPIPE and the pipeline stages trained on the CPU without a word;
// RING (on this machine without a GPU) failed only in its ranks, after they started.
TEST(JobModes, CudaIsRefusedBeforeAnyRankStartsWhereItCannotRun) {
  const CommandResult info = RunCommand({kBinary, "info"});
  const bool gpu_here = info.out.find("no CUDA device") == std::string::npos &&
                        info.out.find("backend not built") == std::string::npos;
  struct Case {
    const char* name;
    std::string config;
    std::vector<std::string> sets;
    const char* mode;
  };
  std::vector<Case> cases = {
      {"PS_SYNC", kConfig, {"train.mode=PS_SYNC"}, "train.mode = PS_SYNC"},
      {"PS_ASYNC", kConfig, {"train.mode=PS_ASYNC"}, "train.mode = PS_ASYNC"},
      {"SDPIPE", kConfig, {"train.mode=SDPIPE"}, "train.mode = SDPIPE"},
      {"pipeline", kPipelineConfig, {"sdpipe.min_group=1"}, "pipeline stages (train.mode = SDPIPE"},
  };
  if (!gpu_here) cases.push_back({"RING", kConfig, {}, "model.device = CUDA"});
  for (const Case& c : cases) {
    std::vector<std::string> sets = {"model.device=CUDA", "train.max_steps=5",
                                     "data.train_limit=960", "data.test_limit=200"};
    sets.insert(sets.end(), c.sets.begin(), c.sets.end());
    const CommandResult r = RunJob(2, c.config, sets);
    EXPECT_NE(r.exit_code, 0) << c.name << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("model.device"), std::string::npos) << c.name << "\n" << r.err;
    EXPECT_NE(r.err.find(c.mode), std::string::npos) << c.name << "\n" << r.err;
    EXPECT_EQ((r.out + r.err).find("[rank "), std::string::npos) << c.name << ": a rank started\n"
                                                                 << r.out << r.err;
  }
}

// Issue 45: the default window was steps 0-19, all inside a width-2 job's synchronous warm-up
// (50 steps by default), so the trace showed no overlap. 20 warm-up steps here: the old default
// window lies entirely within them.
TEST(JobModes, DefaultTimelineOfPipeSgdShowsTheOverlapAfterTheWarmUp) {
  CliTempDir dir;
  const std::string tl = dir.path("tl.json");
  CommandResult r = RunJob(
      2, kConfig,
      {"train.pipeline_width=2", "train.sync_warmup_steps=20", "train.batch_size=16",
       "train.epochs=1", "train.max_steps=60", "data.train_limit=1920", "data.test_limit=200"},
      {"--timeline", tl});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<Span> spans = ReadSpans(tl);
  std::map<int, std::set<int64_t>> steps;
  for (const Span& s : spans) steps[s.rank].insert(s.step);
  bool overlap = false;
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_FALSE(steps[rank].empty()) << rank;
    EXPECT_GE(*steps[rank].begin(), 20) << "rank " << rank << " recorded warm-up steps";
    EXPECT_EQ(steps[rank].size(), 20u) << rank;
  }
  // Step t's AllReduce still running when step t+1's compute began (as tests/timeline_test.cc).
  for (const Span& ar : spans) {
    if (ar.name != "allreduce") continue;
    for (const Span& c : spans) {
      if (c.rank == ar.rank && (c.name == "forward" || c.name == "backward") &&
          c.step == ar.step + 1 && c.begin < ar.end) {
        overlap = true;
      }
    }
  }
  EXPECT_TRUE(overlap) << "no AllReduce overlapped the next step's compute";

  // A run shorter than the warm-up and the window: its last steps, not nothing.
  r = RunJob(
      2, kConfig,
      {"train.pipeline_width=2", "train.sync_warmup_steps=20", "train.batch_size=16",
       "train.epochs=1", "train.max_steps=12", "data.train_limit=1920", "data.test_limit=200"},
      {"--timeline", tl, "--timeline-steps", "5"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  steps.clear();
  for (const Span& s : ReadSpans(tl)) steps[s.rank].insert(s.step);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(steps[rank], (std::set<int64_t>{7, 8, 9, 10, 11})) << rank;
  }
}

}  // namespace
}  // namespace pipesgd
