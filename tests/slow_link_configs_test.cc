// The configs shipped for slow links (issue 49), run as shipped on 4 local ranks: the outer loop
// with its settings as the config states them, to the accuracy the spread over seeds and CPU
// kernels allows. What they buy on a slow link is measured on the emulated lab
// (docs/outer_loop.md, "Measured"), not here: loopback has no slow link.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/support/cli.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace pipesgd {
namespace {

using testing::RunCommand;
using testing::kBinary;
using TempDir = testing::CliTempDir;

struct Shipped {
  const char* config;
  const char* outer_optimizer;
  bool reset_inner_momentum;
  int epochs;
  double min_accuracy;  // from the spread over seeds and kernels (see each bound's comment)
};

nlohmann::json RunShipped(const Shipped& s, TempDir& dir) {
  const std::string config = std::string(PIPESGD_SOURCE_DIR) + "/configs/" + s.config;
  auto r = RunCommand({kBinary, "run", "-np", "4", config, "--set", "train.progress_per_epoch=0",
                       "--out", dir.path("out")},
                      {}, 600);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream file(dir.path("out/summary.json"));
  if (!file) {
    ADD_FAILURE() << "no summary.json\n" << r.out << r.err;
    return {};
  }
  return nlohmann::json::parse(file);
}

void ExpectTheOuterLoopAsShipped(const nlohmann::json& summary, const Shipped& s) {
  ASSERT_FALSE(summary.is_null());
  const auto& details = summary.at("details");
  EXPECT_EQ(details.at("local_steps"), 16);
  EXPECT_EQ(details.at("sync_warmup_steps"), 0);
  EXPECT_EQ(details.at("outer_optimizer"), s.outer_optimizer);
  EXPECT_EQ(details.at("reset_inner_momentum"), s.reset_inner_momentum);
  EXPECT_EQ(summary.at("config").at("comm").at("compression"), "q8");
  EXPECT_EQ(summary.at("world_size"), 4);
  // The usual hyper-parameters, unchanged.
  const auto& train = summary.at("config").at("train");
  EXPECT_EQ(train.at("batch_size"), 64);
  EXPECT_DOUBLE_EQ(train.at("learning_rate").get<double>(), 0.05);
  EXPECT_DOUBLE_EQ(train.at("momentum").get<double>(), 0.9);
  EXPECT_EQ(train.at("epochs"), s.epochs);
  const double accuracy = summary.at("final_test_accuracy").get<double>();
  EXPECT_GE(accuracy, s.min_accuracy) << s.config;
  std::printf("%s: final test accuracy %.4f in %.1f s\n", s.config, accuracy,
              summary.at("wall_s").get<double>());
}

// Seeds 1-4, each with this CPU's OpenBLAS kernels and with its Sandybridge ones
// (scripts/slow_link_seeds.sh mlp, 2026-12-08; the same digits as the lab's runs of the same
// seed): 0.8674-0.8737, mean 0.8708, standard deviation 0.0023. Another CPU's kernels move a run
// as another seed does, so the bound is 4 standard deviations below the mean: 0.86 (DDP on the
// lab, seeds 1-3: 0.8717 on average).
TEST(SlowLinkConfigs, TheMlpTrainsAsShipped) {
  TempDir dir;
  const Shipped s{"fashion_mnist_mlp_slow_link.pbtxt", "NESTEROV", true, 3, 0.86};
  ExpectTheOuterLoopAsShipped(RunShipped(s, dir), s);
}

// Seeds 1-3 with this CPU's oneDNN kernels (the lab's runs, the same computation as here) and
// with oneDNN limited to AVX (scripts/slow_link_seeds.sh cnn's older kernels, 2026-12-08):
// 0.8908-0.8958, mean 0.8926, standard deviation 0.0019; 4 standard deviations below the mean is
// 0.885, and the bound 0.88 (DDP on the lab, seeds 1-3: 0.8930 on average). The longest test of
// its tier (about 90 s on 2 cores): the full job, as shipped.
TEST(SlowLinkConfigs, TheCnnTrainsAsShipped) {
  TempDir dir;
  const Shipped s{"fashion_mnist_cnn_slow_link.pbtxt", "AVERAGE", false, 3, 0.88};
  ExpectTheOuterLoopAsShipped(RunShipped(s, dir), s);
}

}  // namespace
}  // namespace pipesgd
