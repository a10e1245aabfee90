// The pipeline-parallel trainer on loopback TCP (forked ranks, rank = pipeline * M + stage):
//  - 2 stages x 2 pipelines, 3 micro-batches, momentum, synchronous replica averaging: every
//    rank's weights after every step equal, bitwise, a single-process reference that runs the
//    same 1F1B schedules with weight stashing and averages the replicas ((a + b) / 2); the
//    replicas of a stage are bitwise equal; the stash lags are those of the 1F1B order;
//  - M = 1 (one micro-batch) equals the data-parallel SdpipeTrainer bitwise;
//  - M = 2, one pipeline, one micro-batch equals plain SGD on the unsplit layers::Model bitwise.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>
#include <numeric>
#include <vector>

#include "core/base/error.h"
#include "core/collective/group_allreduce.h"
#include "core/train/classifier_task.h"
#include "core/train/pipeline_schedule.h"
#include "core/train/pipeline_stage.h"
#include "core/train/pipeline_trainer.h"
#include "core/train/sdpipe_service.h"
#include "core/train/sdpipe_trainer.h"
#include "layers/model.h"
#include "core/base/rng.h"
#include "tests/support/multiproc.h"
#include "transport/rendezvous.h"
#include "transport/tcp/tcp_transport.h"

namespace pipesgd::train {
namespace {

using testing::PackFloats;
using testing::RankContext;
using testing::RunRanks;
using testing::UnpackFloats;

constexpr size_t kIn = 6, kClasses = 4;
constexpr uint64_t kSeed = 5;

// linear(6->8) relu dropout(0.2) linear(8->8) relu linear(8->4): dropout checks that the random
// keys of a split model follow the global layer index and the micro-batch's rows.
std::vector<std::unique_ptr<layers::Layer>> Mlp() {
  std::vector<std::unique_ptr<layers::Layer>> l;
  l.push_back(layers::MakeLinear(kIn, 8));
  l.push_back(layers::MakeRelu(8));
  l.push_back(layers::MakeDropout(layers::Shape{8, 1, 1}, 0.2f));
  l.push_back(layers::MakeLinear(8, 8));
  l.push_back(layers::MakeRelu(8));
  l.push_back(layers::MakeLinear(8, kClasses));
  return l;
}

std::vector<float> InitialParams() {
  layers::Model model(Mlp(), 1);
  std::vector<float> p(model.num_params());
  model.Init(p, kSeed);
  return p;
}

// Stage `stage` of the MLP split at `boundaries`, with the initial weights of the unsplit model.
std::unique_ptr<PipelineStage> MakeStage(const std::vector<size_t>& boundaries, int stage,
                                         size_t rows, int slots) {
  auto all = Mlp();
  std::vector<size_t> starts{0};
  starts.insert(starts.end(), boundaries.begin(), boundaries.end());
  starts.push_back(all.size());
  const std::vector<float> params = InitialParams();
  size_t offset = 0;
  for (int k = 0; k < stage; ++k) {
    for (size_t i = starts[k]; i < starts[k + 1]; ++i) offset += all[i]->num_params();
  }
  std::vector<std::unique_ptr<layers::Layer>> part;
  size_t n = 0;
  for (size_t i = starts[stage]; i < starts[stage + 1]; ++i) {
    n += all[i]->num_params();
    part.push_back(std::move(all[i]));
  }
  return std::make_unique<PipelineStage>(std::move(part), starts[stage],
                                         static_cast<size_t>(stage) + 2 == starts.size(), rows,
                                         slots, std::span(params).subspan(offset, n));
}

// Samples as a pure function of (step, pipeline, micro-batch, row).
class Synthetic : public MicroBatchSource {
 public:
  explicit Synthetic(size_t rows) : rows_(rows) {}
  void Load(int64_t step, int pipeline, int mb, float* x, uint8_t* labels) override {
    for (size_t r = 0; r < rows_; ++r) {
      const uint64_t key = pipesgd::Mix64((static_cast<uint64_t>(step) << 32) ^
                                         (static_cast<uint64_t>(pipeline) << 20) ^
                                         (static_cast<uint64_t>(mb) << 10) ^ r);
      if (x != nullptr) {
        for (size_t j = 0; j < kIn; ++j) x[r * kIn + j] = 2 * pipesgd::UnitFloat(pipesgd::Hash(key, j)) - 1;
      }
      if (labels != nullptr) labels[r] = static_cast<uint8_t>(pipesgd::Hash(key, 99) % kClasses);
    }
  }

