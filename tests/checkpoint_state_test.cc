// A ring job's checkpoint as the worker takes and restores it (core/train/checkpoint.h): the
// mapping between the trainer's snapshot and the file's fields, exact to the bit, and the
// states that must never become a checkpoint or a resume.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/train/checkpoint.h"

namespace pipesgd::train {
namespace {

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  // memcmp must not see the null data() of an empty vector.
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TrainerSnapshot Width3Snapshot() {
  TrainerSnapshot s;
  s.steps = 7;
  s.applied = 5;
  s.losses = {2.5f, 1.25f, std::numeric_limits<float>::quiet_NaN(), -0.0f};
  s.pending.push_back({5, {0.5f, -1.5f, 3.0f}, {0.25f, 1e-38f, -0.0f}});
  s.pending.push_back({6, {1.0f, 2.0f, 0.125f}, {}});
  return s;
}

TEST(CheckpointState, CaptureThenRestoreGivesTheSameStateToTheBit) {
  const std::vector<float> params = {1.0f, -2.0f, 1e-40f, -0.0f};
  const std::vector<float> opt = {0.1f, 0.2f, 0.3f, 0.4f};
  const std::vector<float> residual = {0.0f, 1e-7f, -1e-7f};
  const TrainerSnapshot snapshot = Width3Snapshot();
  const checkpoint::Checkpoint c =
      CaptureCheckpoint({"the job", 2, 4, 19, params, opt, residual}, snapshot);
  EXPECT_EQ(c.job(), "the job");
  EXPECT_EQ(c.rank(), 2);
  EXPECT_EQ(c.world_size(), 4);
  EXPECT_EQ(c.collective_sequence(), 19u);
  EXPECT_EQ(c.steps(), 7);
  EXPECT_EQ(c.applied(), 5);
  EXPECT_TRUE(SameBits({c.params().begin(), c.params().end()}, params));
  EXPECT_TRUE(SameBits({c.optimizer_state().begin(), c.optimizer_state().end()}, opt));
  EXPECT_TRUE(SameBits({c.residual().begin(), c.residual().end()}, residual));

  // Through the file's bytes, as a resume reads it.
  checkpoint::Checkpoint read;
  ASSERT_TRUE(read.ParseFromString(c.SerializeAsString()));
  const TrainerSnapshot back = SnapshotFromCheckpoint(read);
  EXPECT_EQ(back.steps, snapshot.steps);
  EXPECT_EQ(back.applied, snapshot.applied);
  EXPECT_TRUE(SameBits(back.losses, snapshot.losses));  // NaN and -0.0 included
  ASSERT_EQ(back.pending.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back.pending[i].step, snapshot.pending[i].step);
    EXPECT_TRUE(SameBits(back.pending[i].aggregate, snapshot.pending[i].aggregate)) << i;
    EXPECT_TRUE(SameBits(back.pending[i].local, snapshot.pending[i].local)) << i;
  }
}

TEST(CheckpointState, ANonFiniteParameterIsNeverCaptured) {
  const std::vector<float> params = {1.0f, 2.0f, std::numeric_limits<float>::infinity()};
  try {
    CaptureCheckpoint({"job", 3, 4, 0, params, {}, {}}, Width3Snapshot());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNumerical);
    EXPECT_STREQ(e.what(), "rank 3: step 7: parameter 2 is inf; not writing a checkpoint of "
                           "this state");
  }
}

TEST(CheckpointState, AnotherJobOrAnotherShapeCannotResume) {
  const std::vector<float> params = {1.0f, 2.0f};
  const checkpoint::Checkpoint c =
      CaptureCheckpoint({"line 1\nlr 0.1\n", 0, 4, 0, params, {}, {}}, Width3Snapshot());
  EXPECT_NO_THROW(CheckCheckpointFitsJob(c, "/ckpt", "line 1\nlr 0.1\n", 4, 2));
  try {
    CheckCheckpointFitsJob(c, "/ckpt", "line 1\nlr 0.2\n", 4, 2);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string what = e.what();
    EXPECT_NE(what.find("the checkpoint of step 7 in /ckpt was written by another job"),
              std::string::npos) << what;
    EXPECT_NE(what.find("lr 0.2"), std::string::npos) << what;
  }
  try {
    CheckCheckpointFitsJob(c, "/ckpt", "line 1\nlr 0.1\n", 2, 2);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_STREQ(e.what(), "--resume: checkpoint of step 7 has world size 4 and 2 parameters, "
                           "the job has 2 and 2");
  }
}

}  // namespace
}  // namespace pipesgd::train
