// Rendezvous: every rank learns every address; a misconfigured job (different job description,
// duplicate rank, other world size) fails on every rank with an error naming the culprit; a
// rank that never comes is named; a stranger on the port is dropped without hurting the job.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "core/base/error.h"
#include "tests/support/multiproc.h"
#include "transport/rendezvous.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;
using transport::RendezvousAllGather;
using transport::RendezvousOptions;

RendezvousOptions Options(const RankContext& ctx, std::string job = "job A\n") {
  return {"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size, std::move(job)};
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
