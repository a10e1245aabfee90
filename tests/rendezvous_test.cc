// Rendezvous: every rank learns every address; a misconfigured job (different job description,
// duplicate rank, other world size) fails on every rank with an error naming the culprit; a
// rank that never comes is named; a stranger on the port is dropped without hurting the job.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <thread>

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/base/log.h"
#include "tests/support/multiproc.h"
#include "transport/rendezvous.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;
using transport::RendezvousAllGather;
using transport::RendezvousOptions;

RendezvousOptions Options(const RankContext& ctx, std::string job = "job A\n") {
  return {"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size, std::move(job), ""};
}

std::string Joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + ";";
  return s;
}

TEST(Rendezvous, EveryRankGetsEveryAddress) {
  auto results = RunRanks(5, [](const RankContext& ctx) {
    return Joined(RendezvousAllGather(Options(ctx), "addr" + std::to_string(ctx.rank),
                                      Deadline::After(20)));
  });
  for (int r = 0; r < 5; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "addr0;addr1;addr2;addr3;addr4;");
  }
}

// Rendezvous after rendezvous on one port (tests and tools that build two rings): a rank that
// got its answer early starts the next round while rank 0 is still answering the others. Its
// hello must reach the next round's listener, never the closing one (which once either failed
// the job with "joined twice" or dropped the rank, so the next round timed out naming it).
TEST(Rendezvous, BackToBackRoundsOnOnePortStayApart) {
  constexpr int kRounds = 40;
  auto results = RunRanks(4, [](const RankContext& ctx) {
    std::string out;
    for (int round = 0; round < kRounds; ++round) {
      out += Joined(RendezvousAllGather(Options(ctx), fmt::format("r{}.{}", ctx.rank, round),
                                        Deadline::After(20)));
      out += "|";
    }
    return out;
  });
  std::string want;
  for (int round = 0; round < kRounds; ++round) {
    want += fmt::format("r0.{0};r1.{0};r2.{0};r3.{0};|", round);
  }
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, want) << "rank " << r;
  }
}

TEST(Rendezvous, RanksMayStartLate) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    if (ctx.rank == 0) std::this_thread::sleep_for(std::chrono::seconds(2));  // others retry
    return Joined(RendezvousAllGather(Options(ctx), std::to_string(ctx.rank), Deadline::After(10)));
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "0;1;2;");
  }
}

TEST(Rendezvous, DifferentJobIsRejectedOnEveryRankNamingTheLine) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    std::string job = "pipesgd 0.1.0\ntrain {\n  batch_size: 16\n  pipeline_width: " +
                      std::string(ctx.rank == 2 ? "1" : "2") + "\n}\n";
    RendezvousAllGather(Options(ctx, job), "a", Deadline::After(20));
    return std::string("no error");
  });
  const std::string expected =
      "rank 2 (from 127.0.0.1:";  // then the port, then:
  const std::string difference =
      "was started with a different job than rank 0: in train: rank 2 has `pipeline_width: 1`, "
      "rank 0 has `pipeline_width: 2`";
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].exit_code, 1) << "rank " << r << ": " << results[r].output;
    EXPECT_NE(results[r].error.find(expected), std::string::npos) << results[r].error;
    EXPECT_NE(results[r].error.find(difference), std::string::npos) << results[r].error;
  }
}

TEST(Rendezvous, DuplicateRankIsRejected) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    RankContext c = ctx;
    if (c.rank == 2) c.rank = 1;  // two processes claim rank 1
    RendezvousAllGather(Options(c), "a", Deadline::After(20));
    return std::string("no error");
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].exit_code, 1) << "rank " << r;
    EXPECT_NE(results[r].error.find("rank 1 joined twice"), std::string::npos) << results[r].error;
  }
}