 private:
  size_t rows_;
};

std::unique_ptr<collective::GroupCommunicator> Connect(const RankContext& ctx) {
  transport::tcp::TcpOptions tcp;
  tcp.rank = ctx.rank;
  tcp.world_size = ctx.world_size;
  tcp.bind_host = "127.0.0.1";
  auto transport = transport::tcp::CreateTcpTransport(tcp);
  transport::RendezvousOptions rdv{"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size,
                                   "test", ""};
  auto addresses =
      transport::RendezvousAllGather(rdv, transport->LocalAddress(), Deadline::After(30));
  return std::make_unique<collective::GroupCommunicator>(std::move(transport), ctx.world_size,
                                                         addresses,
                                                         collective::CommunicatorOptions{});
}

struct RunSpec {
  int stages = 2, pipelines = 2, micro_batches = 3, steps = 3;
  size_t rows = 2;
  std::vector<size_t> boundaries{3};
  layers::SgdOptions sgd{0.1f, 0.9f, 0.0f};
  // Groups from SDPipe's group scheduler service (one scheduler state per stage, period 1:
  // every round connects all replicas) instead of AllReplicas.
  bool service = false;
};

class ServiceGroups : public GroupSource {
 public:
  ServiceGroups(GroupSchedulerClient& client, int stage) : client_(client), stage_(stage) {}
  GroupDecision Next(int64_t step) override {
    return client_.Request(stage_, step, Deadline::After(30));
  }

