// `pipesgd run` end to end on this machine: the ssh launcher through a stand-in ssh
// (tests/support/fake_ssh.sh runs the remote command locally; the real sshd is the cluster
// tier's), the job token, the per-network flags and per-rank output files.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>
#include <thread>

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

// Each test's own directory, named for this file.
struct TempDir : testing::TempDir {
  TempDir() : testing::TempDir("pipesgd_launcher") {}
};

const std::string kBinary = PIPESGD_BINARY;
const std::string kConfig = std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_mlp.pbtxt";
const std::string kFakeSsh = std::string(PIPESGD_SOURCE_DIR) + "/tests/support/fake_ssh.sh";
// A short job: 1600 training samples, 1000 test samples, one epoch.
const std::vector<std::string> kShort = {"--set", "data.train_limit=1600", "--set",
                                         "data.test_limit=1000", "--set", "train.epochs=1"};


std::vector<std::string> Args(std::vector<std::string> head, const std::vector<std::string>& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

std::string FinalAccuracy(const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("final test accuracy: ([0-9.]+)"))) return "none";
  return m[1];
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(OverSsh, ShipsTheConfigAndMatchesALocalRun) {
  TempDir dir;
  fs::copy_file(kConfig, dir.path("job.pbtxt"));
  const auto local = RunCommand(Args({kBinary, "run", "-np", "4", dir.path("job.pbtxt")}, kShort));
  ASSERT_EQ(local.exit_code, 0) << local.err;
  const auto ssh = RunCommand(Args({kBinary, "run", "-H", "a:2,b:2", "--ssh-program", kFakeSsh,
                                    dir.path("job.pbtxt")},
                                   kShort));
  ASSERT_EQ(ssh.exit_code, 0) << ssh.out << ssh.err;
  EXPECT_EQ(FinalAccuracy(ssh.out), FinalAccuracy(local.out)) << ssh.out;
  EXPECT_NE(FinalAccuracy(ssh.out), "none");
  // Rank 0 read its shipped copy, not the original.
  EXPECT_TRUE(std::regex_search(
      ssh.out, std::regex("\\[rank 0\\] config /tmp/pipesgd-rank0-[A-Za-z0-9]{6}/job\\.pbtxt \\(")))
      << ssh.out;
  EXPECT_NE(ssh.out.find("pipesgd run: starting 4 ranks over ssh (rank:host 0:a 1:a 2:b 3:b); "
                         "rendezvous 127.0.0.1:"),
            std::string::npos)
      << ssh.out;
  EXPECT_NE(ssh.out.find("[rank 3] rank 3 on b: transport tcp, interface lo, address 127.0.0.1\n"),
            std::string::npos)
      << ssh.out;
  EXPECT_NE(ssh.out.find("pipesgd run: all 4 ranks finished"), std::string::npos) << ssh.out;
  // The shipped copies are gone with their ranks.
  for (const auto& entry : fs::directory_iterator(fs::temp_directory_path())) {
    EXPECT_EQ(entry.path().filename().string().rfind("pipesgd-rank", 0) == 0 &&
                  fs::exists(entry.path() / "job.pbtxt"),
              false)
        << entry.path();
  }
}

TEST(OverSsh, VerboseShowsTheHostInThePrefix) {
  const auto r = RunCommand(Args({kBinary, "run", "-H", "a,b", "--ssh-program", kFakeSsh, "-v",
                                  kConfig},
                                 kShort));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank 1 b] rank 1 on b: transport tcp"), std::string::npos) << r.out;
}

TEST(OverSsh, PreflightNamesEveryBadHostAndStartsNothing) {
  const auto r = RunCommand(
      {kBinary, "run", "-H", "a,bad1,bad2", "--ssh-program", kFakeSsh, kConfig});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("error: preflight failed on 2 of 3 host(s); nothing was started:\n"
                       "  bad1: ssh failed: ssh: Could not resolve hostname bad1: Name or "
                       "service not known\n"
                       "  bad2: ssh failed: ssh: Could not resolve hostname bad2: Name or "
                       "service not known\n"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("[rank"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("starting"), std::string::npos) << r.out;
}

TEST(OverSsh, MissingRemoteBinaryIsNamedOnEveryHost) {
  const auto r = RunCommand({kBinary, "run", "-H", "a,b", "--ssh-program", kFakeSsh,
                             "--remote-binary", "/nonexistent/pipesgd", kConfig});
  EXPECT_EQ(r.exit_code, 1);
  for (const char* host : {"a", "b"}) {
    EXPECT_NE(r.err.find(std::string("  ") + host + ": no pipesgd binary at /nonexistent/pipesgd there ("),
              std::string::npos)
        << r.err;
  }
  EXPECT_NE(r.err.find("install it at the same path, or pass --remote-binary PATH"),
            std::string::npos);
}

TEST(OverSsh, MoreRanksThanSlotsIsAnErrorBeforeAnySsh) {
  const auto r = RunCommand({kBinary, "run", "-np", "3", "-H", "a,b", "--ssh-program",
                             "/nonexistent/ssh", kConfig});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err,
            "error: -np 3 but the hosts have only 2 slot(s) in all (a:1, b:1); give more slots "
            "(-H host:N, or slots=N in the hostfile) or a smaller -np\n");
}

