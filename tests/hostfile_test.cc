// Host lists of `pipesgd run`: -H host[:slots],... and Open MPI hostfiles (slots, comments,
// blank lines, errors naming the line), placement of ranks slot by slot, and the ssh command
// line the launcher builds.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>

#include "core/base/error.h"
#include "launcher/hostfile.h"
#include "launcher/remote_rank.h"
#include "launcher/ssh_launcher.h"
#include "launcher/supervisor.h"

namespace pipesgd::launcher {
namespace {

std::string Listed(const std::vector<HostSlots>& hosts) {
  std::string out;
  for (const auto& h : hosts) out += h.host + "=" + std::to_string(h.slots) + ";";
  return out;
}

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    return e.what();
  }
  return "no error";
}

TEST(HostList, HostsWithAndWithoutSlots) {
  EXPECT_EQ(Listed(ParseHostList("lab0:1,lab1:1,lab2:1,lab3:1")), "lab0=1;lab1=1;lab2=1;lab3=1;");
  EXPECT_EQ(Listed(ParseHostList("a:4,b,root@c.example.org:2")), "a=4;b=1;root@c.example.org=2;");
  EXPECT_EQ(Listed(ParseHostList("10.0.0.1:2")), "10.0.0.1=2;");
}

TEST(HostList, AHostNamedTwiceAddsItsSlots) {
  EXPECT_EQ(Listed(ParseHostList("a,b,a:3")), "a=4;b=1;");
}

TEST(HostList, ErrorsNameTheEntry) {
  EXPECT_EQ(ErrorOf([] { ParseHostList("a,,b"); }),
            "-H a,,b: an empty entry (expected host[:slots],...)");
  EXPECT_EQ(ErrorOf([] { ParseHostList("a:0"); }),
            "-H a:0: slots '0' of a: expected an integer in [1, 4096]");
  EXPECT_EQ(ErrorOf([] { ParseHostList("a:two"); }),
            "-H a:two: slots 'two' of a: expected an integer in [1, 4096]");
  EXPECT_EQ(ErrorOf([] { ParseHostList(":2"); }), "-H :2: empty host name");
  EXPECT_EQ(ErrorOf([] { ParseHostList("-oProxyCommand=x"); }),
            "-H -oProxyCommand=x: host '-oProxyCommand=x' starts with '-'");
  EXPECT_EQ(ErrorOf([] { ParseHostList("a b"); }),
            "-H a b: host 'a b': expected [user@]name with letters, digits, '.', '-', '_' (IPv6 "
            "addresses: use a name from your ssh config)");
  EXPECT_EQ(ErrorOf([] { ParseHostList(""); }), "-H: empty host list");
}

TEST(Hostfile, OpenMpiLinesCommentsAndBlankLines) {
  const std::string text =
      "# the lab\n"
      "\n"
      "lab0 slots=2\n"
      "   lab1    slots=1   max_slots=4   # trailing comment\n"
      "lab2\n"
      "lab3 count=3\n"
      "\t\n";
  EXPECT_EQ(Listed(ParseHostfile(text, "hosts.txt")), "lab0=2;lab1=1;lab2=1;lab3=3;");
  // No newline at the end, a host twice.
  EXPECT_EQ(Listed(ParseHostfile("a slots=2\nb\na slots=1", "h")), "a=3;b=1;");
}

TEST(Hostfile, ErrorsNameTheFileAndLine) {
  EXPECT_EQ(ErrorOf([] { ParseHostfile("a\n\nb slots=0\n", "hosts.txt"); }),
            "hosts.txt:3: slots=0: expected an integer in [1, 4096]");
  EXPECT_EQ(ErrorOf([] { ParseHostfile("# x\na slot=2\n", "hosts.txt"); }),
            "hosts.txt:2: unknown key 'slot' (known: slots, max_slots)");
  EXPECT_EQ(ErrorOf([] { ParseHostfile("a 2\n", "hosts.txt"); }),
            "hosts.txt:1: '2': expected key=value after the host (slots=N, max_slots=N)");
  EXPECT_EQ(ErrorOf([] { ParseHostfile("a slots=4 max_slots=2\n", "hosts.txt"); }),
            "hosts.txt:1: max_slots=2 is less than slots=4");
  EXPECT_EQ(ErrorOf([] { ParseHostfile("a\nb\nc;d slots=1\n", "hosts.txt"); }),
            "hosts.txt:3: host 'c;d': expected [user@]name with letters, digits, '.', '-', '_' "
            "(IPv6 addresses: use a name from your ssh config)");
  EXPECT_EQ(ErrorOf([] { ParseHostfile("# nothing\n\n", "empty.txt"); }),
            "hostfile empty.txt: no hosts (only blank or comment lines)");
}