 private:
  GroupSchedulerClient& client_;
  int stage_;
};

// Each rank returns: its weights after every step, then its stash lags, then its losses.
std::vector<testing::RankResult> RunPipeline(const RunSpec& run) {
  return RunRanks(run.stages * run.pipelines, [&](const RankContext& ctx) {
    auto comm = Connect(ctx);
    const PipelineLayout layout{run.stages, run.pipelines};
    const int s = layout.stage_of(ctx.rank);
    auto stage = MakeStage(run.boundaries, s, run.rows,
                           MaxInFlight(run.stages, s, run.micro_batches));
    SgdOptimizer sgd(run.sgd, stage->num_params());
    Synthetic data(run.rows);
    AllReplicas all(run.pipelines);
    std::unique_ptr<GroupSchedulerService> service;
    std::unique_ptr<GroupSchedulerClient> client;
    std::unique_ptr<ServiceGroups> scheduled;
    if (run.service) {
      GroupSchedulerOptions so;
      so.world_size = run.pipelines;
      so.period = 1;
      // The barrier that stops the job ends exactly at the total: the last step's round.
      so.total_updates = static_cast<int64_t>(run.steps) * run.pipelines;
      std::vector<float> port = {0};
      if (ctx.rank == 0) {
        service = std::make_unique<GroupSchedulerService>(so, run.stages, "127.0.0.1", "");
        port[0] = service->port();
      }
      std::vector<int> everyone(ctx.world_size);
      std::iota(everyone.begin(), everyone.end(), 0);
      comm->AllReduce(port, collective::ReduceOp::kSum, everyone, Deadline::After(30));
      client = std::make_unique<GroupSchedulerClient>(
          "127.0.0.1", static_cast<uint16_t>(port[0]), layout.pipeline_of(ctx.rank),
          run.pipelines, "", Deadline::After(30));
      scheduled = std::make_unique<ServiceGroups>(*client, s);
    }
    GroupSource& groups = run.service ? static_cast<GroupSource&>(*scheduled) : all;
    PipelineTrainerOptions o;
    o.micro_batches = run.micro_batches;
    o.micro_batch_rows = run.rows;
    o.seed = kSeed;
    o.timeout_s = 30;
    PipelineTrainer trainer(*comm, layout, *stage, sgd, data, groups, o);
    std::vector<float> out;
    for (int t = 0; t < run.steps; ++t) {
      const GroupDecision d = trainer.Step();
      if (static_cast<int>(d.members.size()) != run.pipelines) {
        Throw(ErrorCode::kInternal, "a group of {} replicas", d.members.size());
      }
      if (run.service && (d.stop != (t + 1 == run.steps))) {
        Throw(ErrorCode::kInternal, "step {}: stop = {}", t, d.stop);
      }
      out.insert(out.end(), stage->params().begin(), stage->params().end());
    }
    if (service) {
      // The service lives in this rank: it waits until every stage's last round is decided.
      const Deadline deadline = Deadline::After(30);
      for (int st = 0; st < run.stages; ++st) {
        while (static_cast<int>(service->decisions(st).size()) < run.steps) {
          if (deadline.expired()) Throw(ErrorCode::kDeadlineExceeded, "stage {} unfinished", st);
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
    }
    for (int64_t lag : trainer.stash_lags()) out.push_back(static_cast<float>(lag));
    out.insert(out.end(), trainer.losses().begin(), trainer.losses().end());
    return PackFloats(out.data(), out.size());
  });
}

// The same run in one process: the per-stage 1F1B schedules executed round by round (each
// stage runs its next op once its input has arrived), tensors handed over by copy, replicas
// averaged as the ring does for two ranks: (a + b) / 2. Returns, per rank, the weights after
// every step.
std::vector<std::vector<float>> Reference(const RunSpec& run, std::vector<std::vector<float>>* losses) {
  const int M = run.stages, N = run.pipelines, m = run.micro_batches;
  std::vector<std::vector<std::unique_ptr<PipelineStage>>> stage(N);
  std::vector<std::vector<std::unique_ptr<SgdOptimizer>>> opt(N);
  for (int p = 0; p < N; ++p) {
    for (int s = 0; s < M; ++s) {
      stage[p].push_back(MakeStage(run.boundaries, s, run.rows, MaxInFlight(M, s, m)));
      opt[p].push_back(std::make_unique<SgdOptimizer>(run.sgd, stage[p][s]->num_params()));
    }
  }
  Synthetic data(run.rows);
  std::vector<std::vector<float>> out(M * N);
  losses->assign(M * N, {});
  for (int t = 0; t < run.steps; ++t) {
    std::vector<double> loss_sum(N, 0.0);
    for (int p = 0; p < N; ++p) {
      // mail[s][mb]: activations into stage s / gradients into stage s's output, by micro-batch.
      std::vector<std::vector<std::vector<float>>> acts(M, std::vector<std::vector<float>>(m));
      std::vector<std::vector<std::vector<float>>> grads(M, std::vector<std::vector<float>>(m));
      std::vector<std::vector<PipelineOp>> sched;
      for (int s = 0; s < M; ++s) sched.push_back(OneFOneBSchedule(M, s, m));
      std::vector<size_t> pos(M, 0);
      bool done = false;
      while (!done) {
        std::vector<int> ready;
        for (int s = 0; s < M; ++s) {
          if (pos[s] == sched[s].size()) continue;
          const PipelineOp& op = sched[s][pos[s]];
          if (op.kind == PipelineOp::Kind::kForward ? (s == 0 || !acts[s][op.micro_batch].empty())
                                                    : (s == M - 1 || !grads[s][op.micro_batch].empty())) {
            ready.push_back(s);
          }
        }
        if (ready.empty()) ADD_FAILURE() << "reference deadlocked";
        if (ready.empty()) return {};
        for (int s : ready) {
          const PipelineOp op = sched[s][pos[s]++];
          const int mb = op.micro_batch;
          PipelineStage& st = *stage[p][s];
          const size_t in_n = run.rows * st.in_shape().size();
          const size_t out_n = run.rows * st.out_shape().size();
          if (op.kind == PipelineOp::Kind::kForward) {
            std::vector<uint8_t> labels(run.rows);
            float* x = st.InputBuffer(mb);
            if (s == 0) {
              data.Load(t, p, mb, x, s == M - 1 ? labels.data() : nullptr);
            } else {
              std::copy(acts[s][mb].begin(), acts[s][mb].end(), x);
              if (s == M - 1) data.Load(t, p, mb, nullptr, labels.data());
            }
            const layers::BatchKey key{kSeed, static_cast<uint64_t>(t),
                                       (static_cast<uint64_t>(p) * m + mb) * run.rows};
            const float loss = st.Forward(mb, run.rows, key, s == M - 1 ? labels.data() : nullptr);
            if (s == M - 1) {
              loss_sum[p] += loss;
            } else {
              acts[s + 1][mb].assign(st.Output(mb), st.Output(mb) + out_n);
            }
          } else {
            if (s < M - 1) std::copy(grads[s][mb].begin(), grads[s][mb].end(), st.OutputGradBuffer(mb));
            std::vector<float> g(st.num_params());
            st.Backward(mb, g);
            if (s > 0) grads[s - 1][mb].assign(st.InputGrad(mb), st.InputGrad(mb) + in_n);
            st.Update(*opt[p][s], g);
          }
        }
        done = true;
        for (int s = 0; s < M; ++s) done = done && pos[s] == sched[s].size();
      }
    }
    for (int s = 0; s < M; ++s) {
      if (N == 2) {
        std::vector<float> avg(stage[0][s]->num_params());
        for (size_t i = 0; i < avg.size(); ++i) {
          avg[i] = (stage[0][s]->params()[i] + stage[1][s]->params()[i]) / 2.0f;
        }
        for (int p = 0; p < N; ++p) stage[p][s]->SetParams(avg);
      }
      for (int p = 0; p < N; ++p) {
        auto& o = out[p * M + s];
        o.insert(o.end(), stage[p][s]->params().begin(), stage[p][s]->params().end());
      }
    }
    const float l0 = static_cast<float>(loss_sum[0] / m);
    const float l = N == 2 ? (l0 + static_cast<float>(loss_sum[1] / m)) / 2.0f : l0;
    for (int p = 0; p < N; ++p) (*losses)[p * M + M - 1].push_back(l);
  }
  return out;
}

TEST(PipelineTrainer, TwoByTwoWithStashingEqualsTheSequentialReferenceBitwise) {
  const RunSpec run;
  auto results = RunPipeline(run);
  std::vector<std::vector<float>> ref_losses;
  const auto ref = Reference(run, &ref_losses);
  ASSERT_EQ(ref.size(), 4u);
  std::vector<std::vector<float>> got(4);
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    got[r] = UnpackFloats(results[r].output);
    const size_t w = ref[r].size();
    const int stage = r % 2;
    ASSERT_EQ(got[r].size(), w + 3 * run.micro_batches + 3) << "rank " << r;
    for (size_t i = 0; i < w; ++i) {
      ASSERT_EQ(got[r][i], ref[r][i]) << "rank " << r << " step " << i / (w / 3) << " param "
                                      << i % (w / 3);
    }
    // Stage 0 (one micro-batch of warm-up) runs F0 F1 B0 F2 B1 B2: B1 and B2 use weights one
    // update behind the latest; the last stage alternates and is never behind.
    const std::vector<float> want_lags =
        stage == 0 ? std::vector<float>{0, 1, 1, 0, 1, 1, 0, 1, 1}
                   : std::vector<float>{0, 0, 0, 0, 0, 0, 0, 0, 0};
    EXPECT_EQ(std::vector<float>(got[r].begin() + w, got[r].begin() + w + 9), want_lags)
        << "rank " << r;
    if (stage == 1) {
      EXPECT_EQ(std::vector<float>(got[r].begin() + w + 9, got[r].end()), ref_losses[r]);
    }
  }
  // Replicas of a stage are bitwise equal after every averaging (the stage-0 losses are NaN).
  EXPECT_EQ(std::vector<float>(got[0].begin(), got[0].begin() + ref[0].size()),
            std::vector<float>(got[2].begin(), got[2].begin() + ref[2].size()));
  EXPECT_EQ(std::vector<float>(got[1].begin(), got[1].begin() + ref[1].size()),
            std::vector<float>(got[3].begin(), got[3].begin() + ref[3].size()));
}

TEST(PipelineTrainer, GroupsFromTheSchedulerServiceWithOneStatePerStage) {
  RunSpec run;
  run.service = true;
  auto results = RunPipeline(run);
  std::vector<std::vector<float>> ref_losses;
  const auto ref = Reference(run, &ref_losses);
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    const auto got = UnpackFloats(results[r].output);
    ASSERT_GE(got.size(), ref[r].size());
    EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + ref[r].size()), ref[r])
        << "rank " << r;
  }
}

