// SDPipe's group scheduler (core/train/sdpipe_scheduler.h) with scripted arrival times: the
// groups it forms, the wait window's growth and decay, the forced connectivity after P rounds,
// the epoch barrier, and bad input. All asserted exactly (times are injected).
#include <gtest/gtest.h>

#include "core/base/error.h"
#include "core/train/sdpipe_scheduler.h"

namespace pipesgd {
namespace {

using train::GroupDecision;
using train::GroupScheduler;
using train::GroupSchedulerOptions;
using train::RoundKind;

GroupSchedulerOptions Options(int n, int period) {
  GroupSchedulerOptions o;
  o.world_size = n;
  o.period = period;
  return o;  // window 1 ms in [0.01 ms, 10 ms], x2 / x0.9, min group 2: the notes' defaults
}

TEST(GroupScheduler, NormalRoundClosesWhenTheWindowEndsWithWhoeverIsReady) {
  GroupScheduler s(Options(4, 100));
  EXPECT_EQ(s.pending_kind(), RoundKind::kNormal);
  s.Arrive(2, 10.0);
  s.Arrive(0, 10.0005);
  EXPECT_EQ(s.wake_time(), 10.0 + 0.001);
  EXPECT_FALSE(s.Decide(10.0009).has_value());
  std::optional<GroupDecision> d = s.Decide(10.001);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->members, (std::vector<int>{0, 2}));  // sorted, not in arrival order
  EXPECT_EQ(d->kind, RoundKind::kNormal);
  EXPECT_EQ(d->round, 0);
  EXPECT_EQ(d->updates, 2);
  EXPECT_FALSE(d->epoch_end);
  // A group of 2 >= min_group: the window shrinks by 0.9.
  EXPECT_EQ(s.window_s(), 0.001 * 0.9);
  EXPECT_FALSE(s.Decide(11.0).has_value());  // nobody waiting
  EXPECT_EQ(s.wake_time(), std::numeric_limits<double>::infinity());
}

TEST(GroupScheduler, AllReadyClosesAtOnce) {
  GroupScheduler s(Options(3, 100));
  s.Arrive(1, 0.0);
  s.Arrive(2, 0.0);
  EXPECT_FALSE(s.Decide(0.0).has_value());
  s.Arrive(0, 0.0);
  auto d = s.Decide(0.0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->members, (std::vector<int>{0, 1, 2}));
}

TEST(GroupScheduler, WindowGrowsWhenRanksEndUpAloneAndDecaysWhenGroupsForm) {
  GroupScheduler s(Options(4, 1000));
  double t = 0;
  const double expected_growth[] = {0.002, 0.004, 0.008, 0.01, 0.01};  // x2, capped at 10 ms
  for (double w : expected_growth) {
    s.Arrive(3, t);
    const double before = s.window_s();
    EXPECT_FALSE(s.Decide(t + before / 2).has_value());
    auto d = s.Decide(t + before);
    ASSERT_TRUE(d.has_value());
    EXPECT_EQ(d->members, (std::vector<int>{3}));
    EXPECT_EQ(s.window_s(), w);
    t += 1;
  }
  // Pairs: x0.9 per round, floored at 0.01 ms.
  double w = 0.01;
  for (int i = 0; i < 80; ++i) {
    s.Arrive(0, t);
    s.Arrive(1, t);
    auto d = s.Decide(t + s.window_s());
    ASSERT_TRUE(d.has_value());
    EXPECT_EQ(d->members, (std::vector<int>{0, 1}));
    w = std::max(w * 0.9, 1e-5);
    EXPECT_EQ(s.window_s(), w) << "round " << i;
    t += 1;
  }
  EXPECT_EQ(s.window_s(), 1e-5);
}

TEST(GroupScheduler, ForcesConnectivityAfterPRounds) {
  // N = 4, P = 2: after (P-1)*N = 4 worker-updates the next round waits until the union of the
  // groups since the last reset connects everyone.
  GroupScheduler s(Options(4, 2));
  s.Arrive(0, 0.0);
  s.Arrive(1, 0.0);
  auto d = s.Decide(1.0);
  ASSERT_TRUE(d && d->members == (std::vector<int>{0, 1}));
  EXPECT_EQ(s.pending_kind(), RoundKind::kNormal);  // 2 updates
  s.Arrive(3, 2.0);
  s.Arrive(2, 2.0);
  d = s.Decide(3.0);
  ASSERT_TRUE(d && d->members == (std::vector<int>{2, 3}));
  EXPECT_EQ(s.pending_kind(), RoundKind::kConnect);  // 4 updates: {0,1} and {2,3} apart
  s.Arrive(0, 4.0);
  EXPECT_EQ(s.wake_time(), std::numeric_limits<double>::infinity());  // no window
  EXPECT_FALSE(s.Decide(100.0).has_value());
  s.Arrive(1, 101.0);  // {0,1} again: still two components
  EXPECT_FALSE(s.Decide(200.0).has_value());
  s.Arrive(3, 201.0);  // joins {2,3} to {0,1}: connected without rank 2
  d = s.Decide(201.0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->members, (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(d->kind, RoundKind::kConnect);
  EXPECT_EQ(d->updates, 7);
  // The union restarts: the next rounds are normal again until 4 more updates.
  EXPECT_EQ(s.pending_kind(), RoundKind::kNormal);
  const double window = s.window_s();
  EXPECT_EQ(window, 0.001 * 0.9 * 0.9);  // connect rounds leave the window alone
  s.Arrive(2, 300.0);
  d = s.Decide(300.0 + window);
  ASSERT_TRUE(d && d->members == (std::vector<int>{2}) && d->kind == RoundKind::kNormal);
}

TEST(GroupScheduler, PeriodOneIsAlwaysEveryone) {
  GroupScheduler s(Options(3, 1));
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(s.pending_kind(), RoundKind::kConnect);
    s.Arrive(2, round);
    s.Arrive(0, round);
    EXPECT_FALSE(s.Decide(round + 0.5).has_value());  // no window: waits for rank 1
    s.Arrive(1, round + 0.6);
    auto d = s.Decide(round + 0.6);
    ASSERT_TRUE(d.has_value());
    EXPECT_EQ(d->members, (std::vector<int>{0, 1, 2}));
  }
}

TEST(GroupScheduler, EpochBarrierSynchronizesEveryoneAndTheLastOneStops) {
  GroupSchedulerOptions o = Options(2, 1000);
  o.epoch_updates = 4;  // 2 steps per epoch x 2 ranks
  o.total_updates = 8;
  GroupScheduler s(o);
  s.Arrive(0, 0.0);
  auto d = s.Decide(1.0);  // alone
  ASSERT_TRUE(d && d->members == (std::vector<int>{0}) && d->updates == 1);
  // The barrier's 2 updates end the epoch at 4: this round may take 1 more. Rank 0 came first;
  // rank 1's step is kept for the barrier.
  s.Arrive(0, 2.0);
  s.Arrive(1, 2.0);
  d = s.Decide(2.0);
  ASSERT_TRUE(d && d->members == (std::vector<int>{0}) && d->updates == 2);
  EXPECT_EQ(d->kind, RoundKind::kNormal);
  EXPECT_FALSE(d->epoch_end);
  EXPECT_EQ(s.pending_kind(), RoundKind::kBarrier);  // rank 1 waits in it
  EXPECT_EQ(s.waiting(), (std::vector<int>{1}));
  EXPECT_FALSE(s.Decide(1000.0).has_value());  // waits for everyone, however long
  s.Arrive(0, 1001.0);
  d = s.Decide(1001.0);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->members, (std::vector<int>{0, 1}));
  EXPECT_EQ(d->kind, RoundKind::kBarrier);
  EXPECT_TRUE(d->epoch_end);
  EXPECT_EQ(d->epoch, 1);
  EXPECT_FALSE(d->stop);
  EXPECT_EQ(d->updates, 4);  // exactly the epoch's
  s.Arrive(1, 1002.0);
  d = s.Decide(1002.0 + s.window_s());
  ASSERT_TRUE(d && d->members == (std::vector<int>{1}) && d->updates == 5);
  EXPECT_EQ(s.pending_kind(), RoundKind::kNormal);
  s.Arrive(1, 1003.0);
  d = s.Decide(1003.0 + s.window_s());
  ASSERT_TRUE(d && d->updates == 6);
  EXPECT_EQ(s.pending_kind(), RoundKind::kBarrier);  // the total less 2: the last barrier
  s.Arrive(1, 1004.0);
  s.Arrive(0, 1004.0);
  d = s.Decide(1004.0);
  ASSERT_TRUE(d.has_value());
  EXPECT_TRUE(d->epoch_end);
  EXPECT_TRUE(d->stop);
  EXPECT_EQ(d->epoch, 2);
  EXPECT_EQ(d->updates, 8);  // exactly the total
  EXPECT_TRUE(s.stopped());
  try {
    s.Arrive(0, 1005.0);
    FAIL() << "an arrival after the last round was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("after the job's last round"), std::string::npos)
        << e.what();
  }
}

// train.max_steps in SDPIPE (issue 45: 120 asked, 116 local steps on rank 0 and more than 120
// global ones done): whatever the ranks' speeds and groups, every barrier ends exactly at its
// boundary and the last one at the total, also when the total is no multiple of the epoch, of
// the period or of a round. 3 ranks at different paces, 7 steps per epoch, 23 steps in all.
TEST(GroupScheduler, BarriersAndTheTotalAreExactWhateverThePaces) {
  for (int period : {1, 2, 10}) {
    GroupSchedulerOptions o = Options(3, period);
    o.epoch_updates = 7 * 3;
    o.total_updates = 23 * 3;
    o.eval_updates = 5 * 3;
    GroupScheduler s(o);
    const double pace[3] = {1e-3, 1.7e-3, 4.1e-3};  // seconds per local step
    double ready_at[3] = {pace[0], pace[1], pace[2]};
    bool waiting[3] = {false, false, false};
    std::vector<int64_t> barrier_updates;
    int64_t last_updates = 0;
    for (double now = 0; !s.stopped() && now < 10; now += 1e-4) {
      for (int r = 0; r < 3; ++r) {
        if (!waiting[r] && now >= ready_at[r]) {
          s.Arrive(r, now);
          waiting[r] = true;
        }
      }
      while (auto d = s.Decide(now)) {
        EXPECT_GT(d->updates, last_updates);
        last_updates = d->updates;
        if (d->kind == RoundKind::kBarrier) barrier_updates.push_back(d->updates);
        for (int r : d->members) {
          waiting[r] = false;
          ready_at[r] = now + pace[r];
        }
      }
    }
    ASSERT_TRUE(s.stopped()) << "period " << period;
    EXPECT_EQ(s.updates(), 23 * 3) << "period " << period;
    // Evaluations at multiples of 5 steps, epochs at 7, 14 and 21 steps, the total at 23 (45
    // follows 42 at once: its quota is 0 right after the epoch's barrier).
    EXPECT_EQ(barrier_updates, (std::vector<int64_t>{15, 21, 30, 42, 45, 60, 63, 69}))
        << "period " << period;
  }
}

TEST(GroupScheduler, BadArrivalsAreClearErrors) {
  GroupScheduler s(Options(4, 10));
  auto expect_error = [&](int rank, const std::string& text) {
    try {
      s.Arrive(rank, 0.0);
      FAIL() << "rank " << rank << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error(-1, "a request from rank -1: expected a rank in [0, 4)");
  expect_error(4, "a request from rank 4: expected a rank in [0, 4)");
  s.Arrive(1, 0.0);
  expect_error(1, "rank 1 asked for a group twice in round 0");
}

TEST(GroupScheduler, BadOptionsAreClearErrors) {
  auto expect_error = [](GroupSchedulerOptions o, const std::string& text) {
    try {
      GroupScheduler s(o);
      FAIL() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  GroupSchedulerOptions o = Options(4, 0);
  expect_error(o, "period P = 0");
  o = Options(4, 10);
  o.min_group = 5;
  expect_error(o, "min_group = 5: expected an integer in [1, world size]");
  o = Options(4, 10);
  o.window_init_s = 0.5;
  expect_error(o, "window_init_s = 0.5");
  o = Options(4, 10);
  o.window_shrink = 1.5;
  expect_error(o, "window_shrink = 1.5");
}

// train.eval_every_steps in SDPIPE: a barrier at every multiple of eval_updates (an evaluation
// point, not an epoch's end), besides the epoch's; the epoch count is unchanged by them.
TEST(GroupScheduler, EvaluationBarriersComeBetweenTheEpochOnes) {
  GroupSchedulerOptions o = Options(2, 100);
  o.epoch_updates = 8;
  o.total_updates = 16;
  o.eval_updates = 4;
  GroupScheduler s(o);
  double now = 0;
  // Rounds of both ranks (2 updates each); returns the decision.
  auto round = [&] {
    s.Arrive(0, now);
    s.Arrive(1, now);
    auto d = s.Decide(now);
    now += 1;
    EXPECT_TRUE(d.has_value());
    return *d;
  };
  GroupDecision d = round();  // 2: the evaluation's barrier (2 more) is next
  EXPECT_EQ(d.kind, RoundKind::kNormal);
  EXPECT_FALSE(d.evaluate);
  EXPECT_EQ(s.pending_kind(), RoundKind::kBarrier);
  d = round();  // 4: the evaluation's barrier
  EXPECT_EQ(d.kind, RoundKind::kBarrier);
  EXPECT_TRUE(d.evaluate);
  EXPECT_FALSE(d.epoch_end);
  EXPECT_EQ(d.epoch, 0);
  EXPECT_EQ(d.updates, 4);
  d = round();  // 6
  EXPECT_EQ(s.pending_kind(), RoundKind::kBarrier);
  d = round();  // 8: the epoch's barrier (and the next evaluation's)
  EXPECT_TRUE(d.evaluate);
  EXPECT_TRUE(d.epoch_end);
  EXPECT_EQ(d.epoch, 1);
  EXPECT_FALSE(d.stop);
  EXPECT_EQ(d.updates, 8);
  d = round();  // 10
  EXPECT_EQ(s.pending_kind(), RoundKind::kBarrier);
  d = round();  // 12: an evaluation's barrier
  EXPECT_TRUE(d.evaluate);
  EXPECT_FALSE(d.epoch_end);
  EXPECT_EQ(d.updates, 12);
  d = round();  // 14
  EXPECT_EQ(s.pending_kind(), RoundKind::kBarrier);
  d = round();  // 16: the last barrier ends the epoch and the job
  EXPECT_TRUE(d.evaluate);
  EXPECT_TRUE(d.epoch_end);
  EXPECT_TRUE(d.stop);
  EXPECT_EQ(d.epoch, 2);
  EXPECT_EQ(d.updates, 16);
}

}  // namespace
}  // namespace pipesgd