TEST(Rendezvous, WorldSizeMismatchIsRejected) {
  auto results = RunRanks(2, [](const RankContext& ctx) {
    RankContext c = ctx;
    if (c.rank == 1) c.world_size = 3;
    RendezvousAllGather(Options(c), "a", Deadline::After(20));
    return std::string("no error");
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].exit_code, 1);
    EXPECT_NE(results[r].error.find("was started with WORLD_SIZE=3, rank 0 with 2"),
              std::string::npos)
        << results[r].error;
  }
}

TEST(Rendezvous, MissingRanksAreNamedOnTimeout) {
  // WORLD_SIZE 4 but only ranks 0 and 2 start.
  auto results = RunRanks(2, [](const RankContext& ctx) {
    RankContext c = ctx;
    c.world_size = 4;
    c.rank = ctx.rank * 2;
    RendezvousAllGather(Options(c), "a", Deadline::After(c.rank == 0 ? 2 : 4));
    return std::string("no error");
  });
  EXPECT_EQ(results[0].exit_code, 1);
  EXPECT_NE(results[0].error.find("rank(s) 1, 3 never arrived (world size 4, 2 arrived)"),
            std::string::npos)
      << results[0].error;
  EXPECT_EQ(results[1].exit_code, 1);
  EXPECT_NE(results[1].error.find("never arrived"), std::string::npos) << results[1].error;
}

TEST(Rendezvous, StrangerOnThePortIsDroppedAndTheJobCarriesOn) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    if (ctx.rank == 2) {
      // Not a pipesgd rank: garbage, then an oversized frame header. Then join for real.
      for (const std::string& junk : {std::string("GET / HTTP/1.0\r\n\r\n"),
                                      std::string("PSGM\xff\xff\xff\x7f", 8)}) {
        int fd = -1;
        for (int i = 0; i < 100; ++i) {
          fd = socket(AF_INET, SOCK_STREAM, 0);
          sockaddr_in a{};
          a.sin_family = AF_INET;
          a.sin_port = htons(ctx.master_port);
          a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) break;
          close(fd);
          fd = -1;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        if (fd < 0) throw std::runtime_error("cannot reach rank 0");
        (void)!write(fd, junk.data(), junk.size());
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        close(fd);
      }
    }
    return Joined(RendezvousAllGather(Options(ctx), std::to_string(ctx.rank), Deadline::After(10)));
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "0;1;2;");
  }
}

RendezvousOptions WithToken(const RankContext& ctx, int rank, std::string token) {
  RendezvousOptions o = Options(ctx);
  o.rank = rank;
  o.token = std::move(token);
  return o;
}

std::string ErrorOf(const RendezvousOptions& options) {
  try {
    RendezvousAllGather(options, "intruder", Deadline::After(10));
  } catch (const Error& e) {
    return fmt::format("{}: {}", static_cast<int>(e.code()), e.what());
  }
  return "no error";
}

