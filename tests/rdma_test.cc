// The rdma tier's end-to-end cases: jobs of the `pipesgd` binary over ibverbs and UCX-verbs on a
// real (soft-RoCE) RDMA port. ctest runs this inside scripts/rdma_vm's QEMU guest (label rdma);
// on a host without an active RDMA port every case skips with the reason.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tests/support/multiproc.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace pipesgd {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::RunCommand;
using testing::TempDir;

const std::string kBinary = PIPESGD_BINARY;
const std::string kConfig = std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_mlp.pbtxt";
// Both ranks on one soft-RoCE device: UCX 1.13's UD (rc_v's wire-up) drops every packet as
// "wrong destination GID" unless the check is off (docs/transports.md).
const std::map<std::string, std::string> kUcxVerbsEnv = {{"UCX_TLS", "rc_v"},
                                                        {"UCX_UD_VERBS_ETH_DGID_CHECK", "n"}};

// A guest under TCG computes many times slower than the host: short jobs on part of the data
// (reading the gzipped IDX files still takes most of their ~15 s).
std::vector<std::string> JobArgs(int ranks, int steps, const std::string& transport,
                                 const std::string& out) {
  return {kBinary, "run", "-np", std::to_string(ranks), kConfig, "--set",
          fmt::format("train.max_steps={}", steps), "--set", "data.train_limit=4096", "--set",
          "data.test_limit=1000", "--set", "comm.transport=" + transport, "--out", out};
}

// "" if an RDMA port is active (as /sys/class/infiniband lists them), else why these cases skip.
std::string NoActivePort() {
  std::error_code ec;
  std::string seen;
  for (const auto& dev : fs::directory_iterator("/sys/class/infiniband", ec)) {
    for (const auto& port : fs::directory_iterator(dev.path() / "ports", ec)) {
      std::ifstream in(port.path() / "state");
      std::string state;
      std::getline(in, state);
      if (state.find("ACTIVE") != std::string::npos) return "";
      seen += " " + dev.path().filename().string() + "/" + port.path().filename().string() + "=" + state;
    }
  }
  return "no active RDMA port here (" + (seen.empty() ? std::string("no devices") : seen) +
         "): the rdma tier runs these in a soft-RoCE guest (ctest -L rdma, scripts/rdma_vm)";
}

class Rdma : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = NoActivePort(); !why.empty()) GTEST_SKIP() << why;
  }
};

struct JobResult {
  double accuracy = 0;
  std::vector<double> losses;
  std::string transport;
};

JobResult Train(const std::string& transport, const std::map<std::string, std::string>& env = {}) {
  TempDir dir;
  std::vector<std::string> args = JobArgs(4, 30, transport, dir.path("out"));
  // An evaluation every 5 steps: 12 losses to compare, not 4.
  args.insert(args.end(), {"--set", "train.eval_every_steps=5"});
  auto r = RunCommand(args, env, 300);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  JobResult run;
  std::ifstream summary_file(dir.path("out/summary.json"));
  if (!summary_file) return run;
  auto summary = nlohmann::json::parse(summary_file);
  run.transport = summary.at("transport").get<std::string>();
  EXPECT_EQ(summary.at("steps"), 30);
  run.accuracy = summary.at("final_test_accuracy").get<double>();
  std::ifstream metrics(dir.path("out/metrics.jsonl"));
  std::string line;
  while (std::getline(metrics, line)) {
    const auto m = nlohmann::json::parse(line);
    run.losses.push_back(m.at("train_loss").get<double>());
    run.losses.push_back(m.at("test_loss").get<double>());
  }
  std::printf("%s: final test accuracy %.6f after 30 steps, %zu losses\n", transport.c_str(),
              run.accuracy, run.losses.size());
  return run;
}

// The ring reduces in the same order whatever moves the bytes: the same job over ibverbs and TCP
// gives the same bits. (Over UCX rc_verbs too, measured once: 0.674000 all three; left out of
// the tier for CI time, since UCX's equality with TCP is tested on loopback in cli_test.)
TEST_F(Rdma, TrainingOverIbverbsEqualsTcpToTheBit) {
  const JobResult tcp = Train("tcp");
  const JobResult ib = Train("ibverbs");
  EXPECT_EQ(tcp.transport, "tcp");
  EXPECT_EQ(ib.transport, "ibverbs");
  ASSERT_FALSE(tcp.losses.empty());
  EXPECT_EQ(ib.accuracy, tcp.accuracy);
  EXPECT_EQ(ib.losses, tcp.losses);
  EXPECT_GT(tcp.accuracy, 0.5);
}

// AUTO picks ibverbs where a port is active, and every rank says so.
TEST_F(Rdma, AutoChoosesIbverbsWhenAPortIsActive) {
  auto r = RunCommand({kBinary, "bench", "allreduce", "-np", "2", "--transport", "auto", "-b",
                       "64K", "-e", "64K", "-n", "2", "-w", "1", "-c"}, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string line =
        fmt::format("# rank {}: comm.transport = AUTO chose ibverbs", rank);  // bench: comments
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  }
  EXPECT_NE(r.out.find("2 ranks, ibverbs"), std::string::npos) << r.out;
}