TEST(OverSsh, HostfileLineErrorsAreNamed) {
  TempDir dir;
  std::ofstream(dir.path("hosts")) << "# lab\nlab0 slots=1\nlab1 slots=x\n";
  const auto r = RunCommand({kBinary, "run", "--hostfile", dir.path("hosts"), kConfig});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "error: " + dir.path("hosts") + ":3: slots=x: expected an integer in [1, 4096]\n");
}

TEST(Run, SshOptionsWithoutHostsAreAUsageError) {
  const auto r = RunCommand({kBinary, "run", "-np", "2", "--ssh-port", "22", kConfig});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, "error: --ssh-port applies only to runs over ssh (-H or --hostfile)\n");
  const auto none = RunCommand({kBinary, "run", kConfig});
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_EQ(none.err,
            "error: run: give -np N (local workers), or -H / --hostfile (ranks over ssh)\n");
}

TEST(Run, TransportFlagIsPassedToEveryRank) {
  const auto bad = RunCommand({kBinary, "run", "-np", "2", "--transport", "carrier-pigeon", kConfig});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--set comm.transport=carrier-pigeon: expected one of TCP"),
            std::string::npos)
      << bad.err;
  // Any case of a declared value.
  const auto ok = RunCommand(Args({kBinary, "run", "-np", "2", "--transport", "tcp", kConfig}, kShort));
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

TEST(Run, NetworkInterfaceFlagChoosesTheInterfaceOfEveryRank) {
  const auto r = RunCommand(Args({kBinary, "run", "-np", "2", "--network-interface", "=lo", kConfig},
                                 kShort));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const std::string& rank : {std::string("0"), std::string("1")}) {
    EXPECT_TRUE(std::regex_search(
        r.out, std::regex("\\[rank " + rank + "\\] rank " + rank +
                          " on [^:]+: transport tcp, interface lo, address 127\\.0\\.0\\.1 "
                          "\\(comm\\.network_interface = =lo\\)\n")))
        << r.out;
  }
}

TEST(Run, NetworkInterfaceThatMatchesNothingIsNamedByEveryRank) {
  const auto r = RunCommand(Args({kBinary, "run", "-np", "2", "--network-interface",
                                  "=nosuchif0", kConfig},
                                 kShort));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("comm.network_interface = '=nosuchif0' admits none of this host's "
                       "interfaces (lo 127.0.0.1/8"),
            std::string::npos)
      << r.err;
  const auto bad = RunCommand({kBinary, "run", "-np", "2", "--network-interface", "eth0,,ib", kConfig});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("error: --set comm.network_interface=eth0,,ib: comm.network_interface = "
                         "'eth0,,ib': an empty entry"),
            std::string::npos)
      << bad.err;
}

TEST(Run, LogDirKeepsEachRanksLines) {
  TempDir dir;
  const auto r = RunCommand(Args({kBinary, "run", "-np", "2", "--log-dir", dir.path("logs"),
                                  kConfig},
                                 kShort));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string out0 = ReadAll(dir.path("logs/rank.0/stdout"));
  const std::string out1 = ReadAll(dir.path("logs/rank.1/stdout"));
  EXPECT_NE(out0.find("final test accuracy: "), std::string::npos) << out0;
  EXPECT_EQ(out0.find("[rank"), std::string::npos) << "files hold the lines as written";
  EXPECT_NE(out1.find("rank 1 on "), std::string::npos) << out1;
  EXPECT_EQ(out1.find("rank 0 on "), std::string::npos) << out1;
  EXPECT_TRUE(fs::exists(dir.path("logs/rank.1/stderr")));
}

std::vector<pid_t> Children(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state;
    pid_t ppid;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(std::stoi(name));
  }
  return out;
}

