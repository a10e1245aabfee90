// core/base: errors carry their code and context; deadlines expire when they should; the median.
#include <gtest/gtest.h>

#include <thread>

#include "core/base/deadline.h"
#include "core/base/error.h"
#include "core/base/measure.h"

namespace pipesgd {
namespace {

TEST(Error, CarriesCodeAndFormattedMessage) {
  try {
    Throw(ErrorCode::kDataLoss, "{}: expected {} bytes, got {}", "file.idx", 16, 3);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_STREQ(e.what(), "file.idx: expected 16 bytes, got 3");
  }
}

TEST(Error, WrapAddsContextAndKeepsTheCode) {
  Error e(ErrorCode::kUnavailable, "connection reset");
  Error wrapped = e.Wrap("rank 2: AllReduce #7");
  EXPECT_EQ(wrapped.code(), ErrorCode::kUnavailable);
  EXPECT_STREQ(wrapped.what(), "rank 2: AllReduce #7: connection reset");
  EXPECT_EQ(ErrorCodeName(ErrorCode::kDeadlineExceeded), "deadline exceeded");
}

TEST(Deadline, ExpiresAfterItsTime) {
  Deadline d = Deadline::After(0.05);
  EXPECT_FALSE(d.expired());
  EXPECT_GT(d.remaining_s(), 0.0);
  EXPECT_LE(d.remaining_s(), 0.05);
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  EXPECT_TRUE(d.expired());
  EXPECT_EQ(d.remaining_s(), 0.0);
  EXPECT_TRUE(Deadline::After(0).expired());
  EXPECT_TRUE(Deadline::After(-1).expired());
  EXPECT_FALSE(Deadline::Infinite().expired());
}

TEST(Deadline, MinPicksTheEarlier) {
  Deadline far = Deadline::After(100);
  EXPECT_LE(far.Min(1).remaining_s(), 1.0);
  Deadline near = Deadline::After(1);
  EXPECT_EQ(near.Min(100).when(), near.when());
}

TEST(Median, MiddleSampleOrTheMeanOfTheTwoMiddleOnes) {
  EXPECT_EQ(Median({}), 0.0);
  EXPECT_EQ(Median({7.0}), 7.0);
  EXPECT_EQ(Median({3.0, 1.0, 2.0}), 2.0);
  // Two ranks: their mean, not the slower one (the spread printed min / max / max).
  EXPECT_EQ(Median({1.0, 4.0}), 2.5);
  EXPECT_EQ(Median({9.0, 1.0, 5.0, 3.0}), 4.0);
  EXPECT_EQ(Median({2.0, 2.0, 2.0, 8.0}), 2.0);
}

}  // namespace
}  // namespace pipesgd