// A pipeline job ends by step count, not by a stop round: a request marked last lets its rank
// close afterwards without failing the job; without the mark, closing early is a failure that
// names the rank.
std::string SchedulerErrorAfterRank1Leaves(bool mark_last) {
  auto results = RunRanks(2, [&](const RankContext& ctx) -> std::string {
    auto comm = Connect(ctx);
    GroupSchedulerOptions so;
    so.world_size = 2;
    so.period = 1;
    std::unique_ptr<GroupSchedulerService> service;
    std::vector<float> port = {0};
    if (ctx.rank == 0) {
      service = std::make_unique<GroupSchedulerService>(so, 2, "127.0.0.1", "");
      port[0] = service->port();
    }
    comm->AllReduce(port, collective::ReduceOp::kSum, {0, 1}, Deadline::After(30));
    auto client = std::make_unique<GroupSchedulerClient>(
        "127.0.0.1", static_cast<uint16_t>(port[0]), ctx.rank, 2, "", Deadline::After(30));
    for (int step = 1; step <= 3; ++step) {
      // Stage 1's state, to check the per-stage binding too.
      client->Request(1, step, Deadline::After(30), mark_last && step == 3);
    }
    if (ctx.rank == 1) return "";  // closes its connection
    // Rank 0 keeps its connection open: only rank 1's close can be reported.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return "error: " + service->error();
  });
  EXPECT_EQ(results[0].exit_code, 0) << results[0].error;
  EXPECT_EQ(results[1].exit_code, 0) << results[1].error;
  return results[0].output;
}