std::string EnvOf(pid_t pid, const std::string& name) {
  std::stringstream env(ReadAll("/proc/" + std::to_string(pid) + "/environ"));
  std::string var;
  while (std::getline(env, var, '\0')) {
    if (var.rfind(name + "=", 0) == 0) return var.substr(name.size() + 1);
  }
  return "";
}

TEST(Run, LocalWorkersShareAJobTokenThatIsOnNoCommandLine) {
  pid_t run = fork();
  if (run == 0) {
    freopen("/dev/null", "w", stdout);
    freopen("/dev/null", "w", stderr);
    execl(kBinary.c_str(), kBinary.c_str(), "run", "-np", "2", kConfig.c_str(), "--set",
          "train.epochs=100", static_cast<char*>(nullptr));
    _exit(127);
  }
  std::vector<pid_t> workers;
  for (int i = 0; i < 300 && workers.size() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    workers = Children(run);
  }
  ASSERT_EQ(workers.size(), 2u);
  std::string token;
  for (int i = 0; i < 100 && token.empty(); ++i) {  // until the workers have exec'd
    token = EnvOf(workers[0], "PIPESGD_JOB_TOKEN");
    if (token.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(std::regex_match(token, std::regex("[0-9a-f]{32}"))) << token;
  EXPECT_EQ(EnvOf(workers[1], "PIPESGD_JOB_TOKEN"), token);
  for (pid_t p : {run, workers[0], workers[1]}) {
    EXPECT_EQ(ReadAll("/proc/" + std::to_string(p) + "/cmdline").find(token), std::string::npos);
  }
  kill(run, SIGTERM);
  int status = 0;
  waitpid(run, &status, 0);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
}

// A stranger already listening on an explicit --master-port: nothing starts, and the launcher
// says why (before, every rank but 0 sent its hello, token and config to the stranger, and the
// launcher's last line named a random rank).
TEST(Run, AnExplicitMasterPortInUseIsRefusedBeforeAnyRankStarts) {
  uint16_t taken = 0;
  const int listener = testing::ListenOnLoopback(&taken);
  const std::string port = std::to_string(taken);
  const auto r = RunCommand(Args({kBinary, "run", "-np", "4", kConfig, "--master-port", port}, kShort),
                            {}, 60);
  close(listener);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("--master-port " + port + ": the port is in use on 127.0.0.1 (another "
                       "job or program holds it); no rank was started"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("[rank"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("[rank"), std::string::npos) << r.err;
}

// An IPv6 loopback rendezvous keeps the data on loopback too (the interface choice was IPv4-only:
// with MASTER_ADDR ::1 the ranks listened on eth0).
TEST(Run, AnIpv6LoopbackRendezvousKeepsTheDataOnLoopback) {
  const int probe = socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 addr{};
  addr.sin6_family = AF_INET6;
  addr.sin6_addr = in6addr_loopback;
  const bool has_ipv6 =
      probe >= 0 && bind(probe, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  if (probe >= 0) close(probe);
  if (!has_ipv6) GTEST_SKIP() << "no IPv6 loopback (::1) on this host";
  const std::string port = std::to_string(testing::FreePort());
  const auto r = RunCommand(Args({kBinary, "run", "-np", "2", kConfig, "--master-addr", "::1",
                                  "--master-port", port, "--set", "data.train_limit=640",
                                  "--set", "data.test_limit=200", "--set", "train.epochs=1"},
                                 {}),
                            {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string log = r.out + r.err;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(std::regex_search(
        log, std::regex(fmt::format("rank {} on [^\n]*: transport tcp, interface lo, address "
                                    "127\\.0\\.0\\.1\n",
                                    rank))))
        << log;
  }
}

// A rank that stops (SIGSTOP) mid-training: the others fail because of it (status 3) and name
// it; the launcher, which then has to stop it, names it too (it once named a healthy rank).
TEST(Run, AStoppedRankIsTheOneTheLauncherNames) {
  const auto r = RunCommand(Args({kBinary, "run", "-np", "4", kConfig, "--set", "comm.timeout_s=4",
                                  "--set", "train.max_steps=40", "-x",
                                  "PIPESGD_FAULT=2:step:4:stop"},
                                 kShort),
                            {}, 60);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("pipesgd run: failed: rank 2 (pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(named by every rank that failed: rank "), std::string::npos) << r.err;
  for (int rank : {0, 1, 3}) {
    EXPECT_NE(r.err.find(fmt::format("[rank {}] error: rank {}: the job failed because of rank 2: "
                                     "rank 2 stopped responding",
                                     rank, rank)),
              std::string::npos)
        << r.err;
  }
}


// --- --out keeps a finished run; summary.json says where and how it ran -------------------

TEST(RunOut, AFinishedRunIsKeptUnlessOverwriteAndTheSummarySaysHowItRan) {
  TempDir dir;
  const std::string out = dir.path("out");
  const auto first = RunCommand(
      Args({kBinary, "run", "-np", "2", kConfig, "--set", "train.max_steps=5", "--out", out},
           kShort),
      {}, 60);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const auto summary = nlohmann::json::parse(ReadAll(out + "/summary.json"));
  EXPECT_EQ(summary.at("launcher"), "RANK/WORLD_SIZE");
  EXPECT_FALSE(summary.at("host").get<std::string>().empty());
  EXPECT_EQ(summary.at("hosts"), nlohmann::json::array({summary.at("host"), summary.at("host")}));
  EXPECT_TRUE(std::regex_match(summary.at("start_time").get<std::string>(),
                               std::regex("20[0-9]{2}-[01][0-9]-[0-3][0-9]T[0-9:]{8}Z")))
      << summary.at("start_time");
  // The launcher's command line, not the worker's.
  EXPECT_EQ(summary.at("command_line").get<std::string>().find(kBinary + " run -np 2 "), 0u)
      << summary.at("command_line");

  const auto again = RunCommand(
      Args({kBinary, "run", "-np", "2", kConfig, "--set", "train.max_steps=5", "--out", out},
           kShort),
      {}, 60);
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.err.find(fmt::format("--out {}: holds a finished run (summary.json, started at {}); "
                                       "pass --overwrite to replace it",
                                       out, summary.at("start_time").get<std::string>())),
            std::string::npos)
      << again.err;
  EXPECT_EQ(again.out.find("[rank"), std::string::npos) << "a rank started: " << again.out;
  // A rank started by hand (or by srun) refuses it too.
  const auto worker = RunCommand({kBinary, "worker", kConfig, "--out", out}, {}, 60);
  EXPECT_EQ(worker.exit_code, 1);
  EXPECT_NE(worker.err.find("holds a finished run"), std::string::npos) << worker.err;

  const auto replaced = RunCommand(
      Args({kBinary, "run", "-np", "2", kConfig, "--set", "train.max_steps=8", "--out", out,
            "--overwrite"},
           kShort),
      {}, 60);
  ASSERT_EQ(replaced.exit_code, 0) << replaced.err;
  EXPECT_EQ(nlohmann::json::parse(ReadAll(out + "/summary.json")).at("steps"), 8);
}

// --- `pipesgd run -- PROGRAM`: any program, torchrun's environment ------------------------

// Prints what a rank was given; "$0 $1" are the program's own arguments, which must reach it
// untouched (the launcher rewrites -np in its own arguments only).
const std::vector<std::string> kShowEnv = {
    "sh", "-c",
    "echo \"r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK lw=$LOCAL_WORLD_SIZE m=$MASTER_ADDR "
    "p=${MASTER_PORT:+set} t=${#PIPESGD_JOB_TOKEN} o=$OPENBLAS_NUM_THREADS args=$0,$1\"",
    "-np", "--set"};

TEST(RunProgram, EveryRankGetsItsPlaceAndTheJobToken) {
  const auto r = RunCommand(Args({kBinary, "run", "-np", "3", "--"}, kShowEnv), {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_NE(r.out.find(fmt::format("[rank {}] r={} w=3 l={} lw=3 m=127.0.0.1 p=set t=32 o=1 "
                                     "args=-np,--set\n",
                                     rank, rank, rank)),
              std::string::npos)
        << r.out;
  }
  EXPECT_NE(r.out.find("pipesgd run: starting 3 ranks of /"), std::string::npos) << r.out;
}

TEST(RunProgram, AnExecutableInPlaceOfTheConfigIsRunToo) {
  TempDir dir;
  const std::string script = dir.File("rank.sh", "#!/bin/sh\necho \"rank $RANK of $WORLD_SIZE\"\n");
  fs::permissions(script, fs::perms::owner_all);
  const auto r = RunCommand({kBinary, "run", "-np", "2", script}, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 1] rank 1 of 2\n"), std::string::npos) << r.out;
}

TEST(RunProgram, ANameOnPathInPlaceOfTheConfigAndArgumentsThatNeedDashes) {
  auto r = RunCommand({kBinary, "run", "-np", "2", "true"}, {}, 60);  // as mpirun takes it
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("starting 2 ranks of /[^ ]*/true ")))
      << r.out;
  TempDir dir;
  const std::string script = dir.File("rank.sh", "#!/bin/sh\necho \"$@\"\n");
  fs::permissions(script, fs::perms::owner_all);
  r = RunCommand({kBinary, "run", "-np", "2", script, "a", "b"}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find(fmt::format("run: {} is a program: give its arguments after --", script)),
            std::string::npos)
      << r.err;
}

TEST(RunProgram, AFailingRankStopsTheOthersAndItsStatusIsTheJobs) {
  const auto start = std::chrono::steady_clock::now();
  const auto r = RunCommand({kBinary, "run", "-np", "3", "--", "sh", "-c",
                             "if [ \"$RANK\" = 1 ]; then echo bad >&2; exit 7; fi; sleep 60"},
                            {}, 60);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 7) << r.err;
  EXPECT_LT(s, 20) << "the sleeping ranks were not stopped";
  EXPECT_NE(r.err.find("[rank 1] bad"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("pipesgd run: failed: rank 1 (pid "), std::string::npos) << r.err;
}

TEST(RunProgram, UsageErrorsNameWhatIsWrong) {
  auto r = RunCommand({kBinary, "run", "-np", "2", "--"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("nothing after --"), std::string::npos) << r.err;
  r = RunCommand({kBinary, "run", "-np", "2", "--set", "train.epochs=1", "--", "true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--set applies to a pipesgd job config, not to a program (true)"),
            std::string::npos)
      << r.err;
  r = RunCommand({kBinary, "run", "-np", "2", kConfig, "--", "true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("both a config"), std::string::npos) << r.err;
  r = RunCommand({kBinary, "run", "-np", "2", "--", "pipesgd-no-such-program"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("program pipesgd-no-such-program: not found on PATH"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("[rank"), std::string::npos) << "a rank started: " << r.out;
  r = RunCommand({kBinary, "run", "-np", "2", "pipesgd-no-such-program"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("run: pipesgd-no-such-program: no such config file (nor a program of "
                       "that name on PATH)"),
            std::string::npos)
      << r.err;
  r = RunCommand({kBinary, "run", "-np", "2", "--", "./pipesgd-no-such-file"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("program ./pipesgd-no-such-file: no such file"), std::string::npos)
      << r.err;
}

TEST(RunProgram, OverSshEveryRankGetsItsPlace) {
  const auto r = RunCommand(
      Args({kBinary, "run", "-H", "a:2,b", "--ssh-program", kFakeSsh, "--"}, kShowEnv), {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 1] r=1 w=3 l=1 lw=2 m=127.0.0.1 p=set t=32 o=1 args=-np,--set\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("[rank 2] r=2 w=3 l=0 lw=1 m=127.0.0.1 p=set t=32 o=1 args=-np,--set\n"),
            std::string::npos)
      << r.out;
}

// --- a rank's place from Slurm's and Open MPI's environments -------------------------------

// `pipesgd worker` started as srun starts tasks: no RANK, WORLD_SIZE or MASTER_ADDR (the real
// srun and mpirun across lab nodes are the cluster tier's, tests/cluster/launchers_test.sh).
TEST(LaunchEnvironment, WorkersTakeTheirPlaceFromSlurmVariables) {
  const int port = testing::FreePort();
  const auto run = [&](int rank) {
    return RunCommand(Args({kBinary, "worker", kConfig, "--set", "train.max_steps=20"}, kShort),
                      {{"SLURM_JOB_ID", "42"},
                       {"SLURM_PROCID", std::to_string(rank)},
                       {"SLURM_LOCALID", std::to_string(rank)},
                       {"SLURM_STEP_NUM_TASKS", "2"},
                       {"SLURM_STEP_NODELIST", "localhost"},
                       {"MASTER_PORT", std::to_string(port)}},
                      60);
  };
  auto other = std::async(std::launch::async, run, 1);
  const auto lead = run(0);
  const auto second = other.get();
  ASSERT_EQ(lead.exit_code, 0) << lead.err;
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_NE(lead.out.find(fmt::format("rank 0 of 2 from Slurm's environment; rendezvous "
                                      "localhost:{} (the first host of "
                                      "SLURM_STEP_NODELIST=localhost)",
                                      port)),
            std::string::npos)
      << lead.out;
  EXPECT_NE(FinalAccuracy(lead.out), "none") << lead.out;
}

}  // namespace
}  // namespace pipesgd