// The AllReduce bench over each transport on this port, checked (-c): every size exact, in place
// equal to out of place, the same bits on every rank. Prints the rows side by side; on
// soft-RoCE under TCG their times say nothing about a real NIC.
TEST_F(Rdma, BenchAllReduceIsExactOverEveryTransport) {
  struct Case {
    std::string transport;
    std::map<std::string, std::string> env;
  };
  for (const Case& c : std::vector<Case>{{"tcp", {}}, {"ibverbs", {}}, {"ucx", kUcxVerbsEnv}}) {
    TempDir dir;
    auto r = RunCommand({kBinary, "bench", "allreduce", "-np", "3", "--transport", c.transport,
                         "-b", "4K", "-e", "1M", "-f", "4", "-n", "2", "-w", "1", "-c", "--json",
                         dir.path("rows.json")},
                        c.env, 300);
    ASSERT_EQ(r.exit_code, 0) << c.transport << "\n" << r.out << r.err;
    std::ifstream f(dir.path("rows.json"));
    auto rows = nlohmann::json::parse(f);
    ASSERT_EQ(rows.size(), 5u) << c.transport;  // 4K 16K 64K 256K 1M
    for (const auto& row : rows) {
      for (const char* pass : {"out_of_place", "in_place"}) {
        EXPECT_EQ(row.at(pass).at("wrong"), 0) << c.transport << " " << pass << " " << row.dump();
        EXPECT_TRUE(row.at(pass).at("same_bits_on_every_rank").get<bool>()) << c.transport;
      }
      EXPECT_EQ(row.at("in_place").at("differs_from_out_of_place"), 0) << c.transport;
      std::printf("%-8s %9llu B  %10.1f us  busbw %.3f GB/s\n", c.transport.c_str(),
                  static_cast<unsigned long long>(row.at("size_bytes").get<uint64_t>()),
                  row.at("in_place").at("time_us").get<double>(),
                  row.at("in_place").at("busbw_gbs").get<double>());
    }
  }
}

// A user without CAP_IPC_LOCK under a small RLIMIT_MEMLOCK: a clear error naming the limit and
// how to raise it, from every rank, before any traffic.
TEST_F(Rdma, SmallMemlockLimitIsNamedForANonRootUser) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the case as the user nobody";
  TempDir dir;
  fs::permissions(dir.path(), fs::perms::all);  // nobody's HOME
  // A copy nobody can run wherever the build lies (a CI clone may sit in a 0700 directory); the
  // binary links only system libraries.
  const std::string binary = dir.path("pipesgd");
  fs::copy_file(kBinary, binary);
  fs::permissions(binary, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                              fs::perms::others_read | fs::perms::others_exec);
  const std::string cmd =
      fmt::format("ulimit -l 64 && exec {} bench allreduce -np 2 --transport ibverbs -b 64K -e 64K "
                  "-n 1 -w 0",
                  binary);
  auto r = RunCommand({"su", "-s", "/bin/bash", "nobody", "-c", cmd}, {{"HOME", dir.path()}}, 120);
  EXPECT_NE(r.exit_code, 0) << r.out << r.err;
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("RLIMIT_MEMLOCK (ulimit -l) is 65536 bytes (0.1 MiB), but the ibverbs staging "
                     "area needs 527872 bytes (0.5 MiB) of memory pinned for RDMA"),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("raise the limit (ulimit -l unlimited"), std::string::npos) << all;
}

// A rank killed mid-training over ibverbs, ranks started by hand (as under Slurm): every other
// rank fails naming it, seconds after (~8 s at the default comm.ib_timeout and retries), well
// before the 60 s collective deadline.
TEST_F(Rdma, KilledRankIsNamedInTimeOverIbverbs) {
  constexpr int kWorld = 3;
  const uint16_t port = testing::FreePort();
  std::vector<CommandResult> results(kWorld);
  std::vector<double> end_s(kWorld);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      results[r] = RunCommand(
          {kBinary, "worker", kConfig, "--set", "train.max_steps=400", "--set",
           "data.train_limit=4096", "--set", "data.test_limit=256", "--set",
           "comm.transport=ibverbs", "--set", "comm.timeout_s=60"},
          {{"RANK", std::to_string(r)},
           {"WORLD_SIZE", std::to_string(kWorld)},
           {"MASTER_ADDR", "127.0.0.1"},
           {"MASTER_PORT", std::to_string(port)},
           {"PIPESGD_JOB_TOKEN", "0123456789abcdef0123456789abcdef"},
           {"PIPESGD_FAULT", "2:step:5:kill"}},
          120);
      end_s[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(results[2].exit_code, 128 + 9) << results[2].err;
  for (int r : {0, 1}) {
    const std::string& err = results[r].err;
    const std::string named = fmt::format("error: rank {}: the job failed because of rank 2: ", r);
    std::printf("rank %d ended %.1f s after the victim, exit %d\n", r, end_s[r] - end_s[2],
                results[r].exit_code);
    EXPECT_EQ(results[r].exit_code, 3) << err;
    EXPECT_NE(err.find(named), std::string::npos) << named << "\n" << err;
    EXPECT_LT(end_s[r] - end_s[2], 20.0) << err;
  }
}

}  // namespace
}  // namespace pipesgd