TEST(PipelineTrainer, ALastRequestLetsARankCloseWithoutFailingTheJob) {
  EXPECT_EQ(SchedulerErrorAfterRank1Leaves(true), "error: ");
  const std::string e = SchedulerErrorAfterRank1Leaves(false);
  EXPECT_NE(e.find("rank 1 disconnected from the group scheduler"), std::string::npos) << e;
}

// The data-parallel objective the SdpipeTrainer sees: the unsplit model on what the pipeline's
// source gives pipeline `rank`, with the same random keys.
class Unsplit : public Objective {
 public:
  Unsplit(int rank, size_t rows) : model_(Mlp(), rows), rank_(rank), rows_(rows), data_(rows),
                                   x_(rows * kIn), labels_(rows) {}
  size_t num_params() const override { return model_.num_params(); }
  float ComputeGradient(int64_t step, std::span<const float> params,
                        std::span<float> grads) override {
    data_.Load(step, rank_, 0, x_.data(), labels_.data());
    const layers::BatchKey key{kSeed, static_cast<uint64_t>(step), rank_ * rows_};
    return model_.ForwardBackward(params, x_.data(), labels_.data(), rows_, grads, key);
  }

 private:
  layers::Model model_;
  uint64_t rank_;
  size_t rows_;
  Synthetic data_;
  std::vector<float> x_;
  std::vector<uint8_t> labels_;
};

