// Point-to-point tensors between two pipeline stages on loopback TCP (two forked ranks):
// activations forward and gradients back arrive exactly, in schedule order, with many sends in
// flight; a tensor whose shape, rows or micro-batch differ from what the receiver expects is a
// kDataLoss error naming both stages, both ranks and both values.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/train/pipeline_p2p.h"
#include "tests/support/multiproc.h"
#include "transport/rendezvous.h"
#include "transport/tcp/tcp_transport.h"

namespace pipesgd::train {
namespace {

using testing::PackFloats;
using testing::RankContext;
using testing::RunRanks;
using testing::UnpackFloats;

// Rank r is stage r of a two-stage pipeline; fn gets the link to the other stage.
std::vector<testing::RankResult> RunTwoStages(
    const std::function<std::string(StageLink&, int stage)>& fn) {
  return RunRanks(2, [&](const RankContext& ctx) {
    transport::tcp::TcpOptions tcp;
    tcp.rank = ctx.rank;
    tcp.world_size = ctx.world_size;
    tcp.bind_host = "127.0.0.1";
    auto t = transport::tcp::CreateTcpTransport(tcp);
    transport::RendezvousOptions rdv{"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size,
                                     "test", ""};
    auto addresses = transport::RendezvousAllGather(rdv, t->LocalAddress(), Deadline::After(30));
    const int peer = 1 - ctx.rank;
    auto connections = t->Connect({{peer, addresses[peer]}}, Deadline::After(30));
    StageLink link(*t, *connections[0], ctx.rank, peer);
    std::string out = fn(link, ctx.rank);
    link.WaitSends(Deadline::After(30));
    return out;
  });
}

float Value(int kind, int step, int mb, size_t i) {
  return static_cast<float>(kind * 100000 + step * 1000 + mb * 100) + 0.25f * static_cast<float>(i);
}

TEST(PipelineP2p, ActivationsForwardGradientsBackExactly) {
  const layers::Shape act{3, 2, 2}, grad{3, 2, 2};
  const size_t rows = 4, n = rows * act.size();
  const int m = 5;
  auto results = RunTwoStages([&](StageLink& link, int stage) {
    std::vector<std::vector<float>> bufs(m, std::vector<float>(n));
    std::vector<float> got;
    const Deadline deadline = Deadline::After(30);
    if (stage == 0) {
      // Warm-up: every forward sent before any gradient is read, so sends pile up in flight.
      for (int mb = 0; mb < m; ++mb) {
        for (size_t i = 0; i < n; ++i) bufs[mb][i] = Value(1, 7, mb, i);
        link.Send(TensorKind::kActivation, 7, mb, rows, act, bufs[mb].data());
      }
      std::vector<float> g(n);
      for (int mb = 0; mb < m; ++mb) {
        link.Recv(TensorKind::kGradient, 7, mb, rows, grad, g.data(), deadline);
        got.insert(got.end(), g.begin(), g.end());
      }
    } else {
      for (int mb = 0; mb < m; ++mb) {
        std::vector<float> a(n);
        link.Recv(TensorKind::kActivation, 7, mb, rows, act, a.data(), deadline);
        got.insert(got.end(), a.begin(), a.end());
        for (size_t i = 0; i < n; ++i) bufs[mb][i] = Value(2, 7, mb, i);
        link.Send(TensorKind::kGradient, 7, mb, rows, grad, bufs[mb].data());
      }
    }
    return PackFloats(got.data(), got.size());
  });
  ASSERT_EQ(results.size(), 2u);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
  const auto at_stage0 = UnpackFloats(results[0].output);  // gradients from stage 1
  const auto at_stage1 = UnpackFloats(results[1].output);  // activations from stage 0
  ASSERT_EQ(at_stage0.size(), m * n);
  ASSERT_EQ(at_stage1.size(), m * n);
  for (int mb = 0; mb < m; ++mb) {
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(at_stage1[mb * n + i], Value(1, 7, mb, i));
      ASSERT_EQ(at_stage0[mb * n + i], Value(2, 7, mb, i));
    }
  }
}

// Stage 0 sends what it has; stage 1 expects `expect_rows` x `expect_shape` of micro-batch
// `expect_mb` and returns the error it got.
std::string MismatchError(size_t expect_rows, layers::Shape expect_shape, int expect_mb) {
  const layers::Shape sent{30, 1, 1};
  auto results = RunTwoStages([&](StageLink& link, int stage) -> std::string {
    std::vector<float> buf(4 * 30, 1.0f);
    if (stage == 0) {
      link.Send(TensorKind::kActivation, 3, 0, 4, sent, buf.data());
      return "";
    }
    std::vector<float> in(expect_rows * expect_shape.size());
    try {
      link.Recv(TensorKind::kActivation, 3, expect_mb, expect_rows, expect_shape, in.data(),
                Deadline::After(30));
    } catch (const Error& e) {
      return std::string(ErrorCodeName(e.code())) + ": " + e.what();
    }
    return "no error";
  });
  EXPECT_EQ(results[0].exit_code, 0) << results[0].error;
  EXPECT_EQ(results[1].exit_code, 0) << results[1].error;
  return results[1].output;
}

TEST(PipelineP2p, ShapeMismatchNamesBothStagesAndShapes) {
  const std::string e = MismatchError(4, {20, 1, 1}, 0);
  EXPECT_NE(e.find("data loss"), std::string::npos) << e;
  EXPECT_NE(e.find("stage 1 (rank 1) expects activations of 4 rows x 20x1x1 per sample from "
                   "stage 0 (rank 0), which sent 4 rows x 30x1x1"),
            std::string::npos)
      << e;
}

TEST(PipelineP2p, RowMismatchIsAnError) {
  const std::string e = MismatchError(8, {30, 1, 1}, 0);
  EXPECT_NE(e.find("expects activations of 8 rows x 30x1x1 per sample from stage 0 (rank 0), "
                   "which sent 4 rows x 30x1x1"),
            std::string::npos)
      << e;
}

TEST(PipelineP2p, MicroBatchMismatchIsAnError) {
  const std::string e = MismatchError(4, {30, 1, 1}, 2);
  EXPECT_NE(e.find("expects activations of step 3 micro-batch 2 from stage 0 (rank 0), which "
                   "sent activations of step 3 micro-batch 0"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace pipesgd::train
