// The job's failure relay (transport/failure_relay.h) on its own: real ranks (forked processes)
// meet at a rendezvous that hands its connections to the relay, then one rank dies, reports or
// says goodbye, and every rank's verdict is checked.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "core/base/error.h"
#include "tests/support/multiproc.h"
#include "transport/failure_relay.h"
#include "transport/rendezvous.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;
using transport::FailureRelay;

transport::RendezvousOptions Options(const RankContext& ctx) {
  return {"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size, "relay test\n", "t0ken"};
}

// Rendezvous with a relay attached; returns the relay.
std::unique_ptr<FailureRelay> Meet(const RankContext& ctx) {
  auto relay = std::make_unique<FailureRelay>(Options(ctx));
  auto o = Options(ctx);
  o.relay = relay.get();
  transport::RendezvousAllGather(o, std::to_string(ctx.rank), Deadline::After(20));
  EXPECT_TRUE(relay->attached());
  return relay;
}

std::string WaitForVerdict(const FailureRelay& relay, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    if (auto v = relay.verdict()) return fmt::format("{}|{}", v->rank, v->reason);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return "none";
}

TEST(FailureRelay, ARankThatDiesIsTheVerdictOnEveryRank) {
  for (int victim : {2, 0}) {
    auto results = RunRanks(4, [victim](const RankContext& ctx) {
      auto relay = Meet(ctx);
      if (ctx.rank == victim) _exit(9);  // no goodbye, no report: as SIGKILL would
      return WaitForVerdict(*relay, 5);
    });
    for (int r = 0; r < 4; ++r) {
      if (r == victim) continue;
      ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
      const std::string want =
          victim == 0 ? "0|rank 0 is gone: its connection to this rank closed without a goodbye"
                      : fmt::format("{}|rank {} exited without reporting an error", victim, victim);
      EXPECT_EQ(results[r].output.rfind(want, 0), 0u) << "rank " << r << ": " << results[r].output;
    }
  }
}

// Rank 3 blames rank 1 (it waited on it); rank 1 then reports its own error: rank 1's words are
// the verdict, on every rank, including the two that reported.
TEST(FailureRelay, TheBlamedRanksOwnReportIsTheVerdict) {
  auto results = RunRanks(4, [](const RankContext& ctx) {
    auto relay = Meet(ctx);
    if (ctx.rank == 3) {
      Error e(ErrorCode::kDeadlineExceeded, "rank 3: no chunk from rank 1 within 5 s");
      e.set_culprit(1);
      auto v = relay->Report(e, 5);
      return fmt::format("{}|{}", v.rank, v.reason);
    }
    if (ctx.rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      auto v = relay->Report(Error(ErrorCode::kNumerical, "rank 1: the loss is NaN at step 7"), 5);
      return fmt::format("{}|{}", v.rank, v.reason);
    }
    return WaitForVerdict(*relay, 5);
  });
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "1|rank 1: the loss is NaN at step 7") << "rank " << r;
  }
  // And what each rank then prints.
  const Error own(ErrorCode::kUnavailable, "rank 2: rank 1 closed the connection");
  const Error explained = FailureRelay::Explain(own, 2, {1, "rank 1: the loss is NaN at step 7"});
  EXPECT_STREQ(explained.what(),
               "rank 2: the job failed because of rank 1: rank 1: the loss is NaN at step 7 (this "
               "rank's own error: rank 2: rank 1 closed the connection)");
  EXPECT_EQ(explained.culprit(), 1);
  EXPECT_EQ(explained.code(), ErrorCode::kUnavailable);
  const Error self(ErrorCode::kNumerical, "rank 1: the loss is NaN at step 7");
  EXPECT_STREQ(FailureRelay::Explain(self, 1, {1, "x"}).what(), self.what());
}

// A stalled rank (here rank 2) neither reports nor closes; every rank around it times out
// waiting on its own left neighbour. Rank 0 follows the blame (1 -> 0 -> 3 -> 2) to the silent
// rank, and every rank gets that verdict.
TEST(FailureRelay, TheBlameLeadsToTheSilentRank) {
  auto results = RunRanks(4, [](const RankContext& ctx) {
    auto relay = Meet(ctx);
    if (ctx.rank == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // silent, connected
      return WaitForVerdict(*relay, 1);
    }
    const int left = (ctx.rank + 3) % 4;
    Error e(ErrorCode::kDeadlineExceeded,
            fmt::format("rank {}: timed out waiting for a chunk header from rank {}", ctx.rank,
                        left));
    e.set_culprit(left);
    std::this_thread::sleep_for(std::chrono::milliseconds(40 * ctx.rank));  // not all at once
    auto v = relay->Report(e);
    return fmt::format("{}|{}", v.rank, v.reason);
  });
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output.rfind("2|rank 2 stopped responding: it has neither reported an "
                                      "error nor exited (stopped or hung?)",
                                      0),
              0u)
        << "rank " << r << ": " << results[r].output;
  }
}

