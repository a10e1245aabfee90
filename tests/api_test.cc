// The embedding API (include/pipesgd/pipesgd.h) as a program outside pipesgd uses it: Connect
// from a rendezvous, AllReduce on the caller's buffers (exact sums, with and without an exact
// codec), and the width-2 trainer driving a model given as two callbacks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "pipesgd/pipesgd.h"
#include "tests/support/multiproc.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;

ConnectOptions Rendezvous(const RankContext& ctx) {
  ConnectOptions o;
  o.master_port = ctx.master_port;
  o.rank = ctx.rank;
  o.world_size = ctx.world_size;
  o.token = "api-test-token";
  o.chunk_bytes = 256;  // 64 floats: many chunks per ring block
  o.timeout_s = 30;
  return o;
}

// Rank r holds r * 1000 + (i % 97): every sum is an integer far below 2^24, so exact.
std::string CheckSums(const RankContext& ctx, CodecKind codec) {
  auto o = Rendezvous(ctx);
  o.codec = codec;
  Communicator comm = Connect(o);
  const int n = 1001;
  std::vector<float> data(n);
  for (int i = 0; i < n; ++i) data[i] = static_cast<float>(ctx.rank * (codec == CodecKind::kNone ? 1000 : 3) + i % 97);
  comm.AllReduce(data, ReduceOp::kSum, 30);
  const int w = ctx.world_size;
  const int scale = codec == CodecKind::kNone ? 1000 : 3;
  for (int i = 0; i < n; ++i) {
    const float want = static_cast<float>(scale * w * (w - 1) / 2 + w * (i % 97));
    if (data[i] != want) return "element " + std::to_string(i) + ": " + std::to_string(data[i]) + " want " + std::to_string(want);
  }
  return "ok";
}

TEST(ApiAllReduce, ExactSumsOnTheCallersBuffer) {
  auto results = RunRanks(3, [](const RankContext& ctx) { return CheckSums(ctx, CodecKind::kNone); });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "ok") << "rank " << r;
  }
}

// fp16 holds every integer up to 2048 exactly, and every partial sum here stays below 400.
TEST(ApiAllReduce, Fp16CompressionExactOnSmallIntegers) {
  auto results = RunRanks(3, [](const RankContext& ctx) { return CheckSums(ctx, CodecKind::kFp16); });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "ok") << "rank " << r;
  }
}

// Every float bit pattern but NaNs (whose payload an addition may quieten): both zeros,
// subnormals, infinities. Rank r's element i.
float Pattern(int rank, size_t i) {
  uint32_t bits = static_cast<uint32_t>((rank + 1) * 2654435761u) ^ static_cast<uint32_t>(i * 40503u);
  if (i % 5 == 0) bits = i % 10 == 0 ? 0x80000000u : 0u;  // -0.0 and +0.0
  if (i % 7 == 0) bits = (bits & 0x80000000u) | (bits & 0x007fffffu);  // subnormal
  if (i % 11 == 0) bits = (bits & 0x80000000u) | 0x7f800000u;  // infinity
  float f;
  std::memcpy(&f, &bits, sizeof f);
  if (std::isnan(f)) f = static_cast<float>(i);
  return f;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Broadcast from every root, AllGather and Barrier on one communicator, checked bit for bit.
std::string CheckBroadcastGather(const RankContext& ctx) {
  Communicator comm = Connect(Rendezvous(ctx));
  const size_t n = 1000;
  const int w = ctx.world_size;
  for (int root = 0; root < w; ++root) {
    std::vector<float> data(n);
    for (size_t i = 0; i < n; ++i) data[i] = Pattern(ctx.rank, i);
    comm.Broadcast(data, root, 30);
    for (size_t i = 0; i < n; ++i) {
      if (!SameBits(data[i], Pattern(root, i))) {
        return "broadcast from " + std::to_string(root) + ": element " + std::to_string(i);
      }
    }
  }
  std::vector<float> mine(n);
  for (size_t i = 0; i < n; ++i) mine[i] = Pattern(ctx.rank, i);
  std::vector<float> all(n * w, 1.0f);
  comm.AllGather(mine, all, 30);
  for (int r = 0; r < w; ++r) {
    for (size_t i = 0; i < n; ++i) {
      if (!SameBits(all[r * n + i], Pattern(r, i))) {
        return "allgather: rank " + std::to_string(r) + " element " + std::to_string(i);
      }
    }
  }
  comm.Barrier(30);
  return "ok";
}

TEST(ApiCollectives, BroadcastAndAllGatherAreBitwiseExact) {
  auto results = RunRanks(3, CheckBroadcastGather);
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "ok") << "rank " << r;
  }
}