// A job started with a token (as `pipesgd run` does): a process without it, or with another
// job's, is turned away and logged by rank 0, cannot take a rank or fail the job, and the job
// completes with the real ranks.
TEST(Rendezvous, ConnectionWithoutTheTokenIsRefusedLoggedAndTheJobCarriesOn) {
  const std::string token = "0123456789abcdef0123456789abcdef";
  auto results = RunRanks(3, [&](const RankContext& ctx) {
    std::string log;
    std::string refusals;
    if (ctx.rank == 2) {
      // Claims rank 1 with no token, then rank 1 again with another job's token, then world
      // size 7 (which, authenticated, would fail the whole job).
      RendezvousOptions none = WithToken(ctx, 1, "");
      RendezvousOptions wrong = WithToken(ctx, 1, "fedcba9876543210fedcba9876543210");
      RendezvousOptions bad_world = WithToken(ctx, 1, "");
      bad_world.world_size = 7;
      refusals = ErrorOf(none) + "\n" + ErrorOf(wrong) + "\n" + ErrorOf(bad_world) + "\n";
    }
    char path[] = "/tmp/pipesgd_rdv_log_XXXXXX";
    int saved = -1;
    if (ctx.rank == 0) {
      InitLogging();
      const int fd = mkstemp(path);
      saved = dup(STDERR_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
    std::string addresses = Joined(RendezvousAllGather(WithToken(ctx, ctx.rank, token),
                                                       std::to_string(ctx.rank),
                                                       Deadline::After(20)));
    if (ctx.rank == 0) {
      dup2(saved, STDERR_FILENO);
      std::ifstream in(path);
      log.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      unlink(path);
    }
    return addresses + "\n" + refusals + log;
  });
  for (int r = 0; r < 3; ++r) ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
  EXPECT_EQ(results[1].output, "0;1;2;\n");
  const std::string& out2 = results[2].output;
  EXPECT_EQ(out2.substr(0, 7), "0;1;2;\n");
  // kInvalidArgument (code 0), naming rank 0 and why, once per attempt.
  size_t at = 7;
  for (const char* why : {"no job token", "a wrong job token", "no job token"}) {
    const std::string expected_start = "0: rank 1: rendezvous: rank 0 at 127.0.0.1:";
    const size_t end = out2.find('\n', at);
    ASSERT_NE(end, std::string::npos) << out2;
    const std::string line = out2.substr(at, end - at);
    EXPECT_EQ(line.substr(0, expected_start.size()), expected_start) << line;
    EXPECT_NE(line.find(std::string(" refused this process: it presented ") + why +
                        " (PIPESGD_JOB_TOKEN must be that of the job; `pipesgd run` sets it)"),
              std::string::npos)
        << line;
    at = end + 1;
  }
  // Rank 0 logged each refusal, naming where it came from and the rank it claimed.
  const std::string& out0 = results[0].output;
  EXPECT_EQ(out0.substr(0, 7), "0;1;2;\n") << out0;
  size_t logged = 0;
  for (size_t p = out0.find("warning: rank 0: rendezvous refused a connection from 127.0.0.1:");
       p != std::string::npos;
       p = out0.find("warning: rank 0: rendezvous refused a connection from 127.0.0.1:", p + 1)) {
    ++logged;
  }
  EXPECT_EQ(logged, 3u) << out0;
  EXPECT_NE(out0.find("(claiming rank 1): it presented no job token; the job carries on without "
                      "it"),
            std::string::npos)
      << out0;
  EXPECT_NE(out0.find("(claiming rank 1): it presented a wrong job token; the job carries on "
                      "without it"),
            std::string::npos)
      << out0;
}

// A rank 0 started by hand without PIPESGD_JOB_TOKEN runs an unauthenticated rendezvous.
TEST(Rendezvous, WithoutATokenOnRank0EveryHelloIsHeard) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    return Joined(RendezvousAllGather(WithToken(ctx, ctx.rank, ctx.rank == 0 ? "" : "t"),
                                      std::to_string(ctx.rank), Deadline::After(20)));
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "0;1;2;");
  }
}

TEST(DescribeJobDifference, NamesTheSectionAndBothLines) {
  const std::string a = "v1\nmodel {\n  layers {\n    linear {\n      out_features: 256\n    }\n  }\n}\n";
  const std::string b = "v1\nmodel {\n  layers {\n    linear {\n      out_features: 255\n    }\n  }\n}\n";
  EXPECT_EQ(transport::DescribeJobDifference(a, 3, b, 0),
            "in model.layers.linear: rank 3 has `out_features: 256`, rank 0 has "
            "`out_features: 255`");
  EXPECT_EQ(transport::DescribeJobDifference("v1\n", 1, "v2\n", 0),
            "in line 1: rank 1 has `v1`, rank 0 has `v2`");
  EXPECT_EQ(transport::DescribeJobDifference("x\n", 1, "x\ny\n", 0),
            "in line 2: rank 1 has ``, rank 0 has `y`");
}

}  // namespace
}  // namespace pipesgd
