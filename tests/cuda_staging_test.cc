// GPU tier: the staged AllReduce of DEVICE buffers through the CUDA copier (pinned lanes, copy
// streams, events) over loopback TCP, 4 ranks sharing GPU 0: exact integer sums. Skips with a
// message without a CUDA device (NOT run on the machine this was written on). The same pipeline
// over host memory runs everywhere in staged_allreduce_test.cc.
// Also the trainer with device gradient slots (CudaDeviceGradients) against the trainer with host
// slots, same GPU task: bitwise equal in one segment, within 1e-6 in many.
#include <gtest/gtest.h>

#include <cmath>

#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cuda/cuda_gradients.h"
#include "core/cuda/cuda_staging.h"
#include "core/cuda/cuda_task.h"
#include "core/data/dataset.h"
#include "core/train/trainer.h"
#include "layers/cuda/cuda_model.h"
#include "core/collective/staged_allreduce.h"
#include "layers/cuda/device.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;

// "" when a CUDA device is usable, else why not (checked in a child: the CUDA runtime must not
// be initialised before fork()).
std::string WhyNoDevice() {
  auto probe = RunRanks(1, [](const RankContext&) {
    std::string why;
    return cuda::CudaDeviceCount(&why) > 0 ? std::string("yes") : "no: " + why;
  });
  if (probe[0].exit_code != 0) return "probe failed: " + probe[0].error;
  return probe[0].output == "yes" ? "" : probe[0].output.substr(4);
}

// Small enough that the second round (4x the first sums) stays exact in float.
float Input(int rank, size_t i) { return static_cast<float>(1000 * rank + (i % (1 << 16))); }

TEST(CudaStaging, StagedAllReduceOfDeviceBuffersIsExact) {
  if (const std::string why = WhyNoDevice(); !why.empty()) {
    GTEST_SKIP() << "no CUDA device on this machine (" << why
                 << "); the staged AllReduce of device buffers was compiled but is not run here";
  }
  const int world = 4;
  auto results = RunRanks(world, [](const RankContext& ctx) -> std::string {
    cuda::Context gpu(0);
    const int device = gpu.device();
    auto comm = testing::ConnectRing(ctx, 64 << 10);
    // 3 lanes of 100000 floats; 1000003 elements: 11 segments, the last one short.
    cuda::CudaStagingCopier copier(gpu, 3, 100000);
    collective::StagedAllReduce staged(*comm, copier);
    const size_t count = 1000003;
    std::vector<float> host(count);
    for (size_t i = 0; i < count; ++i) host[i] = Input(ctx.rank, i);
    cuda::DeviceBuffer<float> data(count, device);
    PSGD_CUDA(cudaMemcpy(data.data(), host.data(), count * sizeof(float), cudaMemcpyHostToDevice));
    // A copy from pageable memory may still be in flight when cudaMemcpy returns, and
    // the context's stream does not wait for the legacy default stream.
    PSGD_CUDA(cudaDeviceSynchronize());
    for (int round = 0; round < 2; ++round) {
      staged.AllReduce(data.data(), count, collective::ReduceOp::kSum, Deadline::After(120));
      gpu.Synchronize("test");
      PSGD_CUDA(cudaMemcpy(host.data(), data.data(), count * sizeof(float), cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < count; ++i) {
        double s = 0;
        for (int r = 0; r < ctx.world_size; ++r) s += Input(r, i);
        const double want = round == 0 ? s : s * ctx.world_size;
        if (host[i] != static_cast<float>(want)) {
          return fmt::format("rank {} round {} element {}: got {} expected {}", ctx.rank, round, i,
                             host[i], want);
        }
      }
    }
    return "";
  }, 300);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
    EXPECT_EQ(results[r].output, "") << "rank " << r;
  }
}