// Wrong sizes and roots are named before anything goes on the wire, so the ring stays usable.
std::string CheckBadArguments(const RankContext& ctx) {
  Communicator comm = Connect(Rendezvous(ctx));
  std::string out;
  std::vector<float> mine(4), all(7);
  try {
    comm.AllGather(mine, all, 30);
    out += "no error;";
  } catch (const Error& e) {
    out += std::string(e.what()).find("4 floats per rank into 7 floats: expected world size 2 x "
                                      "4 = 8") != std::string::npos ? "size;" : e.what();
  }
  try {
    comm.Broadcast(mine, 2, 30);
    out += "no error;";
  } catch (const Error& e) {
    out += std::string(e.what()).find("root 2: expected 0 <= root < 2") != std::string::npos
               ? "root;" : e.what();
  }
  std::vector<float> one = {static_cast<float>(ctx.rank + 1)};
  comm.AllReduce(one, ReduceOp::kSum, 30);
  out += std::to_string(static_cast<int>(one[0]));
  Communicator moved = std::move(comm);
  try {
    comm.Barrier(30);
    out += ";no error";
  } catch (const Error& e) {
    out += std::string(e.what()).find("moved from") != std::string::npos ? ";moved" : e.what();
  }
  try {
    Trainer trainer(moved, mine, nullptr, PlainSgd(1));
    out += ";no error";
  } catch (const Error& e) {
    out += std::string(e.what()).find("gradient callback is empty") != std::string::npos
               ? ";callback" : e.what();
  }
  return out;
}

TEST(ApiCollectives, BadArgumentsAreNamedAndTheRingStaysUsable) {
  auto results = RunRanks(2, CheckBadArguments);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "size;root;3;moved;callback") << "rank " << r;
  }
}

TEST(ApiConnect, RejectsABadRank) {
  ConnectOptions o;
  o.rank = 2;
  o.world_size = 2;
  try {
    Connect(o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("rank 2"), std::string::npos) << e.what();
  }
}

// f_r(w) = |w - c_r|^2 / 2 with c_r = (r, -r, 2r): the rank average of the gradients is
// w - mean(c), so width-2 Pipe-SGD with lr 0.5 converges to mean(c) = (1, -1, 2) on 3 ranks.
std::string TrainCallersModel(const RankContext& ctx) {
  Communicator comm = Connect(Rendezvous(ctx));
  const float r = static_cast<float>(ctx.rank);
  const std::vector<float> c = {r, -r, 2 * r};
  GradientFn gradient = [&](int64_t, std::span<const float> w, std::span<float> g) {
    float loss = 0;
    for (size_t i = 0; i < 3; ++i) {
      g[i] = w[i] - c[i];
      loss += 0.5f * g[i] * g[i];
    }
    return loss;
  };
  std::vector<float> w = {0, 0, 0};
  auto losses = Train(comm, w, 60, gradient, PlainSgd(0.5f), {.pipeline_width = 2, .timeout_s = 30});
  // The same run one Step at a time on the same ring: bitwise the same weights and losses.
  std::vector<float> v = {0, 0, 0};
  {
    Trainer trainer(comm, v, gradient, PlainSgd(0.5f), {.pipeline_width = 2, .timeout_s = 30});
    for (int t = 0; t < 60; ++t) trainer.Step();
    trainer.Drain();
    if (trainer.steps() != 60) return "steps " + std::to_string(trainer.steps());
    for (int t = 0; t < 60; ++t) {
      if (!SameBits(trainer.StepLoss(t), losses[t])) return "loss of step " + std::to_string(t);
    }
  }
  for (size_t i = 0; i < 3; ++i) {
    if (!SameBits(v[i], w[i])) return "Trainer and Train differ at " + std::to_string(i);
  }
  return testing::PackFloats(w.data(), w.size()) + testing::PackFloats(losses.data(), losses.size());
}

// The launcher's environment as ConnectOptions: Open MPI's variables across nodes give rank 0's
// address (mpirun's host), so bind_host is left to the route toward it; the token is taken.
TEST(ApiConnect, OptionsFromTheLaunchersEnvironment) {
  const std::vector<std::pair<const char*, const char*>> vars = {
      {"OMPI_COMM_WORLD_RANK", "1"},
      {"OMPI_COMM_WORLD_SIZE", "2"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
      {"OMPI_MCA_orte_hnp_uri", "7.0;tcp://10.1.2.3:4000"},
      {"PIPESGD_JOB_TOKEN", "t0ken"}};
  for (const auto& [k, v] : vars) setenv(k, v, 1);
  const pipesgd::ConnectOptions o = pipesgd::ConnectOptionsFromEnv();
  for (const auto& [k, v] : vars) unsetenv(k);
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.world_size, 2);
  EXPECT_EQ(o.master_addr, "10.1.2.3");
  EXPECT_EQ(o.bind_host, "");
  EXPECT_EQ(o.token, "t0ken");
  const pipesgd::ConnectOptions alone = pipesgd::ConnectOptionsFromEnv();
  EXPECT_EQ(alone.world_size, 1);
  EXPECT_EQ(alone.bind_host, "");
}

TEST(ApiTrainer, CallersModelConvergesWithWidthTwo) {
  auto results = RunRanks(3, TrainCallersModel);
  for (int r = 0; r < 3; ++r) ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
  auto w = testing::UnpackFloats(results[0].output);
  ASSERT_EQ(w.size(), 3u + 60u);
  EXPECT_NEAR(w[0], 1.0f, 1e-5);
  EXPECT_NEAR(w[1], -1.0f, 1e-5);
  EXPECT_NEAR(w[2], 2.0f, 1e-5);
  // Step 0's loss at w = 0, averaged over ranks: mean over r of |c_r|^2 / 2 = 6 * 5/3 / 2 = 5.
  EXPECT_FLOAT_EQ(w[3], 5.0f);
  // Every replica applied the same aggregates in the same order: bitwise identical.
  for (int r = 1; r < 3; ++r) EXPECT_EQ(results[r].output, results[0].output) << "rank " << r;
}

}  // namespace
}  // namespace pipesgd
