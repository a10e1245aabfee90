// `pipesgd report` over the headline experiment's saved runs (docs/results/time_to_accuracy:
// the MLP at 100mbit, seed 1): the table's times to accuracy are the ones the README quotes,
// computed from the metrics lines; the plot is a PNG; bad runs are named.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace pipesgd {
namespace {

using testing::RunCommand;

struct TempDir : testing::TempDir {
  TempDir() : testing::TempDir("pipesgd_report") {}
};

const std::string kBinary = PIPESGD_BINARY;
const std::string kRuns = std::string(PIPESGD_SOURCE_DIR) + "/docs/results/time_to_accuracy/mlp/100mbit/";

TEST(Report, HeadlineRunsSideBySide) {
  TempDir dir;
  const std::string png = dir.path("tta.png");
  const auto r = RunCommand({kBinary, "report", kRuns + "ddp.metrics.jsonl", kRuns + "ring_k1",
                             kRuns + "ring_k2_plain", kRuns + "ring_k2", kRuns + "ring_k2_q8",
                             "--target", "0.85", "--target", "0.87", "--png", png});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* line : {
           "| run | mode | width | codec | transport | launcher | samples/s | time to 0.85 (s) | "
           "time to 0.87 (s) | final accuracy | speedup to 0.85 vs ddp |\n",
           "| ddp | - | - | - | - | - | 2162 | 29.6 | 83.0 | 0.8759 | 1.00x |\n",
           "| ring_k1 | RING | 1 | none | tcp | - | 2166 | 47.2 | 82.7 | 0.8641 | 0.63x |\n",
           "| ring_k2_plain | RING | 2 | none | tcp | - | 2166 | never | never | 0.8297 | - |\n",
           "| ring_k2 | RING | 2 | none | tcp | - | 2166 | 35.4 | 83.0 | 0.8705 | 0.84x |\n",
           "| ring_k2_q8 | RING | 2 | q8 EF | tcp | - | 8543 | 9.0 | 21.0 | 0.8728 | 3.30x |\n"}) {
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  }
  std::ifstream in(png, std::ios::binary);
  char magic[8] = {};
  in.read(magic, 8);
  EXPECT_EQ(std::string(magic, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << png;
}

TEST(Report, RunsOfTheSameNameAreToldApartByPath) {
  const std::string other =
      std::string(PIPESGD_SOURCE_DIR) + "/docs/results/time_to_accuracy/mlp/1gbit/ring_k2";
  const auto r = RunCommand({kBinary, "report", kRuns + "ring_k2", other, "--png", ""});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("| " + kRuns + "ring_k2 | RING | 2 |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| " + other + " | RING | 2 |"), std::string::npos) << r.out;
}

TEST(Report, BadRunsAreNamed) {
  TempDir dir;
  std::filesystem::create_directories(dir.path("empty"));
  auto r = RunCommand({kBinary, "report", dir.path("empty"), "--png", ""});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("cannot read " + dir.path("empty") + "/metrics.jsonl (expected a --out "
                       "directory or a metrics.jsonl file)"),
            std::string::npos)
      << r.err;
  const std::string bad = dir.File("bad.jsonl", "{\"wall_s\": 1, \"test_accuracy\": 0.5}\nnope\n");
  r = RunCommand({kBinary, "report", bad, "--png", ""});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(bad + " line 2: expected a metrics object"), std::string::npos) << r.err;
  const std::string empty = dir.File("empty.jsonl", "");
  r = RunCommand({kBinary, "report", empty, "--png", ""});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("report: " + empty + ": no evaluations (an empty metrics.jsonl)"),
            std::string::npos)
      << r.err;
  r = RunCommand({kBinary, "report", kRuns + "ring_k2", "--target", "85", "--png", ""});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--target 85: expected an accuracy in (0, 1]"), std::string::npos) << r.err;
}

// Every field report reads is checked where it is read: a bad one names the file, the field, the
// value and what was expected (a null target_accuracy once gave "unexpected failure: stod").
TEST(Report, BadFieldsAreNamedWithTheirFile) {
  TempDir dir;
  const std::string line = "{\"wall_s\": 1, \"test_accuracy\": 0.5}\n";
  auto run = [&](const std::string& name, const std::string& summary) {
    std::filesystem::create_directories(dir.path(name));
    dir.File(name + "/metrics.jsonl", line);
    dir.File(name + "/summary.json", summary);
    return RunCommand({kBinary, "report", dir.path(name), "--png", ""});
  };
  struct Case {
    const char* summary;
    std::string expected;
  };
  for (const Case& c : {
           Case{"{\"target_accuracy\": null}", "field target_accuracy is null; expected an "
                                               "accuracy in [0, 1] (0: no target)"},
           Case{"{\"target_accuracy\": \"0.9\"}", "field target_accuracy is \"0.9\"; expected "
                                                  "an accuracy in [0, 1] (0: no target)"},
           Case{"{\"target_accuracy\": 85}", "field target_accuracy is 85; expected an accuracy "
                                             "in [0, 1] (0: no target)"},
           Case{"{\"train_wall_s\": 10, \"global_batch\": 64}",
                "field steps is missing; expected an integer >= 0"},
           Case{"{\"mode\": 3}", "field mode is 3; expected a string"}}) {
    const auto r = run("run", c.summary);
    EXPECT_EQ(r.exit_code, 1) << c.summary;
    EXPECT_NE(r.err.find("report: " + dir.path("run") + "/summary.json: " + c.expected),
              std::string::npos)
        << c.summary << "\n" << r.err;
  }
  const std::string bad = dir.File("bad.jsonl", line + "{\"wall_s\": 2}\n");
  auto r = RunCommand({kBinary, "report", bad, "--png", ""});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("report: " + bad + " line 2: field test_accuracy is missing; expected an "
                       "accuracy in [0, 1]"),
            std::string::npos)
      << r.err;
  const std::string null_time =
      dir.File("null.jsonl", "{\"wall_s\": null, \"test_accuracy\": 1}\n");
  r = RunCommand({kBinary, "report", null_time, "--png", ""});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("report: " + null_time + " line 1: field wall_s is null; expected a number "
                       "of seconds in [0, 1e9]"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace pipesgd
