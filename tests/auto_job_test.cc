// Jobs with auto values (train.pipeline_width, comm.chunk_bytes, comm.streams = auto) end to end:
// `pipesgd run` on this machine, checked against the same job with the chosen values written out.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace pipesgd {
namespace {

using testing::RunCommand;

struct TempDir : testing::TempDir {
  TempDir() : testing::TempDir("pipesgd_auto_job") {}
};

const std::string kBinary = PIPESGD_BINARY;
const std::string kConfig = std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_mlp.pbtxt";
// Short, and compressed with error feedback: a tuning that moved the job ring's sequence or
// residual, or a chunk size other than the one reported, would change the bits.
const std::vector<std::string> kJob = {
    "--set", "data.train_limit=6000", "--set", "data.test_limit=500", "--set", "train.epochs=1",
    "--set", "train.eval_every_steps=10", "--set", "train.sync_warmup_steps=5",
    "--set", "comm.compression=q8", "--set", "comm.error_feedback=true",
    "--set", "comm.warmup_steps=0"};
const std::vector<std::string> kAuto = {"--set", "train.pipeline_width=auto", "--set",
                                        "comm.chunk_bytes=auto", "--set", "comm.streams=auto"};

std::vector<std::string> Cmd(std::vector<std::string> head,
                             std::initializer_list<const std::vector<std::string>*> parts) {
  for (const auto* p : parts) head.insert(head.end(), p->begin(), p->end());
  return head;
}

nlohmann::json Summary(const std::string& dir) {
  std::ifstream f(dir + "/summary.json");
  return nlohmann::json::parse(f);
}

// Every evaluation's losses and accuracy, as written (the floats' text round-trips).
std::vector<std::string> Metrics(const std::string& dir) {
  std::ifstream f(dir + "/metrics.jsonl");
  std::vector<std::string> out;
  for (std::string line; std::getline(f, line);) {
    const auto m = nlohmann::json::parse(line);
    out.push_back(m.at("train_loss").dump() + " " + m.at("test_loss").dump() + " " +
                  m.at("test_accuracy").dump());
  }
  return out;
}

TEST(AutoJob, TrainsTheSameBitsAsItsChoicesWrittenInTheConfig) {
  TempDir dir;
  const std::string auto_dir = dir.path("auto");
  auto r = RunCommand(Cmd({kBinary, "run", "-np", "3", kConfig, "--out", auto_dir}, {&kJob, &kAuto}),
                      {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] auto: comm.chunk_bytes = "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 0] auto: train.pipeline_width = "), std::string::npos) << r.out;
  const nlohmann::json details = Summary(auto_dir).at("details");
  const nlohmann::json chosen = details.at("auto").at("chosen");
  const int width = chosen.at("pipeline_width");
  const uint64_t chunk = chosen.at("chunk_bytes");
  const int streams = chosen.at("streams");
  EXPECT_TRUE(width == 1 || width == 2) << details.dump();
  EXPECT_TRUE(streams == 1 || streams == 2) << details.dump();
  EXPECT_EQ(details.at("pipeline_width"), width);
  EXPECT_EQ(details.at("chunk_bytes"), chunk);
  EXPECT_EQ(details.at("streams"), streams);
  EXPECT_EQ(details.at("auto").at("widths").size(), 2u);
  // 4 chunk sizes x 2 streams; on 3 ranks the MLP's blocks are 313529 bytes, so 1 MiB and 4 MiB
  // cut them alike (one chunk) and 4 MiB is not timed.
  EXPECT_EQ(details.at("auto").at("allreduce").size(), 6u) << details.dump();
  // The job's connections start their congestion control afresh after the tuning: the
  // machine's default algorithm ("" for reno, which keeps no state). The bits below are the
  // untuned job's all the same.
  std::string cc;
  std::ifstream("/proc/sys/net/ipv4/tcp_congestion_control") >> cc;
  EXPECT_EQ(details.at("auto").at("congestion_restarted"), cc == "reno" ? "" : cc)
      << details.dump();

  const std::string manual_dir = dir.path("manual");
  const std::vector<std::string> chosen_sets = {
      "--set", "train.pipeline_width=" + std::to_string(width),
      "--set", "comm.chunk_bytes=" + std::to_string(chunk),
      "--set", "comm.streams=" + std::to_string(streams)};
  r = RunCommand(
      Cmd({kBinary, "run", "-np", "3", kConfig, "--out", manual_dir}, {&kJob, &chosen_sets}), {},
      300);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(Summary(manual_dir).at("details").at("auto").is_null());
  const auto auto_metrics = Metrics(auto_dir);
  EXPECT_GE(auto_metrics.size(), 3u);
  EXPECT_EQ(auto_metrics, Metrics(manual_dir));
}

// A checkpoint records the values in effect; --resume keeps them instead of measuring again
// (here of a finished run: nothing is left to train, the choice is still the checkpoint's).
TEST(AutoJob, AResumeKeepsTheCheckpointsChoices) {
  TempDir dir;
  const std::vector<std::string> ckpt = {"--set", "checkpoint.dir=" + dir.path("ckpt"), "--set",
                                         "checkpoint.every_steps=20"};
  const std::vector<std::string> first = {"--set", "train.max_steps=40"};
  auto r = RunCommand(Cmd({kBinary, "run", "-np", "2", kConfig, "--out", dir.path("a")},
                          {&kJob, &kAuto, &ckpt, &first}),
                      {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json chosen = Summary(dir.path("a")).at("details").at("auto").at("chosen");
  const std::vector<std::string> more = {"--set", "train.max_steps=40", "--resume"};
  r = RunCommand(Cmd({kBinary, "run", "-np", "2", kConfig, "--out", dir.path("a")},
                     {&kJob, &kAuto, &ckpt, &more}),
                 {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("auto: kept the checkpoint's"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("auto: tuned in"), std::string::npos) << r.out;
  const nlohmann::json resumed = Summary(dir.path("a")).at("details").at("auto");
  EXPECT_EQ(resumed.at("chosen"), chosen);
  EXPECT_EQ(resumed.at("from_checkpoint"), true);
}

}  // namespace
}  // namespace pipesgd