TEST(Hostfile, MissingFileIsNotFound) {
  try {
    ReadHostfile("/nonexistent/hosts.txt");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_EQ(std::string(e.what()), "--hostfile /nonexistent/hosts.txt: cannot open: No such file or directory");
  }
}

std::string Placed(const std::vector<Placement>& placement) {
  std::string out;
  for (const auto& p : placement) {
    out += std::to_string(p.rank) + "@" + p.host + "/" + std::to_string(p.local_rank) + "of" +
           std::to_string(p.local_world_size) + ";";
  }
  return out;
}

TEST(Placement, RanksFillHostsSlotBySlot) {
  const auto hosts = ParseHostList("a:2,b:2,c:1");
  EXPECT_EQ(TotalSlots(hosts), 5);
  EXPECT_EQ(Placed(PlaceRanks(hosts, 5)), "0@a/0of2;1@a/1of2;2@b/0of2;3@b/1of2;4@c/0of1;");
  // -np smaller than the slots: the first slots are used.
  EXPECT_EQ(Placed(PlaceRanks(hosts, 3)), "0@a/0of2;1@a/1of2;2@b/0of1;");
  EXPECT_EQ(Placed(PlaceRanks(ParseHostList("lab0:1,lab1:1,lab2:1,lab3:1"), 4)),
            "0@lab0/0of1;1@lab1/0of1;2@lab2/0of1;3@lab3/0of1;");
}

TEST(Placement, MoreRanksThanSlotsIsAClearError) {
  EXPECT_EQ(ErrorOf([] { PlaceRanks(ParseHostList("lab0:1,lab1:1,lab2:1,lab3:1"), 6); }),
            "-np 6 but the hosts have only 4 slot(s) in all (lab0:1, lab1:1, lab2:1, lab3:1); "
            "give more slots (-H host:N, or slots=N in the hostfile) or a smaller -np");
}

TEST(Ssh, CommandLineKeepsBatchModeFirstAndUserOptionsBeforeDefaults) {
  SshOptions ssh;
  ssh.config_file = "/run/lab/ssh_config";
  ssh.port = 2222;
  ssh.identity = "/root/.ssh/id_lab";
  ssh.options = {"ServerAliveInterval=30", "StrictHostKeyChecking=accept-new"};
  ssh.connect_timeout_s = 3;
  const auto argv = SshArgv(ssh, "lab2", "exec '/opt/pipesgd' remote-rank");
  std::string joined;
  for (const auto& a : argv) joined += a + " ";
  EXPECT_EQ(joined,
            "ssh -o BatchMode=yes -o ConnectTimeout=3 -F /run/lab/ssh_config -p 2222 -i "
            "/root/.ssh/id_lab -o ServerAliveInterval=30 -o StrictHostKeyChecking=accept-new -o "
            "ServerAliveInterval=5 -o ServerAliveCountMax=3 -T -x -- lab2 exec '/opt/pipesgd' "
            "remote-rank ");
}

TEST(Ssh, ShellQuoting) {
  EXPECT_EQ(ShellQuote("/opt/pipe sgd/bin"), "'/opt/pipe sgd/bin'");
  EXPECT_EQ(ShellQuote("it's"), "'it'\\''s'");
  EXPECT_EQ(ShellQuote(""), "''");
  EXPECT_EQ(ShellQuote("/opt/pipesgd/bin/pipesgd"), "/opt/pipesgd/bin/pipesgd");
  EXPECT_EQ(ShellQuote("--np"), "--np");
  EXPECT_EQ(ShellQuote("train.max_steps=20"), "'train.max_steps=20'");  // never an assignment
  EXPECT_EQ(ShellQuote("a;b"), "'a;b'");
  EXPECT_EQ(ShellQuote("$HOME"), "'$HOME'");
}