// 20 steps of an MLP on random 28x28 images, 4 ranks on GPU 0, width 2; host slots
// (segment_bytes 0) or device slots staged in segments of segment_bytes. Returns the params.
std::string TrainOnGpu(const RankContext& ctx, uint64_t segment_bytes) {
  cuda::Context gpu(0);
  data::Dataset train;
  train.count = 1024;
  train.rows = train.cols = 28;
  train.features = 784;
  train.num_classes = 10;
  train.pixels.resize(train.count * train.features);
  train.labels.resize(train.count);
  for (size_t i = 0; i < train.pixels.size(); ++i) train.pixels[i] = (i * 2654435761u) >> 24;
  for (size_t i = 0; i < train.count; ++i) train.labels[i] = (i * 7) % 10;
  const size_t batch = 16;
  std::vector<std::unique_ptr<cuda::CudaLayer>> layers;
  layers.push_back(cuda::MakeCudaLinear(784, 128));
  layers.push_back(cuda::MakeCudaRelu(128));
  layers.push_back(cuda::MakeCudaLinear(128, 10));
  cuda::CudaModel model(gpu, std::move(layers), batch);
  std::vector<float> params(model.num_params());
  for (size_t i = 0; i < params.size(); ++i) {
    params[i] = static_cast<float>(static_cast<int>((i * 40503u) % 2001) - 1000) * 5e-5f;
  }
  cuda::DeviceParams device_params(gpu, params.size());
  cuda::CudaClassifierTask task(gpu, model, device_params, train, batch, batch, ctx.rank,
                                ctx.world_size, 3, {0.286f, 0.353f});
  cuda::CudaSgdOptimizer sgd(gpu, device_params,
                             std::make_unique<cuda::CudaSgd>(gpu, layers::SgdOptions{0.05f, 0.5f, 0.0f},
                                                             params.size()));
  auto comm = testing::ConnectRing(ctx, 64 << 10);
  std::unique_ptr<cuda::CudaDeviceGradients> slots;
  train::TrainerOptions options{2, 60};
  if (segment_bytes > 0) {
    collective::StagingOptions staging;
    staging.segment_bytes = segment_bytes;
    staging.lanes = 3;
    slots = std::make_unique<cuda::CudaDeviceGradients>(gpu, *comm, 2, params.size() + 1,
                                                        staging);
    options.gradient_slots = slots.get();
  }
  train::Trainer trainer(*comm, task, sgd, params, options);
  for (int t = 0; t < 20; ++t) trainer.Step();
  trainer.Drain(true);
  if (!std::isfinite(trainer.StepLoss(19))) return "loss of step 19 is not finite";
  return testing::PackFloats(params.data(), params.size());
}

TEST(CudaTrainer, DeviceGradientSlotsMatchHostSlots) {
  if (const std::string why = WhyNoDevice(); !why.empty()) {
    GTEST_SKIP() << "no CUDA device on this machine (" << why
                 << "); device gradient slots were compiled but are not run here";
  }
  const int world = 4;
  auto host = RunRanks(world, [](const RankContext& ctx) { return TrainOnGpu(ctx, 0); }, 300);
  auto one = RunRanks(world, [](const RankContext& ctx) { return TrainOnGpu(ctx, 4 << 20); }, 300);
  auto many = RunRanks(world, [](const RankContext& ctx) { return TrainOnGpu(ctx, 16 << 10); }, 300);
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(host[r].exit_code, 0) << host[r].error;
    ASSERT_EQ(one[r].exit_code, 0) << one[r].error;
    ASSERT_EQ(many[r].exit_code, 0) << many[r].error;
    auto want = testing::UnpackFloats(host[r].output);
    auto got_one = testing::UnpackFloats(one[r].output);
    auto got_many = testing::UnpackFloats(many[r].output);
    ASSERT_EQ(want.size(), 101770u) << host[r].output;
    ASSERT_EQ(got_one.size(), want.size()) << one[r].output;
    ASSERT_EQ(got_many.size(), want.size()) << many[r].output;
    // One segment: the same ring on the same floats as the host slot, so bitwise equal.
    EXPECT_EQ(one[r].output, host[r].output) << "rank " << r;
    // 16 KiB segments: other ring blocks, so another summation order per element.
    double max_diff = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_diff = std::max(max_diff, static_cast<double>(std::fabs(got_many[i] - want[i])));
    }
    EXPECT_LE(max_diff, 1e-6) << "rank " << r;
    EXPECT_EQ(many[r].output, many[0].output) << "rank " << r << " drifted from rank 0";
  }
}

}  // namespace
}  // namespace pipesgd
