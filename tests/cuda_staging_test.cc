// GPU tier: the staged AllReduce of DEVICE buffers through the CUDA copier (pinned lanes, copy
// streams, events) over loopback TCP, 4 ranks sharing GPU 0: exact integer sums. Skips with a
// message without a CUDA device (NOT run on the machine this was written on). The same pipeline
// over host memory runs everywhere in staged_allreduce_test.cc.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/cuda/cuda_staging.h"
#include "core/collective/staged_allreduce.h"
#include "layers/cuda/device.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using testing::RankContext;
using testing::RunRanks;

// Small enough that the second round (4x the first sums) stays exact in float.
float Input(int rank, size_t i) { return static_cast<float>(1000 * rank + (i % (1 << 16))); }

TEST(CudaStaging, StagedAllReduceOfDeviceBuffersIsExact) {
  // The device check runs in a child: the CUDA runtime must not be initialised before fork().
  auto probe = RunRanks(1, [](const RankContext&) {
    std::string why;
    return cuda::CudaDeviceCount(&why) > 0 ? std::string("yes") : "no: " + why;
  });
  ASSERT_EQ(probe[0].exit_code, 0) << probe[0].error;
  if (probe[0].output != "yes") {
    GTEST_SKIP() << "no CUDA device on this machine (" << probe[0].output.substr(4)
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

}  // namespace
}  // namespace pipesgd
