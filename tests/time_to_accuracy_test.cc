// Time to accuracy in every training mode, through the CLI: train.eval_every_steps puts one
// metrics line per evaluation (step, epoch, wall_s, test loss and accuracy), train.target_accuracy
// stops every rank at the first evaluation that reaches it, and summary.json has the same
// top-level keys in every mode, with reached_target, steps_to_target and time_to_target_s as
// numbers.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/subprocess.h"

namespace pipesgd {
namespace {

using testing::RunCommand;
namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    static int n = 0;
    path_ = fs::temp_directory_path() /
            ("pipesgd_tta_" + std::to_string(getpid()) + "_" + std::to_string(n++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string path(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

constexpr const char* kBinary = PIPESGD_BINARY;
const std::string kMlp = std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_mlp.pbtxt";
const std::string kMlpPipeline =
    std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_mlp_pipeline.pbtxt";

struct ModeCase {
  const char* name;
  std::string config;
  int np;
  std::vector<std::string> sets;
  int workers;  // ranks computing gradients of separate samples (global batch = 16 x this)
};

std::vector<ModeCase> Modes() {
  return {{"RING", kMlp, 4, {"train.mode=RING"}, 4},
          {"RING_WIDTH1", kMlp, 4, {"train.mode=RING", "train.pipeline_width=1"}, 4},
          {"PS_SYNC", kMlp, 5, {"train.mode=PS_SYNC"}, 4},
          {"PS_ASYNC", kMlp, 5, {"train.mode=PS_ASYNC"}, 4},
          {"SDPIPE", kMlp, 4, {"train.mode=SDPIPE"}, 4},
          {"SDPIPE_STAGES", kMlpPipeline, 4, {}, 2}};  // 2 stages x 2 pipelines
}

std::vector<nlohmann::json> MetricLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

std::set<std::string> Keys(const nlohmann::json& j) {
  std::set<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.insert(k);
  return keys;
}

// 2 epochs of 8000 samples at batch 16: 125 steps per epoch with 4 workers, 250 with 2
// pipelines. An evaluation every 40 steps; a target of 0.7, which each mode reaches within the
// first epoch, so every run stops early at an evaluation point.
TEST(TimeToAccuracy, EveryModeEvaluatesEveryNStepsStopsAtTheTargetAndReportsAlike) {
  std::set<std::string> summary_keys;
  for (const ModeCase& mode : Modes()) {
    TempDir dir;
    std::vector<std::string> argv = {kBinary, "run", "-np", std::to_string(mode.np), mode.config,
                                     "--out", dir.path("out")};
    for (std::string s : {"data.train_limit=8000", "data.test_limit=1000", "train.epochs=2",
                          "train.batch_size=16", "train.progress_per_epoch=0",
                          "train.eval_every_steps=40", "train.target_accuracy=0.7"}) {
      argv.push_back("--set");
      argv.push_back(s);
    }
    for (const auto& s : mode.sets) {
      argv.push_back("--set");
      argv.push_back(s);
    }
    auto r = RunCommand(argv, {}, 300);
    ASSERT_EQ(r.exit_code, 0) << mode.name << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("target 0.7000 reached at step"), std::string::npos) << mode.name << r.out;

    const auto lines = MetricLines(dir.path("out/metrics.jsonl"));
    ASSERT_FALSE(lines.empty()) << mode.name;
    const int64_t per_epoch = 8000 / (16 * mode.workers);
    double previous_wall = 0;
    for (size_t i = 0; i < lines.size(); ++i) {
      const auto& m = lines[i];
      for (const char* key : {"step", "epoch", "epoch_end", "wall_s", "eval_s", "train_loss",
                              "test_loss", "test_accuracy", "samples_per_s"}) {
        EXPECT_TRUE(m.contains(key)) << mode.name << ": metrics line " << i << " has no " << key;
      }
      const int64_t step = m.at("step").get<int64_t>();
      // Every 40 steps or an epoch's end (SDPIPE's barriers end exactly there too).
      EXPECT_TRUE(step % 40 == 0 || step % per_epoch == 0) << mode.name << " step " << step;
      EXPECT_EQ(m.at("epoch").get<int>(), step <= per_epoch ? 1 : 2) << mode.name;
      EXPECT_GE(m.at("wall_s").get<double>(), previous_wall) << mode.name;
      previous_wall = m.at("wall_s").get<double>();
      // Every evaluation before the last is below the target; the last reaches it.
      if (i + 1 < lines.size()) {
        EXPECT_LT(m.at("test_accuracy").get<double>(), 0.7) << mode.name << " step " << step;
      }
    }
    const auto& last = lines.back();
    EXPECT_GE(last.at("test_accuracy").get<double>(), 0.7) << mode.name;

    std::ifstream summary_file(dir.path("out/summary.json"));
    ASSERT_TRUE(summary_file) << mode.name;
    const auto s = nlohmann::json::parse(summary_file);
    EXPECT_TRUE(s.at("reached_target").get<bool>()) << mode.name;
    EXPECT_TRUE(s.at("steps_to_target").is_number_integer()) << mode.name;
    EXPECT_TRUE(s.at("time_to_target_s").is_number()) << mode.name;
    EXPECT_EQ(s.at("steps_to_target"), last.at("step")) << mode.name;
    EXPECT_DOUBLE_EQ(s.at("time_to_target_s").get<double>(), last.at("wall_s").get<double>())
        << mode.name;
    EXPECT_DOUBLE_EQ(s.at("final_test_accuracy").get<double>(),
                     last.at("test_accuracy").get<double>()) << mode.name;
    EXPECT_LT(s.at("steps").get<int64_t>(), 2 * per_epoch) << mode.name << ": stopped early";
    EXPECT_EQ(s.at("target_accuracy").get<double>(), 0.7) << mode.name;
    EXPECT_EQ(s.at("global_batch").get<int64_t>(), 16 * mode.workers) << mode.name;
    EXPECT_EQ(s.at("evaluations").get<int64_t>(), static_cast<int64_t>(lines.size())) << mode.name;
    // The steady time per step: the steps after the default train.sync_warmup_steps (50) and 10
    // more, within the training time.
    const int64_t steps = s.at("steps").get<int64_t>();
    EXPECT_EQ(s.at("steady_steps").get<int64_t>(), std::max<int64_t>(0, steps - 60)) << mode.name;
    if (steps > 60) {
      EXPECT_GT(s.at("steady_step_s").get<double>(), 0.0) << mode.name;
      EXPECT_LE(s.at("steady_step_s").get<double>() * static_cast<double>(steps - 60),
                s.at("train_wall_s").get<double>())
          << mode.name;
    }
    const std::set<std::string> keys = Keys(s);
    if (summary_keys.empty()) summary_keys = keys;
    EXPECT_EQ(keys, summary_keys) << mode.name << ": summary.json keys differ from RING's";
  }
}

// Without a target the run goes to the end and says so with numbers, not strings.
TEST(TimeToAccuracy, ATargetNotReachedIsFalseAndMinusOne) {
  TempDir dir;
  auto r = RunCommand({kBinary, "run", "-np", "2", kMlp, "--set", "data.train_limit=2000",
                       "--set", "data.test_limit=500", "--set", "train.epochs=1", "--set",
                       "train.batch_size=16", "--set", "train.progress_per_epoch=0", "--set",
                       "train.target_accuracy=0.99", "--out", dir.path("out")},
                      {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("target 0.9900 not reached"), std::string::npos) << r.out;
  std::ifstream summary_file(dir.path("out/summary.json"));
  const auto s = nlohmann::json::parse(summary_file);
  EXPECT_FALSE(s.at("reached_target").get<bool>());
  EXPECT_EQ(s.at("steps_to_target").get<int64_t>(), -1);
  EXPECT_EQ(s.at("time_to_target_s").get<double>(), -1.0);
  EXPECT_EQ(s.at("steps").get<int64_t>(), 2000 / 32);
}

}  // namespace
}  // namespace pipesgd
