// Every phase x every victim (issue: start-up failures told as precisely as mid-job ones): 4
// ranks started by hand, as `pipesgd worker` with RANK/WORLD_SIZE/MASTER_*; one of them is
// killed (SIGKILL) or fails with an error (PIPESGD_FAULT, core/job/fault.h) at the rendezvous,
// at ring set-up, before the first AllReduce or mid-training. Every survivor must name the
// victim ("the job failed because of rank V"), exit with kExitBecauseOfAnotherRank (3), and do
// so within comm.start_timeout_s / comm.timeout_s + 1 s of the victim's end. Before the failure
// relay, ranks blamed whichever neighbour closed first.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "tests/support/multiproc.h"
#include "tests/support/subprocess.h"

namespace pipesgd {
namespace {

const std::string kBinary = PIPESGD_BINARY;
const std::string kConfig = std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_mlp.pbtxt";
constexpr int kWorld = 4;
constexpr double kTimeoutS = 4;  // comm.start_timeout_s and comm.timeout_s

struct Case {
  int victim;
  const char* phase;  // PIPESGD_FAULT's PHASE
  const char* action;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  std::string phase = info.param.phase;
  for (char& c : phase) {
    if (c == ':') c = '_';
  }
  return fmt::format("rank{}_{}_{}", info.param.victim, phase, info.param.action);
}

std::string LastErrorLine(const std::string& err) {
  std::string last;
  size_t at = 0;
  while (at < err.size()) {
    size_t end = err.find('\n', at);
    if (end == std::string::npos) end = err.size();
    const std::string line = err.substr(at, end - at);
    if (line.rfind("error: ", 0) == 0) last = line;
    at = end + 1;
  }
  return last;
}

// Rank `rank` of a short 4-rank job started by hand, with PIPESGD_FAULT = `fault`.
testing::CommandResult RunRank(int rank, uint16_t port, const std::string& fault,
                               double timeout_s) {
  return testing::RunCommand(
      {kBinary, "worker", kConfig, "--set", "train.epochs=1", "--set", "train.max_steps=8",
       "--set", "data.train_limit=2048", "--set", "data.test_limit=256", "--set",
       fmt::format("comm.start_timeout_s={}", kTimeoutS), "--set",
       fmt::format("comm.timeout_s={}", kTimeoutS)},
      {{"RANK", std::to_string(rank)},
       {"WORLD_SIZE", std::to_string(kWorld)},
       {"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", std::to_string(port)},
       {"PIPESGD_JOB_TOKEN", "0123456789abcdef0123456789abcdef"},
       {"PIPESGD_FAULT", fault}},
      timeout_s);
}

class StartupFailure : public ::testing::TestWithParam<Case> {};

TEST_P(StartupFailure, EverySurvivorNamesTheVictimInTime) {
  const Case c = GetParam();
  const uint16_t port = testing::FreePort();
  const std::string fault = fmt::format("{}:{}:{}", c.victim, c.phase, c.action);
  struct Outcome {
    testing::CommandResult result;
    double end_s = 0;
  };
  std::vector<Outcome> outcomes(kWorld);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      outcomes[r].result = RunRank(r, port, fault, 60);
      outcomes[r].end_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  for (auto& t : ranks) t.join();

  const Outcome& victim = outcomes[c.victim];
  if (std::string(c.action) == "kill") {
    EXPECT_EQ(victim.result.exit_code, 128 + 9) << victim.result.err;
  } else {
    EXPECT_EQ(victim.result.exit_code, 1) << victim.result.err;
    EXPECT_NE(LastErrorLine(victim.result.err).find("injected failure"), std::string::npos)
        << victim.result.err;
  }
  const std::string named = fmt::format("the job failed because of rank {}: ", c.victim);
  for (int r = 0; r < kWorld; ++r) {
    if (r == c.victim) continue;
    const Outcome& o = outcomes[r];
    const std::string line = LastErrorLine(o.result.err);
    std::printf("%s rank %d (%.1f s after the victim): %s\n", fault.c_str(), r,
                o.end_s - victim.end_s, line.c_str());
    EXPECT_FALSE(o.result.timed_out) << "rank " << r;
    EXPECT_EQ(o.result.exit_code, 3) << "rank " << r << ": " << o.result.err;
    EXPECT_EQ(line.rfind(fmt::format("error: rank {}: {}", r, named), 0), 0u)
        << "rank " << r << ": " << o.result.err;
    EXPECT_LE(o.end_s - victim.end_s, kTimeoutS + 1.0) << "rank " << r << ": " << line;
  }
}

// A rank that stops (SIGSTOP: the whole process) or hangs (its main thread) mid-training
// neither exits nor reports: every rank around it times out at about the same moment, each
// waiting on its own left neighbour. The relay must still name the silent rank on every rank,
// not each rank's neighbour (before it, ranks named whichever neighbour they waited on).
class StalledRank : public ::testing::TestWithParam<Case> {};

TEST_P(StalledRank, EverySurvivorNamesTheSilentRank) {
  const Case c = GetParam();
  const uint16_t port = testing::FreePort();
  const std::string fault = fmt::format("{}:{}:{}", c.victim, c.phase, c.action);
  std::vector<testing::CommandResult> results(kWorld);
  std::vector<double> end_s(kWorld);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      // The silent rank never ends by itself: its command's timeout kills it.
      results[r] = RunRank(r, port, fault, r == c.victim ? 3 * kTimeoutS : 60);
      end_s[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_TRUE(results[c.victim].timed_out) << results[c.victim].err;
  const std::string named = fmt::format("the job failed because of rank {}: ", c.victim);
  for (int r = 0; r < kWorld; ++r) {
    if (r == c.victim) continue;
    const std::string line = LastErrorLine(results[r].err);
    std::printf("%s rank %d (ended %.1f s after start): %s\n", fault.c_str(), r, end_s[r],
                line.c_str());
    EXPECT_EQ(results[r].exit_code, 3) << "rank " << r << ": " << results[r].err;
    EXPECT_EQ(line.rfind(fmt::format("error: rank {}: {}", r, named), 0), 0u)
        << "rank " << r << ": " << results[r].err;
    // Start-up, the collective's timeout, the relay's windows (at most kReportWaitS): before
    // the victim's kill.
    EXPECT_LT(end_s[r], 3 * kTimeoutS - 0.5) << "rank " << r;
  }
}

std::vector<Case> StallCases() {
  std::vector<Case> cases;
  for (int v = 0; v < kWorld; ++v) cases.push_back({v, "step:4", "stop"});
  // A hung main thread: rank 0's relay thread still runs (victim 0), or not the relay's host.
  for (int v : {0, 2}) cases.push_back({v, "step:4", "hang"});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(MidTraining, StalledRank, ::testing::ValuesIn(StallCases()), Name);

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const char* phase : {"rendezvous", "ring_setup", "first_allreduce", "step:4"}) {
    for (const char* action : {"kill", "exit"}) {
      for (int v = 0; v < kWorld; ++v) cases.push_back({v, phase, action});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(PhaseByVictim, StartupFailure, ::testing::ValuesIn(AllCases()), Name);

}  // namespace
}  // namespace pipesgd