TEST(RemoteJob, RoundTripsAsOneLine) {
  RemoteJob job;
  job.rank = 2;
  job.host = "lab2";
  job.env = {{"RANK", "2"}, {"PIPESGD_JOB_TOKEN", "0123abcd"}};
  job.env_defaults = {{"OPENBLAS_NUM_THREADS", "1"}};
  job.config_name = "job.pbtxt";
  job.config_text = "train {\n  epochs: 1\n}\n# \"quoted\" \\ and tab\t\n";
  job.worker_args = {"--set", "train.max_steps=300"};
  job.cwd = "/work";
  job.kill_grace_s = 2.5;
  const std::string line = EncodeRemoteJob(job);
  ASSERT_EQ(line.find('\n'), line.size() - 1);
  const RemoteJob back = DecodeRemoteJob(line.substr(0, line.size() - 1));
  EXPECT_EQ(back.rank, 2);
  EXPECT_EQ(back.host, "lab2");
  EXPECT_EQ(back.env, job.env);
  EXPECT_EQ(back.env_defaults, job.env_defaults);
  EXPECT_EQ(back.config_name, "job.pbtxt");
  EXPECT_EQ(back.config_text, job.config_text);
  EXPECT_EQ(back.worker_args, job.worker_args);
  EXPECT_EQ(back.cwd, "/work");
  EXPECT_EQ(back.kill_grace_s, 2.5);
}

TEST(RemoteJob, MalformedOrUnsafeJobsAreRejected) {
  for (const std::string& line : {std::string("not json"), std::string("{\"format\": 2}"),
                                 std::string("{\"format\": 1, \"rank\": 0}")}) {
    try {
      DecodeRemoteJob(line);
      ADD_FAILURE() << "accepted " << line;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kDataLoss) << e.what();
    }
  }
  RemoteJob job;
  job.config_name = "../../etc/passwd";
  std::string line = EncodeRemoteJob(job);
  try {
    DecodeRemoteJob(line.substr(0, line.size() - 1));
    ADD_FAILURE() << "accepted a config name with a path";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "remote-rank: bad config file name '../../etc/passwd'");
  }
}

TEST(ForwardedEnv, NamesAndValues) {
  setenv("PIPESGD_TEST_FORWARDED", "from the shell", 1);
  const auto env = ResolveForwardedEnv({"PIPESGD_TEST_FORWARDED", "NCCL_DEBUG=INFO", "EMPTY="});
  ASSERT_EQ(env.size(), 3u);
  EXPECT_EQ(env[0], (std::pair<std::string, std::string>{"PIPESGD_TEST_FORWARDED", "from the shell"}));
  EXPECT_EQ(env[1], (std::pair<std::string, std::string>{"NCCL_DEBUG", "INFO"}));
  EXPECT_EQ(env[2], (std::pair<std::string, std::string>{"EMPTY", ""}));
}

TEST(ForwardedEnv, ErrorsNameTheEntry) {
  unsetenv("PIPESGD_TEST_UNSET");
  EXPECT_EQ(ErrorOf([] { ResolveForwardedEnv({"PIPESGD_TEST_UNSET"}); }),
            "-x PIPESGD_TEST_UNSET: PIPESGD_TEST_UNSET is not set in the launcher's environment "
            "(give -x PIPESGD_TEST_UNSET=VALUE to set it)");
  EXPECT_EQ(ErrorOf([] { ResolveForwardedEnv({"RANK=3"}); }),
            "-x RANK=3: RANK is set by pipesgd run for every rank and cannot be forwarded");
  EXPECT_EQ(ErrorOf([] { ResolveForwardedEnv({"PIPESGD_JOB_TOKEN"}); }),
            "-x PIPESGD_JOB_TOKEN: PIPESGD_JOB_TOKEN is set by pipesgd run for every rank and "
            "cannot be forwarded");
  EXPECT_EQ(ErrorOf([] { ResolveForwardedEnv({"1BAD=x"}); }),
            "-x 1BAD=x: expected NAME or NAME=VALUE, NAME of letters, digits and _");
  EXPECT_EQ(ErrorOf([] { ResolveForwardedEnv({"=x"}); }),
            "-x =x: expected NAME or NAME=VALUE, NAME of letters, digits and _");
}

}  // namespace
}  // namespace pipesgd::launcher