class Everyone : public GroupSource {
 public:
  explicit Everyone(int n) : all_(n) { std::iota(all_.begin(), all_.end(), 0); }
  GroupDecision Next(int64_t) override {
    GroupDecision d;
    d.members = all_;
    return d;
  }

 private:
  std::vector<int> all_;
};

TEST(PipelineTrainer, OneStageEqualsTheDataParallelSdpipeTrainerBitwise) {
  RunSpec run;
  run.stages = 1;
  run.micro_batches = 1;
  run.rows = 4;
  run.steps = 4;
  run.boundaries = {};
  auto pipeline = RunPipeline(run);
  auto sdpipe = RunRanks(2, [&](const RankContext& ctx) {
    auto comm = Connect(ctx);
    Unsplit objective(ctx.rank, run.rows);
    SgdOptimizer sgd(run.sgd, objective.num_params());
    std::vector<float> w = InitialParams();
    Everyone groups(2);
    SdpipeTrainer trainer(*comm, objective, sgd, w, groups, {});
    std::vector<float> out;
    for (int t = 0; t < run.steps; ++t) {
      trainer.Step();
      out.insert(out.end(), w.begin(), w.end());
    }
    for (int i = 0; i < run.steps; ++i) out.push_back(0);  // no stash lags on one stage
    out.insert(out.end(), trainer.losses().begin(), trainer.losses().end());
    return PackFloats(out.data(), out.size());
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(pipeline[r].exit_code, 0) << pipeline[r].error;
    ASSERT_EQ(sdpipe[r].exit_code, 0) << sdpipe[r].error;
    const auto a = UnpackFloats(pipeline[r].output);
    const auto b = UnpackFloats(sdpipe[r].output);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "rank " << r << " float " << i;
  }
}

TEST(PipelineTrainer, TwoStagesOneMicroBatchEqualsUnsplitSgdBitwise) {
  RunSpec run;
  run.pipelines = 1;
  run.micro_batches = 1;
  run.rows = 5;
  run.steps = 4;
  auto results = RunPipeline(run);
  // Plain SGD with momentum on the unsplit model, pipeline 0's samples.
  Unsplit objective(0, run.rows);
  SgdOptimizer sgd(run.sgd, objective.num_params());
  std::vector<float> w = InitialParams(), g(w.size());
  std::vector<std::vector<float>> want;
  for (int t = 0; t < run.steps; ++t) {
    objective.ComputeGradient(t, w, g);
    sgd.Apply(w, g);
    want.push_back(w);
  }
  ASSERT_EQ(results[0].exit_code, 0) << results[0].error;
  ASSERT_EQ(results[1].exit_code, 0) << results[1].error;
  const auto s0 = UnpackFloats(results[0].output), s1 = UnpackFloats(results[1].output);
  const size_t n0 = MakeStage(run.boundaries, 0, 1, 1)->num_params();
  const size_t n1 = w.size() - n0;
  for (int t = 0; t < run.steps; ++t) {
    std::vector<float> got(s0.begin() + t * n0, s0.begin() + (t + 1) * n0);
    got.insert(got.end(), s1.begin() + t * n1, s1.begin() + (t + 1) * n1);
    ASSERT_EQ(got, want[t]) << "step " << t;
  }
}

}  // namespace
}  // namespace pipesgd::train