// Rank 0 itself stopped (SIGSTOP: its relay thread too): nobody answers the reports, and every
// rank takes rank 0 as the failed rank after FailureRelay::kReportWaitS.
TEST(FailureRelay, ASilentRank0IsTheVerdictAfterTheReportWait) {
  auto results = RunRanks(
      3,
      [](const RankContext& ctx) {
        auto relay = Meet(ctx);
        if (ctx.rank == 0) kill(getpid(), SIGSTOP);  // the harness kills it at its timeout
        Error e(ErrorCode::kDeadlineExceeded, fmt::format("rank {}: timed out", ctx.rank));
        e.set_culprit(ctx.rank - 1);
        auto v = relay->Report(e);
        return fmt::format("{}|{}", v.rank, v.reason);
      },
      8);
  for (int r = 1; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output.rfind("0|rank 0 did not answer this rank's failure report within "
                                      "2.5 s while its connection stayed open",
                                      0),
              0u)
        << "rank " << r << ": " << results[r].output;
  }
}

// Ranks that end normally say goodbye: their connections closing is no failure.
TEST(FailureRelay, GoodbyeThenExitIsNoFailure) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    auto relay = Meet(ctx);
    relay->Goodbye();
    if (ctx.rank == 1) {
      relay.reset();  // closes at once
      return std::string("none");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    return WaitForVerdict(*relay, 0.1);
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "none") << "rank " << r;
  }
}

// A rank that fails before it could join tells rank 0, which fails the rendezvous for every
// rank, naming it, at once rather than at the deadline.
TEST(FailureRelay, AFailureBeforeJoiningFailsTheRendezvousAtOnce) {
  auto results = RunRanks(3, [](const RankContext& ctx) {
    const auto start = std::chrono::steady_clock::now();
    if (ctx.rank == 2) {
      FailureRelay relay(Options(ctx));
      relay.Report(Error(ErrorCode::kNotFound, "rank 2: /data/train.gz: no such file"));
      return std::string("reported");
    }
    try {
      Meet(ctx);
    } catch (const Error& e) {
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return fmt::format("{}|{}|{}", e.culprit(), s < 5 ? "soon" : "late", e.what());
    }
    return std::string("no error");
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output.rfind("2|soon|", 0), 0u) << results[r].output;
    EXPECT_NE(results[r].output.find("rank 2 (from 127.0.0.1:"), std::string::npos)
        << results[r].output;
    EXPECT_NE(results[r].output.find(
                  ") failed before it could join: rank 2: /data/train.gz: no such file"),
              std::string::npos)
        << results[r].output;
  }
}

}  // namespace
}  // namespace pipesgd

// Issue 48: the supervisor parsed a sentence that failure_relay.cc wrote separately; now one
// pair of functions writes and reads it. The rank an explained error names is the one read back,
// whatever the reason quotes, and a text without a whole verdict names none.
TEST(FailureRelay, TheVerdictAnErrorNamesIsTheOneTheLauncherReads) {
  const pipesgd::Error own(pipesgd::ErrorCode::kUnavailable, "receive from rank 1 failed");
  for (const int failed : {0, 1, 7, 1023}) {
    const pipesgd::Error same = pipesgd::transport::FailureRelay::Explain(
        own, 5, {failed, "receive from rank 1 failed"});
    const pipesgd::Error other = pipesgd::transport::FailureRelay::Explain(
        own, 5, {failed, "rank 9: the job failed because of rank 9 once: not a verdict"});
    EXPECT_EQ(pipesgd::transport::FailureRelay::BlamedRankIn(same.what()), failed) << same.what();
    EXPECT_EQ(pipesgd::transport::FailureRelay::BlamedRankIn(
                  std::string("[rank 5] log line\nerror: ") + other.what() + "\n"),
              failed)
        << "a reason that quotes the words: " << other.what();
    EXPECT_EQ(same.culprit(), failed);
  }
  EXPECT_EQ(pipesgd::transport::FailureRelay::BlamedRankIn("no verdict here"), -1);
  EXPECT_EQ(pipesgd::transport::FailureRelay::BlamedRankIn("the job failed because of rank :"), -1);
  EXPECT_EQ(pipesgd::transport::FailureRelay::BlamedRankIn("the job failed because of rank 3"), -1);
  EXPECT_EQ(pipesgd::transport::FailureRelay::BlamedRankIn(
                "x: the job failed because of rank 2: y\nz: the job failed because of rank 4: w"),
            4);
}
